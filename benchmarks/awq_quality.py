"""AWQ quality per slice, side by side in one run: the dense baseline, RTN (int4 at load) and one
or more AWQ checkpoints of the same model, on the held-out slices of data/corpora.py. Reports
perplexity with 95% bootstrap intervals and each int4 model's paired increase over the baseline.

    python benchmarks/awq_quality.py --model qwen2.5-coder-0.5b-instruct \
        --awq code=DIR_CODE --awq chat=DIR_CHAT --out results/awq_quality_05b.json
"""
from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--awq", action="append", default=[], help="LABEL=FOLDER of an AWQ checkpoint (repeatable)")
    ap.add_argument("--no-rtn", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--rtn-groups", default=None,
                    help="comma-separated group sizes for RTN runs (default: --group-size); e.g. 128,32 adds the grid "
                         "control at group 32")
    ap.add_argument("--int4-head", action="store_true",
                    help="round the LM head to int4 in the int4 runs (default: keep it dense in every run)")
    ap.add_argument("--slices", default="code_stdlib,code_humaneval,chat_en,chat_nonen,odd_format")
    ap.add_argument("--tokens-per-slice", type=int, default=6144)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", default="results/awq_quality.json")
    a = ap.parse_args()

    from mixserve.bench.ppl import compare, evaluate
    from mixserve.env import machine_info
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    slices = a.slices.split(",")
    runs = [("baseline", dict(model=a.model))]
    head = dict(quant_lm_head=a.int4_head)
    if not a.no_rtn:
        groups = [int(g) for g in (a.rtn_groups or str(a.group_size)).split(",")]
        for g in groups:
            label = "rtn" if g == a.group_size else f"rtn-g{g}"
            runs.append((label, dict(model=a.model, quantization="rtn", quant_group_size=g, **head)))
    for spec in a.awq:
        label, folder = spec.split("=", 1)
        runs.append((f"awq-{label}", dict(model=folder, quantization="awq", **head)))
    res = {"config": vars(a), "machine": machine_info(), "runs": {}}
    for label, kw in runs:
        eng = LLMEngine(EngineArgs(dtype=a.dtype, max_num_seqs=1, kv_cache_memory="256MiB", progress=False,
                                   gguf_weights="dequantize", **kw))
        if label == "baseline":
            res["weights"] = eng.describe()
        r = evaluate(eng, slices, a.tokens_per_slice, a.seq_len)
        res["runs"][label] = {"slices": r}
        if label != "baseline":
            res["runs"][label]["vs_baseline"] = compare(r, res["runs"]["baseline"]["slices"])
        line = "  ".join(f"{s} {r[s]['ppl']:.3f}" for s in slices)
        print(f"{label:<12} {line}", flush=True)
        del eng
        gc.collect()
    print("\n| slice (tokens) | " + " | ".join(label for label, _ in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for s in slices:
        base = res["runs"]["baseline"]["slices"][s]
        cells = [f"{base['ppl']:.3f} [{base['ci95'][0]:.3f}, {base['ci95'][1]:.3f}]"]
        for label, _ in runs[1:]:
            r = res["runs"][label]["slices"][s]
            c = res["runs"][label]["vs_baseline"][s]
            sig = "*" if c["significant"] else ""
            cells.append(f"{r['ppl']:.3f} (+{c['delta']:.3f} [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}]{sig})")
        print(f"| {s} ({base['tokens']}) | " + " | ".join(cells) + " |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
