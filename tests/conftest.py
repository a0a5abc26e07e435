import atexit
import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Engines in the suite time no kernels: each choice the cache lacks is its eager candidate
# (layers/kernel_choice.py, timing "prior"), so no test pays a first start's timing and decode-graph
# compile unless it asks. The tests of a mechanism ask: they force a candidate through `kernels=`
# (decode_graph=compiled, ...), and the one test of measured choices on a real model sets
# MIXSERVE_KERNEL_TIMING=measure (test_real_models.py). Suite time: issue 32.
os.environ.setdefault("MIXSERVE_KERNEL_TIMING", "prior")
# ... and they read a choices file of the suite's own, empty at its start: a machine's cached
# choices (a compiled decode graph, measured by an earlier run or by the one test above) would
# otherwise be taken by every later engine, each loading a graph at its start (the replica tests'
# cluster took 106 s instead of 22 s so). Tests of the cache itself name their own files.
if "MIXSERVE_KERNEL_CACHE" not in os.environ:
    _choices = tempfile.mkdtemp(prefix="mixserve-suite-choices-")
    atexit.register(shutil.rmtree, _choices, True)
    os.environ["MIXSERVE_KERNEL_CACHE"] = os.path.join(_choices, "choices.json")
# The packed weights the suite's engines write (models/packed_weights.py) go to a folder of the
# suite's own: the tiny models live in temporary folders, so the user's cache root gathered one store
# per test run (61 after a day's runs).
if "MIXSERVE_PACKED_CACHE" not in os.environ:
    _packed = tempfile.mkdtemp(prefix="mixserve-suite-packed-")
    atexit.register(shutil.rmtree, _packed, True)
    os.environ["MIXSERVE_PACKED_CACHE"] = _packed
# ... and so do the native GGUF layouts (models/native_store.py), for the same reason
if "MIXSERVE_NATIVE_CACHE" not in os.environ:
    _native = tempfile.mkdtemp(prefix="mixserve-suite-native-")
    atexit.register(shutil.rmtree, _native, True)
    os.environ["MIXSERVE_NATIVE_CACHE"] = _native


@pytest.fixture(scope="session")
def smollm2_path():
    from mixserve.models.registry import pull

    return str(pull("smollm2-135m-instruct", progress=False))


@pytest.fixture(scope="session")
def qwen05_path():
    from mixserve.models.registry import pull

    return str(pull("qwen2.5-coder-0.5b-instruct", progress=False))
