"""Device placement (issue 20): inside an engine step every tensor is made on the engine's device,
or explicitly on the host ("cpu") where it is staged there on purpose (the step's one batch upload,
CPU generators' noise). A factory call that names no device lands on the default device, the CPU,
whatever the engine runs on: on CUDA that is a hidden host tensor and a copy per call. This runs
on the CPU, so it checks the rule that makes CUDA right: no factory call without a device."""
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors

from mixserve import SamplingParams
from mixserve.device import HostStager, resolve_device
from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from tests.unit.test_engine_tiny import make_tiny, prompts

CONSTRUCTORS = _device_constructors()


class DeviceAudit(TorchFunctionMode):
    """Records, inside the mode, factory calls that name no device (with the mixserve line that
    made them) and tensors created on a device other than `device` without naming "cpu"."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.implicit: list[str] = []
        self.off_device: list[str] = []
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in CONSTRUCTORS:
            self.calls += 1
            dev = kwargs.get("device")
            if dev is None:
                self.implicit.append(f"{func.__name__} at {_caller()}")
            elif torch.device(dev).type != self.device.type and torch.device(dev).type != "cpu":
                self.off_device.append(f"{func.__name__} on {dev} at {_caller()}")
        return out


def _caller() -> str:
    for f in reversed(traceback.extract_stack()[:-2]):
        if "/mixserve/" in f.filename:
            return f"{f.filename.rsplit('/mixserve/', 1)[1]}:{f.lineno}"
    return "outside mixserve"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dev"), "qwen2", tie=False)[0]


def _engine(folder, **kw):
    return LLMEngine(EngineArgs(model=folder, dtype="float32", kv_cache_memory="2MiB", progress=False,
                                max_model_len=256, device="cpu", **kw))


def _audit_steps(eng, n_steps):
    audit = DeviceAudit(eng.device)
    uploads = eng.runner.stager.num_uploads
    with audit:
        for _ in range(n_steps):
            eng.step()
    return audit, eng.runner.stager.num_uploads - uploads


@pytest.mark.parametrize("kernels", ["eager", "auto"])
def test_an_engine_step_makes_no_tensor_off_the_engine_device(tiny_folder, kernels):
    eng = _engine(tiny_folder, kernels=kernels, max_num_batched_tokens=24)
    ps = prompts(4, seed=3, lo=20, hi=40)  # a 24-token budget: chunked prefills with a gather
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, min_p=0.05, repetition_penalty=1.2,
                             presence_penalty=0.3, frequency_penalty=0.2, ignore_eos=True, min_tokens=3),
              SamplingParams(max_tokens=6, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True)]
    for p, sp in zip(ps, params):
        eng.add_request(p, sp)
    audit, uploads = _audit_steps(eng, 6)
    assert audit.calls > 0  # the mode saw the step's factories
    assert not audit.implicit, "factory calls without a device inside a step:\n" + "\n".join(audit.implicit)
    assert not audit.off_device, audit.off_device
    # one metadata upload per forward (eager steps; a captured decode graph has its own buffers)
    assert 1 <= uploads <= eng.runner.num_forwards


def test_a_speculative_step_makes_no_tensor_off_the_engine_device(tiny_folder):
    eng = _engine(tiny_folder, kernels="eager", draft_model=tiny_folder, speculation="fixed", num_speculative_tokens=3)
    for seed, sp in enumerate([SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                               SamplingParams(max_tokens=8, temperature=0.9, seed=1, ignore_eos=True),
                               SamplingParams(max_tokens=8, temperature=0.9, ignore_eos=True)]):
        eng.add_request(prompts(1, seed=seed)[0], sp)
    audit, _ = _audit_steps(eng, 4)
    assert eng.proposer.num_forwards > 0
    assert not audit.implicit, "factory calls without a device inside a step:\n" + "\n".join(audit.implicit)


def test_the_audit_catches_a_factory_call_without_a_device():
    audit = DeviceAudit(torch.device("cpu"))
    with audit:
        torch.zeros(3, device="cpu")
        torch.arange(4)
    assert len(audit.implicit) == 1 and audit.implicit[0].startswith("arange")


def test_stager_returns_one_int64_tensor_of_the_values():
    st = HostStager(torch.device("cpu"))
    t = st.upload([3, 1, 4, 1, 5])
    assert t.dtype == torch.long and t.tolist() == [3, 1, 4, 1, 5] and st.num_uploads == 1


def test_resolve_device_refuses_what_is_not_here():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
        with pytest.raises(ValueError, match="no CUDA GPU"):
            EngineArgs(model="x", device="cuda").validate()


def test_bucketed_decode_steps_equal_eager_steps_and_padding_writes_only_the_sink(tiny_folder):
    """engine/cuda_graph.py's bucketing and padding, run without capture on the CPU: the same
    greedy tokens as eager steps, padding rows (5 sequences in an 8-row bucket) write their K/V
    into the sink block only, and a step is one upload."""
    from mixserve.engine.cuda_graph import CudaGraphDecoder, row_buckets, width_buckets
    from mixserve.engine.model_runner import ModelRunner

    assert row_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40] and row_buckets(3) == [1, 2, 3]
    assert width_buckets(16) == [1, 2, 4, 8, 16] and width_buckets(5) == [1, 2, 4, 5]
    ps = prompts(5, seed=11, lo=5, hi=40)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = []
    for bucketed in (False, True):
        eng = _engine(tiny_folder, kernels="eager")
        if bucketed:
            r = eng.runner
            eng.runner = ModelRunner(r.model, r.cfg, r.bm, r.num_blocks, r.block_size, r.k_caches[0].dtype, "cpu",
                                     sink_block=True)
            eng.runner.use_cuda_graphs(eng.max_model_len, 8, capture=False)
            no_sink = ModelRunner(r.model, r.cfg, r.bm, r.num_blocks, r.block_size, r.k_caches[0].dtype, "cpu",
                                  sink_block=False)
            with pytest.raises(ValueError, match="sink"):
                CudaGraphDecoder(no_sink, 8, 16)
            r.model.bind_kv_cache(eng.runner.k_caches, eng.runner.v_caches)  # the runner in use's cache
        for p in ps:
            eng.add_request(p, sp)
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.token_ids
        outs.append([done[k] for k in sorted(done)])
        if bucketed:
            g = eng.runner.graph
            assert g.num_steps >= 11 and any(k[0] == 8 for k in g.graphs)  # 5 rows padded to 8
            pad = eng.runner.pad_block
            assert all(kc[pad].abs().sum() > 0 for kc in eng.runner.k_caches)  # the padding rows' writes
            assert eng.block_manager.num_free_blocks == eng.num_blocks
            # no block beyond what the sequences needed was written
            need = sum(-(-(len(p) + 12) // eng.runner.block_size) for p in ps)
            written = (eng.runner.k_caches[0][:pad].flatten(1).abs().sum(1) > 0).sum()
            assert written <= need
    assert outs[0] == outs[1]
