"""The cost of float32 logits (issue 15, item 2): decode step time at batch 1 and 64 with the LM
head's float32 path (`float_out`, layers/linear.py) against the bf16-rounded head it replaced, on
the real LLMEngine (decode graph, kernels as chosen on this machine), bf16 and int4 (rtn) models.

One engine per format; for each batch size its sequences (200-token prompts, greedy, speculation
off) are prefilled once, then decode steps alternate between the two heads in blocks of --block
steps (--rounds rounds), so the host's drift falls on both; the first block of each head is
warm-up (its graph variant compiles there) and is not counted. Reported: median step time of
each head, the difference (the cost per step) and the ratio. "bf16 head" is the old path: the
same head module with float_out off, its bf16 result cast to float32 (`.float()`), on the kernel
the head's own choice picked (for int4 the vnni layout's int8 kernel at every row count: the
head's dense switch is no longer chosen; it was 128 rows here, above both batch sizes).

    python benchmarks/float_logits.py --model qwen2.5-coder-0.5b-instruct
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(model: str, quant: str | None, batches: list[int], block: int, rounds: int, log=print) -> dict:
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.sampling_params import SamplingParams

    eng = LLMEngine(EngineArgs(model=model, quantization=quant, progress=False, kv_cache_memory="2GiB",
                               max_num_seqs=max(batches)))
    head = eng.model.lm_head
    desc = {k: getattr(head, k) for k in ("impl", "kernel", "float_gemv_rows", "float_dense_rows", "dense_rows")
            if hasattr(head, k)}
    log(f"{quant or 'bf16'}: head {type(head).__name__} {desc}; decode graph: {eng.runner.graph_choice}")
    g = torch.Generator().manual_seed(0)
    out = {"head": desc, "batches": {}}
    steps_needed = block * rounds * 2 + 2
    for b in batches:
        prompts = [torch.randint(100, 20000, (200,), generator=g).tolist() for _ in range(b)]
        for p in prompts:
            eng.add_request(p, SamplingParams(max_tokens=steps_needed + 4, temperature=0, ignore_eos=True))
        eng.step()  # prefill (the token budget admits all 64 x 200 in a few steps)
        while any(s.num_output_tokens == 0 for s in eng.requests.values()):
            eng.step()
        times = {True: [], False: []}
        for r in range(rounds):
            for flag in (True, False):
                head.float_out = flag
                for _ in range(block):
                    t0 = time.perf_counter()
                    eng.step()
                    if r > 0:
                        times[flag].append(time.perf_counter() - t0)
        head.float_out = True
        for rid in list(eng.requests):
            eng.abort(rid)
        while eng.has_unfinished():
            eng.step()
        f32, b16 = statistics.median(times[True]), statistics.median(times[False])
        out["batches"][b] = {"float32_ms": f32 * 1e3, "bf16_ms": b16 * 1e3, "cost_ms": (f32 - b16) * 1e3,
                             "ratio": f32 / b16, "steps_each": len(times[True])}
        log(f"  batch {b:3}: float32 head {f32 * 1e3:7.2f} ms/step, bf16 head {b16 * 1e3:7.2f} ms/step, "
            f"cost {(f32 - b16) * 1e3:+6.2f} ms ({f32 / b16:.3f}x), {len(times[True])} steps each")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="model (default %(default)s)")
    ap.add_argument("--batches", default="1,64", help="decode batch sizes, comma-separated (default %(default)s)")
    ap.add_argument("--block", type=int, default=5, help="steps per head before switching (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of both heads; the first is warm-up (default %(default)s)")
    ap.add_argument("--out", default="results/float_logits.json", help="JSON results (default %(default)s)")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    res = {"cpu": cpu_name(), "cores": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M"),
           "torch": torch.__version__, "model": a.model}
    print(f"{res['cpu']}, {res['cores']} threads, torch {res['torch']}, {res['date']}")
    for quant in (None, "rtn"):
        res[quant or "bf16"] = run(a.model, quant, batches, a.block, a.rounds)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
