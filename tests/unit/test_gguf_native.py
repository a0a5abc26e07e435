"""GGUF weights run as stored (issue 16): the native layout's effective weights equal the `gguf`
package's dequantization bit for bit for every block type, the integer kernel equals
those weights times the int8-quantized activations, and a GGUF model loads natively with the same
tensors as the dequantized load. Random blocks here; the real files are in tests/integration."""
import gguf
import numpy as np
import pytest
import torch

from mixserve.layers import gguf_kernels, gguf_linear
from mixserve.layers.gguf_linear import GGUFEmbedding, GGUFLinear, GGUFWeight, random_blocks
from mixserve.layers.gguf_blocks import BLOCK_SIZES

pytestmark = pytest.mark.skipif(not gguf_kernels.available(), reason="native GGUF kernel needs AVX2 (or AVX512-VNNI)")

TYPES = tuple(BLOCK_SIZES)


def reference(qtype: str, blocks: np.ndarray, k: int) -> torch.Tensor:
    arr = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.asarray(arr, np.float32).reshape(blocks.shape[0], k).copy())


def shapes(qtype):
    # K: whole 16-group blocks and a tail block; N odd (the kernel takes rows in pairs)
    return [(37, 256 * 3), (8, 512)] if qtype.endswith("_K") else [(37, 32 * 20), (5, 512), (3, 32)]


@pytest.mark.parametrize("qtype", TYPES)
def test_effective_weights_equal_gguf_dequantization_exactly(qtype):
    for n, k in shapes(qtype):
        blocks = random_blocks(qtype, n, k)
        ref = reference(qtype, blocks, k)
        w = GGUFWeight.from_blocks(qtype, blocks, k)
        eff = w.dequantize(torch.float32)
        # every d * sc and dm * mn is exact in float32 and w = fma(q, s, m) rounds once, as gguf's
        # float32 arithmetic does: equal bit for bit, not within an ulp
        assert torch.equal(eff, ref), (qtype, n, k, (eff - ref).abs().max())
        assert torch.equal(w.dequantize(torch.bfloat16), ref.to(torch.bfloat16))
        rows = torch.tensor([n - 1, 0, n // 2, n - 1])
        assert torch.equal(w.dequantize(torch.float32, rows=rows), ref[rows])
        # the layout keeps the file's bits: resident bytes within 3% of the file's, rows padded to
        # whole 16-row panels
        padded = -(-n // 16) * 16
        assert blocks.nbytes <= w.nbytes() <= 1.03 * blocks.nbytes * padded / n


def int8_reference(x: torch.Tensor, w: torch.Tensor, levels: int = 1) -> torch.Tensor:
    """x quantized per 32 channels (dx = max|x| / 127, round half to even) to `levels` int8 levels,
    two making one int16 (x16 = round(256 x / dx)), times w^T in float64: what the kernel computes;
    levels > 2: what that left over quantized again and added."""
    rest, total = x.double(), 0
    for i in range((levels + 1) // 2):
        xr = rest.view(x.shape[0], -1, 32)
        d = xr.abs().amax(-1, keepdim=True) / 127
        t = torch.where(d > 0, xr / torch.where(d > 0, d, 1), 0)
        q = torch.round(t * 256) if 2 * (i + 1) <= levels else torch.round(t) * 256
        total = total + (q * d / 256).view_as(x)
        rest = rest - (q * d / 256).view_as(x)
    return total @ w.double().t()


@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_equals_effective_weights_times_int8_activations(qtype):
    n, k = shapes(qtype)[0]
    w = GGUFWeight.from_blocks(qtype, random_blocks(qtype, n, k, seed=1), k)
    ref_w = w.dequantize(torch.float32)
    torch.manual_seed(0)
    for rows in (1, 2, 5):  # the kernel takes activation rows four at a time
        x = torch.randn(rows, k) * torch.linspace(0.1, 3, k)  # uneven channels, as real activations
        for pf in (0, 4, -1, -5):  # prefetching, or one weight row a pass, must not change a value
            w.prefetch = pf
            y = w.matmul(x)
            ref = int8_reference(x, ref_w)
            assert y.dtype == torch.float32 and y.shape == (rows, n)
            assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-6, (qtype, rows, pf)
        exact = x.double() @ ref_w.double().t()
        # three int8 levels: each keeps ~7 more bits of the activations
        e1 = (w.matmul(x).double() - exact).abs().max()
        e3 = (w.matmul(x, levels=3).double() - exact).abs().max()
        assert e3 < 1e-4 * exact.abs().max() and e3 < e1 / 100, (qtype, e1, e3)


def _fma32(a, b, c):
    """float32 fma(a, b, c): a * b is exact in float64 and the sum rounds twice (to float64, then
    float32), which differs from one rounding only at a float32 tie, ~2^-29 of the time."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def float_order_reference(qtype: str, blocks: np.ndarray, k: int, x: np.ndarray, levels: int = 2) -> np.ndarray:
    """What the native kernel computes, in the float order layers/gguf_src.py documents, in numpy:
    x float32 [R, K] quantized per 32 channels to int16 (x16 = round(256 x / dx), or 256 round(x / dx)
    for an odd last level), e = dx / 256; per group g the exact integer sum of (q - z) * x16 (or q *
    x16 and the offset first: acc = fma(m, e * sum(x16), acc)); acc = fma(isum, s * e, acc) over the
    groups in order; levels 3-4 add the same for what the first row left over. float32 [R, N]."""
    from mixserve.layers import gguf_blocks

    f = gguf_blocks.parse(qtype, blocks, k)
    n, g = f.q.shape[0], f.group
    ng, f32, rows = k // g, np.float32, x.shape[0]
    d = f.d.astype(f32)
    gps = f.superblock // g
    s = d if f.sc is None else np.repeat(d, gps, axis=1) * f.sc.astype(f32)
    offset = f.dm is not None
    if f.mn is not None:
        m = np.repeat(f.dm.astype(f32), gps, axis=1) * f.mn.astype(f32)
    else:
        m = f.dm.astype(f32) if offset else None
    qq = f.q.reshape(n, ng, g).astype(np.int64) - (0 if offset else f.zero)
    rest, total = x.astype(f32), None
    for i in range((levels + 1) // 2):
        full = 2 * (i + 1) <= levels
        xb = rest.reshape(rows, -1, 32)
        dx = (np.abs(xb).max(-1) / f32(127)).astype(f32)
        inv = np.where(dx > 0, f32(1) / np.where(dx > 0, dx, f32(1)), f32(0)).astype(f32)
        t = (xb * inv[..., None]).astype(f32)
        v = np.rint(t * f32(256)) if full else np.rint(t) * f32(256)
        v = np.clip(v, -32512, 32512).astype(f32)
        e = (dx * f32(1 / 256)).astype(f32)
        x16 = v.astype(np.int64).reshape(rows, ng, g)
        eg = np.repeat(e, 32 // g, axis=1)  # [R, ng]
        xs = (eg * x16.sum(-1).astype(f32)).astype(f32)
        isum = np.einsum("ngc,rgc->rng", qq, x16)  # [R, N, ng], exact
        acc = np.zeros((rows, n), f32)
        for gi in range(ng):
            if offset:
                acc = _fma32(m[None, :, gi], xs[:, gi, None], acc)
            acc = _fma32(isum[:, :, gi].astype(f32), (s[None, :, gi] * eg[:, gi, None]).astype(f32), acc)
        total = acc if total is None else (total + acc).astype(f32)
        rest = _fma32(-v, np.broadcast_to(e[..., None], v.shape), xb).reshape(rows, k)
    return total


@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_follows_the_documented_float_order_bit_for_bit(qtype):
    """Every variant of the kernel (AVX512-VNNI, AVX2) computes the float order gguf_src.py writes
    down, so they give the same bits (issue 43): checked against a numpy emulation of it, at 1, 2,
    5, 6 and 13 rows (the few-row kernel's passes of 5 rows and of 4 + 2, the many-row kernel),
    whole and partial panels, with and without prefetch, at one int8 level and at the engine's two
    (one int16 row)."""
    torch.manual_seed(3)
    for n, k in shapes(qtype):
        blocks = random_blocks(qtype, n, k, seed=2)
        w = GGUFWeight.from_blocks(qtype, blocks, k)
        for rows in (1, 2, 5, 6, 13):
            x = (torch.randn(rows, k) * torch.linspace(0.1, 3, k)).contiguous()
            for levels in (1, 2):
                ref = torch.from_numpy(float_order_reference(qtype, blocks, k, x.numpy(), levels))
                for pf in (0, 8):
                    w.prefetch = pf
                    y = w.matmul(x, levels)
                    assert torch.equal(y, ref), (qtype, n, k, rows, levels, pf, (y - ref).abs().max().item(),
                                                 (y != ref).sum().item())


@pytest.mark.parametrize("qtype", TYPES)
def test_integer_extremes_follow_the_float_order(qtype):
    """The largest q of each type against activations whose int8 levels are extreme and of one sign
    (x1 = +-127 everywhere, or x2 = -128 on 31 of a block's 32 channels): the sums the AVX2 variant
    keeps in int16 before widening (gguf_src.py's cap16) come closest to overflowing there, and an
    overflow shows as a wrong bit against the numpy float order, at the few-row and many-row kernels'
    row counts and the LM head's three levels."""
    from mixserve.layers.gguf_linear import _HALF_FIELDS

    bs, ts = BLOCK_SIZES[qtype]
    for n, k in shapes(qtype)[:2]:
        b = random_blocks(qtype, n, k, seed=9).reshape(n, k // bs, ts)
        keep = np.zeros(ts, bool)
        for off in _HALF_FIELDS[qtype]:
            keep[off:off + 2] = True
        # Q8_0's int8 127 is the unsigned 255 (both nibbles 15); every other type's largest q is all ones
        b[..., ~keep] = 0x7F if qtype == "Q8_0" else 0xFF
        blocks = b.reshape(n, -1)
        w = GGUFWeight.from_blocks(qtype, blocks, k)
        half = np.full(k, -0.5, np.float32)
        half[::32] = 127.0  # dx = 1: x16 = -128 (x1 = 0, x2 = -128) beside each block's 32512
        base = np.stack([np.full(k, 127.0, np.float32), np.full(k, -127.0, np.float32), half, -half])
        for rows in (1, 2, 4, 13):
            x = base[np.arange(rows) % 4]
            for levels in (2, 3):
                ref = torch.from_numpy(float_order_reference(qtype, blocks, k, x, levels))
                y = w.matmul(torch.from_numpy(x.copy()), levels)
                assert torch.equal(y, ref), (qtype, n, k, rows, levels, (y != ref).sum().item())


def test_two_panel_passes_follow_the_float_order():
    """The few-row kernel's two-panel passes (Q6_K at K >= 4096, gguf_src.py's fewp): 1-4 rows at the
    engine's two levels and the LM head's three, against the numpy float order, on panel counts that
    leave a thread an odd number of panels (its last panel alone) and a partial last panel."""
    torch.manual_seed(12)
    k = 4352
    for n in (83, 117):
        blocks = random_blocks("Q6_K", n, k, seed=13)
        w = GGUFWeight.from_blocks("Q6_K", blocks, k)
        x = (torch.randn(4, k) * torch.linspace(0.1, 3, k)).contiguous()
        for levels in (2, 3):
            ref = torch.from_numpy(float_order_reference("Q6_K", blocks, k, x.numpy(), levels))
            for rows in (1, 2, 3, 4):
                assert torch.equal(w.matmul(x[:rows], levels), ref[:rows]), (n, levels, rows)


def test_one_or_two_panels_a_pass_as_timed_give_the_same_bits():
    """GGUFWeight.passes (the `gguf_passes` choice: the few-row kernel's one or two panels a pass for
    16-channel groups, timed per weight since the faster differs by CPU) changes no bit: Q6_K at a K
    below and above the kernel's own rule (4096), 1-4 rows, the engine's two levels and the LM head's
    three, against the rule's default and the numpy float order."""
    torch.manual_seed(21)
    for n, k in ((37, 1536), (21, 4352)):
        blocks = random_blocks("Q6_K", n, k, seed=22)
        w = GGUFWeight.from_blocks("Q6_K", blocks, k)
        for rows in (1, 2, 3, 4):
            x = (torch.randn(rows, k) * torch.linspace(0.1, 3, k)).contiguous()
            ref = torch.from_numpy(float_order_reference("Q6_K", blocks, k, x.numpy(), 2))
            for levels in (2, 3):
                got = []
                for passes in (0, 1, 2):
                    w.passes = passes
                    got.append(w.matmul(x, levels))
                assert torch.equal(got[0], got[1]) and torch.equal(got[0], got[2]), (k, rows, levels)
                if levels == 2:
                    assert torch.equal(got[2], ref), (k, rows)
        w.passes = 0


@pytest.mark.parametrize("qtype", TYPES)
def test_levels_past_two_add_the_first_rows_rest(qtype):
    """levels 3 and 4 (the LM head's float32 logits): the row's int16 quantization, then what it left
    over, fma(-x16, e, x) in float32, quantized again (one int8 level, or two), the two products
    added in float32 (the vectorized row quantizer against numpy, for the rest it writes as well as
    the integers), at 1 and 13 rows."""
    n, k = shapes(qtype)[0]
    blocks = random_blocks(qtype, n, k, seed=6)
    w = GGUFWeight.from_blocks(qtype, blocks, k)
    for rows in (1, 13):
        x = (torch.randn(rows, k) * torch.linspace(0.1, 3, k)).numpy()
        for levels in (3, 4):
            ref = float_order_reference(qtype, blocks, k, x, levels)
            y = w.matmul(torch.from_numpy(x), levels=levels)
            assert torch.equal(y, torch.from_numpy(ref)), (qtype, rows, levels, (y.numpy() != ref).sum())


@pytest.mark.skipif(gguf_kernels.isa() == "avx2", reason="this CPU's variant is the AVX2 one: the tests above ran it")
def test_the_forced_avx2_variant_follows_the_same_float_order(tmp_path):
    """MIXSERVE_ISA=avx2 on a CPU with AVX512-VNNI: the AVX2 variant, built on its own, passes the
    float-order and row-count tests above too, so the two variants give the same bits (issue 43)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MIXSERVE_ISA": "avx2"}
    code = "from mixserve.layers import gguf_kernels; assert gguf_kernels.isa() == 'avx2', gguf_kernels.isa()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", __file__, "-k",
                        "float_order or bits_it_gets_alone or levels_past_two or bfloat16 or chunks"], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("qtype", TYPES)
def test_many_rows_give_each_row_the_bits_it_gets_alone(qtype):
    """Batch invariance in the kernel (issue 43): a row's output is the same bits at 1, 2, 7, 64 and
    512 rows (the many-row kernel past four rows, the few-row one below), on whole and tail blocks
    and for the LM head's three int8 levels."""
    torch.manual_seed(4)
    for n, k in shapes(qtype)[:2]:
        w = GGUFWeight.from_blocks(qtype, random_blocks(qtype, n, k, seed=5), k)
        x = (torch.randn(512, k) * torch.linspace(0.1, 3, k)).contiguous()
        for levels in (1, 3):
            alone = torch.cat([w.matmul(x[i:i + 1], levels=levels) for i in (0, 1, 6, 63, 511)])
            for rows in (2, 7, 64, 512):
                y = w.matmul(x[:rows], levels=levels)
                picked = [i for i in (0, 1, 6, 63, 511) if i < rows]
                assert torch.equal(y[picked], alone[:len(picked)]), (qtype, n, k, levels, rows)


def _amx_usable() -> bool:
    from mixserve.layers.kernel_choice import amx_permitted

    return gguf_kernels.amx_built() and amx_permitted()


@pytest.mark.skipif(not _amx_usable(), reason="the AMX-INT8 variant needs a CPU with AMX (and a build for it)")
@pytest.mark.parametrize("qtype", TYPES)
def test_amx_many_row_kernel_gives_each_row_the_bits_it_gets_alone(qtype):
    """Issue 43: the many-row kernel on AMX-INT8 tiles (GGUFWeight.many = 1) gives every row the bits
    it gets alone (the few-row kernel) and from the AVX512-VNNI many-row kernel: 9-512 rows (a
    partial last block of 16), the engine's two levels and the LM head's three, whole and tail
    blocks of K, and a K past one 1024-channel block (the accumulators carried between blocks)."""
    torch.manual_seed(14)
    old = gguf_kernels.set_amx(True)
    try:
        ks = [(37, 768), (19, 2304)] if qtype.endswith("_K") else [(37, 640), (19, 2080)]
        for n, k in ks:
            w = GGUFWeight.from_blocks(qtype, random_blocks(qtype, n, k, seed=15), k)
            x = (torch.randn(512, k) * torch.linspace(0.1, 3, k)).bfloat16()
            picked = [0, 6, 8, 15, 16, 63, 511]
            for levels in (2, 3):
                w.many = 0
                alone = torch.cat([w.matmul(x[i:i + 1], levels=levels) for i in picked])
                for rows in (9, 17, 64, 512):
                    w.many = 0
                    vnni = w.matmul(x[:rows], levels=levels)
                    w.many = 1
                    y = w.matmul(x[:rows], levels=levels)
                    at = [j for j, i in enumerate(picked) if i < rows]
                    assert torch.equal(y, vnni), (qtype, n, k, levels, rows)
                    assert torch.equal(y[[picked[j] for j in at]], alone[at]), (qtype, n, k, levels, rows)
    finally:
        gguf_kernels.set_amx(old)


def test_allowing_amx_where_linux_refuses_its_state_raises_instead_of_dying(monkeypatch):
    """set_amx(True) asks for AMX's state first: where it is refused, a RuntimeError, not the SIGILL
    of an AMX instruction (a break-it helper's fresh process died with rc 132 before)."""
    from mixserve.layers import kernel_choice

    monkeypatch.setattr(gguf_kernels, "amx_built", lambda: True)
    monkeypatch.setattr(kernel_choice, "amx_permitted", lambda *a, **k: False)
    with pytest.raises(RuntimeError, match="may not use AMX"):
        gguf_kernels.set_amx(True)


def test_amx_variant_is_asked_for_only_where_it_may_run():
    """A weight's `many` = 1 runs the VNNI many-row kernel where AMX is not allowed in the process
    (the same bits), and allowing it where the build has no AMX variant is refused."""
    w = GGUFWeight.from_blocks("Q4_0", random_blocks("Q4_0", 20, 256, seed=16), 256)
    x = torch.randn(40, 256)
    w.many = 0
    ref = w.matmul(x, levels=2)
    old = gguf_kernels.set_amx(False) if gguf_kernels.amx_built() else False
    try:
        w.many = 1
        assert torch.equal(w.matmul(x, levels=2), ref)
        if not gguf_kernels.amx_built():
            with pytest.raises(RuntimeError, match="no AMX-INT8 variant"):
                gguf_kernels.set_amx(True)
    finally:
        if gguf_kernels.amx_built():
            gguf_kernels.set_amx(old)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0", "Q5_0"])
def test_rows_in_chunks_and_channels_in_blocks_keep_each_rows_bits(qtype):
    """The many-row kernel takes rows in chunks of ~2 MB of activations (450 rows at K = 2304) and
    channels in blocks of 1024: rows on either side of a chunk's edge, and a K past one block with
    a partial last block, get the bits they get alone and in a 7-row call."""
    torch.manual_seed(10)
    k = 2304 if qtype.endswith("_K") else 2080
    w = GGUFWeight.from_blocks(qtype, random_blocks(qtype, 37, k, seed=11), k)
    x = (torch.randn(1100, k) * torch.linspace(0.1, 3, k)).bfloat16()
    picked = [0, 5, 449, 450, 451, 899, 900, 1099]
    y = w.matmul(x, levels=2)
    alone = torch.cat([w.matmul(x[i:i + 1], levels=2) for i in picked])
    assert torch.equal(y[picked], alone), qtype
    assert torch.equal(y[445:452], w.matmul(x[445:452], levels=2)), qtype


@pytest.mark.parametrize("qtype", TYPES)
def test_bfloat16_activations_go_in_as_their_float32_values(qtype):
    """The kernel reads bfloat16 rows itself (no float32 copy a call): the same bits as the same
    values in float32, at few rows and many, every level count, with a NaN row failing only itself."""
    torch.manual_seed(8)
    n, k = shapes(qtype)[1]
    w = GGUFWeight.from_blocks(qtype, random_blocks(qtype, n, k, seed=9), k)
    xb = (torch.randn(70, k) * torch.linspace(0.1, 3, k)).bfloat16()
    xb[5, 3] = float("nan")
    for levels in (1, 2, 3, 4):
        for rows in (1, 3, 7, 70):
            y = w.matmul(xb[:rows], levels=levels)
            ref = torch.ops.mixserve.gguf_matmul(xb[:rows].float().contiguous(), *w._args(), levels, w.prefetch)
            assert y.dtype == torch.float32 and torch.equal(y.nan_to_num(7.0), ref.nan_to_num(7.0)), (levels, rows)
            if rows > 5:
                assert y[5].isnan().all() and not y[:5].isnan().any() and not y[6:].isnan().any()


@pytest.mark.parametrize("qtype", TYPES)
def test_streaming_passes_at_few_rows_give_the_many_row_kernels_bits(qtype):
    """Issue 34: up to `set_wide_rows` int16 activation rows (a 2-8-row step: speculative
    verification) run by the few-row kernel's streaming passes, 4 rows a pass or 5 where 5 are left
    (at the LM head's three levels 2 rows a pass, or 3 where 3 are left), instead of the many-row
    kernel; each row gets the same bits either way, and the bits it gets alone."""
    from mixserve.layers import gguf_kernels

    torch.manual_seed(6)
    n, k = shapes(qtype)[1]
    w = GGUFWeight.from_blocks(qtype, random_blocks(qtype, n, k, seed=7), k)
    x = (torch.randn(8, k) * torch.linspace(0.1, 3, k)).contiguous()
    old = gguf_kernels.set_wide_rows(16)
    try:
        for levels in (2, 3):
            alone = torch.cat([w.matmul(x[i:i + 1], levels=levels) for i in range(8)])
            for rows in (3, 4, 5, 6, 7, 8):
                gguf_kernels.set_wide_rows(16)
                y = w.matmul(x[:rows], levels=levels)
                gguf_kernels.set_wide_rows(4)
                assert torch.equal(y, w.matmul(x[:rows], levels=levels)), (qtype, levels, rows)
                assert torch.equal(y, alone[:rows]), (qtype, levels, rows)
    finally:
        gguf_kernels.set_wide_rows(old)
    assert gguf_kernels.set_wide_rows(old) == old


def test_linear_parts_dense_switch_and_float_head():
    k = 512
    parts = [GGUFWeight.from_blocks(t, random_blocks(t, n, k, seed=i), k)
             for i, (t, n) in enumerate([("Q4_K", 64), ("Q6_K", 32), ("Q8_0", 16)])]
    bias = torch.randn(112)
    lin = GGUFLinear(parts, bias, torch.float32)
    assert lin.out_features == 112 and lin.qtypes == "Q4_K+Q6_K+Q8_0"
    dense = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(lin.dense_weight(), dense)
    x = torch.randn(3, 7, k)
    y = lin(x)
    ref = (int8_reference(x.reshape(-1, k), dense, gguf_linear.ACT_LEVELS) + bias.double()).view(3, 7, -1)
    # a second level quantizes a float32 residual: a rounding boundary may fall either side of the float64 one
    assert y.shape == (3, 7, 112) and (y.double() - ref).abs().max() < 3e-5 * ref.abs().max()
    lin.dense_rows = 4  # 21 rows: dequantize + GEMM, no activation rounding
    assert torch.allclose(lin(x), torch.nn.functional.linear(x, dense, bias), rtol=1e-5, atol=1e-3)
    assert lin(torch.randn(0, k)).shape == (0, 112)
    lin.dense_rows, lin.float_out = None, True
    exact = x.reshape(-1, k).double() @ dense.double().t() + bias.double()
    for switch in (None, 1):  # three-level kernel; float32 dequantization in slices
        lin.float_dense_rows = switch
        out = lin(x)
        assert out.dtype == torch.float32 and (out.reshape(-1, 112).double() - exact).abs().max() < 1e-5 * exact.abs().max()


def test_panels_concatenate_and_permute_as_rows():
    """The 16-row panel layout (issue 43) keeps GGUFWeight's row operations: parts of 37 and 5 rows
    (partial panels) stacked, and rows reordered (llama files' Q/K rows), dequantize to the stacked /
    reordered rows and multiply as them, bit for bit."""
    k = 256
    a = GGUFWeight.from_blocks("Q4_K", random_blocks("Q4_K", 37, k, seed=11), k)
    b = GGUFWeight.from_blocks("Q4_K", random_blocks("Q4_K", 5, k, seed=12), k)
    both = GGUFWeight.concat([a, b])
    ref = torch.cat([a.dequantize(), b.dequantize()])
    assert both.out_features == 42 and both.lo.shape[0] == 3 and torch.equal(both.dequantize(), ref)
    x = torch.randn(3, k)
    assert torch.equal(both.matmul(x, 2), torch.cat([a.matmul(x, 2), b.matmul(x, 2)], 1))
    index = torch.randperm(42, generator=torch.Generator().manual_seed(0))
    perm = both.permute_rows(index)
    assert torch.equal(perm.dequantize(), ref[index])
    assert torch.equal(perm.matmul(x, 2), both.matmul(x, 2)[:, index])


def test_bad_row_operations_are_refused_and_empty_rows_write_nothing():
    """Break-it findings (issue 43's panels): no rows asked for writes nothing (an empty index's null
    data pointer once meant "all rows": the whole weight was written past a [0, K] buffer, and an
    embedding of no ids crashed); parts of two types do not concatenate; a non-permutation or a
    non-integer index is refused."""
    w = GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 4, 32), 32)
    buf = torch.zeros(128)
    out = w.dequantize(rows=torch.empty(0, dtype=torch.long), out=buf)
    assert out.shape == (0, 32) and not buf.any()
    assert GGUFEmbedding(w, torch.bfloat16)(torch.empty(0, dtype=torch.long)).shape == (0, 32)
    with pytest.raises(ValueError, match="rows must be integer"):
        w.dequantize(rows=torch.tensor([0.0, 1.0]))
    other = GGUFWeight.from_blocks("Q5_0", random_blocks("Q5_0", 4, 32), 32)
    with pytest.raises(ValueError, match="one GGUF type"):
        GGUFWeight.concat([w, other])
    for bad in (torch.arange(3), torch.tensor([0, 0, 1, 2]), torch.tensor([0.0, 1, 2, 3]), torch.arange(4).view(2, 2)):
        with pytest.raises(ValueError, match="permutation"):
            w.permute_rows(bad)
    with pytest.raises(RuntimeError, match="x has 64 channels, the weight 32"):  # names both sizes
        w.matmul(torch.randn(2, 64), 2)


def test_embedding_rows_are_the_dequantized_rows():
    w = GGUFWeight.from_blocks("Q5_0", random_blocks("Q5_0", 50, 96), 96)
    emb = GGUFEmbedding(w, torch.bfloat16)
    ids = torch.tensor([[3, 49, 0], [3, 3, 7]])
    out = emb(ids)
    assert out.shape == (2, 3, 96) and out.dtype == torch.bfloat16
    assert torch.equal(out, w.dequantize()[ids].to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="out of range"):
        emb(torch.tensor([50]))


def test_unknown_type_and_bad_row_size_are_refused():
    with pytest.raises(ValueError, match="no native kernel"):
        GGUFWeight.from_blocks("Q5_K", np.zeros((2, 176), np.uint8), 256)
    with pytest.raises(ValueError, match="bytes per row"):
        GGUFWeight.from_blocks("Q8_0", np.zeros((2, 35), np.uint8), 32)


# ----------------------------------------------------------------------------------------------
# a tiny llama GGUF (Q/K rows permuted as llama.cpp stores them, a tied head) loaded both ways
# ----------------------------------------------------------------------------------------------

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, LAYERS = 256, 512, 4, 2, 320, 2
LAYER_TYPES = {"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0", "attn_output": "Q5_0",
               "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_0"}


def write_tiny_gguf(path):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_context_length(256)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shape = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (HIDDEN // 2, HIDDEN), "attn_v": (HIDDEN // 2, HIDDEN),
             "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
             "ffn_down": (HIDDEN, INTER)}

    def quant(name, qtype, n, k, seed):
        w.add_tensor(name, random_blocks(qtype, n, k, seed), raw_dtype=gguf.GGMLQuantizationType[qtype])
    quant("token_embd.weight", "Q8_0", VOCAB, HIDDEN, 99)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for i in range(LAYERS):
        for j, (kind, qtype) in enumerate(LAYER_TYPES.items()):
            quant(f"blk.{i}.{kind}.weight", qtype, *shape[kind], 10 * i + j)
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")


def test_native_read_holds_the_dequantized_tensors(tiny_gguf):
    from mixserve.models.weights import dequantize_gguf, read_gguf_native

    cfg, _, native, types = read_gguf_native(tiny_gguf, progress=False)
    _, _, ref, = dequantize_gguf(tiny_gguf, progress=False)[:3]
    assert set(native) == set(ref)
    assert types["Q4_K"][0] == LAYERS and types["F32"][0] == 2 * LAYERS + 1
    for name, t in native.items():
        if isinstance(t, GGUFWeight):  # q/k rows reordered as dequantize_gguf reorders them
            assert torch.equal(t.dequantize(), ref[name]), name
        else:
            assert torch.equal(t, ref[name]), name
    assert sum(isinstance(t, GGUFWeight) for t in native.values()) == 1 + 7 * LAYERS


def test_engine_native_matches_dequantized_load(tiny_gguf):
    from mixserve import SamplingParams
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    ids = np.random.default_rng(5).integers(2, VOCAB, 40).tolist()
    scores, models = {}, {}
    for mode in ("native", "dequantize"):
        eng = LLMEngine(EngineArgs(model=str(tiny_gguf), dtype="float32", kv_cache_memory="2MiB", progress=False,
                                   gguf_weights=mode, kernels="eager"))
        eng.add_request(ids, SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0, ignore_eos=True))
        outs = []
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.finished]
        scores[mode] = torch.tensor([lp.logprob for lp in outs[0].prompt_logprobs])
        models[mode] = eng.model
        if mode == "native":  # the start-up line names each block type's kernel
            text = eng.describe()
            assert "GGUF weights native" in text and "Q6_K x2: integer kernel at every row count" in text
            assert "Q8_0 x3 (with the LM head)" in text
        assert len(outs[0].token_ids) == 3
    m = models["native"]
    assert isinstance(m.embed_tokens, GGUFEmbedding) and isinstance(m.lm_head, GGUFLinear)
    assert m.lm_head.parts[0] is m.embed_tokens.weight_q  # the tied head shares the embedding's blocks
    assert [type(p).__name__ for p in m.layers[0].qkv_proj.parts] == ["GGUFWeight"] * 3
    assert m.layers[0].qkv_proj.qtypes == "Q4_K+Q6_K+Q8_0" and m.layers[0].gate_up_proj.qtypes == "Q4_1"
    # int8 activations are the one numeric change: prompt logprobs agree closely
    diff = (scores["native"] - scores["dequantize"]).abs()
    assert diff.max() < 0.05, (diff.max(), scores["dequantize"].abs().max())


def test_gguf_weights_setting_is_checked(tiny_gguf):
    from mixserve.engine.args import EngineArgs
    from mixserve.models.loader import use_native_gguf

    with pytest.raises(ValueError, match="gguf_weights"):
        EngineArgs(model=str(tiny_gguf), gguf_weights="int4").validate()
    with pytest.raises(ValueError, match="dequantize"):
        EngineArgs(model=str(tiny_gguf), gguf_weights="native", quantization="rtn").validate()
    # unset: native wherever a variant runs, the AVX2 one included (issue 43)
    assert use_native_gguf(None, None) == gguf_kernels.available() and not use_native_gguf(None, "rtn")
    assert use_native_gguf("native", None) and not use_native_gguf("dequantize", None)


def test_planner_counts_the_files_bytes(tiny_gguf):
    from mixserve.plan.cost_model import gguf_format, weight_bytes
    from mixserve.plan.planner import default_variants
    from mixserve.models.weights import read_gguf_native
    from mixserve.plan.simulator import SpecSettings
    from mixserve.plan.step_time import Accelerator, RooflineModel

    cfg = read_gguf_native(tiny_gguf, progress=False)[0]
    fmt = gguf_format(tiny_gguf)
    reader = gguf.GGUFReader(str(tiny_gguf))
    layer_bytes = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2)
    embed_bytes = next(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    wb = weight_bytes(cfg, fmt)
    norms = (2 * cfg.hidden_size * cfg.num_layers + cfg.hidden_size) * 2  # counted at 2 bytes each
    # a decode step reads every layer matmul as stored and the tied head (the embedding's blocks)
    assert wb["decode_read"] == pytest.approx(layer_bytes + embed_bytes + norms)
    assert wb["embed"] == pytest.approx(embed_bytes) and wb["lm_head"] == 0.0
    assert "Q4_1" in fmt.label
    names = [v.name for v in default_variants(SpecSettings(0.6, 4, 0.1, "auto"), gguf=fmt)]
    assert names[-1].startswith("GGUF as stored")
    am = RooflineModel(cfg, Accelerator("x", 1e14, 1e11, 80e9, "test"))
    # bandwidth-bound at one row: the time is the stored bytes over the bandwidth
    s = next(s for s in am.shapes if s.name == "gate_up")
    assert am.linear_time("gate_up", 1, fmt) == pytest.approx((s.numel * fmt.bytes_per_weight + 2 * (s.in_features
                                                               + s.out_features)) / 1e11)


def test_hw_probe_times_the_files_own_block_types(tiny_gguf):
    from mixserve.models.weights import read_gguf_native
    from mixserve.plan.hardware import gguf_shape_types, probe_linears

    cfg = read_gguf_native(tiny_gguf, progress=False)[0]
    types = gguf_shape_types(tiny_gguf, cfg)
    assert types["qkv"] == [("Q4_K", HIDDEN), ("Q6_K", HIDDEN // 2), ("Q8_0", HIDDEN // 2)]
    assert types["lm_head"] == [("Q8_0", VOCAB)]  # tied: the embedding's blocks
    out = probe_linears(cfg, [1, 4], ["gguf"], torch.float32, repeats=1, log=lambda m: None,
                        gguf_path=tiny_gguf)
    assert set(out) == {"gguf"} and set(out["gguf"]) == {"qkv", "o", "gate_up", "down", "lm_head"}
    for name, t in out["gguf"].items():
        assert t["rows"] == [1, 4] and all(s > 0 for s in t["seconds"]), name
        assert t["kernel"].startswith("gguf ")
    with pytest.raises(ValueError, match="GGUF"):
        probe_linears(cfg, [1], ["gguf"], torch.float32, repeats=1, log=lambda m: None)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0"])
def test_non_finite_activations_give_non_finite_rows(qtype):
    """A NaN or inf in a row must reach the output (the engine fails such a request on its
    non-finite logits); rounding it into int8 gave a finite, wrong row."""
    n, k = shapes(qtype)[0]
    w = GGUFWeight.from_blocks(qtype, random_blocks(qtype, n, k), k)
    x = torch.randn(4, k)
    x[1, 5], x[2, k - 1] = float("nan"), float("inf")
    for levels in (1, 3):
        y = w.matmul(x, levels)
        assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all(), levels
        assert torch.isfinite(y[0]).all() and torch.isfinite(y[3]).all()
    from mixserve.layers import int4_vnni
    if int4_vnni.available():  # the int4 x int8 kernel shares the row quantizer
        q = torch.randint(0, 16, (64, 256), dtype=torch.int32)
        s = torch.full((64, 2), 0.01, dtype=torch.float16)
        y = int4_vnni.int4_vnni_matmul(x[:, :256], int4_vnni.pack(q), s, -8 * s, 128)
        assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all()


def test_tiny_activations_give_finite_rows():
    """A 32-channel chunk whose largest |x| is ~1e-38 has a subnormal scale whose inverse is inf:
    it quantized to inf * x, cast to int8 (undefined), and a second level made the row NaN from
    finite input. Such a chunk now quantizes to zeros and its rest carries x."""
    w = GGUFWeight.from_blocks("Q8_0", random_blocks("Q8_0", 6, 64), 64)
    x = torch.randn(3, 64)
    x[1, :32] = 1e-38
    x[1, 3] = 0.0
    for levels in (1, 2, 3):
        y = w.matmul(x, levels)
        assert torch.isfinite(y).all(), levels
    ref = w.matmul(torch.cat([x[:1], torch.cat([torch.zeros(32), x[1, 32:]])[None], x[2:]]))
    assert torch.equal(w.matmul(x), ref)  # the tiny chunk adds nothing at one level


def test_probe_runs_a_part_without_native_kernel_dense(tmp_path):
    from mixserve.layers.kernel_choice import KernelChooser
    from mixserve.layers.linear import DenseLinear
    from mixserve.plan.hardware import _make_linear

    chooser = KernelChooser(tmp_path / "choices.json",
                            overrides={"dense_linear": "plain", "gguf_prefetch": "0", "gguf_dense_rows": "never"})
    lin = _make_linear("gguf", 96, 256, torch.float32, 128, chooser, gguf_parts=[("Q4_K", 64), ("Q5_K", 32)])
    assert isinstance(lin, DenseLinear) and lin(torch.randn(2, 256)).shape == (2, 96)
    lin = _make_linear("gguf", 96, 256, torch.float32, 128, chooser, gguf_parts=[("Q4_K", 64), ("Q6_K", 32)])
    assert isinstance(lin, GGUFLinear) and lin.qtypes == "Q4_K+Q6_K"


def test_native_on_a_folder_is_refused(tmp_path):
    from mixserve.models.loader import load_model
    from tests.unit.test_engine_tiny import make_tiny

    folder, _ = make_tiny(tmp_path, "llama", tie=True)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_model(str(folder), torch.float32, gguf_weights="native")


def test_forcing_avx2_gives_an_avx2_machines_default_dtype(monkeypatch):
    """MIXSERVE_ISA=avx2 stands for an AVX2-only CPU, whose default dtype is float32: a forced run kept
    bfloat16 and measured bf16 GEMMs capped at AVX2 (`--batch-invariant off` 4x slower than `on`, a
    configuration no AVX2 machine gets)."""
    from mixserve.engine.args import default_dtype

    monkeypatch.setenv("MIXSERVE_ISA", "avx2")
    assert default_dtype("cpu") == torch.float32
    monkeypatch.setenv("MIXSERVE_ISA", "native")
    cap = torch.backends.cpu.get_cpu_capability()
    assert default_dtype("cpu") == (torch.bfloat16 if cap.startswith(("AVX512", "AMX")) else torch.float32)
