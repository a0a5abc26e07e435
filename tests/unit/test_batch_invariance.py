"""Batch invariance (layers/batch_invariance.py) on kernels and tiny models made here: every row is
computed the same way whatever the batch, so a request's tokens and logprobs are bitwise the same
alone, in a batch, chunked, from a cached prefix, speculated or not, eager or compiled."""
import random

import pytest
import torch
import torch.nn.functional as F

from mixserve import SamplingParams
from mixserve.layers import batch_invariance, invariant_linear
from mixserve.layers.paged_decode import paged_decode, paged_rows
from mixserve.llm import LLM
from tests.unit.test_engine_tiny import VOCAB, make_tiny

pytestmark = pytest.mark.skipif(batch_invariance.unavailable() is not None,
                                reason=f"batch invariance unavailable: {batch_invariance.unavailable()}")


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(37, 64), (96, 67), (300, 896), (130, 1100)])
def test_invariant_linear_rows_do_not_depend_on_the_row_count(wdtype, n, k):
    """Row tiles of 6 / 3 / 2 / 1 rows, partial 16-column panels, partial blocks of 8 panels, one
    to three k blocks of 512 and the bf16 widening from 7 rows: a row's bits never change."""
    torch.manual_seed(0)
    w = (torch.randn(n, k) * 0.1).to(wdtype)
    b = torch.randn(n)
    x = torch.randn(70, k)
    wp = invariant_linear.pack(w)
    assert wp.shape == (-(-n // 16), k, 16) and torch.equal(invariant_linear.unpack(wp, n), w)
    assert invariant_linear.unpack(invariant_linear.pack(w[:, :0]), n).shape == (n, 0)
    full = invariant_linear.linear(x, wp, n, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (full.double() - ref).abs().max() < 1e-4
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 17, 33, 64):
        for start in (0, 70 - m):  # the row's place in its tile and in the call
            got = invariant_linear.linear(x[start:start + m], wp, n, b)
            assert torch.equal(got, full[start:start + m]), (m, start)
    empty = invariant_linear.pack(w[:, :0])
    assert torch.equal(invariant_linear.linear(torch.randn(3, 0), empty, n, b), b.expand(3, n))
    assert invariant_linear.linear(x[:0], wp, n, b).shape == (0, n)
    with pytest.raises(RuntimeError, match="panels"):
        invariant_linear.linear(x, wp, n + 16, b)


def test_invariant_linear_is_one_fma_chain_in_k_order():
    """The documented arithmetic: y = fma(x[K-1], w[K-1], ... fma(x[0], w[0], 0)) + bias, checked
    against that chain in float64-rounded steps (an fma rounds once: exact in float64 for these
    float32 operands, then rounded to float32)."""
    torch.manual_seed(5)
    n, k = 20, 40
    w, x, b = torch.randn(n, k), torch.randn(3, k), torch.randn(n)
    got = invariant_linear.linear(x, invariant_linear.pack(w), n, b)
    acc = torch.zeros(3, n, dtype=torch.float32)
    for i in range(k):  # x*w is exact in float64 (24 + 24 bits), the add then rounds once to float32
        acc = (acc.double() + x[:, i:i + 1].double() * w[:, i].double()).float()
    assert torch.equal(got, acc + b)


def test_dense_linear_invariant_kernel_float_head():
    from mixserve.layers.linear import DenseLinear

    torch.manual_seed(1)
    lin = DenseLinear((torch.randn(128, 64) * 0.1).to(torch.bfloat16))
    lin.float_out = True
    lin.set_impl("invariant")
    assert lin.impl == "invariant"
    x = torch.randn(9, 64).to(torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.float32
    assert torch.equal(y[3:4], lin(x[3:4]))
    lin.float_out = False
    assert lin(x).dtype == torch.bfloat16
    w = lin.dense_weight().clone()
    assert lin.weight is None and lin.inv_packed is not None  # one copy resident
    lin.set_impl("plain")
    assert lin.impl == "plain" and torch.equal(lin.weight, w) and lin.inv_packed is None


def test_paged_rows_prefill_rows_equal_decode_rows():
    """A chunk's query rows through paged_rows get exactly what decode rows at those positions
    get from paged_decode, whatever the chunking and the rows beside them."""
    torch.manual_seed(2)
    bs, kvh, h, d, L = 16, 2, 4, 32, 70
    nb = 12
    kc, vc = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    table = torch.tensor([[7, 3, 9, 1, 5]])
    q = torch.randn(L, h, d)
    lens = torch.arange(1, L + 1)
    whole = paged_rows(q, kc, vc, table, torch.zeros(L, dtype=torch.long), lens, 0.125)
    for t in (0, 15, 16, 69):
        one = paged_decode(q[t:t + 1], kc, vc, table, lens[t:t + 1], 0.125)
        assert torch.equal(one, whole[t:t + 1])
    two = torch.cat([table, torch.tensor([[2, 4, 6, 8, 10]])])
    mixed = paged_rows(torch.cat([q[20:40], q[:5]]), kc, vc, two, torch.tensor([0] * 20 + [1] * 5),
                       torch.cat([lens[20:40], lens[:5]]), 0.125)
    assert torch.equal(mixed[:20], whole[20:40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,kvh,d", [(14, 2, 64), (12, 2, 128), (6, 3, 16), (4, 2, 40)])
def test_paged_rows_in_groups_equal_rows_alone(dtype, h, kvh, d):
    """A prefill chunk's rows are taken 16 at a time (K and V widened once a group; with AVX-512 the
    scores 16 positions at a time from K transposed, the V sums several heads a pass): every row
    equals itself alone and the decode row at its position, bit for bit, across group edges, with
    two sequences' chunks in one call."""
    torch.manual_seed(d + h)
    bs, nb, L = 16, 20, 41
    kc, vc = torch.randn(nb, bs, kvh, d).to(dtype), torch.randn(nb, bs, kvh, d).to(dtype)
    table = torch.tensor([[7, 3, 9, 1, 5, 11, 13]])
    q = torch.randn(L, h, d).to(dtype)
    lens = torch.arange(60, 60 + L)
    whole = paged_rows(q, kc, vc, table, torch.zeros(L, dtype=torch.long), lens, 0.125)
    for t in (0, 15, 16, 17, 31, 32, 40):
        assert torch.equal(paged_decode(q[t:t + 1], kc, vc, table, lens[t:t + 1], 0.125), whole[t:t + 1])
    two = torch.cat([table, torch.tensor([[2, 4, 6, 8, 10, 12, 14]])])
    mixed = paged_rows(torch.cat([q[3:23], q[:9]]), kc, vc, two, torch.tensor([0] * 20 + [1] * 9),
                       torch.cat([lens[3:23], lens[:9]]), 0.125)
    assert torch.equal(mixed[:20], whole[3:23])
    alone = paged_rows(q[:9], kc, vc, two[1:], torch.zeros(9, dtype=torch.long), lens[:9], 0.125)
    assert torch.equal(mixed[20:], alone)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("bi"), "llama", tie=True)[0]


def _ids(n, seed, lo=5, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _key(o):
    return o.token_ids, [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in o.logprobs]


SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True, logprobs=3)
FREE = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True)
ENGINE = dict(dtype="float32", kv_cache_memory="16MiB", progress=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_request_is_the_same_in_any_batch(tiny, dtype):
    llm = LLM(tiny, **{**ENGINE, "dtype": dtype})
    assert llm.engine.batch_invariant and "batch invariance on" in llm.engine.describe()
    p = _ids(1, 0, 30, 30)[0]
    alone = _key(llm.generate([p], SEEDED)[0])
    for others in (1, 7, 40):
        outs = llm.generate([p] + _ids(others, others), [SEEDED] + [FREE] * others)
        assert _key(outs[0]) == alone, others


def test_tiny_chunked_cached_and_speculated_prefills_agree(tiny):
    p = _ids(1, 3, 100, 100)[0]
    whole = LLM(tiny, kernels="decode_graph=compiled", **ENGINE)
    ref = _key(whole.generate([p], SEEDED)[0])
    again = whole.generate([p], SEEDED)[0]  # its first 96 tokens now come from the prefix cache
    assert again.metrics["cached_tokens"] >= 96 and _key(again) == ref
    chunked = LLM(tiny, max_num_batched_tokens=24, **ENGINE)
    assert _key(chunked.generate([p], SEEDED)[0]) == ref
    assert whole.engine.runner.graph.num_steps > 0  # the decode steps above ran the compiled graph
    eager = LLM(tiny, kernels="eager", **ENGINE)
    assert eager.engine.runner.graph is None and _key(eager.generate([p], SEEDED)[0]) == ref
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = whole.generate([p], greedy)[0].token_ids
    for k in (1, 4):  # verification rows (k + 1 of them) against decode rows: no tie allowance
        spec = LLM(tiny, draft_model="ngram", speculation="fixed", num_speculative_tokens=k, **ENGINE)
        assert spec.generate([p], greedy)[0].token_ids == plain


def test_verification_and_catch_up_rows_run_in_the_compiled_graph_with_eagers_bits(tiny):
    """Issue 34: a verification's k + 1 positions and a draft's catch-up run as rows of the compiled
    decode graph, each with its own context (its logits only where wanted): the tokens and
    logprobs are those of plain eager decoding, with the n-gram drafter and with a draft model,
    greedy and seeded."""
    p = _ids(1, 4, 40, 40)[0]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    eager = LLM(tiny, kernels="eager", **ENGINE)
    want = [_key(eager.generate([p], sp)[0]) for sp in (greedy, SEEDED)]
    for draft in ("ngram", tiny):
        spec = LLM(tiny, draft_model=draft, speculation="fixed", num_speculative_tokens=3,
                   kernels="decode_graph=compiled", **ENGINE)
        assert [_key(spec.generate([p], sp)[0]) for sp in (greedy, SEEDED)] == want, draft
        assert spec.engine.runner.graph.span_steps > 0  # verifications ran in the graph
        if draft != "ngram":
            assert spec.engine.proposer.runner.graph.span_steps > 0  # the draft's catch-ups too


def test_tiny_off_mode_runs_and_is_said(tiny):
    llm = LLM(tiny, batch_invariant="off", **ENGINE)
    assert not llm.engine.batch_invariant and "batch invariance off" in llm.engine.describe()
    assert len(llm.generate([_ids(1, 5)[0]], SEEDED)[0].token_ids) == 20
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM(tiny, batch_invariant="maybe", **ENGINE)


def test_top_alternatives_at_exact_ties_do_not_depend_on_the_batch():
    """token_logprobs runs one topk at the batch's largest n: among exactly tied logprobs the ids it
    returns depend on that n, so ties at a row's k-th value are settled by the lower token id."""
    from mixserve.engine.sampler import token_logprobs

    torch.manual_seed(3)
    row = torch.randn(64)
    row[[5, 9, 17, 30, 41]] = row.max() + 1  # five exact ties at the top
    raw = torch.stack([row, torch.randn(64)])
    tok = torch.tensor([0, 0])
    alone = token_logprobs(raw[:1], tok[:1], [0], [3])[0].top
    beside = token_logprobs(raw, tok, [0, 0], [3, 20])[0].top
    assert alone == beside and [t for t, _ in alone] == [5, 9, 17]
    assert token_logprobs(raw[:1], tok[:1], [0], [6])[0].top[:5] == [(t, alone[0][1]) for t in (5, 9, 17, 30, 41)]


def test_compiled_graph_equals_eager_at_an_odd_mlp_width(tmp_path):
    """An MLP width that is not a multiple of 16: Inductor's SwiGLU loop rounds the last columns
    unlike eager's scalar tail, unless the product is the opaque op (rmsnorm.silu_mul_op)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      initializer_range=0.3, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).float().eval().save_pretrained(tmp_path / "odd")
    p = _ids(1, 2, 16, 16)[0]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    compiled = LLM(str(tmp_path / "odd"), kernels="decode_graph=compiled", max_num_batched_tokens=16, **ENGINE)
    alone = _key(compiled.generate([p], sp)[0])
    assert compiled.engine.runner.graph.num_steps > 0
    beside = compiled.generate([p, _ids(1, 5, 200, 200)[0]], [sp, SamplingParams(temperature=0, max_tokens=1)])[0]
    assert _key(beside) == alone  # its decode steps shared with a chunked prefill run eagerly
    eager = LLM(str(tmp_path / "odd"), kernels="eager", **ENGINE)
    assert _key(eager.generate([p], sp)[0]) == alone


@pytest.mark.parametrize("case", ["v_shape", "v_blocks", "dtype", "len_long", "len_zero", "block_out", "block_neg",
                                  "row_table", "no_kv_heads"])
def test_paged_kernel_refuses_inputs_that_would_read_outside_the_cache(case):
    """Found by a break-it round: these read out of bounds, divided by zero or gave garbage."""
    q, kc, vc = torch.randn(2, 4, 64), torch.randn(6, 16, 2, 64), torch.randn(6, 16, 2, 64)
    t, lens, rt = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([40, 3]), torch.tensor([0, 1])
    if case == "v_shape":
        vc = vc[..., :8].contiguous()
    elif case == "v_blocks":
        vc = vc[:1].contiguous()
    elif case == "dtype":
        kc = kc.bfloat16()
    elif case == "len_long":
        lens = torch.tensor([20000, 3])
    elif case == "len_zero":
        lens = torch.tensor([0, 3])
    elif case == "block_out":
        t = torch.tensor([[0, 10**9, 2], [3, 4, 5]])
    elif case == "block_neg":
        t = torch.tensor([[0, 1, 2], [-1, 4, 5]])
    elif case == "row_table":
        rt = torch.tensor([0, 10**9])
    else:
        kc, vc = kc[:, :, :0].contiguous(), vc[:, :, :0].contiguous()
    with pytest.raises(RuntimeError, match="paged_decode"):
        paged_rows(q, kc, vc, t, rt, lens, 0.1)
    assert torch.isfinite(paged_rows(q, torch.randn(6, 16, 2, 64), torch.randn(6, 16, 2, 64),
                                     torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([0, 1]),
                                     torch.tensor([40, 3]), 0.1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [64, 896, 1000])
def test_rms_norm_rows_do_not_depend_on_the_row_count(dtype, h):
    """The opaque RMSNorm's C++ op (layers/rmsnorm.py): a row's output is the same alone and among
    1-64 rows (any H, a partial last 16-lane group included), within one rounding of the aten
    composite it replaced, and a NaN row leaves the others as they were."""
    from mixserve.layers.rmsnorm import rms_norm_rows, rows_kernel

    if not rows_kernel():
        pytest.skip("C++ kernels unavailable")
    g = torch.Generator().manual_seed(h)
    x = (torch.randn(64, h, generator=g) * 3).to(dtype)
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    full = rms_norm_rows(x, w, 1e-6)
    for rows in (1, 2, 7, 64):
        assert torch.equal(rms_norm_rows(x[:rows].clone(), w, 1e-6), full[:rows])
    assert torch.equal(rms_norm_rows(x[5:6].clone(), w, 1e-6), full[5:6])
    ref = w * F.rms_norm(x.float(), (h,), eps=1e-6).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert torch.allclose(full.float(), ref.float(), rtol=tol, atol=tol)
    bad = x.clone()
    bad[3, 0] = float("nan")
    out = rms_norm_rows(bad, w, 1e-6)
    assert out[3].isnan().all() and torch.equal(out[torch.arange(64) != 3], full[torch.arange(64) != 3])
    with pytest.raises(RuntimeError, match="one dtype"):
        rms_norm_rows(x, w.to(torch.float16 if dtype == torch.float32 else torch.float32), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_rows_do_not_depend_on_the_row_count(dtype):
    """SwiGLU's C++ op (layers/rmsnorm.silu_mul_rows): a row alone equals it among 64, on the strided
    halves of one gate_up output; close to F.silu(gate) * up; NaN stays in its element."""
    from mixserve.layers.rmsnorm import rows_kernel, silu_mul

    if not rows_kernel():
        pytest.skip("C++ kernels unavailable")
    gu = (torch.randn(64, 2 * 1000, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    g, u = gu.chunk(2, dim=-1)
    full = torch.ops.mixserve.silu_mul_rows(g, u)
    assert full.is_contiguous() and full.shape == (64, 1000)
    for rows in (1, 2, 7):
        a, b = gu[:rows].chunk(2, dim=-1)
        assert torch.equal(torch.ops.mixserve.silu_mul_rows(a, b), full[:rows])
    assert torch.equal(silu_mul(g, u, opaque=False), full)  # eager steps take the op
    tol = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert torch.allclose(full.float(), (F.silu(g) * u).float(), rtol=tol, atol=tol)
    g2 = g.clone()
    g2[5, 7] = float("nan")
    out = torch.ops.mixserve.silu_mul_rows(g2, u)
    assert out[5, 7].isnan() and out.isnan().sum() == 1


def test_the_thread_count_changes_no_bits():
    """The kernels split their work across threads by output columns, rows or heads, never inside a
    row's reduction: the invariant linear (at 3 and 64 rows), the paged attention rows, the bf16 GEMV,
    the int4 VNNI kernel (levels 1 and 3), and every native GGUF kernel (few-row at 1 and 3 rows with
    one and two panels a pass, int8 levels 1-3, float32 and bfloat16 rows; many-row at 64; AMX's where
    it runs; the dequantization) give the same bits at 1, 2 and 3 threads. The suite runs one thread a
    worker (pytest-xdist, tests/conftest.py), so this test is where the split itself is checked."""
    from mixserve.layers import bf16_gemv, gguf_kernels, int4_vnni
    from mixserve.layers.gguf_blocks import BLOCK_SIZES
    from mixserve.layers.gguf_linear import GGUFWeight, random_blocks
    from mixserve.layers.kernel_choice import amx_permitted

    torch.manual_seed(9)
    w = torch.randn(300, 640) * 0.1
    wp, b, x = invariant_linear.pack(w), torch.randn(300), torch.randn(64, 640)
    kc, vc = torch.randn(20, 16, 2, 64), torch.randn(20, 16, 2, 64)
    table = torch.tensor([[7, 3, 9, 1, 5, 11, 13], [2, 4, 6, 8, 10, 12, 14]])
    q, seqs, lens = torch.randn(37, 14, 64), torch.tensor([0] * 30 + [1] * 7), torch.arange(60, 97)
    wb, xb = w.bfloat16(), x[:3].bfloat16()
    q4 = int4_vnni.pack(torch.randint(0, 16, (300, 640))) if int4_vnni.available() else None
    s4, m4 = torch.rand(300, 5).half() * 0.1, torch.randn(300, 5).half() * 0.1
    native = {}
    if gguf_kernels.available():
        for qtype in BLOCK_SIZES:
            k = 768 if qtype.endswith("_K") else 640
            native[qtype] = GGUFWeight.from_blocks(qtype, random_blocks(qtype, 290, k, seed=3), k)
    xs = {k: (torch.randn(64, k) * torch.linspace(0.1, 3, k)).contiguous() for k in (640, 768)}
    amx = gguf_kernels.amx_built() and amx_permitted()

    def run():
        out = [invariant_linear.linear(x, wp, 300, b), invariant_linear.linear(x[:3], wp, 300, b),
               paged_rows(q, kc, vc, table, seqs, lens, 0.125)]
        if bf16_gemv.available():
            out.append(bf16_gemv.gemv(xb, wb, None, torch.float32))
        if q4 is not None:
            out += [int4_vnni.int4_vnni_matmul(x[:3], q4, s4, m4, 128, levels) for levels in (1, 3)]
        for gw in native.values():
            xk = xs[gw.in_features]
            gw.many = 0
            out.append(gw.dequantize())
            for passes in (1, 2):  # one panel a pass, two (few2)
                gw.passes = passes
                out += [gw.matmul(xk[:rows], levels=levels) for rows in (1, 3) for levels in (1, 2, 3)]
                out.append(gw.matmul(xk[:3].bfloat16(), levels=2))
            gw.passes = 0
            out.append(gw.matmul(xk, levels=2))
            if amx:
                old = gguf_kernels.set_amx(True)
                try:
                    gw.many = 1
                    out.append(gw.matmul(xk, levels=2))
                finally:
                    gw.many = 0
                    gguf_kernels.set_amx(old)
        return out

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = run()
        for n in (2, 3):
            torch.set_num_threads(n)
            for i, (a, r) in enumerate(zip(run(), ref)):
                assert torch.equal(a, r), (n, i)
    finally:
        torch.set_num_threads(before)


_CROSS_ISA = r"""
import sys, torch
from mixserve.layers import invariant_linear
from mixserve.layers.paged_decode import paged_rows
torch.manual_seed(11)
out = {}
for dtype in (torch.float32, torch.bfloat16):
    kc, vc = torch.randn(20, 16, 2, 64).to(dtype), torch.randn(20, 16, 2, 64).to(dtype)
    q = torch.randn(41, 14, 64).to(dtype)
    table = torch.tensor([[7, 3, 9, 1, 5, 11, 13]])
    out[f"attn-{dtype}"] = paged_rows(q, kc, vc, table, torch.zeros(41, dtype=torch.long), torch.arange(60, 101), 0.125)
    w = (torch.randn(300, 1100) * 0.1).to(dtype)
    out[f"gemm-{dtype}"] = invariant_linear.linear(torch.randn(70, 1100), invariant_linear.pack(w), 300, torch.randn(300))
torch.save(out, sys.argv[1])
print("LIBS", sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "mixserve_kernels" in ln}))
"""


def test_the_forced_avx2_build_gives_the_native_builds_bits(tmp_path):
    """Issue 43: under MIXSERVE_ISA=avx2 the bundle is built without AVX-512 (cpp_build.forced_isa_flags),
    as an AVX2-only CPU builds it: the paged kernel's prefill rows then take the AVX2 loop, not the
    AVX-512 group path, and the invariant GEMM has 16 vector registers. Both builds give the same
    bits, so a request's answer does not depend on which of them served it; the kernels' invariance
    tests pass on it; and the forced process really ran another build (its own library under the
    cache root, with no 512-bit register)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "cross.py"
    script.write_text(_CROSS_ISA)

    def run(name, isa):
        r = subprocess.run([sys.executable, str(script), str(tmp_path / name)], capture_output=True, text=True,
                           timeout=900, env={**os.environ, "MIXSERVE_ISA": isa})
        assert r.returncode == 0, r.stderr[-3000:]
        return [ln for ln in r.stdout.splitlines() if ln.startswith("LIBS")]

    native_libs = run("native.pt", "native")
    forced_env = {**os.environ, "MIXSERVE_ISA": "avx2"}
    r = subprocess.run([sys.executable, "-c", "from mixserve.layers import cpp_build; print(cpp_build.forced_isa_flags())"],
                       env=forced_env, capture_output=True, text=True, timeout=120)
    assert "-mno-avx512f" in r.stdout
    forced_libs = run("avx2.pt", "avx2")
    assert native_libs and forced_libs and native_libs != forced_libs, (native_libs, forced_libs)
    import ast
    import shutil

    from mixserve.env import cpu_flags

    if shutil.which("objdump"):  # no 512-bit register in the forced build; the native one has them
        def zmm(lib_line):
            (lib,) = ast.literal_eval(lib_line[len("LIBS "):])
            return subprocess.run(["objdump", "-d", lib], capture_output=True, text=True).stdout.count("zmm")

        assert zmm(forced_libs[0]) == 0
        if "avx512f" in cpu_flags():
            assert zmm(native_libs[0]) > 0
    # and the kernels' tests above and a tiny engine's any-batch test pass on that build (issue 43: the
    # invariance tests on the forced AVX2 path; the compiled-graph ones, 50 s more, run on the native build)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k",
                        "(invariant_linear or paged or rms_norm or tiny_request_is_the_same) and not forced_avx2_build"],
                       env=forced_env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
    native, avx2 = torch.load(tmp_path / "native.pt"), torch.load(tmp_path / "avx2.pt")
    assert native.keys() == avx2.keys() and len(native) == 4
    for name in native:
        assert torch.equal(native[name], avx2[name]), name
