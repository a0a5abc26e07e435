"""The space `plan --suggest` searches: one engine configuration (`Config`), the drafter whose
speculation it may use, and the weight formats a profile can time and a quality floor allows."""
from __future__ import annotations

import math
from dataclasses import dataclass

from mixserve.plan.cost_model import BF16, WeightFormat
from mixserve.plan.step_time import MeasuredModel, StepModel

# The planner's error against the engine's own runs: output throughput, TTFT p50 and TPOT p50
# within 15% on four traces (BENCHMARKS.md, "plan_vs_engine"); a predicted gain smaller than this
# is not a gain the planner can claim.
PLANNER_ERROR = 0.15

SEQS = (4, 8, 16, 32, 64, 128, 256)
BATCHED_TOKENS = (256, 512, 1024, 2048, 4096, 8192)
SPEC_KS = (1, 2, 4, 8)
DIMENSIONS = ("weights", "prefix_caching", "allocator", "max_num_seqs", "max_num_batched_tokens",
              "speculation", "replicas")


@dataclass(frozen=True)
class Config:
    """One engine configuration, in the engine's own terms (EngineArgs / CLI flags).

    weights: "bf16" (dense in bfloat16; a GGUF dequantized), "gguf" (a GGUF's tensors as stored,
        run natively), "int4-rtn" (round-to-nearest at load), "int4-awq" (an AWQ checkpoint made
        first by `mixserve quantize`). allocator: "paged" or "contiguous" (reserve max-tokens).
    speculation: ("off", 0), ("fixed", k) or ("auto", k_max), with the Suggester's one drafter.
    """

    weights: str = "bf16"
    allocator: str = "paged"
    prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    speculation: tuple[str, int] = ("off", 0)
    replicas: int = 1

    def describe(self) -> str:
        """One line naming every setting, e.g. "gguf, paged, prefix caching on, max-num-seqs 256, ..."."""
        spec = "no speculation" if self.speculation[0] == "off" else (
            f"speculation {self.speculation[0]} k{'<=' if self.speculation[0] == 'auto' else '='}"
            f"{self.speculation[1]}")
        parts = [self.weights, self.allocator, f"prefix caching {'on' if self.prefix_caching else 'off'}",
                 f"max-num-seqs {self.max_num_seqs}", f"max-num-batched-tokens {self.max_num_batched_tokens}", spec]
        if self.replicas > 1:
            parts.append(f"{self.replicas} replicas")
        return ", ".join(parts)

    def differences(self, other: "Config") -> list[str]:
        """The settings of self that differ from `other`, as "name value" phrases."""
        out = []
        for d in DIMENSIONS:
            a, b = getattr(self, d), getattr(other, d)
            if a != b:
                if d == "speculation":
                    out.append("no speculation" if a[0] == "off" else f"speculation {a[0]} k {a[1]}")
                elif d == "prefix_caching":
                    out.append(f"prefix caching {'on' if a else 'off'}")
                else:
                    out.append(f"{d.replace('_', '-')} {a}")
        return out


@dataclass
class Drafter:
    """The speculation the search may use: a draft model name (or "ngram") with its measured or
    given per-token acceptance rate alpha and cost c (a draft step over a target step, the
    paper's section 3.4). None of it measured: speculation is left out of the search."""

    name: str
    alpha: float
    cost: float
    source: str = "given"


def quality_format(report: dict) -> str | None:
    """Which weight format an eval-ppl report measured (its "quantization", "gguf_weights" and
    "weights" fields): "int4-rtn", "int4-awq", "gguf" (native GGUF), "bf16", or None."""
    q = report.get("quantization")
    if q in ("rtn", "awq"):
        return f"int4-{q}"
    w = str(report.get("weights") or "")
    if "AWQ" in w or "awq" in w:
        return "int4-awq"
    if report.get("gguf_weights") == "native" or w.startswith("GGUF weights native"):
        return "gguf"
    return "bf16"


def quality_violations(deltas: dict, floor: float) -> list[str]:
    """Slices of an eval-ppl comparison (plan/measure.load_quality's {slice: {"delta", ...}})
    whose perplexity increase is over `floor` (absolute perplexity), as "slice +delta" strings."""
    # a delta that is not a number (a broken report) cannot be shown to be under the floor
    return [f"{name} +{d['delta']:.3f}" for name, d in sorted(deltas.items())
            if not math.isfinite(d["delta"]) or d["delta"] > floor]


def available_formats(sm: StepModel, model_kind: str, gguf: WeightFormat | None, group_size: int = 128,
                      quality: dict[str, dict] | None = None, floor: float | None = None
                      ) -> tuple[dict[str, WeightFormat], dict[str, str]]:
    """The weight formats a search may use, and a reason for each left out: the ones the step
    model cannot time (a profile without gguf or int4 tables), bf16 of an AWQ checkpoint (not
    stored), and, with a quality floor (absolute perplexity increase per slice), every format
    other than the reference whose recorded eval-ppl comparison is over it on some slice, or that
    has no record (quality: {format: load_quality's {slice: ...}})."""
    fmts: dict[str, WeightFormat] = {}
    why: dict[str, str] = {}
    tables = sm.tables if isinstance(sm, MeasuredModel) else None
    if model_kind == "awq":
        why["bf16"] = "the model is an AWQ checkpoint; its dense weights are not stored"
    else:
        fmts["bf16"] = BF16
    if model_kind == "gguf" and gguf is not None:
        if tables is not None and "gguf" not in tables:
            why["gguf"] = "the profile has no gguf timings (hw probe --formats bf16,int4,gguf)"
        else:
            fmts["gguf"] = gguf
    elif model_kind != "gguf":
        why["gguf"] = "the model is not a GGUF file"
    # the engine rounds an int4 model's LM head too by default (EngineArgs.quant_lm_head), and the
    # commands pin it: time it from the int4 table where the profile has one
    head = tables is None or "lm_head" in (tables.get("int4") or {})
    int4 = WeightFormat("int4", group_size, lm_head_int4=head)
    for name in ("int4-rtn", "int4-awq"):
        if tables is not None and "int4" not in tables:
            why[name] = "the profile has no int4 timings (hw probe --formats bf16,int4)"
        elif name == "int4-rtn" and model_kind == "awq":
            why[name] = "the model is already an AWQ checkpoint"
        else:
            fmts[name] = int4
    if floor is not None:
        # the reference of an eval-ppl comparison: bf16 (or the dequantized GGUF) is never excluded
        for name in [f for f in fmts if f != "bf16"]:
            rec = (quality or {}).get(name)
            if rec is None:
                why[name] = (f"no eval-ppl comparison on disk for it (--quality FILE), so the quality floor "
                             f"(+{floor:g} perplexity) cannot be checked")
                del fmts[name]
                continue
            bad = quality_violations(rec, floor)
            if bad:
                why[name] = f"perplexity over the floor (+{floor:g}) on {', '.join(bad)}"
                del fmts[name]
    return fmts, why


def _ms(seconds: float) -> str:
    """Seconds as ms text, in us below a millisecond (an SLO of 1 us is not "0 ms")."""
    if seconds != seconds:
        return "nan ms"
    return f"{seconds * 1e6:.0f} us" if abs(seconds) < 1e-3 else f"{seconds * 1e3:.0f} ms"

