"""The cost of batch invariance (layers/batch_invariance.py), side by side in one process.

Engines on the same model timed in alternation (a, b, a, b, ...) so that the machine's drift hits
all: decode tokens/s at batch 1, 8 and 64 (every row decoding; the rate between the last first token
and the last finish), and the time to prefill a 512-token prompt (TTFT of a lone request with
max_tokens 1). `--arms invariance` (default): `--batch-invariant on` and `off`; `--arms gguf` (a GGUF
model): the native kernel and the float32 dequantized copy, each with invariance on and off (issue
43: which pays on this CPU). Prints the machine first, then a table of medians and each arm's ratio
to the first; `--out` saves it as JSON.

    python benchmarks/batch_invariance.py --model qwen2.5-coder-0.5b-instruct --out results/bi.json
    python benchmarks/batch_invariance.py --arms gguf --out results/gguf_arms.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mixserve import SamplingParams
from mixserve.env import machine_info
from mixserve.llm import LLM


def decode_rate(llm: LLM, batch: int, new_tokens: int) -> float:
    """Generated tokens/s of `batch` rows decoding together (prefill excluded)."""
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(32)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    t0 = max(o.metrics["first_token"] for o in outs)
    t1 = max(o.metrics["finish"] for o in outs)
    return batch * (new_tokens - 1) / (t1 - t0)


def prefill_s(llm: LLM, tokens: int, salt: int) -> float:
    """Seconds to the first token of one `tokens`-token prompt (no cached prefix: `salt` differs)."""
    ids = [200 + (salt * 31 + j * 13) % 20000 for j in range(tokens)]
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    return out.metrics["ttft"]


ARMS = {"invariance": {"on": {"batch_invariant": "on"}, "off": {"batch_invariant": "off"}},
        "gguf": {"native-on": {"gguf_weights": "native", "batch_invariant": "on"},
                 "f32-on": {"gguf_weights": "dequantize", "batch_invariant": "on"},
                 "native-off": {"gguf_weights": "native", "batch_invariant": "off"},
                 "f32-off": {"gguf_weights": "dequantize", "batch_invariant": "off"}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--arms", choices=sorted(ARMS), default="invariance")
    ap.add_argument("--out")
    a = ap.parse_args()
    print(machine_info(), flush=True)
    from mixserve.layers import gguf_kernels

    print(f"native GGUF kernel variant: {gguf_kernels.isa()}", flush=True)
    t0 = time.time()
    engines = {m: LLM(a.model, kv_cache_memory="1GiB", max_model_len=2048, progress=False,
                      enable_prefix_caching=False, **kw) for m, kw in ARMS[a.arms].items()}
    print(f"engines ready in {time.time() - t0:.0f} s", flush=True)
    for m, llm in engines.items():
        print(f"  {m}: {llm.engine.describe()}", flush=True)
    cases = [("decode tok/s, batch 1", lambda llm, r: decode_rate(llm, 1, a.new_tokens)),
             ("decode tok/s, batch 8", lambda llm, r: decode_rate(llm, 8, a.new_tokens)),
             ("decode tok/s, batch 64", lambda llm, r: decode_rate(llm, 64, a.new_tokens)),
             (f"prefill {a.prefill_tokens} tokens, s", lambda llm, r: prefill_s(llm, a.prefill_tokens, r))]
    for llm in engines.values():  # warm-up: first calls, graphs
        decode_rate(llm, 2, 8)
        prefill_s(llm, 64, -1)
    rows = []
    first = next(iter(engines))
    for name, fn in cases:
        got = {m: [] for m in engines}
        for r in range(a.rounds):
            for m, llm in engines.items():
                got[m].append(fn(llm, r))
        med = {m: statistics.median(v) for m, v in got.items()}
        rows.append({"case": name, **med, **{f"{m}/{first}": med[m] / med[first] for m in engines if m != first},
                     "runs": got})
        print(f"{name:28s} " + "  ".join(f"{m} {v:9.3f}" for m, v in med.items()) + "  " +
              "  ".join(f"{m}/{first} {med[m] / med[first]:.3f}" for m in engines if m != first), flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump({"machine": machine_info(), "model": a.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
