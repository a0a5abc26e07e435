"""Regional compilation of the decode step, measured against the whole-step graph (issue 32: a
rejected idea, kept with its figures).

The decode graph (engine/decode_graph.py) compiles the whole decode step: Dynamo traces every
decoder layer at each start (SmolLM2: 30 layers), which is most of the graph's load time. Compiling
one decoder layer instead, called once per layer (every layer shares its compiled code: the
weights are graph inputs), traces one layer. This script times, in one process on one model: the
regional graph's first call (fresh Inductor folder), then eager steps, the regional graph and the
whole-step graph at 1 and 8 rows, `rounds` times alternated (median of 6 steps after 2), and checks
that the regional graph's logits equal eager's (batch invariance on: they must be the same bits).

    python benchmarks/regional_compile.py --model PATH.gguf [--dtype float32] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    os.environ.setdefault("MIXSERVE_KERNEL_TIMING", "prior")
    import torch
    import torch.fx.experimental._config as fx_config
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from mixserve.engine.decode_graph import DecodeGraph, _symbolic, dummy_decode_steps
    from mixserve.env import cpu_flags, cpu_model
    from mixserve.llm import LLM

    llm = LLM(a.model, dtype=a.dtype, kv_cache_memory="128MiB", progress=False, graph_warmup="off",
              max_model_len=1024)
    runner, m = llm.engine.runner, llm.engine.model

    def layer_step(layer, x, cos, sin, slots, tables, lens, rope):
        return layer(x, (cos, sin), (slots, tables, lens), rope)

    opts = {"guard_filter_fn": lambda es: [not (e.guard_type == "TENSOR_MATCH" and e.name.startswith("L['layer']")
                                                 and "_cache" not in e.name) for e in es],
            "size_asserts": False, "alignment_asserts": False}
    if m.batch_invariant:
        opts["emulate_precision_casts"] = True
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="regional-inductor-")
    fn = torch.compile(layer_step, dynamic=False, options=opts)
    first = {}

    def regional(items, block_table):
        bs = runner.block_size
        pos = torch.tensor([it.start for it in items])
        tabs = [block_table(it.seq_id)[:it.start // bs + 1] for it in items]
        slots = torch.tensor([block_table(it.seq_id)[it.start // bs] * bs + it.start % bs for it in items])
        w = max(len(t) for t in tabs)
        tables = torch.tensor([t + [0] * (w - len(t)) for t in tabs])
        lens = pos + 1
        with torch.inference_mode():
            x = m.embed_tokens(torch.tensor([it.token_ids[it.start] for it in items]))
            cos, sin = m.rope.tables(pos)
            ctx = contextlib.ExitStack()
            if not first:
                for t in (x, cos, sin, slots, tables, lens, m.rope.cos, m.rope.sin_signed):
                    _symbolic(t, 0)
                _symbolic(tables, 1)
                for layer in m.layers:
                    _symbolic(layer.k_cache, 0)
                    _symbolic(layer.v_cache, 0)
                ctx.enter_context(torch._dynamo.config.patch(automatic_dynamic_shapes=False))
                ctx.enter_context(fx_config.patch(use_duck_shape=False, backed_size_oblivious=True))
            with ctx:
                t0 = time.perf_counter()
                for layer in m.layers:
                    x = fn(layer, x, cos, sin, slots, tables, lens, m.rope)
                first.setdefault("s", time.perf_counter() - t0)
            return m.lm_head(m.norm(x)).float()

    dummy_decode_steps(runner, 1, 100, 1, regional)
    for rows in (3, 8):
        dummy_decode_steps(runner, rows, 100, 1, regional)
    entries = len(_debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__))

    def eager(items, block_table):
        return runner.run_eager(items, block_table)[0]

    def logits(run, rows):
        out = []
        dummy_decode_steps(runner, rows, 50, 2, lambda it, bt: out.append(run(it, bt)) or out[-1])
        return out
    same = all(torch.equal(x, y) for rows in (1, 4) for x, y in zip(logits(regional, rows), logits(eager, rows)))
    whole = DecodeGraph(m, runner.block_size, 1024 // runner.block_size, 8)
    t0 = time.perf_counter()
    dummy_decode_steps(runner, 1, 100, 1, whole.run)
    whole_first = time.perf_counter() - t0
    flags = cpu_flags()
    print(f"# {cpu_model()} ({'AVX-512' if 'avx512f' in flags else 'AVX2' if 'avx2' in flags else 'no AVX2'}), "
          f"{os.cpu_count()} cores, torch {torch.__version__}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; {a.model} {a.dtype}, {len(m.layers)} layers")
    print(f"regional: first call {first['s']:.1f} s (fresh Inductor folder), {entries} Dynamo cache entry after "
          f"1, 3 and 8 rows, logits equal to eager's: {same}")
    print(f"whole-step graph: first call {whole_first:.1f} s (Inductor's folder of this cache root)")
    print("| round | rows | eager ms | regional ms | whole graph ms |\n|---|---|---|---|---|")
    for r in range(a.rounds):
        for rows in (1, 8):
            t = {name: statistics.median(dummy_decode_steps(runner, rows, 128, 8, run)[2:]) * 1e3
                 for name, run in (("eager", eager), ("regional", regional), ("whole", whole.run))}
            print(f"| {r} | {rows} | {t['eager']:.2f} | {t['regional']:.2f} | {t['whole']:.2f} |")


if __name__ == "__main__":
    main()
