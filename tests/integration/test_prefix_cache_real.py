"""Prefix caching on a real model: greedy output with cache hits equals HF transformers (float32,
near-tie rule), and a mix recorded by the server replays through `bench --dataset` and
`plan --trace` with the same requests and token totals."""
import json

import openai
import pytest

from mixserve import SamplingParams
from mixserve.llm import LLM
from tests.integration.test_real_models import hf_model
from tests.reference import compare_along, hf_logits_along

pytestmark = pytest.mark.integration


def test_smollm2_cache_hits_equal_hf(smollm2_path):
    llm = LLM(smollm2_path, dtype="float32", kv_cache_memory="128MiB", progress=False, gguf_weights="dequantize")
    hf = hf_model(smollm2_path)
    tok = llm.tokenizer
    system = "You are a careful assistant who answers in one short paragraph. " * 4
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    first = tok.apply_chat_template(msgs("Name three rivers in Europe."), tokenize=False, add_generation_prompt=True)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    a = llm.generate([tok.encode(first)], sp)[0]
    second = tok.apply_chat_template(msgs("What is a prime number?"), tokenize=False, add_generation_prompt=True)
    cont = a.prompt_token_ids + a.token_ids + tok.encode(" And one more river, please.")
    outs = llm.generate([tok.encode(first), tok.encode(second), cont], sp)
    assert outs[0].metrics["cached_tokens"] > 0 and outs[1].metrics["cached_tokens"] > 0
    assert outs[2].metrics["cached_tokens"] > len(a.prompt_token_ids)  # generated blocks reused
    for o in [a] + outs:
        assert len(o.token_ids) == 32
        c = compare_along(o.token_ids, hf_logits_along(hf, o.prompt_token_ids, o.token_ids))
        assert c.ok, f"not HF's greedy token at {c.position}: {c.gap} below its top logit"


def test_recorded_mix_replays_through_bench_and_plan(smollm2_path, tmp_path):
    from mixserve.cli import main
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from mixserve.server.api import ServerConfig
    from tests.live_server import LiveServer

    mix = tmp_path / "mix.jsonl"
    eng = LLMEngine(EngineArgs(model=smollm2_path, kv_cache_memory="64MiB", max_model_len=2048, progress=False))
    srv = LiveServer(eng, ServerConfig("smol", record_mix=str(mix)))
    try:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        doc = "Rivers of Europe: the Danube, the Rhine, the Elbe, the Loire and the Vistula. " * 6
        for q in ("Which is longest?", "Which flows into the North Sea?"):
            r = cl.completions.create(model="smol", prompt=doc + q, max_tokens=12, temperature=0,
                                      extra_headers={"x-mixserve-tag": "docs"})
        assert r.usage.prompt_tokens_details.cached_tokens > 0
        cl.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
                                   n=2, temperature=0.7, seed=3)
        assert srv.wait_idle(30)
    finally:
        srv.stop()
    lines = [json.loads(x) for x in mix.read_text().splitlines()]
    assert len(lines) == 4 and [x["tag"] for x in lines] == ["docs", "docs", "serve", "serve"]
    assert all("prompt" not in x and x["block_hashes"] for x in lines)
    prompt_total = sum(x["prompt_tokens"] for x in lines)
    out_total = sum(x["output_tokens"] for x in lines)

    report = tmp_path / "bench.json"
    assert main(["bench", "--model", smollm2_path, "--dataset", str(mix), "--kv-cache-memory", "64MiB",
                 "--max-model-len", "2048", "--output", str(report)]) == 0
    b = json.loads(report.read_text())
    assert (b["num_requests"], b["input_tokens"], b["output_tokens"]) == (4, prompt_total, out_total)

    assert main(["plan", "--trace", str(mix), "--model", smollm2_path, "--hardware", "h100-sxm", "--slo", "",
                 "--out", str(tmp_path / "plan")]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    off = plan["variants"]["prefix caching"]["offline"]
    assert plan["trace"]["num_requests"] == 4
    assert (off["num_requests"], off["input_tokens"], off["output_tokens"]) == (4, prompt_total, out_total)
    # the recorded hashes carry the shared document: `mix describe` finds it (the planner's
    # capacity run queues both at t = 0, so they start together and neither hits, as in the engine)
    desc = tmp_path / "describe.json"
    assert main(["mix", "describe", str(mix), "--model", smollm2_path, "--json", str(desc)]) == 0
    d = json.loads(desc.read_text())
    assert d["count"] == 4 and d["prefix_cache"]["cached_tokens"] > 0
