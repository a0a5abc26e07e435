"""The paged attention kernel against SDPA, and against another checkout's kernel, side by side (issue 43).

For each head layout (the 0.5B's 14 query / 2 KV heads of 64, the 1.5B's 12 / 2 of 128) and context
length L, bfloat16 (the engine's default cache dtype), 2 threads:
  - prefill: one L-token chunk through `paged_rows` (what `--batch-invariant on` runs for a prompt's
    attention) against causal SDPA on the same K/V laid out contiguously (what `off` runs);
  - decode: 32 rows at context L through `paged_decode`;
each the median of --reps calls. Under MIXSERVE_ISA=avx2 the kernels are built without AVX-512 and
SDPA's oneDNN is capped at AVX2 (kernel_choice.cap_isa), as the engine does. With --old PATH, that checkout's kernel source
(PATH/mixserve/layers/paged_decode.py) is built as a scratch module beside this one, both are
checked for equal bits on every case, and their times are taken alternately, --rounds rounds
(medians): the machines are noisy, ratios within one run are what to read.

    flock /tmp/heavy.lock python benchmarks/paged_attention.py [--old /tmp/old-checkout] [--out results/x.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mixserve.env import machine_info
from mixserve.layers import paged_decode
from mixserve.layers.cpp_build import build_extension, forced_isa_flags
from mixserve.layers.kernel_choice import cap_isa

LAYOUTS = {"0.5B": (14, 2, 64), "1.5B": (12, 2, 128)}
BLOCK = 16


def other_kernel(path: Path):
    """Another checkout's paged kernel, built as a scratch module (its op registration left out, so
    it loads beside this process's own)."""
    spec = importlib.util.spec_from_file_location("other_paged_decode", path / "mixserve/layers/paged_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = mod._SRC[:mod._SRC.index("TORCH_LIBRARY_FRAGMENT")]
    # one name: build_extension keys its folder by the source's digest (a name from Python's hash() of
    # the source changed every process, so every run compiled it again into a new folder)
    built = build_extension("bench_paged_other", src, ["paged_rows", "paged_decode"], extra_flags=forced_isa_flags())
    if built is None:
        raise SystemExit(f"could not build the kernel of {path}")
    return built


def ms(fn, reps: int) -> float:
    """The median of reps calls after one warm-up, in milliseconds."""
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--old", type=Path, default=None, help="another checkout, its kernel timed beside this one")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    cap_isa()  # MIXSERVE_ISA=avx2 caps SDPA's library too, as in the engine, before its first call
    torch.set_num_threads(2)
    info = machine_info()
    print(json.dumps(info), flush=True)
    mod = paged_decode.build()
    if mod is None:
        raise SystemExit("the paged kernel does not build here")
    kernels = {"new": mod}
    if a.old:
        kernels["old"] = other_kernel(a.old)
    rows = []
    for name, (h, kvh, d) in LAYOUTS.items():
        for L in (int(x) for x in a.lengths.split(",")):
            g = torch.Generator().manual_seed(L + d)
            nb = L // BLOCK
            kc = torch.randn(nb, BLOCK, kvh, d, generator=g).bfloat16()
            vc = torch.randn(nb, BLOCK, kvh, d, generator=g).bfloat16()
            q = torch.randn(L, h, d, generator=g).bfloat16()
            table = torch.arange(nb).view(1, -1)
            pre = (q, kc, vc, table, torch.zeros(L, dtype=torch.long), torch.arange(1, L + 1), d ** -0.5)
            dq = torch.randn(32, h, d, generator=g).bfloat16()
            dec = (dq, kc, vc, table.expand(32, -1).contiguous(), torch.full((32,), L), d ** -0.5)
            if "old" in kernels:
                for fn, args in (("paged_rows", pre), ("paged_decode", dec)):
                    x, y = getattr(kernels["new"], fn)(*args), getattr(kernels["old"], fn)(*args)
                    assert torch.equal(x.view(torch.int16), y.view(torch.int16)), f"{fn} differs at {name} L={L}"
            ks = kc.view(1, L, kvh, d).transpose(1, 2)
            vs = vc.view(1, L, kvh, d).transpose(1, 2)
            qs = q.transpose(0, 1).unsqueeze(0)
            t = {f"{k}_{what}": [] for k in kernels for what in ("prefill", "decode")}
            t["sdpa_prefill"] = []
            for r in range(a.rounds):
                order = list(kernels) if r % 2 == 0 else list(reversed(list(kernels)))
                for k in order:
                    t[f"{k}_prefill"].append(ms(lambda: kernels[k].paged_rows(*pre), a.reps))
                    t[f"{k}_decode"].append(ms(lambda: kernels[k].paged_decode(*dec), a.reps))
                t["sdpa_prefill"].append(ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                                 enable_gqa=True), a.reps))
            row = {"layout": name, "heads": h, "kv_heads": kvh, "head_dim": d, "L": L,
                   **{k: round(statistics.median(v), 3) for k, v in t.items()}}
            row["new_vs_sdpa_prefill"] = round(row["new_prefill"] / row["sdpa_prefill"], 3)
            if "old" in kernels:
                row["old_over_new_prefill"] = round(row["old_prefill"] / row["new_prefill"], 3)
                row["old_over_new_decode"] = round(row["old_decode"] / row["new_decode"], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| layout | L | paged_rows ms | SDPA ms | paged / SDPA | decode x32 ms |" +
          (" old prefill ms | old / new prefill | old decode ms | old / new decode |" if a.old else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|---|" if a.old else ""))
    for r in rows:
        line = (f"| {r['layout']} | {r['L']} | {r['new_prefill']:.2f} | {r['sdpa_prefill']:.2f} | "
                f"{r['new_vs_sdpa_prefill']:.2f} | {r['new_decode']:.2f} |")
        if a.old:
            line += (f" {r['old_prefill']:.2f} | {r['old_over_new_prefill']:.2f} | {r['old_decode']:.2f} | "
                     f"{r['old_over_new_decode']:.2f} |")
        print(line)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"machine": info, "rows": rows}, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
