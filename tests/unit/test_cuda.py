"""The CUDA path (issue 20) on a real GPU: skipped where PyTorch sees none (CI has none; a lent
GPU runs them with `pytest -m cuda`). The CPU-side mechanics (placement, bucketing, padding) are
tested in test_device_placement.py."""
import pytest
import torch

from mixserve import SamplingParams
from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine
from tests.reference import TIE_GAP
from tests.unit.test_device_placement import DeviceAudit
from tests.unit.test_engine_tiny import make_tiny, prompts

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU visible to PyTorch")]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cuda"), "qwen2", tie=False)[0]


def _engine(folder, device, **kw):
    return LLMEngine(EngineArgs(model=folder, dtype=kw.pop("dtype", "float32"), kv_cache_memory="8MiB",
                                progress=False, max_model_len=256, device=device, **kw))


def _greedy(eng, ps, n=16, logprobs=None):
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=logprobs))
           for p in ps]
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]


def _check_tie_rule(got, ref):
    for a, b in zip(got, ref):
        div = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if div is not None:
            top = b.logprobs[div].top
            assert top[0][1] - top[1][1] < TIE_GAP, f"diverged at {div} with a top-2 gap {top[0][1] - top[1][1]}"


@pytest.mark.parametrize("kernels", ["eager", "auto"])  # auto: CUDA graphs
def test_greedy_on_cuda_equals_the_cpu_float32_run(tiny_folder, kernels):
    torch.backends.cuda.matmul.allow_tf32 = False
    ps = prompts(6, seed=4, lo=5, hi=60)
    ref = _greedy(_engine(tiny_folder, "cpu", kernels="eager"), ps, logprobs=2)
    eng = _engine(tiny_folder, "cuda", kernels=kernels)
    assert eng.runner.k_caches[0].is_cuda and eng.model.embed_tokens.weight.is_cuda
    _check_tie_rule(_greedy(eng, ps), ref)
    if kernels == "auto":
        assert eng.runner.graph.num_steps > 0 and eng.runner.graph.num_captures > 0


def test_a_cuda_step_makes_no_tensor_without_a_device(tiny_folder):
    eng = _engine(tiny_folder, "cuda", kernels="eager")
    for p in prompts(3, seed=1):
        eng.add_request(p, SamplingParams(max_tokens=4, temperature=0.8, seed=3, ignore_eos=True))
    audit = DeviceAudit(eng.device)
    with audit:
        for _ in range(4):
            eng.step()
    assert not audit.implicit and not audit.off_device, audit.implicit + audit.off_device


def test_int4_cuda_kernel_equals_its_dequantized_weight():
    from mixserve.device import move_module
    from mixserve.layers.linear import Int4Linear

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (512, 1024), generator=g, dtype=torch.int32)
    s = torch.rand(512, 8, generator=g).half() * 0.01
    z = torch.randint(0, 16, (512, 8), generator=g, dtype=torch.int32)
    cpu = Int4Linear(q, s, z, 128, None, torch.bfloat16)
    ref_w = cpu.float_weight().clone()
    lin = move_module(Int4Linear(q, s, z, 128, None, torch.bfloat16), torch.device("cuda"))
    assert lin.kernel == "cuda"
    torch.testing.assert_close(lin.float_weight().cpu(), ref_w, rtol=0, atol=1e-6)
    for rows in (1, 7, 300):  # the kernel, and the dequantize + GEMM path past dense_rows
        x = torch.randn(rows, 1024, generator=g).to(torch.bfloat16)
        with torch.inference_mode():
            y = lin(x.cuda()).float().cpu()
        ref = x.double() @ ref_w.double().t()
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 2e-2


def test_cuda_float_linear_keeps_float32_precision():
    from mixserve.layers.linear import cuda_float_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 896, generator=g).to(torch.bfloat16)
    w = (torch.randn(4096, 896, generator=g) * 0.05).to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    y = cuda_float_linear(x.cuda(), w.cuda(), None).double().cpu()
    bf16 = (x.cuda() @ w.cuda().t()).double().cpu()
    err, err_bf16 = (y - ref).abs().max(), (bf16 - ref).abs().max()
    assert err < err_bf16 / 16, (err, err_bf16)  # two-pass: far below one bf16 rounding
