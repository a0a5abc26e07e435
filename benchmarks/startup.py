"""Start-up cost, phase by phase, in fresh processes (issue 32).

Runs `mixserve generate` (default: 16 greedy tokens) in three states and reports the wall time from
spawning the process to its exit, and when each phase ended, counted from the process's start
(mixserve/startup.py writes them to $MIXSERVE_STARTUP_LOG):
  - cold: a new cache root holding only the pulled model (hard-linked from the machine's cache);
  - warm: the same root again;
  - checkout: the same root, the project cloned to another path (PYTHONPATH points there), which
    catches caches keyed by the checkout's paths.

    python benchmarks/startup.py --model qwen2.5-coder-0.5b-instruct [--states cold,warm,checkout]
    python benchmarks/startup.py --code /tmp/old-checkout   # another checkout's code (wall time only
                                                            # where it has no phase marks)

Phases: imports (torch and mixserve, until the engine starts), weights (read, convert or repack,
map), tokenizer, kernel choices, decode graph (compile or load), first token, last token; sums:
C++ kernels (build or load, wall), the C++ compiler's CPU seconds and kernel timing. Run one heavy thing at a time: the figures are
wall times on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("imports", "weights", "tokenizer", "kernel choices", "decode graph", "first token", "last token")
SUMS = ("C++ kernels", "C++ compiler CPU", "kernel timing")


def machine_cache() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg if xdg and os.path.isabs(xdg) else Path.home() / ".cache")


def pulled_model(name: str) -> Path:
    """The model's file in the machine's cache, pulled there first if need be."""
    out = subprocess.run([sys.executable, "-m", "mixserve.cli", "pull", name], capture_output=True, text=True,
                         env={**os.environ, "XDG_CACHE_HOME": str(machine_cache())}, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def fresh_root(model_file: Path, name: str) -> Path:
    """A cache root holding only the model (a hard link; a copy across file systems)."""
    root = Path(tempfile.mkdtemp(prefix="mixserve-startup-"))
    d = root / "mixserve" / name
    d.mkdir(parents=True)
    try:
        os.link(model_file, d / model_file.name)
    except OSError:
        shutil.copy(model_file, d / model_file.name)
    return root


def run_once(code: Path, root: Path, argv: list[str]) -> dict:
    """One `mixserve generate` process: wall seconds, phase ends and sums, its exit code."""
    log = Path(tempfile.mkstemp(prefix="startup-", suffix=".jsonl")[1])
    # caches and modes set in the caller's environment would make a cold run warm or untimed
    inherited = {k: v for k, v in os.environ.items() if k not in (
        "TORCHINDUCTOR_CACHE_DIR", "MIXSERVE_KERNEL_CACHE", "MIXSERVE_KERNEL_TIMING", "MIXSERVE_KERNELS",
        "MIXSERVE_NO_CPP_KERNELS")}
    env = {**inherited, "XDG_CACHE_HOME": str(root), "MIXSERVE_STARTUP_LOG": str(log),
           "PYTHONPATH": str(code) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mixserve.cli", "generate", *argv], cwd=code, env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    phases, sums = {}, {}
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if "t" in r:
            phases.setdefault(r["phase"], r["t"])  # the first engine's (a draft would load a second)
        else:
            sums[r["phase"]] = sums.get(r["phase"], 0.0) + r["add"]
    log.unlink()
    return {"wall_s": round(wall, 2), "rc": p.returncode, "phases": phases,
            "sums": {k: round(v, 2) for k, v in sums.items()},
            "stderr_tail": p.stderr[-1500:] if p.returncode else ""}


def checkout_of(code: Path) -> Path:
    """A clone of `code`'s committed state at another path."""
    dest = Path(tempfile.mkdtemp(prefix="mixserve-checkout-")) / "mixserve-clone"
    subprocess.run(["git", "clone", "-q", str(code), str(dest)], check=True)
    return dest


def table(model: str, results: dict) -> str:
    head = ["state", "wall s", *PHASES, *(f"{s} (sum)" for s in SUMS)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for state, r in results.items():
        cells = [state, f"{r['wall_s']:.1f}" + ("" if r["rc"] == 0 else f" (rc {r['rc']})")]
        cells += [f"{r['phases'][p]:.1f}" if p in r["phases"] else "-" for p in PHASES]
        cells += [f"{r['sums'][s]:.1f}" if s in r["sums"] else "-" for s in SUMS]
        rows.append("| " + " | ".join(cells) + " |")
    return f"{model}\n" + "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="a built-in model name")
    ap.add_argument("--states", default="cold,warm,checkout")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--code", default=str(ROOT), help="the checkout whose code runs (default: this one)")
    ap.add_argument("--engine-args", default="", help="extra `generate` flags, e.g. '--gguf-weights native'")
    ap.add_argument("--out", default=None, help="JSON results (default: results/startup-<model>.json)")
    a = ap.parse_args(argv)
    from mixserve.env import machine_info

    code = Path(a.code).resolve()
    model_file = pulled_model(a.model)
    gen = ["--model", a.model, "--prompt", "def fibonacci(n):", "--max-tokens", str(a.tokens), "--temperature", "0",
           *a.engine_args.split()]
    root = fresh_root(model_file, a.model)
    results: dict[str, dict] = {}
    clone = None
    try:
        for state in a.states.split(","):
            if state == "checkout":
                clone = checkout_of(code)
                results[state] = run_once(clone, root, gen)
            elif state in ("cold", "warm"):
                if state == "cold" and results:  # a cold state after another one: a new root
                    shutil.rmtree(root, ignore_errors=True)
                    root = fresh_root(model_file, a.model)
                results[state] = run_once(code, root, gen)
            else:
                raise SystemExit(f"unknown state {state!r} (cold, warm, checkout)")
            print(f"{state}: {json.dumps(results[state])}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if clone is not None:
            shutil.rmtree(clone.parent, ignore_errors=True)
    report = {"machine": machine_info(), "model": a.model, "code": str(code), "argv": gen, "results": results}
    out = Path(a.out or ROOT / "results" / f"startup-{a.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(table(a.model, results))
    print(f"machine: {report['machine']}; wrote {out}")
    return 0 if all(r["rc"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
