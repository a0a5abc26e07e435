"""`mixserve bench` with batch invariance on and off, the arms alternated (issue 43).

Runs `mixserve bench --dataset sharegpt --num-prompts N --batch-invariant ARM` as fresh processes,
arms in turn (on, off, on, off, ... for --rounds), each writing its JSON report, and prints each
run's output tok/s, TTFT mean and TPOT mean, then the medians per arm and on / off (tok/s ratio;
TTFT and TPOT as how many times slower on is). The machine first: CPU model, ISA, date.

    flock /tmp/heavy.lock python benchmarks/invariance_bench.py --num-prompts 64 --rounds 2 \
        --out results/invariance-bench-64.json

Extra `bench` flags go after `--` (e.g. `-- --gguf-weights native`). Each run is its own process,
so start-up is paid per run, outside what `bench` measures (its clock starts at the first request).

Before the rounds, `mixserve prepare` runs once per arm (with the extra flags that are engine flags),
so that every kernel choice of both arms is measured and cached: on a fresh cache a start times only
what its 20 s budget allows and runs the rest on priors, and the arms can then compare different
choices (issue 43, AVX2 forced, 200 requests: 0.755x on a cache the two arms had filled unevenly, or on a
noisy host, 0.979x with both prepared; BENCHMARKS.md). `--no-prepare` skips it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mixserve.env import machine_info

KEYS = {"output tok/s": ("output_tokens_per_s",), "TTFT mean s": ("ttft_s", "mean"), "TPOT mean s": ("tpot_s", "mean")}


def pick(report: dict, path: tuple) -> float:
    """A figure of a `bench` report, by its keys (a KeyError names what the report lacks)."""
    v = report
    for k in path:
        v = v[k]
    return float(v)


def engine_flags(extra: list[str]) -> list[str]:
    """The flags of `extra` (a `bench` command line's tail) that `mixserve prepare` takes too: the
    engine's (cli.add_engine_args), each with its value where it has one."""
    from mixserve.cli import build_parser

    sub = next(x for x in build_parser()._actions if isinstance(x, argparse._SubParsersAction))
    prep = sub.choices["prepare"]
    known = {o: act for act in prep._actions for o in act.option_strings}
    out, i = [], 0
    while i < len(extra):
        flag = extra[i].split("=", 1)[0]
        takes = flag in known and known[flag].nargs != 0 and "=" not in extra[i]
        if flag in known and flag not in ("--model", "--batch-invariant"):
            out += extra[i:i + 1 + takes]
        i += 1 + takes
    return out


def prepare(model: str, arm: str, extra: list[str]) -> None:
    """`mixserve prepare` with invariance `arm`: every kernel choice of that arm measured and
    cached before any timed run. Raises SystemExit where it fails."""
    cmd = [sys.executable, "-m", "mixserve.cli", "prepare", "--model", model, "--batch-invariant", arm,
           *engine_flags(extra)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"prepare ({arm}) exited {p.returncode}:\n{p.stderr[-3000:]}")
    print(f"prepared {arm}: {p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ''}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    ap.add_argument("--no-prepare", action="store_true", help="skip `mixserve prepare` for each arm first")
    ap.add_argument("extra", nargs="*", help="more `mixserve bench` flags, after --")
    a = ap.parse_args()
    info = machine_info()
    print(json.dumps(info), flush=True)
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    if not a.no_prepare:
        for arm in runs:
            prepare(a.model, arm, a.extra)
    with tempfile.TemporaryDirectory(prefix="invariance-bench-") as tmp:  # each run's report, read back
        work = Path(tmp)
        for r in range(a.rounds):
            for arm in runs:
                out = work / f"{arm}-{r}.json"
                cmd = [sys.executable, "-m", "mixserve.cli", "bench", "--model", a.model, "--dataset", "sharegpt",
                       "--num-prompts", str(a.num_prompts), "--batch-invariant", arm, "--output", str(out),
                       *a.extra]
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    raise SystemExit(f"bench ({arm}, round {r}) exited {p.returncode}:\n{p.stderr[-3000:]}")
                report = json.loads(out.read_text())
                got = {name: pick(report, path) for name, path in KEYS.items()}
                runs[arm].append(got)
                print(f"round {r} {arm:3s} " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()), flush=True)
    med = {arm: {k: statistics.median(x[k] for x in v) for k in KEYS} for arm, v in runs.items()}
    ratio = {"output tok/s": med["on"]["output tok/s"] / med["off"]["output tok/s"],
             "TTFT mean s": med["on"]["TTFT mean s"] / med["off"]["TTFT mean s"],
             "TPOT mean s": med["on"]["TPOT mean s"] / med["off"]["TPOT mean s"]}
    for arm, m in med.items():
        print(f"median {arm:3s} " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))
    print("on / off  " + "  ".join(f"{k} {v:.3f}" for k, v in ratio.items()))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"machine": info, "model": a.model, "num_prompts": a.num_prompts,
                                           "runs": runs, "median": med, "on_over_off": ratio}, indent=1))


if __name__ == "__main__":
    main()
