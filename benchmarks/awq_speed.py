"""Int4 speed, single stream, side by side in one run: HF transformers bf16, mixserve bf16 and
mixserve AWQ int4 (with the LM head bf16, and rounded to int4 at load) and RTN int4 at load, on the same model; decode tokens/s (prefill excluded) and
prefill time of a 512-token prompt, with weight bytes resident. Rounds are interleaved across
configurations and the median round is reported, since the host is shared.

    python benchmarks/awq_speed.py --model qwen2.5-coder-1.5b-instruct --awq DIR --out results/awq_speed.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def weight_bytes(model) -> int:
    """Bytes of the weights the engine keeps: int4 layers count their packed integers and scales,
    dense layers out x in x dtype bytes (oneDNN's packed copy is opaque), plus embeddings/norms."""
    from mixserve.layers.linear import DenseLinear, Int4Linear

    total = 0
    for m in model.modules():
        if isinstance(m, Int4Linear):
            total += m.weight_bytes()
        elif isinstance(m, DenseLinear):
            if m is not model.lm_head or not model.cfg.tie_word_embeddings:
                total += m.out_features * m.in_features * torch.finfo(model.dtype).bits // 8
    total += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def ours_round(eng, prompt_ids, long_ids, n_tokens):
    from mixserve import SamplingParams

    def run(ids, max_tokens):
        t = time.perf_counter()
        eng.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        final = None
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    final = o
        return time.perf_counter() - t, final

    dt, final = run(prompt_ids, n_tokens)
    decode = (n_tokens - 1) / (dt - final.metrics["ttft"])
    pt, _ = run(long_ids, 1)
    return decode, pt


def hf_round(model, prompt_ids, long_ids, n_tokens):
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False)
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=n_tokens, min_new_tokens=n_tokens, **kw)
        decode = (n_tokens - 1) / (time.perf_counter() - t - t1)
        lid = torch.tensor([long_ids])
        t = time.perf_counter()
        model(lid, attention_mask=torch.ones_like(lid))
        return decode, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--awq", required=True, help="AWQ checkpoint folder of the same model")
    ap.add_argument("--no-rtn", action="store_true")
    ap.add_argument("--no-lm-head-int4", action="store_true",
                    help="skip the AWQ configuration whose LM head is also rounded to int4 at load")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/awq_speed.json")
    a = ap.parse_args()

    from mixserve.data.datasets import load_humaneval
    from mixserve.env import machine_info
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    common = dict(dtype="bfloat16", kv_cache_memory="512MiB", max_num_seqs=4, progress=False)
    engines = {"ours-bf16": LLMEngine(EngineArgs(model=a.model, **common)),
               "ours-awq": LLMEngine(EngineArgs(model=a.awq, quantization="awq", **common))}
    if not a.no_lm_head_int4:
        engines["ours-awq-head4"] = LLMEngine(EngineArgs(model=a.awq, quantization="awq", quant_lm_head=True,
                                                         **common))
    if not a.no_rtn:
        engines["ours-rtn"] = LLMEngine(EngineArgs(model=a.model, quantization="rtn", **common))
    tok = engines["ours-bf16"].tokenizer
    prompt_ids = tok.encode(load_humaneval(1)[0].prompt)
    corpus = "".join(r.prompt for r in load_humaneval(40))
    long_ids = tok.encode(corpus)[: a.prefill]
    hf = None
    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(engines["ours-bf16"].model_dir), dtype=torch.bfloat16).eval()
    rounds = {k: [] for k in [*engines, *(["hf-bf16"] if hf is not None else [])]}
    for r in range(a.rounds + 1):  # round 0 warms every shape up and is dropped
        for name, eng in engines.items():
            res = ours_round(eng, prompt_ids, long_ids, a.tokens)
            if r:
                rounds[name].append(res)
        if hf is not None:
            res = hf_round(hf, prompt_ids, long_ids, a.tokens)
            if r:
                rounds["hf-bf16"].append(res)
        print("round", r, {k: v[-1] for k, v in rounds.items() if v and r}, flush=True)
    out = {"config": vars(a), "machine": machine_info(), "results": {}}
    for name, xs in rounds.items():
        out["results"][name] = {"decode_tok_s": statistics.median(x[0] for x in xs),
                                "prefill_s": statistics.median(x[1] for x in xs), "rounds": xs}
        if name in engines:
            out["results"][name]["weight_bytes"] = weight_bytes(engines[name].model)
    R = out["results"]
    base = R["ours-bf16"]
    for name, r in R.items():
        r["decode_vs_ours_bf16"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["prefill_speed_vs_ours_bf16"] = base["prefill_s"] / r["prefill_s"]
    print(f"{'config':<15}{'decode tok/s':>14}{'x bf16':>8}{'prefill s':>11}{'x bf16':>8}{'weights GiB':>13}")
    for name, r in R.items():
        wb = r.get("weight_bytes")
        print(f"{name:<15}{r['decode_tok_s']:>14.2f}{r['decode_vs_ours_bf16']:>8.2f}{r['prefill_s']:>11.2f}"
              f"{r['prefill_speed_vs_ours_bf16']:>8.2f}{(wb / 2**30 if wb else float('nan')):>13.2f}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
