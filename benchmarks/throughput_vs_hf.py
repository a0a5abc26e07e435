"""mixserve vs HF transformers, side by side in one run, same model, same dtype, same requests.

1. Throughput: N ShareGPT requests (seed, prompts <= 1024 tokens, max_tokens = reply length capped
   at 256). mixserve: continuous batching, all requests queued at t=0. HF: `generate` with static
   left-padded batches of 8 in dataset order; each batch runs until its longest request is done,
   and only the tokens each request asked for are counted.
2. Single stream: decode tokens/s at batch size 1 = (new tokens - 1) / (time(n) - time(1)),
   i.e. prefill excluded, for the same prompt and the same number of tokens.

Each side runs in its own subprocess so its peak resident memory (ru_maxrss) is its own.

    python benchmarks/throughput_vs_hf.py --num-prompts 96 --out results/throughput_vs_hf.json
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch


def load_requests(tokenizer, n, seed):
    from mixserve.data.datasets import load_sharegpt

    return load_sharegpt(tokenizer, n, seed=seed, max_prompt_len=1024, max_output_len=256)


def side_ours(a) -> dict:
    from mixserve import SamplingParams
    from mixserve.bench.offline import run_offline
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineArgs(model=a.model, dtype=a.dtype, progress=False))
    reqs = load_requests(eng.tokenizer, a.num_prompts, a.seed)
    report, outs = run_offline(eng, reqs, progress=False)
    res = {"output_tokens": report["output_tokens"], "duration_s": report["duration_s"],
           "output_tok_s": report["output_tokens_per_s"], "peak_running_seqs": report["extra"]["peak_running_seqs"],
           "preemptions": report["extra"]["preemptions"]}
    # single stream
    prompt = eng.tokenizer.encode(reqs[0].prompt)
    times = {}
    for n in (1, a.single_tokens + 1):
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        eng.add_request(prompt, sp)
        while eng.has_unfinished():
            eng.step()
        times[n] = time.perf_counter() - t
    res["single_decode_tok_s"] = a.single_tokens / (times[a.single_tokens + 1] - times[1])
    return res


def side_hf(a) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mixserve.models.weights import convert_gguf
    from mixserve.models.registry import resolve_model

    r = resolve_model(a.model)
    folder = convert_gguf(r.path, progress=False) if r.kind == "gguf" else r.path
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    dtype = torch.bfloat16 if a.dtype == "bfloat16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    reqs = load_requests(tok, a.num_prompts, a.seed)
    asked = sum(r.max_tokens for r in reqs)
    t0 = time.perf_counter()
    for i in range(0, len(reqs), 8):
        batch = reqs[i:i + 8]
        enc = tok([r.prompt for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        n = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    dur = time.perf_counter() - t0
    res = {"output_tokens": asked, "duration_s": dur, "output_tok_s": asked / dur}
    ids = torch.tensor([tok.encode(reqs[0].prompt, add_special_tokens=False)])
    times = {}
    for n in (1, a.single_tokens + 1):
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False)
        times[n] = time.perf_counter() - t
    res["single_decode_tok_s"] = a.single_tokens / (times[a.single_tokens + 1] - times[1])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--single-tokens", type=int, default=128)
    ap.add_argument("--side", choices=["ours", "hf"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="results/throughput_vs_hf.json")
    a = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if a.side:
        res = side_ours(a) if a.side == "ours" else side_hf(a)
        res["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print("RESULT " + json.dumps(res), flush=True)
        return
    from mixserve.env import machine_info

    results = {"config": vars(a), "machine": machine_info()}
    for side in ("ours", "hf"):
        cmd = [sys.executable, __file__, "--side", side] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                                                           if k not in ("side", "out")]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        if out.returncode or not line:
            sys.exit(f"{side} failed:\n{out.stderr[-3000:]}")
        results[side] = json.loads(line[0][7:])
        print(side, results[side], flush=True)
    results["throughput_ratio"] = results["ours"]["output_tok_s"] / results["hf"]["output_tok_s"]
    results["single_stream_ratio"] = results["ours"]["single_decode_tok_s"] / results["hf"]["single_decode_tok_s"]
    print(f"throughput ratio (ours / HF static batches of 8): {results['throughput_ratio']:.2f}x")
    print(f"single-stream decode ratio: {results['single_stream_ratio']:.2f}x")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
