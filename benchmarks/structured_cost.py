"""What structured output costs, beside unconstrained requests in the same run (issue 33).

On the 24 schemas of mixserve/data/schemas.py (each asked for through the model's chat template):

- compile: each schema compiled once by a fresh GrammarCompiler (llguidance), p50 / p99 / max, and
  the one-off tokenizer view;
- batch 1: one request at a time, free (ignore_eos) and constrained alternated prompt by prompt;
  TPOT = (E2E - TTFT) / (tokens - 1) per request, mean over the prompts, median over rounds;
- batch 16: the same 16 prompts all free, then 8 free + 8 constrained, alternated; TPOT of rows
  8-15 in each arm (the constrained ones end first, so both are timed while 16 rows run);
- speculation: the constrained requests one at a time with `--draft-model ngram` (speculation
  auto) against without, output tok/s;
- the engine's own account: seconds filling masks per constrained row (GrammarSteps.mask_s).

    flock /tmp/heavy.lock python benchmarks/structured_cost.py --rounds 3 --out results/structured-cost.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mixserve import SamplingParams
from mixserve.data.schemas import SCHEMAS, prompt
from mixserve.env import machine_info
from mixserve.llm import LLM
from mixserve.structured_output import StructuredOutputs
from mixserve.structured_output.compiler import GrammarCompiler


def tpot(o) -> float | None:
    m, n = o.metrics, len(o.token_ids)
    return (m["e2e"] - m["ttft"]) / (n - 1) if n > 1 else None


def mean(xs) -> float:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="prompts in the batch-1 and speculation arms")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out")
    a = ap.parse_args()
    info = machine_info()
    print(json.dumps(info), flush=True)
    llm = LLM(a.model, progress=False)
    eng = llm.engine
    print(eng.describe(), flush=True)
    tok = eng.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": prompt(w, s)}], tokenize=False,
                                     add_generation_prompt=True) for w, s in SCHEMAS]
    specs = [StructuredOutputs(json=s) for _, s in SCHEMAS]
    out: dict = {"machine": info, "model": a.model, "engine": eng.describe()}

    # compile: a fresh compiler, every schema once
    gc = GrammarCompiler(eng.new_tokenizer, eng.cfg.vocab_size, list(eng.cfg.eos_token_ids))
    t0 = time.perf_counter()
    gc.view()
    view_s = time.perf_counter() - t0
    for sp in specs:
        gc.compile(sp)
    ct = sorted(gc.compile_times)
    out["compile"] = {"tokenizer_view_s": round(view_s, 3), "p50_ms": round(1e3 * statistics.median(ct), 2),
                      "p99_ms": round(1e3 * ct[min(len(ct) - 1, int(0.99 * len(ct)))], 2),
                      "max_ms": round(1e3 * ct[-1], 2), "schemas": len(ct)}
    print("compile:", out["compile"], flush=True)
    llm.generate(texts[:2], [SamplingParams(temperature=0, max_tokens=8, structured=specs[0])] * 2)  # warm

    def free(seed):
        return SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True, seed=seed)

    def constrained(i):
        return SamplingParams(temperature=0, max_tokens=a.max_tokens, structured=specs[i])

    rounds = []
    for r in range(a.rounds):
        res = {}
        # batch 1, alternated prompt by prompt
        f1, c1 = [], []
        for i in range(a.prompts):
            f1.append(tpot(llm.generate(texts[i], free(i))[0]))
            c1.append(tpot(llm.generate(texts[i], constrained(i))[0]))
        res["b1_free_tpot_ms"], res["b1_constrained_tpot_ms"] = 1e3 * mean(f1), 1e3 * mean(c1)
        # batch 16: all free, then half constrained (rows 8-15), alternated by round
        arms = [("b16_free", [free(i) for i in range(16)]),
                ("b16_half", [free(i) for i in range(8)] + [constrained(i) for i in range(8, 16)])]
        for name, params in (arms if r % 2 == 0 else arms[::-1]):
            outs = llm.generate(texts[:16], params)
            res[f"{name}_rows8_15_tpot_ms"] = 1e3 * mean(tpot(o) for o in outs[8:])
        res["b1_ratio"] = res["b1_constrained_tpot_ms"] / res["b1_free_tpot_ms"]
        res["b16_ratio"] = res["b16_half_rows8_15_tpot_ms"] / res["b16_free_rows8_15_tpot_ms"]
        print(f"round {r}:", {k: round(v, 3) for k, v in res.items()}, flush=True)
        rounds.append(res)
    out["rounds"] = rounds
    out["median"] = {k: round(statistics.median(x[k] for x in rounds), 3) for k in rounds[0]}
    gs = eng.grammar_steps
    out["mask_ms_per_constrained_row"] = round(1e3 * gs.mask_s / max(1, gs.mask_rows), 3)
    print("median:", out["median"], "| mask fill per constrained row:", out["mask_ms_per_constrained_row"], "ms",
          flush=True)
    del llm, eng

    # speculation: constrained, one at a time, n-gram drafts (auto k) against none
    spec = {}
    for name, kw in (("plain", {}), ("ngram", {"draft_model": "ngram"})):
        s = LLM(a.model, progress=False, **kw)
        s.generate(texts[0], constrained(0))  # warm
        toks = secs = 0.0
        for i in range(a.prompts):
            o = s.generate(texts[i], constrained(i))[0]
            toks += len(o.token_ids) - 1
            secs += o.metrics["e2e"] - o.metrics["ttft"]
        spec[name] = toks / secs
        del s
    out["speculation"] = {"plain_tok_s": round(spec["plain"], 1), "ngram_tok_s": round(spec["ngram"], 1),
                          "speedup": round(spec["ngram"] / spec["plain"], 2)}
    print("speculation (constrained, batch 1):", out["speculation"], flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
