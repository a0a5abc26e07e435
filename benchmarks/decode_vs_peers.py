"""Single-stream decode speed of mixserve vs llama.cpp and HF transformers, side by side (issue 14).

One run on the machine at hand, one stream, greedy, 128 generated tokens, prefill excluded,
2 threads, no speculation, for each model in --models:

- llama.cpp: `llama-bench -m GGUF -p 0 -n 128 -t 2 -o json` (tg128: 128 one-token decodes from an
  empty context, mean of llama-bench's 5 repetitions after its warm-up) on the GGUF as shipped. The
  binary comes from benchmarks/build_llama_cpp.sh (no AMX); --llama-bench PATH, else
  <cache_root>/llama.cpp/bin/llama-bench, else the column is skipped with a note.
- HF transformers bf16, loaded by transformers' own GGUF loader: tok/s = 127 / (time of a
  128-token `generate` - time of a 1-token `generate`) on the HumanEval/0 prompt (one warm-up
  1-token generate first).
- mixserve: "eager" (kernels=eager, bf16, GGUF dequantized), "bf16" (kernels=auto, dequantized),
  "int4" (rtn, group 128, int4 LM head, kernels=auto), "native" (the GGUF's quantized tensors as
  stored, kernels=auto; issue 16). After a 4-token warm-up request, the HumanEval/0 prompt is added,
  one step runs prefill + first token, and the next 127 steps are timed one by one: tok/s = 127 /
  their sum. Then a 512-token prompt is prefilled in one step, twice; the second is timed
  (prefill tok/s, beside llama-bench's pp512 from the same llama-bench call as tg128).
- Resident weights: every distinct weight tensor the engine's model holds (llama.cpp: the file's
  tensor bytes).
- `--rounds N` (N > 1): the host's bandwidth can swing 1.5x within minutes (a Zen 5 read llama.cpp's
  1.5B at 20.0, 30.9 and 34.0 tok/s within 20 minutes, 2026-12-08), so one llama.cpp run and one
  mixserve run minutes apart compare two host states. Each mixserve configuration then loads once and
  alternates with llama-bench N times: llama-bench (tg128 only), then 127 timed mixserve steps, per
  round. Each round's mixserve / llama.cpp ratio is paired in time; the table shows medians and the
  notes every round's ratio and their median.

Bytes per token = weight bytes read per decoded token: mixserve, every DenseLinear (out x in x dtype
size) and Int4Linear (weight_bytes()); llama.cpp, every GGUF tensor but token_embd.weight when
output.weight exists; HF, parameter bytes minus the input embedding when the head is separate.
GB/s = tok/s x bytes/token, set against the read bandwidth measured in the same run (median
time of t.sum() over 1 GiB of float32) and against the streaming rate of F.linear over rotating
9728x896 bf16 weights (> 1 GB, 1 row), which judges the target "bf16 0.5B >= 1.3x HF or >= 90%
of F.linear's streaming rate / bytes per token".

    flock /tmp/heavy.lock python benchmarks/decode_vs_peers.py \
        --models qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mixserve.env import cache_root, machine_info
from mixserve.layers.kernel_choice import amx_permitted

NEW_TOKENS = 128
THREADS = 2
MIXSERVE_CONFIGS = {
    "eager": dict(kernels="eager", dtype="bfloat16", gguf_weights="dequantize"),
    "bf16": dict(kernels="auto", dtype="bfloat16", gguf_weights="dequantize"),
    "int4": dict(kernels="auto", dtype="bfloat16", quantization="rtn", quant_group_size=128, quant_lm_head=True),
    "native": dict(kernels="auto", dtype="bfloat16", gguf_weights="native"),
}
PREFILL_TOKENS = 512


def gguf_path(model: str) -> Path:
    if model.endswith(".gguf"):
        return Path(model)
    from mixserve.models.registry import pull

    return Path(pull(model, progress=False))


def humaneval0() -> str:
    from mixserve.data.datasets import load_humaneval

    return load_humaneval(1)[0].prompt


def read_bandwidth() -> float:
    t = torch.ones(2**28)  # 1 GiB of float32
    t.sum()
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    return t.numel() * 4 / statistics.median(times)


def bf16_stream_rate() -> float:
    # 64 copies of 17.4 MB: far past the last-level cache, so every call streams from DRAM
    ws = [torch.randn(9728, 896).to(torch.bfloat16) for _ in range(64)]
    x = torch.randn(1, 896).to(torch.bfloat16)
    for w in ws:
        F.linear(x, w)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for w in ws:
            F.linear(x, w)
        times.append(time.perf_counter() - t0)
    return sum(w.numel() * 2 for w in ws) / statistics.median(times)


def gguf_tensor_bytes(path: Path) -> dict[str, int]:
    from gguf import GGUFReader

    return {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}


def gguf_bytes_per_token(path: Path) -> int:
    tensors = gguf_tensor_bytes(path)
    if "output.weight" in tensors:  # separate head: the embedding table is only indexed
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def run_llama_bench(binary: Path, path: Path, prefill: bool = True) -> dict:
    """llama-bench's tg128 (and pp512 where `prefill`) on the GGUF at `path`: tok/s, its stddev over
    llama-bench's repetitions, the build, and the file's bytes. Raises RuntimeError where it fails."""
    out = subprocess.run([str(binary), "-m", str(path), "-p", str(PREFILL_TOKENS if prefill else 0),
                          "-n", str(NEW_TOKENS), "-t", str(THREADS), "-o", "json"], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama-bench exited {out.returncode}: {out.stderr[-500:]}")
    runs = json.loads(out.stdout)
    tg = next(r for r in runs if r["n_gen"] == NEW_TOKENS)
    pp = next(r for r in runs if r["n_prompt"] == PREFILL_TOKENS) if prefill else {"avg_ts": float("nan")}
    return {"tok_s": tg["avg_ts"], "stddev_tok_s": tg["stddev_ts"], "prefill_tok_s": pp["avg_ts"],
            "build_commit": tg["build_commit"], "model_type": tg["model_type"],
            "bytes_per_token": gguf_bytes_per_token(path), "resident_weight_bytes": sum(gguf_tensor_bytes(path).values())}


def run_hf(path: Path, prompt: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.bfloat16).eval()
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])

    def gen(n):
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t0

    gen(1)  # warm-up
    t1, tn = gen(1), gen(NEW_TOKENS)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if head.data_ptr() != emb.data_ptr():
        nbytes -= emb.numel() * emb.element_size()
    # transformers may keep GGUF blocks packed (GgufLinear, with the `kernels` package): then this
    # row would not be bf16, so the linear classes and weight dtypes are recorded
    linears = sorted({f"{type(m).__name__}/{m.weight.dtype}" for m in model.modules()
                      if isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2})
    res = {"tok_s": (NEW_TOKENS - 1) / (tn - t1), "prompt_tokens": ids.shape[1], "bytes_per_token": nbytes,
           "tied_head": head.data_ptr() == emb.data_ptr(), "linears": linears}
    del model
    gc.collect()
    return res


def mixserve_bytes_per_token(engine) -> int:
    from mixserve.layers.gguf_linear import GGUFLinear
    from mixserve.layers.linear import DenseLinear, Int4Linear

    elt = torch.finfo(engine.dtype).bits // 8
    total = 0
    for m in engine.model.modules():
        if isinstance(m, DenseLinear):
            total += m.out_features * m.in_features * elt
        elif isinstance(m, (Int4Linear, GGUFLinear)):
            total += m.weight_bytes()
    return total


def resident_weight_bytes(model) -> int:
    """Bytes of every distinct weight tensor the model holds (linears in whatever layout, the
    embedding, norms, biases; not the RoPE tables or the KV cache the layers are bound to):
    shared storage counted once."""
    from mixserve.layers.gguf_linear import GGUFEmbedding, GGUFLinear, GGUFWeight

    seen: dict[int, int] = {}

    def add(t):
        if isinstance(t, torch.Tensor) and t.numel():
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
    for m in model.modules():
        if m is getattr(model, "rope", None):
            continue
        parts = m.parts if isinstance(m, GGUFLinear) else [m.weight_q] if isinstance(m, GGUFEmbedding) else []
        for p in parts:
            for name in GGUFWeight.TENSORS:
                add(getattr(p, name))
        for name, t in vars(m).items():
            if name not in ("k_cache", "v_cache") and isinstance(t, torch.Tensor):
                add(t)
        for t in list(m._parameters.values()) + list(m._buffers.values()):
            add(t)
    return sum(seen.values())


def run_mixserve(model: str, prompt: str, config: dict, rounds: int = 1, peer=None) -> dict:
    """mixserve's single-stream decode (127 timed steps after prefill) and 512-token prefill with
    engine `config`. rounds > 1: the decode is timed `rounds` times in the one engine, `peer(r)` (a
    callable, or None) run before each, and tok_s is their median (rounds_tok_s lists them)."""
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.sampling_params import SamplingParams

    # no prefix caching: the timed 512-token prefill repeats its warm-up's prompt, and a cache hit
    # made it a ~10-token step (a 6,800 tok/s "prefill" on the 0.5B, 2026-12-05)
    engine = LLMEngine(EngineArgs(model=model, kv_cache_memory="256MiB", progress=False, speculation="off",
                                  max_num_batched_tokens=max(2048, PREFILL_TOKENS), enable_prefix_caching=False,
                                  **config))
    ids = engine.tokenizer.encode(prompt)
    engine.add_request(ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    while engine.has_unfinished():
        engine.step()
    per_round = []
    for r in range(rounds):
        if peer is not None:
            peer(r)
        engine.add_request(ids, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        engine.step()  # prefill + first token
        steps = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        assert len(steps) == NEW_TOKENS - 1, len(steps)
        per_round.append((len(steps) / sum(steps), statistics.median(steps)))
    # prefill of PREFILL_TOKENS tokens in one step (as llama-bench's pp512), after one warm-up
    long_ids = (ids * (PREFILL_TOKENS // len(ids) + 1))[:PREFILL_TOKENS]
    prefill = []
    for _ in range(2):
        engine.add_request(long_ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()
        prefill.append(time.perf_counter() - t0)
        while engine.has_unfinished():
            engine.step()
    res = {"tok_s": statistics.median(t for t, _ in per_round),
           "median_step_ms": 1e3 * statistics.median(m for _, m in per_round),
           "rounds_tok_s": [t for t, _ in per_round],
           "prefill_tok_s": PREFILL_TOKENS / prefill[-1], "resident_weight_bytes": resident_weight_bytes(engine.model),
           "prompt_tokens": len(ids), "bytes_per_token": mixserve_bytes_per_token(engine),
           "describe": engine.describe(), "load_s": engine.load_time_s, "kernel_choice_s": engine.kernel_choice_s}
    del engine
    gc.collect()
    return res


def table(rows: list[dict], bandwidth: float) -> str:
    lines = ["| model | engine | tok/s | ms/token | median step ms | bytes/token | GB/s | % of bandwidth "
             "| × llama.cpp | × HF | resident weights | prefill 512 tok/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peers = {p["engine"]: p["tok_s"] for p in rows if p["model"] == r["model"]}
        gbs = r["tok_s"] * r["bytes_per_token"] / 1e9
        def ratio(k):
            if k == "llama.cpp" and r.get("paired_ratios"):  # --rounds: the median of ratios paired in time
                return f"{statistics.median(r['paired_ratios']):.2f} (paired)"
            return f"{r['tok_s'] / peers[k]:.2f}" if k in peers else "—"
        step = f"{r['median_step_ms']:.1f}" if "median_step_ms" in r else "—"
        lines.append(f"| {r['model']} | {r['engine']} | {r['tok_s']:.1f} | {1e3 / r['tok_s']:.1f} | {step} "
                     f"| {r['bytes_per_token'] / 1e6:.0f} MB | {gbs:.1f} | {gbs * 1e9 / bandwidth:.0%} "
                     f"| {ratio('llama.cpp')} | {ratio('HF bf16')} "
                     f"| {r['resident_weight_bytes'] / 1e6:.0f} MB | {r['prefill_tok_s']:.0f} |"
                     if "resident_weight_bytes" in r else
                     f"| {ratio('llama.cpp')} | {ratio('HF bf16')} | — | — |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct",
                    help="comma-separated built-in names or GGUF paths")
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (default: the build script's)")
    ap.add_argument("--configs", default=",".join(MIXSERVE_CONFIGS),
                    help=f"mixserve configurations to run (of {', '.join(MIXSERVE_CONFIGS)})")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers row")
    ap.add_argument("--out", default="results/decode_vs_peers.json")
    ap.add_argument("--rounds", type=int, default=1,
                    help="N > 1: each mixserve configuration alternates with llama-bench N times (paired ratios)")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    amx_permitted()  # before any oneDNN call, so HF and F.linear run under the ISA cap mixserve uses
    torch.set_num_threads(THREADS)

    binary = Path(a.llama_bench) if a.llama_bench else cache_root() / "llama.cpp" / "bin" / "llama-bench"
    notes = []
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        notes.append(f"llama.cpp skipped: no llama-bench at {binary} (run benchmarks/build_llama_cpp.sh)")
        binary = None

    prompt = humaneval0()
    bandwidth = read_bandwidth()
    stream = bf16_stream_rate()
    print(f"read bandwidth (t.sum, 1 GiB f32): {bandwidth / 1e9:.1f} GB/s; "
          f"F.linear bf16 streaming (1 row, rotating 9728x896): {stream / 1e9:.1f} GB/s", flush=True)

    rows = []
    for model in a.models.split(","):
        path = gguf_path(model)
        name = path.stem if model.endswith(".gguf") else model
        if binary is not None:
            rows.append({"model": name, "engine": "llama.cpp", **run_llama_bench(binary, path)})
            print(f"{name} llama.cpp: {rows[-1]['tok_s']:.1f} tok/s", flush=True)
        if not a.no_hf:
            rows.append({"model": name, "engine": "HF bf16", **run_hf(path, prompt)})
            print(f"{name} HF bf16: {rows[-1]['tok_s']:.1f} tok/s; modules {rows[-1]['linears']}", flush=True)
        for cname in a.configs.split(","):
            cfg = MIXSERVE_CONFIGS[cname]
            paired: list[float] = []
            peer = None
            if a.rounds > 1 and binary is not None:
                def peer(r, path=path, paired=paired):
                    paired.append(run_llama_bench(binary, path, prefill=False)["tok_s"])
                    print(f"  round {r}: llama.cpp {paired[-1]:.1f} tok/s", flush=True)
            rows.append({"model": name, "engine": f"mixserve {cname}",
                         **run_mixserve(model, prompt, cfg, rounds=a.rounds, peer=peer)})
            if paired:
                rows[-1]["paired_llama_tok_s"] = paired
                ratios = [m / l for m, l in zip(rows[-1]["rounds_tok_s"], paired)]
                rows[-1]["paired_ratios"] = ratios
                notes.append(f"{name} mixserve {cname}: paired with llama.cpp tg{NEW_TOKENS} in {a.rounds} rounds: "
                             f"mixserve {', '.join(f'{t:.1f}' for t in rows[-1]['rounds_tok_s'])} against "
                             f"{', '.join(f'{t:.1f}' for t in paired)} tok/s; ratios "
                             f"{', '.join(f'{x:.2f}' for x in ratios)}, median {statistics.median(ratios):.2f}")
            print(f"{name} mixserve {cname}: {rows[-1]['tok_s']:.1f} tok/s; {rows[-1]['describe']}", flush=True)

    for r in rows:
        peer = {p["engine"]: p for p in rows if p["model"] == r["model"]}
        if r["engine"] == "mixserve native" and "llama.cpp" in peer:
            lc = peer["llama.cpp"]
            x = statistics.median(r["paired_ratios"]) if r.get("paired_ratios") else r["tok_s"] / lc["tok_s"]
            notes.append(f"{r['model']} mixserve native: {x:.2f}x llama.cpp tg{NEW_TOKENS}"
                         f"{' (paired rounds, median)' if r.get('paired_ratios') else ''}; "
                         f"resident weights {r['resident_weight_bytes'] / lc['resident_weight_bytes']:.3f}x the "
                         f"file's tensor bytes; prefill {PREFILL_TOKENS}: {r['prefill_tok_s']:.0f} tok/s vs "
                         f"llama.cpp pp{PREFILL_TOKENS} {lc['prefill_tok_s']:.0f}")
        if r["engine"] == "mixserve bf16" and "HF bf16" in peer:
            hf = peer["HF bf16"]["tok_s"]
            bound = stream / r["bytes_per_token"]
            notes.append(f"{r['model']} mixserve bf16: {r['tok_s'] / hf:.2f}x HF (target >= 1.3), "
                         f"{r['tok_s'] / bound:.0%} of F.linear's streaming bound {bound:.1f} tok/s (target >= 90%)")
    info = machine_info()
    text = table(rows, bandwidth)
    print(f"\nMachine: {info}\n\n{text}\n")
    print("\n".join(notes))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": info, "read_bandwidth_Bps": bandwidth, "bf16_linear_stream_Bps": stream,
                               "new_tokens": NEW_TOKENS, "threads": THREADS, "rows": rows, "notes": notes,
                               "table": text}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
