"""Where one engine step's time goes (issue 14, "measure first"): decode steps at batch 1, 8 and 64
(each row a 200-token prompt, timed over --steps steps after warm-up) and one 512-token prefill
(--prefill-repeats of them), greedy, speculation off, on the real LLMEngine; step times are medians.

Each shape runs four passes over the same sequences, one after another (the context grows by
--steps tokens a pass):
  1. plain: nothing instrumented; the step time and tokens/s.
  2. timed: perf_counter wrappers, set on this engine instance only, around the engine's phases
     (Scheduler.schedule, ModelRunner.prepare, the forward, sampling metadata + Sampler,
     _append_token with detokenization inside) and, inside the forward, around the linears
     (qkv, o, gate/up, down), the LM head, paged attention (KV write included), RMSNorm and RoPE.
     The split comes from this pass: "other ops" is the forward minus linears, head and attention
     (norms, RoPE, embedding, residual adds, SiLU*up, views, the logits cast); "engine rest" is
     the step minus every timed phase (LLMEngine.step's own loop).
  3. torch.profiler (CPU) with the same ranges as record_function: the split as the profiler
     sees it, the top ops, and the share of the (profiled, slower) step inside top-level ops.
  4. pyinstrument, if installed (not a project dependency): Python's share by innermost frame,
     an upper bound (see pyinstrument_profile); skipped with a note otherwise.
"Per-step overhead" = step time minus linears, LM head and attention (timed pass). Steps more
than 25% slower than the fastest of their pass are left out (another process on the shared host);
the script prints how many were kept. mixserve's code is not changed: only the objects of this
one engine are wrapped, at run time.

    python benchmarks/step_profile.py --model qwen2.5-coder-0.5b-instruct
    python benchmarks/step_profile.py --model qwen2.5-coder-1.5b-instruct

(--out defaults to results/step_profile-<model>.json.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

LINEARS = ("qkv", "o", "gate_up", "down")
PASSES = 4  # plain, timed, torch.profiler, pyinstrument: each runs --steps steps
# exclusive parts of a step, in table order
PARTS = ("linears", "lm_head", "attention", "other_ops", "prepare", "schedule", "sampling", "output", "engine_rest")


class Probe:
    """Wraps callables on objects; each call adds its wall time to `t[name]`, or, while `ranges`
    is set, runs inside a torch.profiler record_function of that name instead."""

    def __init__(self):
        self.t = defaultdict(float)
        self.totals: list[dict] = []  # a copy of t after each LLMEngine.step
        self.names: set[str] = set()
        self.ranges = False
        self._undo = []

    def wrap(self, obj, attr: str, name: str) -> None:
        orig = getattr(obj, attr)
        had = attr in vars(obj)
        self.names.add(name)
        t = self.t

        def timed(*args, **kw):
            if self.ranges:
                with torch.profiler.record_function(name):
                    return orig(*args, **kw)
            t0 = time.perf_counter()
            try:
                return orig(*args, **kw)
            finally:
                t[name] += time.perf_counter() - t0
                if name == "step":
                    self.totals.append(dict(t))

        setattr(obj, attr, timed)
        self._undo.append((obj, attr, orig if had else None))

    def unwrap(self) -> None:
        for obj, attr, orig in reversed(self._undo):
            if orig is None:
                delattr(obj, attr)  # a method again, found on the class
            else:
                setattr(obj, attr, orig)
        self._undo.clear()

    def install(self, eng) -> None:
        import mixserve.engine.llm_engine as le
        import mixserve.models.llama as llama

        self.wrap(eng, "step", "step")
        self.wrap(eng.scheduler, "schedule", "schedule")
        self.wrap(eng.runner, "prepare", "prepare")
        self.wrap(eng, "_sampling_metadata", "sampling_meta")
        self.wrap(eng, "sampler", "sampler")
        self.wrap(eng, "_append_token", "output")
        self.wrap(le, "detokenize_incrementally", "detokenize")
        m = eng.model
        self.wrap(m, "forward", "forward")
        self.wrap(m.lm_head, "forward", "lm_head")
        self.wrap(llama, "paged_attention", "attention")  # the name DecoderLayer.forward calls
        # RoPE: per layer `rotate` since the decode work (one table lookup per step), `forward` before
        self.wrap(m.rope, "rotate" if hasattr(m.rope, "rotate") else "forward", "rope")
        self.wrap(m.norm, "forward", "norm")
        for layer in m.layers:
            for name, mod in (("qkv", layer.qkv_proj), ("o", layer.o_proj), ("gate_up", layer.gate_up_proj),
                              ("down", layer.down_proj)):
                self.wrap(mod, "forward", name)
            self.wrap(layer.input_layernorm, "forward", "norm")
            self.wrap(layer.post_attention_layernorm, "forward", "norm")


def split(t: dict) -> dict:
    """Exclusive parts (seconds) of one step from its wrapped totals."""
    lin = sum(t[n] for n in LINEARS)
    return {
        "linears": lin, "lm_head": t["lm_head"], "attention": t["attention"],
        "other_ops": t["forward"] - lin - t["lm_head"] - t["attention"],
        "prepare": t["prepare"], "schedule": t["schedule"], "sampling": t["sampling_meta"] + t["sampler"],
        "output": t["output"],
        "engine_rest": t["step"] - t["forward"] - t["prepare"] - t["schedule"] - t["sampling_meta"] - t["sampler"]
        - t["output"],
        # inside the parts above, for the JSON
        "of_linears": {n: t[n] for n in LINEARS}, "of_other_ops": {"norms": t["norm"], "rope": t["rope"]},
        "of_output": {"detokenize": t["detokenize"]},
    }


def run_steps(eng, n: int) -> list[float]:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t0)
    return ts


def undisturbed(ts: list[float]) -> list[int]:
    """Indices of the steps within 25% of the fastest. Another process on these shared 2-core
    hosts slows a run of steps by 2x and more; a clean pass varies by about 5%."""
    return [i for i, t in enumerate(ts) if t <= 1.25 * min(ts)]


def torch_profile(probe: Probe, step) -> dict:
    """Run `step()` under torch.profiler with the probe's ranges. Seconds per undisturbed step."""
    from torch.profiler import ProfilerActivity, profile

    probe.ranges = True
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        probe.ranges = False
    per_step = defaultdict(lambda: defaultdict(float))  # step event id -> totals
    op_self = defaultdict(lambda: defaultdict(float))  # step event id -> "range: op" -> self time
    for e in prof.events():
        p, inside_op, where = e.cpu_parent, False, None
        while p is not None and p.name != "step":
            inside_op |= p.name not in probe.names
            if where is None and p.name in probe.names:
                where = p.name  # the innermost range: which part of the step ran this op
            p = p.cpu_parent
        if e.name == "step":
            per_step[e.id]["step"] += e.cpu_time_total * 1e-6
        elif p is None:
            continue  # outside any engine step
        elif e.name in probe.names:
            per_step[p.id][e.name] += e.cpu_time_total * 1e-6
        else:
            op_self[p.id][f"{where or 'step'}: {e.name.split('::')[-1]}"] += e.self_cpu_time_total * 1e-6
            if not inside_op:  # an op not inside another op: time in torch, not in Python
                per_step[p.id]["top_level_ops_s"] += e.cpu_time_total * 1e-6
                per_step[p.id]["top_level_ops"] += 1
    ids = list(per_step)
    kept = [ids[i] for i in undisturbed([per_step[i]["step"] for i in ids])]
    m = defaultdict(float, {k: sum(per_step[i][k] for i in kept) / len(kept)
                            for k in set().union(*(per_step[i] for i in kept))})
    lin = sum(m[x] for x in LINEARS)
    ops = defaultdict(float)
    for i in kept:
        for k, v in op_self[i].items():
            ops[k] += v / len(kept)
    return {"step_s": m["step"], "forward_s": m["forward"], "linears_s": lin, "lm_head_s": m["lm_head"],
            "attention_s": m["attention"], "other_ops_s": m["forward"] - lin - m["lm_head"] - m["attention"],
            "top_level_ops_s": m["top_level_ops_s"], "top_level_ops": m["top_level_ops"],
            "steps_kept": len(kept), "steps": len(ids),
            "top_ops_by_self_time": [{"op": k, "self_s": v}
                                     for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12]]}


def pyinstrument_profile(step) -> dict | None:
    """Shares of the engine steps' wall time in `step()` by innermost frame, from pyinstrument's
    stack samples (every 0.5 ms): Python code (ours, torch's Python wrappers, Python builtins),
    a torch function or method, or the tokenizer. pyinstrument sees a C function only when it is
    called as one: a torch op reached through an operator or indexing (x + y, t[idx]) is booked
    to the Python line that wrote it, so its Python share is an upper bound. None when
    pyinstrument is not installed (it is not a project dependency)."""
    try:
        from pyinstrument import Profiler
    except ImportError:
        return None
    prof = Profiler(interval=0.0005)
    prof.start()
    step()
    session = prof.stop()
    shares = defaultdict(float)
    by_frame = defaultdict(float)

    def walk(f, builtin: bool, name: str) -> None:
        if not f.is_synthetic:  # a "[self]" leaf belongs to its parent frame
            builtin = f.file_path == "<built-in>"
            name = f"{f.class_name}.{f.function}" if f.class_name else f.function
            if not builtin:
                name += f" ({f.file_path_short}:{f.line_no})"
        own = f.time - sum(c.time for c in f.children)
        if own > 0:
            shares[_kind(name) if builtin else "python"] += own
            by_frame[name] += own
        for c in f.children:
            walk(c, builtin, name)

    def steps(f) -> None:  # only time inside LLMEngine.step (not tokenizing prompts, add_request)
        if f.function == "step" and (f.file_path or "").endswith("llm_engine.py"):
            walk(f, False, "step")
        else:
            for c in f.children:
                steps(c)

    steps(session.root_frame())
    total = sum(shares.values())
    return {"sampled_s": total, "share": {k: v / total for k, v in shares.items()},
            "top_self_s": sorted(by_frame.items(), key=lambda kv: -kv[1])[:15]}


# C functions that are the interpreter's own work (containers, builtins), not a torch op
_PY_BUILTIN_TYPES = ("list.", "dict.", "set.", "str.", "tuple.", "int.", "float.", "deque.", "object.", "type.")
_PY_BUILTINS = {"len", "isinstance", "getattr", "setattr", "hasattr", "max", "min", "sum", "sorted", "zip", "range",
                "iter", "next", "any", "all", "abs", "id", "hash", "enumerate", "reversed", "map", "perf_counter",
                "callable", "issubclass", "super", "vars", "divmod", "round", "repr", "format"}


def _kind(name: str) -> str:
    base = name.rsplit(".", 1)[-1]
    if name.startswith(_PY_BUILTIN_TYPES) or name in _PY_BUILTINS or base in ("__enter__", "__exit__"):
        return "python"
    if "Tokenizer" in name or base in ("decode", "decode_batch", "encode"):
        return "tokenizer"
    return "torch"


def measure(eng, probe: Probe, step) -> dict:
    """The four passes over `step()`, which runs some engine steps and returns their wall times.
    Steps slowed by something else on the machine are left out of every figure (undisturbed)."""
    plain = step()
    probe.t.clear()
    probe.totals.clear()
    probe.install(eng)
    try:
        step()
        prev = defaultdict(float)
        steps = []
        for tot in probe.totals:
            steps.append(defaultdict(float, {k: v - prev[k] for k, v in tot.items()}))
            prev = defaultdict(float, tot)
        kept = [steps[i] for i in undisturbed([s["step"] for s in steps])]
        mean = defaultdict(float, {k: sum(s[k] for s in kept) / len(kept) for k in steps[0]})
        parts = split(mean)
        prof = torch_profile(probe, step)
    finally:
        probe.unwrap()
    plain_kept = [plain[i] for i in undisturbed(plain)]
    return {
        "step_s": statistics.median(plain_kept), "plain_steps_s": plain, "plain_steps_kept": len(plain_kept),
        "timed_step_s": mean["step"], "timed_steps_s": [s["step"] for s in steps], "timed_steps_kept": len(kept),
        "parts_s": parts, "overhead_s": mean["step"] - parts["linears"] - parts["lm_head"] - parts["attention"],
        "torch_profiler": prof, "pyinstrument": pyinstrument_profile(step),
    }


def kept(r: dict) -> str:
    n = len(r["plain_steps_s"])
    return (f"undisturbed steps kept: plain {r['plain_steps_kept']}/{n}, timed {r['timed_steps_kept']}/{n}, "
            f"profiled {r['torch_profiler']['steps_kept']}/{r['torch_profiler']['steps']}")


def _label(r: dict) -> str:
    return f"prefill {r['tokens']}" if r["kind"] == "prefill" else f"decode ×{r['rows']}"


def table(rows: list[dict]) -> str:
    head = ("| step | context | step ms | tok/s | linears | LM head | attention | other ops | prepare | schedule "
            "| sampling | output | engine rest | per-step overhead | Python outside torch ops |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        p = r["parts_s"]
        # at least: the plain step less its time in top-level ops under the profiler (which
        # slows the ops too); at most: pyinstrument's share (it books operator-called ops as Python)
        lo = max(0.0, r["step_s"] - r["torch_profiler"]["top_level_ops_s"]) / r["step_s"]
        pyi = r["pyinstrument"]
        py = f"{lo:.0%}–{pyi['share'].get('python', 0):.0%}" if pyi else f"≥ {lo:.0%} (no pyinstrument)"
        ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
        lines.append(f"| {_label(r)} | {r['context'][0]}–{r['context'][1]} | {ms(r['step_s'])} | "
                     f"{r['tokens'] / r['step_s']:.1f} | " + " | ".join(ms(p[k]) for k in PARTS)
                     + f" | {ms(r['overhead_s'])} ({r['overhead_s'] / r['timed_step_s']:.0%}) | {py} |")
    return "\n".join(lines)


def profiler_table(rows: list[dict]) -> str:
    lines = ["| step | profiled step ms | top-level torch ops: count, time | linears | LM head | attention "
             "| other ops | top ops by self time, under the innermost range (ms/step) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["torch_profiler"]
        f = t["forward_s"]
        top = ", ".join(f"{o['op']} {o['self_s'] * 1e3:.1f}" for o in t["top_ops_by_self_time"][:5])
        lines.append(f"| {_label(r)} | {t['step_s'] * 1e3:.1f} | {t['top_level_ops']:.0f}, "
                     f"{t['top_level_ops_s'] / t['step_s']:.0%} | "
                     + " | ".join(f"{t[k] / f:.0%}" if f else "-" for k in ("linears_s", "lm_head_s", "attention_s", "other_ops_s"))
                     + f" | {top} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--prefill", type=int, default=512, help="prefill tokens (0: skip)")
    ap.add_argument("--prefill-repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-invariant", default="on", choices=("on", "off"))
    ap.add_argument("--gguf-weights", default=None, choices=("native", "dequantize"),
                    help="a GGUF model's weights (default: the engine's choice for this CPU)")
    ap.add_argument("--out", default=None, help="default results/step_profile-<model>.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)

    from mixserve.data.datasets import synthetic_prompt
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.env import machine_info
    from mixserve.sampling_params import SamplingParams

    eng = LLMEngine(EngineArgs(model=a.model, dtype=a.dtype, speculation="off", progress=False,
                               batch_invariant=a.batch_invariant, gguf_weights=a.gguf_weights))
    seeds = iter(range(10**6))

    def prompt(n):  # real words, so detokenization does its usual work
        return eng.encode(synthetic_prompt(eng.tokenizer, n, seed=next(seeds)))[:n]

    probe = Probe()
    rows = []
    if a.prefill:
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def prefills(n=a.prefill_repeats):
            ids = [prompt(a.prefill) for _ in range(n)]  # tokenized before the clock starts
            ts = []
            for x in ids:
                eng.add_request(x, sp)
                ts += run_steps(eng, 1)
            return ts

        prefills(1)  # oneDNN sets up its primitives for a new shape on the first call
        r = measure(eng, probe, prefills)
        rows.append({"kind": "prefill", "rows": 1, "tokens": a.prefill, "context": [a.prefill, a.prefill], **r})
        print(f"prefill {a.prefill}: {r['step_s'] * 1e3:.1f} ms; {kept(r)}", flush=True)
    for b in [int(x) for x in a.batches.split(",")]:
        sp = SamplingParams(temperature=0, max_tokens=a.warmup + PASSES * a.steps + 8, ignore_eos=True)
        rids = [eng.add_request(prompt(a.prompt_len), sp) for _ in range(b)]
        while eng.scheduler.waiting or any(s.num_uncomputed_tokens > 1 for s in eng.scheduler.running):
            eng.step()  # the prefills (chunked at the step's token budget)
        run_steps(eng, a.warmup)
        ctx0 = a.prompt_len + 1 + a.warmup
        r = measure(eng, probe, lambda: run_steps(eng, a.steps))
        rows.append({"kind": "decode", "rows": b, "tokens": b, "context": [ctx0, ctx0 + PASSES * a.steps], **r})
        print(f"decode batch {b}: {r['step_s'] * 1e3:.1f} ms; {kept(r)}", flush=True)
        for rid in rids:
            eng.abort(rid)

    info = machine_info()
    print(f"\n{a.model}, {eng.dtype}, {info['torch_threads']} threads, {info['cpu']}, {info['cores']} cores, "
          f"torch {info['torch']}, {info['date']}\n")
    print(table(rows))
    print()
    print(profiler_table(rows))
    out = Path(a.out or f"results/step_profile-{a.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "config": vars(a), "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
