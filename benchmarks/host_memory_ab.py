"""The host-memory settings on and off (mixserve/host_memory.py): fresh processes alternated.

Each setting is once a process (malloc's thresholds, where the weights were placed), so each arm is a
child process with its environment, the arms run in turn `--rounds` times: per child, one engine
(`--batch-invariant`), a warm-up, then the seconds to the first token of `--prefill-tokens`-token
prompts (three, no cached prefix), the decode tokens/s of one stream (`--new-tokens`) and the
process's peak RSS. Arms:
  - keep-heap on / off: MIXSERVE_KEEP_HEAP (host_memory.keep_freed_heap: a step's freed temporaries
    reused, not mapped afresh);
  - huge-pages on / off: MIXSERVE_HUGE_PAGES (weights and KV cache on transparent huge pages).
Prints the machine, each child's figures, and the medians with off / on ratios; `--out` saves JSON.

    flock /tmp/heavy.lock python benchmarks/host_memory_ab.py --setting keep-heap --rounds 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from mixserve.env import machine_info

SETTINGS = {"keep-heap": "MIXSERVE_KEEP_HEAP", "huge-pages": "MIXSERVE_HUGE_PAGES"}

CHILD = r"""
import json, statistics, sys, time
from mixserve import SamplingParams
from mixserve.llm import LLM
model, inv, tokens, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(model, kv_cache_memory="1GiB", max_model_len=2048, progress=False, enable_prefix_caching=False,
          batch_invariant=inv)
def prefill(salt, n):
    ids = [200 + (salt * 31 + j * 13) % 20000 for j in range(n)]
    return llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0].metrics["ttft"]
def decode():
    o = llm.generate([[100 + j for j in range(32)]], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0]
    return (new - 1) / (o.metrics["finish"] - o.metrics["first_token"])
prefill(-1, 64); decode()
import resource
got = {"prefill_s": statistics.median(prefill(r, tokens) for r in range(3)), "decode_tok_s": decode()}
print(json.dumps({**got, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="keep-heap")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--batch-invariant", choices=("on", "off"), default="on")
    ap.add_argument("--prefill-tokens", type=int, default=1536)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args()
    info = machine_info()
    print(json.dumps(info), flush=True)
    var = SETTINGS[a.setting]
    got: dict[str, list[dict]] = {"on": [], "off": []}
    for r in range(a.rounds):
        for arm in ("on", "off"):
            env = dict(os.environ, **{var: "1" if arm == "on" else "0"})
            out = subprocess.run([sys.executable, "-c", CHILD, a.model, a.batch_invariant, str(a.prefill_tokens),
                                  str(a.new_tokens)], env=env, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{a.setting} {arm}: child failed\n{out.stderr[-3000:]}")
            got[arm].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {a.setting} {arm}: {got[arm][-1]}", flush=True)
    med = {arm: {k: statistics.median(g[k] for g in runs) for k in runs[0]} for arm, runs in got.items()}
    print(f"{a.model}, batch invariance {a.batch_invariant}, {a.setting} on / off, medians of {a.rounds}:")
    print(f"  {a.prefill_tokens}-token prefill: {med['on']['prefill_s']:.3f} / {med['off']['prefill_s']:.3f} s "
          f"(off / on {med['off']['prefill_s'] / med['on']['prefill_s']:.2f})")
    print(f"  decode, one stream: {med['on']['decode_tok_s']:.1f} / {med['off']['decode_tok_s']:.1f} tok/s "
          f"(on / off {med['on']['decode_tok_s'] / med['off']['decode_tok_s']:.2f})")
    print(f"  peak RSS: {med['on']['peak_rss_mb']:.0f} / {med['off']['peak_rss_mb']:.0f} MB")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": info, "args": vars(a), "runs": got, "medians": med}, f, indent=1)


if __name__ == "__main__":
    main()
