import atexit
import os
import shutil
import tempfile

import pytest
import torch

from mixserve.env import usable_cores


@pytest.hookimpl(optionalhook=True)  # a known hook only where pytest-xdist is installed
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): one pytest-xdist worker a core, as many as memory holds at
    ~8 GiB each (a worker may hold the 0.5B's float32 engine and its HF reference at once), at most
    4; 0 (no workers, the run in this process) on one core. PYTEST_XDIST_AUTO_NUM_WORKERS, where set,
    decides instead. Two workers took the suite from 1073 to 678 s on CI's 2-core kind (BENCHMARKS.md,
    the suite's time): much of it is one-threaded (Dynamo and Inductor compiles, imports,
    tokenizers, servers' and Ray's start-ups, the HTTP round trips)."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    mem_gib = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    n = max(1, min(usable_cores(), round(mem_gib / 8), 4))
    return 0 if n == 1 else n


# A worker's share of the cores (its servers and CLI runs inherit it through OMP_NUM_THREADS): the
# workers together use each core once; at most 2 threads either way, as CI's 2-core machine runs it.
# The kernels' split across threads is checked by a test that sets its own counts
# (test_batch_invariance.py, test_the_thread_count_changes_no_bits).
_threads = max(1, min(2, usable_cores()))
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, min(2, usable_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
torch.set_num_threads(_threads)

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
