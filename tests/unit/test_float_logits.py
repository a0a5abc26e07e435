"""Float32 logits (issue 15, item 2): every LM head path returns float32 equal to a float32 head
applied to the same hidden state (to 1e-3), eager and inside a compiled graph, and the engine's
logits are that head's output."""
import pytest
import torch
import torch.nn.functional as F

from mixserve.layers import bf16_gemv, int4_vnni
from mixserve.layers.linear import DenseLinear, Int4Linear

TOL = 1e-3


def hidden(rows, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * 2
    x[:, 3] *= 20  # an outlier channel, as real final-norm outputs have
    return x.to(torch.bfloat16)


def dense_head(n=1000, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.3).to(torch.bfloat16)


def int4_head(n=1024, k=256, g=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    s = torch.rand(n, k // g, generator=gen) * 0.05 + 0.01
    z = torch.randint(0, 16, (n, k // g), generator=gen, dtype=torch.int32)
    return q, s, z, g


DENSE_CASES = [("plain", 0, False), ("onednn", 0, False), ("onednn", 0, True)]
if bf16_gemv.available():
    DENSE_CASES += [("plain", 1 << 30, False), ("onednn", 1 << 30, True), ("plain", 4, False)]


@pytest.mark.parametrize("impl,gemv_rows,keep_plain", DENSE_CASES)
def test_dense_head_float32(impl, gemv_rows, keep_plain):
    w = dense_head()
    lin = DenseLinear(w.clone())
    lin.keep_plain = keep_plain
    lin.set_impl(impl)
    lin.float_out, lin.float_gemv_rows = True, gemv_rows
    ref_w = w.double()
    for rows in (1, 3, 5, 17):
        x = hidden(rows, w.shape[1], seed=rows)
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (rows, w.shape[0])
        ref = x.double() @ ref_w.t()
        err = (y.double() - ref).abs().max().item()
        assert err < TOL, (rows, err)
        # the bf16-rounded result is off by far more: the check above can fail
        assert (F.linear(x, w).double() - ref).abs().max().item() > 10 * TOL
    assert lin(hidden(6, w.shape[1]).view(2, 3, -1)).shape == (2, 3, w.shape[0])


@pytest.mark.parametrize("kernel,dense_rows", [("torch", None), ("vnni", None), ("vnni", 0), ("vnni", 4)])
def test_int4_head_float32(kernel, dense_rows):
    if kernel == "vnni" and not int4_vnni.available():
        pytest.skip("int4 vnni kernel not built on this machine")
    q, s, z, g = int4_head()
    lin = Int4Linear(q, s, z, g, None, torch.bfloat16)
    lin.set_kernel(kernel)
    assert lin.kernel == kernel
    lin.float_out, lin.float_dense_rows = True, dense_rows
    w = lin.float_weight().double()
    # float_weight is the module's own dequantization: q * s + zero' within the scales' rounding
    zero = (8 - z.double()) * s.double()
    direct = ((q.double() - 8).view(q.shape[0], -1, g) * s.double().unsqueeze(-1) + zero.unsqueeze(-1)).view_as(w)
    assert (w - direct).abs().max().item() < 2e-3
    for rows in (1, 3, 5, 9):
        x = hidden(rows, q.shape[1], seed=rows)
        y = lin(x)
        assert y.dtype == torch.float32
        err = (y.double() - x.double() @ w.t()).abs().max().item()
        assert err < TOL, (rows, err)


def test_int4_vnni_levels_shrink_the_error():
    if not int4_vnni.available():
        pytest.skip("int4 vnni kernel not built on this machine")
    q, s, z, g = int4_head()
    lin = Int4Linear(q, s, z, g, None, torch.bfloat16)
    lin.set_kernel("vnni")
    w = lin.float_weight().double()
    x = hidden(4, q.shape[1])
    ref = x.double() @ w.t()
    errs = [(int4_vnni.int4_vnni_matmul(x, lin.vq, lin.vs, lin.vm, g, levels=n).double() - ref).abs().max().item()
            for n in (1, 2, 3)]
    assert errs[0] > 20 * errs[2] and errs[1] > errs[2] and errs[2] < TOL, errs


def compiled_equals_eager(lin, rows=(1, 5)):
    fn = torch.compile(lambda x: lin(x) * 1.0, fullgraph=True, dynamic=False)  # fullgraph: no break
    for r in rows:
        x = hidden(r, lin.in_features, seed=r)
        with torch.inference_mode():
            a, b = lin(x), fn(x)
        assert b.dtype == torch.float32
        assert torch.allclose(a, b, atol=1e-5, rtol=0), (r, (a - b).abs().max())


@pytest.mark.parametrize("impl,gemv_rows", [c[:2] for c in DENSE_CASES if not c[2]])
def test_dense_head_float32_in_compiled_graph(impl, gemv_rows):
    torch._dynamo.reset()
    lin = DenseLinear(dense_head())
    lin.set_impl(impl)
    lin.float_out, lin.float_gemv_rows = True, gemv_rows
    compiled_equals_eager(lin)


def test_int4_head_float32_in_compiled_graph():
    if not int4_vnni.available():
        pytest.skip("int4 vnni kernel not built on this machine")
    torch._dynamo.reset()
    q, s, z, g = int4_head()
    lin = Int4Linear(q, s, z, g, None, torch.bfloat16)
    lin.set_kernel("vnni")
    lin.float_out, lin.float_dense_rows = True, 4
    compiled_equals_eager(lin)


@pytest.fixture(scope="module")
def tiny128(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.3)
    folder = tmp_path_factory.mktemp("f32") / "tiny128"
    Qwen2ForCausalLM(cfg).float().eval().save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("quant", [None, "rtn"])
def test_engine_logits_are_the_float32_head_of_the_hidden_state(tiny128, quant):
    from mixserve import SamplingParams
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=tiny128, dtype="bfloat16", quantization=quant, progress=False,
                               kv_cache_memory="8MiB"))
    eng.runner.graph = None  # eager, so that the forward hook sees every head call
    head = eng.model.lm_head
    assert isinstance(head, Int4Linear if quant else DenseLinear) and head.float_out
    calls, seen = [], []
    hook = head.register_forward_hook(lambda m, i, o: calls.append((i[0].clone(), o.clone())))
    eng.logits_hook = lambda logits, rows: seen.append(logits.clone())
    for p in ([1, 2, 3, 4, 5], [9, 8, 7]):
        eng.add_request(p, SamplingParams(max_tokens=6, temperature=0))
    while eng.has_unfinished():
        eng.step()
    hook.remove()
    w = (head.float_weight() if quant else head.dense_weight().float()).double()
    assert len(calls) == len(seen) > 0
    for (x, y), logits in zip(calls, seen):
        assert y.dtype == logits.dtype == torch.float32
        assert torch.equal(y, logits)  # what the sampler gets is the head's float32 output
        err = (y.double() - x.double() @ w.t()).abs().max().item()
        assert err < TOL, err
