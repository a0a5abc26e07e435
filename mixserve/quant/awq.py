"""AWQ: activation-aware weight quantization (Lin et al., MLSys 2024), and RTN as its baseline.

The model is run block by block over calibration tokens. For each group of linears that share an
input (q/k/v after the attention norm, gate/up after the MLP norm, down after the activation, o
after attention when v's output can absorb a scale) AWQ:

1. takes s_x, the mean |activation| of each input channel (§3.2: salient channels are found by
   activation, not weight, magnitude);
2. grid-searches α in [0, 1] (20 points) for s = s_x^α (normalised by sqrt(max s * min s))
   minimising ||Q(W diag(s)) (diag(s)^-1 X) - W X||² over the group's outputs (§3.3, Eq. 5), or
   with AWQConfig.objective = "module" over the attention or MLP output they feed (AutoAWQ);
3. folds 1/s into the operation before (RMSNorm weight, v_proj rows, up_proj rows) and s into W,
   which leaves the unquantized model's function unchanged;
4. optionally (AWQConfig.clip; off by default) searches a clipping ratio per output row and
   group (max |w| shrunk by up to 50% in 20 steps) minimising the same output error, for o,
   gate/up and down (never q and k, as in AutoAWQ). On the dequantized GGUF releases mixserve
   ships, the clipping search lowers this output error yet raises held-out perplexity on every
   slice, doubling RTN's increase (benchmarks/awq_ablation.py, BENCHMARKS.md), so it is off.

Then every linear is quantized group-wise (groupwise.py). The next block's input is the float
block's output, as in the reference implementation (AutoAWQ `AwqQuantizer`).

What the search saw is reported per linear group (QuantReport: α, the weight/activation
log-magnitude correlation, the objective against RTN's) with a one-line verdict, since on weights
whose large-activation channels already hold large weights the premise of §3.2 fails and the
search rightly picks α ≈ 0 (benchmarks/awq_diagnose.py, awq_salient.py).

The objective's output error is computed as X (Q(W) - W)^T with the difference in float32 and the
matmul in bfloat16 on CPUs with bf16 units (AVX512-BF16, AMX), where it is several times faster: the
error of a difference, so bf16's 3 significant digits are ample. Elsewhere the matmul is float32, which
an AVX2-only CPU runs 7x faster than its emulated bf16 (1.8 vs 12.5 ms for 128 x 576 @ 576 x 1536 on 2
cores; SmolLM2's search 57 s -> ~15 s, issue 32).
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mixserve.env import cpu_flags
from mixserve.models.config import ModelConfig
from mixserve.quant.groupwise import fake_quantize, quantizable

CLIP_GROUPS = ("o", "gate_up", "down")
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class AWQConfig:
    """method: "awq" or "rtn". group_size: input channels per group. n_grid: α grid points and
    clipping steps. max_shrink: largest clipping (0.5 = clip at half the max). search_tokens /
    clip_tokens: calibration tokens (strided from token 0) used by the scale and clip searches.
    skip_first: leading positions of every calibration sample left out of the objectives (their
    activation means and output errors); the first position is the attention sink, whose massive
    activations (Sun et al. 2024) are orders of magnitude above other tokens' and would otherwise
    decide every search alone. duo: candidates s = s_x^α / s_w^(1-α), with s_w the mean relative
    weight magnitude per input channel (AutoAWQ's `duo_scaling`), besides s = 1.
    clip: the groups whose clipping is searched, comma- or plus-separated ("o", "gate_up", "down";
    q and k never); empty (the default) searches none, see the module docstring.
    objective: what the α search scores for q/k/v and gate/up. "linear": the group's own outputs
    (Eq. 5 as written). "module": the output of the module they feed, attention through o_proj
    for q/k/v and the whole MLP for gate/up (AutoAWQ's `module2inspect`), so that an error in q
    or k is weighed by what it does to the attention output. down and o score their own outputs
    either way. On the built-in 0.5B, "module" picks the same α (mostly 0) and the same held-out
    perplexity as "linear" at 5x the search time (benchmarks/awq_ablation.py, BENCHMARKS.md), so
    "linear" is the default. module_samples: calibration sequences (whole, since attention needs
    them) used by the module objective.
    seed: the shuffle of calibration documents."""

    method: str = "awq"
    group_size: int = 128
    bits: int = 4
    n_grid: int = 20
    max_shrink: float = 0.5
    search_tokens: int = 2048
    clip_tokens: int = 512
    skip_first: int = 0
    duo: bool = False
    clip: str = ""
    objective: str = "linear"
    module_samples: int = 8
    seed: int = 0

    def __post_init__(self):
        if self.objective not in ("linear", "module"):
            raise ValueError(f"objective: must be linear or module (got {self.objective!r})")
        bad = [g for g in self.clip_groups if g not in CLIP_GROUPS]
        if bad:
            raise ValueError(f"clip: unknown group(s) {', '.join(bad)}; use {', '.join(CLIP_GROUPS)}")

    @property
    def clip_groups(self) -> tuple[str, ...]:
        """The groups of `clip`, in order."""
        return tuple(g for g in self.clip.replace("+", ",").split(",") if g)


@dataclass
class QuantReport:
    """What quantization did: per-layer chosen α (by group), seconds, linears left dense, and per
    linear group what the scale search saw (`groups`: dicts with layer, group, corr = the
    correlation over input channels of log mean|x_j| and log mean_i |W_ij| (None when undefined,
    see log_magnitude_corr), alpha, err_rtn and err = the objective's output MSE at α = 0 and at
    the chosen α; always finite: quantize_weights refuses NaN/inf)."""

    alphas: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    groups: list[dict] = field(default_factory=list)

    @staticmethod
    def _ratio(g: dict) -> float:
        return g["err"] / g["err_rtn"] if g["err_rtn"] > 0 else 1.0

    @staticmethod
    def _corr(g: dict) -> str:
        return "n/a" if g["corr"] is None else f"{g['corr']:+.2f}"

    def table(self) -> list[str]:
        """One line per block: each group's α, correlation and error relative to RTN."""
        lines = []
        for layer in sorted({g["layer"] for g in self.groups}):
            cells = [f"{g['group']} α {g['alpha']:.2f} corr {self._corr(g)} err/RTN {self._ratio(g):.3f}"
                     for g in self.groups if g["layer"] == layer]
            lines.append(f"block {layer:3d}: " + " | ".join(cells))
        return lines

    def verdict(self) -> str:
        """One line: did the scale search find scales that beat RTN, and how much (§3.2's premise
        is that salient-by-activation channels hold ordinary weights: the correlation says whether
        that holds)."""
        if not self.groups:
            return "AWQ: no linear group was searched"
        n = len(self.groups)
        # a win is a lower objective than RTN's, which is α > 0 except with duo scaling (whose
        # α = 0 candidate is not s = 1)
        won = [g for g in self.groups if g["err"] < g["err_rtn"]]
        ratio = lambda gs: statistics.median(self._ratio(g) for g in gs)  # noqa: E731
        corrs = [g["corr"] for g in self.groups if g["corr"] is not None]
        corr = statistics.median(corrs) if corrs else None
        line = (f"AWQ verdict: the search found scales that beat RTN in {len(won)} of {n} linear groups "
                f"({len(won) / n:.0%}); output error / RTN's, median: "
                + (f"{ratio(won):.3f} in those, " if won and len(won) < n else "")
                + f"{ratio(self.groups):.3f} over all; weight/activation log-magnitude correlation, median: "
                + ("n/a" if corr is None else f"{corr:+.2f}"))
        if len(won) < n / 2 or ratio(self.groups) > 0.97:
            line += (". AWQ is about RTN on these weights"
                     + (": their large-activation channels already hold large weights (AWQ §3.2's premise fails)"
                        if corr is not None and corr > 0.5 else ""))
        else:
            line += ". AWQ's scales lower the rounding error here"
        return line


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_tables(cfg: ModelConfig, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [T, head_dim] of rotary positions 0..T-1 (the HF rotate-half layout)
    for block_forward."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
    f = torch.outer(torch.arange(T).float(), inv)
    return torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def block_forward(cfg: ModelConfig, w: dict, p: str, x: torch.Tensor, cos, sin, capture: bool = False):
    """One float32 decoder block over [B, T, hidden] with causal attention (no KV cache).

    w: HF-named weights; p: the block's prefix ("model.layers.N."); cos/sin: [T, head_dim].
    Returns the block output, and with capture=True also the inputs of each linear group:
    {"qkv": [B,T,hidden], "o": [B,T,q_size], "gate_up": [B,T,hidden], "down": [B,T,intermediate]}.
    """
    B, T, _ = x.shape
    h = _rms(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
    proj = lambda n, inp: F.linear(inp, w[p + n + ".weight"], w.get(p + n + ".bias"))  # noqa: E731
    q = proj("self_attn.q_proj", h).view(B, T, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    k = proj("self_attn.k_proj", h).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    v = proj("self_attn.v_proj", h).view(B, T, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    a = a.transpose(1, 2).reshape(B, T, cfg.q_size)
    x2 = x + proj("self_attn.o_proj", a)
    h2 = _rms(x2, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
    act = F.silu(proj("mlp.gate_proj", h2)) * proj("mlp.up_proj", h2)
    out = x2 + proj("mlp.down_proj", act)
    if capture:
        return out, {"qkv": h, "o": a, "gate_up": h2, "down": act}
    return out


@functools.cache
def _diff_dtype() -> torch.dtype:
    """The matmul dtype of weight differences (module docstring): bf16 where the CPU has bf16 units."""
    return torch.bfloat16 if cpu_flags() & {"avx512_bf16", "amx_bf16"} else torch.float32


def _out_error(x: torch.Tensor, w_q: torch.Tensor, w: torch.Tensor) -> float:
    """Mean squared output error of using w_q for w on inputs x [N, in]."""
    return _diff_mm(x, w_q - w).pow(2).mean().item()


class ScaleChoice(NamedTuple):
    """search_scale's answer: s [in] float32, α, and the objective at α = 0 (RTN) and at α."""

    s: torch.Tensor
    alpha: float
    err_rtn: float
    err: float


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def log_magnitude_corr(x_mean: torch.Tensor, w: torch.Tensor) -> float | None:
    """Correlation over input channels j of log x_mean[j] and log mean_i |w[i, j]| (w [out, in]):
    near +1 when the channels with large activations already hold the largest weights, where
    scaling them up (AWQ §3.2) widens every group's range instead of protecting them.
    Channels that are zero (or not finite) on either side are left out, since two dead channels
    would otherwise decide the result alone; None when fewer than three channels remain or either
    side is constant."""
    xs, ws = x_mean.float(), w.float().abs().mean(0)
    ok = (xs > 0) & (ws > 0) & xs.isfinite() & ws.isfinite()
    if int(ok.sum()) < 3:  # two points are always perfectly correlated
        return None
    lx, lw = xs[ok].log(), ws[ok].log()
    lx, lw = lx - lx.mean(), lw - lw.mean()
    den = (lx.pow(2).sum() * lw.pow(2).sum()).sqrt().item()
    if not den > 1e-12 * lx.numel():
        return None
    return max(-1.0, min(1.0, (lx * lw).sum().item() / den))


def search_scale(x: torch.Tensor, x_mean: torch.Tensor, w: torch.Tensor, qc: AWQConfig,
                 error=None) -> ScaleChoice:
    """Best per-input-channel scale s [in] for the stacked weights w [out, in] of one group.

    x: sampled inputs [N, in] float32; x_mean: mean |x| per channel over all calibration tokens.
    error: optional callable scoring a candidate dequantized weight [out, in] (AttentionProbe,
    MLPProbe); by default the group's own output error on x.
    Returns ScaleChoice(s, α, err_rtn, err). s = 1 (reported as α = 0) is always a candidate, so
    AWQ never does worse than RTN on this objective.
    """
    if error is None:
        error = lambda w_q: _out_error(x, w_q, w)  # noqa: E731
    ones = torch.ones_like(x_mean)
    err_rtn = error(fake_quantize(w, qc.group_size, qc.bits))
    best = (err_rtn, ones, 0.0)
    w_mean = None
    if qc.duo:
        wa = w.abs().view(-1, qc.group_size)
        w_mean = (wa / (wa.amax(1, keepdim=True) + 1e-6)).view_as(w).mean(0)
    for i in range(1 if not qc.duo else 0, qc.n_grid):
        alpha = i / qc.n_grid
        s = x_mean.pow(alpha)
        if w_mean is not None:
            s = s / (w_mean.pow(1 - alpha) + 1e-4)
        s = s.clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = error(fake_quantize(w * s, qc.group_size, qc.bits) / s)
        if err < best[0]:
            best = (err, s, alpha)
    return ScaleChoice(best[1], best[2], err_rtn, best[0])


def _diff_mm(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [.., in] @ d [out, in]^T in _diff_dtype() (bfloat16 where the CPU has bf16 units, else float32: module
    docstring), returned in float32: for weight differences d."""
    dt = _diff_dtype()
    return (x.to(dt) @ d.to(dt).t()).float()


class AttentionProbe:
    """Output error of attention (through o_proj) when q/k/v weights change, on fixed inputs.

    h: attention-norm output [B, T, hidden] float32 (whole sequences from position 0); w: the
    block's HF-named weights without prefix. Each call takes a stacked [q; k; v] weight and returns
    the mean squared difference of the o_proj output from the float block's. Projections of the
    weight difference run in bfloat16 (it is a difference, see the module docstring); attention
    itself runs in float32.
    """

    def __init__(self, cfg: ModelConfig, w: dict, h: torch.Tensor, cos, sin):
        self.cfg, self.h, self.cos, self.sin = cfg, h, cos, sin
        names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.w = torch.cat([w[n + ".weight"] for n in names])
        bias = [w.get(n + ".bias") for n in names]
        self.qkv = F.linear(h, self.w, torch.cat(bias) if all(b is not None for b in bias) else None)
        self.wo = w["self_attn.o_proj.weight"]
        self.ref = self._attend(self.qkv)

    def _attend(self, qkv: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        B, T, _ = qkv.shape
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = _rope(q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2), self.cos, self.sin)
        k = _rope(k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2), self.cos, self.sin)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return a.transpose(1, 2).reshape(B, T, c.q_size)

    def __call__(self, w_q: torch.Tensor) -> float:
        a = self._attend(self.qkv + _diff_mm(self.h, w_q - self.w))
        return _diff_mm(a - self.ref, self.wo).pow(2).mean().item()


class MLPProbe:
    """Output error of the MLP (through down_proj) when gate/up weights change, on fixed inputs.

    h: MLP-norm output [N, hidden] float32; w: the block's HF-named weights without prefix. Each
    call takes a stacked [gate; up] weight and returns the mean squared difference of down_proj's
    output from the float block's.
    """

    def __init__(self, w: dict, h: torch.Tensor):
        self.h = h
        self.w = torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])
        self.gu = F.linear(h, self.w)
        self.n = w["mlp.gate_proj.weight"].shape[0]
        self.wd = w["mlp.down_proj.weight"]
        g, u = self.gu.split(self.n, -1)
        self.act = F.silu(g) * u

    def __call__(self, w_q: torch.Tensor) -> float:
        g, u = (self.gu + _diff_mm(self.h, w_q - self.w)).split(self.n, -1)
        return _diff_mm(F.silu(g) * u - self.act, self.wd).pow(2).mean().item()


def search_clip(x: torch.Tensor, w: torch.Tensor, qc: AWQConfig) -> torch.Tensor:
    """Best clipping bound per (output row, group): max_val [out, in / g] for w [out, in] on
    inputs x [N, in]; the weight is then clamped to [-max_val, max_val] before quantizing."""
    out_f, in_f = w.shape
    g = qc.group_size
    ng = in_f // g
    wg = w.view(out_f, ng, g)
    xg = x.view(-1, ng, g).transpose(0, 1).to(torch.bfloat16)  # [ng, N, g]
    org_max = wg.abs().amax(-1)  # [out, ng]
    best_err = torch.full((out_f, ng), math.inf)
    best_max = org_max.clone()
    for i in range(int(qc.max_shrink * qc.n_grid)):
        max_val = org_max * (1 - i / qc.n_grid)
        cur = torch.maximum(torch.minimum(wg, max_val.unsqueeze(-1)), -max_val.unsqueeze(-1))
        d = (fake_quantize(cur.view(out_f, in_f), g, qc.bits).view(out_f, ng, g) - wg)
        # per group: x_g [N, g] @ d_g [g, out] -> squared error averaged over tokens
        err = torch.bmm(xg, d.permute(1, 2, 0).to(torch.bfloat16)).float().pow(2).mean(1).t()  # [out, ng]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max


def _apply_clip(w: torch.Tensor, max_val: torch.Tensor, g: int) -> torch.Tensor:
    out_f, in_f = w.shape
    m = max_val.unsqueeze(-1)
    return torch.maximum(torch.minimum(w.view(out_f, -1, g), m), -m).view(out_f, in_f)


def quantize_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], calib: torch.Tensor | None,
                     qc: AWQConfig, progress: bool = True, on_block=None) -> tuple[dict[str, torch.Tensor], QuantReport]:
    """Transform a dense model's weights for int4 group-wise quantization (AWQ or RTN).

    weights: HF-named float tensors (not modified). calib: int64 [n_samples, seq_len] token ids
    (required for AWQ). Returns (weights, report): float32 copies of the block weights with AWQ's
    scales folded in and clipping applied (RTN: unchanged), ready for `checkpoint.save_awq`, which
    does the rounding. Linears whose shape does not fit the grid are listed in report.skipped.
    on_block: optional callable given each block's report line (QuantReport.table) as it is done.
    Raises ValueError for an unknown method or AWQ without calibration data.
    """
    if qc.method not in ("awq", "rtn"):
        raise ValueError(f"method: must be awq or rtn (got {qc.method!r})")
    if qc.method == "awq" and (calib is None or calib.numel() == 0):
        raise ValueError("awq needs calibration tokens")
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"weights hold NaN or inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): "
                         "nothing to quantize")
    t0 = time.perf_counter()
    report = QuantReport()
    out = {k: v for k, v in weights.items()}
    for i in range(cfg.num_layers):
        for n in LINEARS:
            name = f"model.layers.{i}.{n}"
            wt = out[name + ".weight"]
            why = quantizable(wt.shape[1], wt.shape[0], qc.group_size)
            if why:
                report.skipped.append(f"{name}: {why}")
                continue
            # refused here, not after the search: a range a float16 scale cannot hold
            g = wt.float().view(wt.shape[0], -1, qc.group_size)
            widest = (g.amax(-1) - g.amin(-1)).max().item()
            if widest / (2 ** qc.bits - 1) > 65504:
                raise ValueError(f"{name}: a group's range ({widest:.3g}) is too wide for a float16 scale")
    if qc.method == "rtn":
        report.seconds = time.perf_counter() - t0
        return out, report

    x = F.embedding(calib, weights["model.embed_tokens.weight"].float())
    B, T = calib.shape
    cos, sin = rope_tables(cfg, T)
    n_tok = B * T
    # strided samples starting at token 0 (as AutoAWQ samples), so every calibration window's
    # first tokens, where this family's massive activations live, are scored like the rest
    valid = torch.nonzero(torch.arange(n_tok) % T >= qc.skip_first).squeeze(1)
    if valid.numel() == 0:
        raise ValueError(f"skip_first {qc.skip_first} leaves no calibration tokens (samples of {T})")
    search_idx = valid[torch.arange(0, len(valid), max(1, len(valid) // qc.search_tokens))[: qc.search_tokens]]
    clip_idx = valid[torch.arange(0, len(valid), max(1, len(valid) // qc.clip_tokens))[: qc.clip_tokens]]
    skipped = {s.split(":")[0] for s in report.skipped}
    n_mod = max(1, min(B, qc.module_samples))
    bar = tqdm(range(cfg.num_layers), desc="awq", unit="block", disable=not progress)
    for i in bar:
        p = f"model.layers.{i}."
        w = {k[len(p):]: out[k].float().clone() for k in out if k.startswith(p)}
        wp = {p + k: v for k, v in w.items()}
        with torch.no_grad():
            y, feats = block_forward(cfg, wp, p, x, cos, sin, capture=True)
        feats = {k: v.reshape(n_tok, -1) for k, v in feats.items()}
        groups = [("qkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "input_layernorm"),
                  ("gate_up", ["mlp.gate_proj", "mlp.up_proj"], "post_attention_layernorm"),
                  ("down", ["mlp.down_proj"], "mlp.up_proj"),
                  ("o", ["self_attn.o_proj"], "self_attn.v_proj")]
        chosen = {}
        for key, names, prev in groups:
            if any(p + n in skipped for n in names):
                continue
            if key == "o" and w["self_attn.v_proj.weight"].shape[0] != w["self_attn.o_proj.weight"].shape[1]:
                continue  # grouped-query attention: v's rows do not map one-to-one onto o's inputs
            feat = feats[key]
            x_mean = feat[valid].abs().mean(0)
            stacked = torch.cat([w[n + ".weight"] for n in names])
            probe = None
            if qc.objective == "module" and key == "qkv":
                probe = AttentionProbe(cfg, w, feat.view(B, T, -1)[:n_mod], cos, sin)
            elif qc.objective == "module" and key == "gate_up":
                probe = MLPProbe(w, feat.view(B, T, -1)[:n_mod].reshape(-1, feat.shape[1]))
            s, alpha, err_rtn, err = search_scale(feat[search_idx], x_mean, stacked, qc, probe)
            del probe
            if not (math.isfinite(err_rtn) and math.isfinite(err)):
                raise ValueError(f"block {i} {key}: the quantization error is not finite ({err_rtn}): the scaled "
                                 "weights overflow a float16 scale, or the activations overflow float32")
            chosen[key] = alpha
            report.groups.append({"layer": i, "group": key, "corr": _round(log_magnitude_corr(x_mean, stacked)),
                                  "alpha": alpha, "err_rtn": err_rtn, "err": err})
            for n in names:
                w[n + ".weight"] = w[n + ".weight"] * s
            if prev.endswith("layernorm"):
                w[prev + ".weight"] = w[prev + ".weight"] / s
            else:  # a linear's output rows feed this group's input channels
                w[prev + ".weight"] = w[prev + ".weight"] / s.unsqueeze(1)
                if prev + ".bias" in w:
                    w[prev + ".bias"] = w[prev + ".bias"] / s
            feats[key] = feat / s
        for key, names in (("o", ["self_attn.o_proj"]), ("gate_up", ["mlp.gate_proj", "mlp.up_proj"]),
                           ("down", ["mlp.down_proj"])):
            if key not in qc.clip_groups:
                continue
            for n in names:
                if p + n in skipped:
                    continue
                mv = search_clip(feats[key][clip_idx], w[n + ".weight"], qc)
                w[n + ".weight"] = _apply_clip(w[n + ".weight"], mv, qc.group_size)
        report.alphas.append(chosen)
        if on_block is not None and chosen:
            on_block(report.table()[-1])
        for k, v in w.items():
            out[p + k] = v
        x = y
        del feats
    report.seconds = time.perf_counter() - t0
    return out, report
