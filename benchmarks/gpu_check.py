"""One-shot GPU check (issue 20): the engine on CUDA, measured in one short run on a lent GPU.

    bash benchmarks/gpu_check.sh     # on the lent GPU: --device cuda, no C++ builds, a 295 s limit, a log
    PYTHONPATH=. python3 benchmarks/gpu_check.py --tiny --device cpu --out /tmp/gc   # CI's CPU run

Run it through the .sh on the GPU (its environment and outer time limit matter), with the device
tool's timeout_s at least 330. Results: `$OUT/gpu_check/summary.json` (read `targets` first, then
each section; `units` says the units), `probe.json` (the GPU profile `plan --hardware` takes) and
`log.txt`: three files, within what a lent machine sends back.

The lent machine has its own PyTorch and no network, and our model files cannot travel there, so
the models are made here: the real Qwen2.5-Coder 0.5B and 1.5B configs with seeded random weights
(speed, bandwidth and the planner's error do not need trained weights; about 7 GB of them go
through the temporary folder). Each section has its own time box (SIGALRM; a long C call ends it
late) and `summary.json` is rewritten as soon as a section ends. A section that fails or runs out
of time records why (and what it measured so far); the next one runs. Exit 0: every section ran;
whether the targets were met is `targets`.

Sections:
  env       GPU, driver, torch, CUDA, the attention and int4 kernels found.
  equality  greedy tokens on the device in float32 against this machine's CPU float32 run of the
            same seeded model (0.5B shape), with the near-tie rule (a divergence counts only where
            the CPU run's top-two logprobs differ by 0.01 or more); bf16 agreement is stated too.
  decode    batch-1 decode of the 1.5B shape, bf16 with CUDA graphs, bf16 eager and int4 (RTN,
            group 128): tokens/s against bandwidth / bytes per token (target >= 50% in bf16
            with graphs), bandwidth measured here by a device copy and from the datasheet.
  sharegpt  200 requests with ShareGPT's prompt and output lengths (benchmarks/data/
            sharegpt_200.jsonl: `mixserve bench`'s first 200 ShareGPT requests, seed 0, counted in
            Qwen2.5 tokens; remade by `--make-trace` where the model and the data set are installed),
            all queued at once, 0.5B shape in bf16.
  plan      `hw probe` on the device for the 0.5B shape, then the planner's simulation of the
            sharegpt run from that profile and from the GPU's datasheet roofline: predicted
            against measured output throughput (target within 20% from the probe).
  spec      speculation mechanics and cost: the 0.5B shape with a copy of itself as draft (k 4,
            greedy: every draft token must be accepted) and n-gram on repetitive prompts,
            against plain decoding.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TRACE = HERE / "data" / "sharegpt_200.jsonl"
COMMON = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu", rms_norm_eps=1e-6,
              max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True, vocab_size=151936,
              bos_token_id=151643, eos_token_id=151645)
CONFIGS = {  # the released models' config.json values that shape the compute
    "qwen2.5-0.5b": dict(COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2),
    "qwen2.5-1.5b": dict(COMMON, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "tiny": dict(COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0, max_position_embeddings=4096,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}
TIE_GAP = 0.01
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class SectionTimeout(Exception):
    pass


def _alarm(signum, frame):
    raise SectionTimeout("the section ran out of its time box")


# -- models -----------------------------------------------------------------------------------

def make_model(folder: Path, hf: dict, seed: int, std: float, dtype: torch.dtype, device: str) -> Path:
    """An HF folder (config.json + model.safetensors) of a Qwen2 model with seeded N(0, std)
    weights drawn on `device` (fast on a GPU), norms 1, q/k/v biases N(0, std). Returns folder."""
    from safetensors.torch import save_file

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter = hf["hidden_size"], hf["intermediate_size"]
    hd = h // hf["num_attention_heads"]
    kv = hf["num_key_value_heads"] * hd

    def rnd(*shape):
        return (torch.randn(*shape, generator=g, device=device) * std).to(dtype).cpu()

    sd = {"model.embed_tokens.weight": rnd(hf["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    if not hf["tie_word_embeddings"]:
        sd["lm_head.weight"] = rnd(hf["vocab_size"], h)
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                  "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
                  "mlp.down_proj": (h, inter)}
        for n, shp in shapes.items():
            sd[p + n + ".weight"] = rnd(*shp)
        for n, size in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
            sd[p + f"self_attn.{n}.bias"] = rnd(size)
        sd[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({**hf, "torch_dtype": str(dtype).removeprefix("torch.")}))
    return folder


def make_int4(src: Path, folder: Path, device: str, group_size: int = 128) -> Path:
    """An AWQ-format int4 checkpoint (round-to-nearest, zero point, `group_size`) of `src`'s
    linears, as `mixserve quantize` writes it (quant/checkpoint.py). Returns folder."""
    from safetensors.torch import load_file, save_file

    from mixserve.quant.checkpoint import awq_tensors

    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    sd = load_file(str(src / "model.safetensors"))
    out = {}
    for k, v in sd.items():
        base = k.removesuffix(".weight")
        if k.endswith(".weight") and base.split(".", 3)[-1] in LINEARS:  # rounded on the device: seconds, not minutes
            out.update({n: t.cpu() for n, t in awq_tensors(base, v.to(device), group_size).items()})
        else:
            out[k] = v.to(torch.float16)
    save_file(out, str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf.update(torch_dtype="float16", quantization_config={"quant_method": "awq", "bits": 4, "group_size": group_size,
                                                          "zero_point": True, "version": "gemm"})
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


def engine(folder: Path, device: str, **kw):
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine

    kw.setdefault("kv_cache_memory", "4GiB" if device != "cpu" else "64MiB")
    kw.setdefault("max_model_len", 2048)
    return LLMEngine(EngineArgs(model=str(folder), device=device, progress=False, **kw))


def drain(eng) -> dict:
    """Step until every request ends; {request id: final RequestOutput}."""
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


# -- sections ---------------------------------------------------------------------------------

def sec_env(ctx) -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": ctx.device, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
    from mixserve.env import machine_info

    out["machine"] = machine_info()
    if ctx.device != "cpu":
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, sms=p.multi_processor_count, memory_bytes=p.total_memory,
                   capability=f"{p.major}.{p.minor}")
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            out["driver"] = f"unknown ({type(e).__name__})"
    kernels = {}
    for mod in ("flash_attn", "flashinfer", "triton"):
        try:
            m = __import__(mod)
            kernels[mod] = getattr(m, "__version__", "present")
        except Exception as e:  # noqa: BLE001 -- absent or broken: both are facts to record
            kernels[mod] = f"absent ({type(e).__name__})"
    kernels["attention_used"] = ("decode: gather + SDPA (layers/attention.gathered_decode_attention; flash-attn's "
                                 "paged kernel only with --block-size 256, not used here); prefill: the engine's "
                                 "paged PyTorch path" if ctx.device != "cpu" else "CPU kernels")
    # the int4 kernel the engine uses here, checked on one small layer against its dequantized weight
    from mixserve.device import move_module
    from mixserve.layers.linear import Int4Linear

    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (256, 512), generator=g, dtype=torch.int32)
    s = torch.rand(256, 4, generator=g).half() * 0.01
    z = torch.randint(0, 16, (256, 4), generator=g, dtype=torch.int32)
    lin = move_module(Int4Linear(q, s, z, 128, None, ctx.dtype), torch.device(ctx.device))
    x = torch.randn(1, 512, generator=g).to(ctx.dtype).to(ctx.device)
    with torch.inference_mode():
        y = lin(x).float()
        ref = x.float() @ lin.float_weight().float().t() if hasattr(lin, "float_weight") else None
    kernels["int4"] = getattr(lin, "kernel", "?")
    if ref is not None:
        kernels["int4_max_rel_err"] = float((y - ref).abs().max() / ref.abs().max())
    out["kernels"] = kernels
    return out


def sec_equality(ctx) -> dict:
    from mixserve import SamplingParams

    folder = make_model(ctx.work / f"{ctx.small}-f32-eq", CONFIGS[ctx.small], seed=1, std=0.08,
                        dtype=torch.float32, device=ctx.device)
    ps = prompts(ctx.n(4, 3), ctx.n(48, 16), CONFIGS[ctx.small]["vocab_size"], seed=2)
    n_new = ctx.n(32, 12)
    greedy = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True, logprobs=2)

    def run(device, dtype, kernels):
        eng = engine(folder, device, dtype=dtype, kernels=kernels, kv_cache_memory="256MiB")
        ids = [eng.add_request(p, greedy) for p in ps]
        done = drain(eng)
        return [done[i] for i in ids]

    ref = run("cpu", "float32", "eager")
    out = {"model": f"{ctx.small} shape, seeded N(0, 0.08) weights", "prompts": len(ps), "new_tokens": n_new}
    for name, dtype in (("float32", "float32"), ("bf16", "bfloat16")):
        got = run(ctx.device, dtype, "auto")
        equal = ties = bad = 0
        first = []
        for a, b in zip(got, ref):
            div = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            if div is None:
                equal += 1
                continue
            top = b.logprobs[div].top
            gap = top[0][1] - top[1][1]
            first.append({"position": div, "gap": gap})
            if gap < TIE_GAP:
                ties += 1
            else:
                bad += 1
        out[name] = {"equal": equal, "near_tie": ties, "diverged": bad, "first_divergences": first}
    out["ok"] = out["float32"]["diverged"] == 0
    return out


def _decode_rate(folder: Path, ctx, n_tokens: int, **kw) -> dict:
    from mixserve import SamplingParams
    from mixserve.device import synchronize

    eng = engine(folder, ctx.device, **kw)
    sp = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    p = prompts(1, 32, eng.cfg.vocab_size, seed=3)[0]
    # warm-up over the same lengths: every (rows, width) graph the timed run needs is captured here
    eng.add_request(p, sp)
    drain(eng)
    eng.add_request(p, sp)
    eng.step()  # the prefill
    synchronize(eng.device)
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step()
        n += 1
    dt = time.perf_counter() - t0
    from mixserve.layers.linear import DenseLinear

    weights = 0  # what a decode step reads: every linear's weight, the LM head's included
    for m in eng.model.modules():
        if hasattr(m, "weight_bytes"):
            weights += m.weight_bytes()
        elif isinstance(m, DenseLinear):  # its plain weight may be gone (a prepacked layout): count the shape
            weights += m.out_features * m.in_features * (torch.finfo(eng.dtype).bits // 8)
    row = eng.model.embed_tokens.weight
    kv = eng.cfg.kv_bytes_per_token(torch.finfo(eng.dtype).bits // 8) * (32 + n_tokens / 2)  # mean context read
    per_token = weights + row.shape[1] * row.element_size() + kv
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt, "tpot_ms": dt / n * 1e3,
            "bytes_per_token": per_token, "weight_bytes": weights, "graph": eng.runner.graph_choice}


def sec_decode(ctx) -> dict:
    from mixserve.plan.hardware import probe_bandwidth
    from mixserve.plan.step_time import ACCELERATORS

    big = ctx.big
    out = ctx.partial  # what is measured so far is kept if the time box ends the section
    f = make_model(ctx.work / f"{big}-bf16", CONFIGS[big], seed=4, std=0.02, dtype=torch.bfloat16, device=ctx.device)
    bw = probe_bandwidth(1 << 30 if ctx.device != "cpu" else 1 << 26, 5, device=ctx.device)
    n = ctx.n(256, 16)
    out.update({"model": f"{big} shape", "measured_copy_bandwidth_bytes_per_s": bw})
    sheet = ctx.accelerator()
    # "graphs": CUDA graphs on a GPU (the CPU's compiled decode graph in the CI run); each row's
    # "graph" field says which ran
    runs = {"bf16 + graphs": (lambda: f, {}), "bf16 eager": (lambda: f, {"kernels": "eager"}),
            "int4 (RTN g128) + graphs": (lambda: make_int4(f, ctx.work / f"{big}-int4", ctx.device), {})}
    for name, (folder, kw) in runs.items():
        try:
            r = _decode_rate(folder(), ctx, n, **kw)
        except SectionTimeout:
            raise
        except Exception as e:  # noqa: BLE001 -- one variant failing must not hide the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        r["share_of_measured_bandwidth"] = r["tokens_per_s"] * r["bytes_per_token"] / bw
        if sheet:
            r["share_of_datasheet_bandwidth"] = r["tokens_per_s"] * r["bytes_per_token"] / ACCELERATORS[sheet].bandwidth
        out[name] = r
    g = out.get("bf16 + graphs", {})
    out["target_met"] = g.get("share_of_measured_bandwidth", 0) >= 0.5
    out["target"] = "bf16 + graphs: tokens/s x bytes per token >= 50% of the measured copy bandwidth"
    return out


def load_trace(ctx) -> list:
    from mixserve.data.datasets import BenchRequest

    lines = [json.loads(ln) for ln in TRACE.read_text().splitlines() if ln.strip()]
    lines = lines[:ctx.n(200, 12)]
    vocab = CONFIGS[ctx.small]["vocab_size"]
    out = []
    for i, ln in enumerate(lines):
        p_len = ln["prompt_tokens"] if not ctx.tiny else min(ln["prompt_tokens"], 48)
        o_len = ln["output_tokens"] if not ctx.tiny else min(ln["output_tokens"], 8)
        ids = prompts(1, p_len, vocab, seed=1000 + i)[0]
        out.append(BenchRequest(prompt=ids, max_tokens=o_len, prompt_len=p_len, tag="sharegpt", ref_output_len=o_len))
    return out


def sec_sharegpt(ctx) -> dict:
    from mixserve.bench.offline import run_offline

    f = make_model(ctx.work / f"{ctx.small}-bf16", CONFIGS[ctx.small], seed=5, std=0.02, dtype=torch.bfloat16,
                   device=ctx.device)
    reqs = load_trace(ctx)
    eng = engine(f, ctx.device, kv_cache_memory=ctx.kv, max_num_seqs=256, max_num_batched_tokens=2048)
    eng.set_prefix_caching(False)  # random prompts share nothing; the planner's run has it off too
    # warm-up: the same run once, so that the timed one captures no CUDA graph (the same lengths
    # give the same schedule, hence the same (rows, width) buckets); a server captures at start-up
    run_offline(eng, reqs, progress=False)
    report, _ = run_offline(eng, reqs, progress=False)
    ctx.shared["sharegpt"] = {"num_blocks": eng.num_blocks, "block_size": eng.args.block_size,
                              "max_num_seqs": 256, "max_num_batched_tokens": 2048, "max_model_len": eng.max_model_len,
                              "requests": [(r.prompt_len, r.max_tokens) for r in reqs], "report": report,
                              "folder": str(f)}
    keep = {k: v for k, v in report.items() if k != "requests"}  # per-request rows: too long to keep
    return {"requests": len(reqs), "report": keep, "graph": eng.runner.graph_choice}


def sec_plan(ctx) -> dict:
    from mixserve.models.config import ModelConfig
    from mixserve.plan.hardware import load_step_model, probe
    from mixserve.plan.simulator import SimConfig, SimRequest, simulate

    run = ctx.shared.get("sharegpt")
    if run is None:
        return {"skipped": "the sharegpt section did not finish: nothing to compare with"}
    folder = Path(run["folder"])
    rows = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512] if not ctx.tiny else [1, 2, 4]
    prof = probe(str(folder), rows, ("bf16",), repeats=ctx.n(3, 1), max_context=ctx.n(2048, 128),
                 engine_steps=True, log=lambda s: print(s, flush=True), device=ctx.device)
    path = ctx.out / "probe.json"
    path.write_text(json.dumps(prof, indent=1))
    cfg = ModelConfig.from_folder(folder)
    reqs = [SimRequest(p, o) for p, o in run["requests"]]
    sim = SimConfig(num_blocks=run["num_blocks"], block_size=run["block_size"], max_num_seqs=run["max_num_seqs"],
                    max_num_batched_tokens=run["max_num_batched_tokens"], max_model_len=run["max_model_len"])
    measured = run["report"]
    key = "output_tokens_per_s"
    out = {"measured_" + key: measured.get(key), "measured_duration_s": measured.get("duration_s"),
           "probe_datasheet": prof.get("datasheet")}
    sources = {"probe": str(path)}
    if ctx.accelerator():
        sources["datasheet"] = ctx.accelerator()
    for name, hw in sources.items():
        sm, _ = load_step_model(hw, cfg, run["block_size"])
        res = simulate(reqs, sim, lambda b: sm.step_time(b))
        pred = res.report.get(key)
        out[name] = {"predicted_" + key: pred, "predicted_duration_s": res.duration_s,
                     "error": (pred / measured[key] - 1) if pred and measured.get(key) else None}
    e = out["probe"]["error"]
    out["target_met"] = e is not None and abs(e) <= 0.20
    out["target"] = "the probe's predicted output tok/s within 20% of the measured (error = predicted / measured - 1)"
    return out


def sec_spec(ctx) -> dict:
    from mixserve import SamplingParams

    f = make_model(ctx.work / f"{ctx.small}-bf16", CONFIGS[ctx.small], seed=5, std=0.02, dtype=torch.bfloat16,
                   device=ctx.device)
    vocab = CONFIGS[ctx.small]["vocab_size"]
    n_new = ctx.n(128, 12)
    # repetitive prompts: a random phrase said over and over (n-gram's case)
    base = prompts(ctx.n(8, 2), 16, vocab, seed=6)
    ps = [(b * 8)[:128] if not ctx.tiny else (b * 3)[:40] for b in base]
    out = ctx.partial
    variants = {"plain": {}, "draft = copy of the target, k 4": dict(draft_model=str(f), speculation="fixed",
                                                                      num_speculative_tokens=4),
                "n-gram, k 4": dict(draft_model="ngram", speculation="fixed", num_speculative_tokens=4)}
    for name, kw in variants.items():
        eng = engine(f, ctx.device, kv_cache_memory=ctx.kv, **kw)
        sp = SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True)
        eng.add_request(ps[0][:20], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        drain(eng)  # warm-up
        t0 = time.perf_counter()
        ids = [eng.add_request(p, sp) for p in ps]
        done = drain(eng)
        dt = time.perf_counter() - t0
        prop = sum(done[i].metrics["spec_proposed"] for i in ids)
        acc = sum(done[i].metrics["spec_accepted"] for i in ids)
        out[name] = {"tokens_per_s": len(ps) * n_new / dt, "seconds": dt, "proposed": prop, "accepted": acc,
                     "acceptance_rate": acc / prop if prop else None,
                     "tokens": [done[i].token_ids for i in ids]}
    plain = out["plain"]
    for name in list(variants)[1:]:
        v = out[name]
        v["same_tokens_as_plain"] = v["tokens"] == plain["tokens"]
        v["speedup"] = v["tokens_per_s"] / plain["tokens_per_s"]
    for v in out.values():
        v.pop("tokens")
    return out


# seconds each: 255 in all, under the script's 295 s with start-up and imports
SECTIONS = {"env": (sec_env, 10), "equality": (sec_equality, 35), "decode": (sec_decode, 75),
            "sharegpt": (sec_sharegpt, 50), "plan": (sec_plan, 60), "spec": (sec_spec, 25)}


class Context:
    def __init__(self, a):
        from mixserve.device import resolve_device

        self.device = str(resolve_device(a.device))  # ValueError: cuda asked for, none here
        self.tiny = a.tiny
        self.small = "tiny" if a.tiny else "qwen2.5-0.5b"
        self.big = "tiny" if a.tiny else "qwen2.5-1.5b"
        self.dtype = torch.bfloat16 if self.device != "cpu" else torch.float32
        self.out = Path(a.out)
        self.work = Path(a.work) if a.work else Path(tempfile.gettempdir()) / "mixserve-gpu-check-models"
        self.kv = "16GiB" if self.device != "cpu" else "64MiB"
        self.shared: dict = {}
        self.partial: dict = {}  # a section's results so far (kept when its time box ends it)

    def n(self, real: int, tiny: int) -> int:
        return tiny if self.tiny else real

    def accelerator(self) -> str | None:
        if self.device == "cpu":
            return None
        from mixserve.plan.hardware import gpu_datasheet_ratio

        return gpu_datasheet_ratio(torch.cuda.get_device_name(0), 0.0, {}).get("accelerator")


def targets(sections: dict) -> dict:
    """{target: True / False / None (not measured)} over the sections run so far: the issue's checks
    in one place."""
    def get(name, *keys):
        v = sections.get(name)
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    spec = sections.get("spec") or {}
    same = [v.get("same_tokens_as_plain") for v in spec.values() if isinstance(v, dict) and "speedup" in v]
    return {"greedy float32 equal to the CPU run (tie rule)": get("equality", "ok"),
            "batch-1 bf16 decode >= 50% of bandwidth / bytes per token": get("decode", "target_met"),
            "ShareGPT-shaped run completed": (get("sharegpt", "status") == "ok") if "sharegpt" in sections else None,
            "planner from the probe within 20% of the measured run": get("plan", "target_met"),
            "speculation gives plain decoding's tokens": all(same) if same else None}


def make_trace(path: Path = TRACE) -> None:
    """Write the sharegpt section's lengths: the requests `mixserve bench --dataset sharegpt
    --num-prompts 200` replays (seed 0, prompts <= 1024 tokens, outputs capped at 256)."""
    from mixserve.data.datasets import load_sharegpt
    from mixserve.models.weights import load_tokenizer

    reqs = load_sharegpt(load_tokenizer("qwen2.5-coder-0.5b-instruct"), 200, seed=0)
    path.write_text("".join(json.dumps({"prompt_tokens": r.prompt_len, "output_tokens": r.max_tokens,
                                        "tag": "sharegpt"}) + "\n" for r in reqs))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/gpu_check", help="folder for the results (one JSON per section, summary.json)")
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and a few requests (CI runs this on the CPU)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, from: " + ", ".join(SECTIONS))
    ap.add_argument("--work", default=None, help="where the made models go (default: a folder in the temporary "
                    "directory; several GB for the real shapes)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every section's time box")
    ap.add_argument("--make-trace", action="store_true", help=f"rewrite {TRACE.name} and exit")
    a = ap.parse_args(argv)
    if a.make_trace:
        make_trace()
        return 0
    names = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad:
        ap.error(f"unknown sections {bad}; choose from {', '.join(SECTIONS)}")
    try:
        ctx = Context(a)
    except ValueError as e:  # --device cuda where PyTorch sees no GPU: say so, in the results too
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "summary.json").write_text(json.dumps({"error": str(e)}, indent=1))
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    ctx.out.mkdir(parents=True, exist_ok=True)
    if ctx.device != "cpu":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 equality means float32 matmuls
        torch.backends.cudnn.allow_tf32 = False
    summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": ctx.device, "tiny": ctx.tiny, "sections": {}}
    summary["units"] = {"seconds": "s", "*_bytes_per_s": "bytes/s", "tokens_per_s": "tokens/s",
                        "share_*": "fraction (1 = all of it)", "error": "fraction, predicted / measured - 1",
                        "gap": "logprob nats between the CPU run's top two tokens (near tie below 0.01)"}
    # a caller's own timer (pytest-timeout's bound in the suite) is put back afterwards, less the
    # time spent here: the section boxes below share the one SIGALRM timer with it
    outer, t_outer = signal.getitimer(signal.ITIMER_REAL), time.monotonic()
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for name in names:
            fn, box = SECTIONS[name]
            box = max(1, math.ceil(box * a.scale * (4 if ctx.tiny else 1)))
            print(f"== {name} (time box {box} s)", flush=True)
            t0 = time.perf_counter()
            ctx.partial = {}
            signal.alarm(box)
            try:
                res = {"status": "ok", **fn(ctx)}
            except SectionTimeout as e:
                res = {"status": "timeout", "why": str(e), **ctx.partial}
            except Exception as e:  # noqa: BLE001 -- record and go on to the next section
                res = {"status": "error", "why": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            finally:
                signal.alarm(0)
            failed = [k for k, v in res.items() if isinstance(v, dict) and "error" in v and isinstance(v["error"], str)]
            if failed and res["status"] == "ok":  # a variant that failed is a failed section, not a quiet row
                res["status"] = "error"
                res["why"] = f"failed: {', '.join(failed)}"
            res["seconds"] = round(time.perf_counter() - t0, 2)
            summary["sections"][name] = res
            summary["targets"] = targets(summary["sections"])
            # one file, rewritten after each section (what the lent machine sends back is capped in files)
            (ctx.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
            print(json.dumps({k: v for k, v in res.items() if k != "traceback"}, default=str)[:2000], flush=True)
    finally:
        signal.signal(signal.SIGALRM, old)
        if outer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, max(1e-3, outer[0] - (time.monotonic() - t_outer)), outer[1])
    return 0 if all(s["status"] == "ok" for s in summary["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
