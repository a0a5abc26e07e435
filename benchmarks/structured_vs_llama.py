"""Structured output against llama.cpp's `llama-server` with `json_schema`, same schemas, file and machine (issue 33).

The 24 schemas of mixserve/data/schemas.py, each asked for once through the chat API, greedy,
max_tokens 512, one request at a time, in one run: llama-server (built by
`LLAMA_SERVER=1 bash benchmarks/build_llama_cpp.sh`; its own grammar from the schema, GBNF) and
mixserve (llguidance) on the same GGUF. Per engine: how many replies parse and validate
(`jsonschema`), how many ended at max_tokens, how many schemas it refused, and the time per output
token (llama-server's own `timings.predicted_ms / predicted_n`; mixserve's (E2E - TTFT) / (n - 1)).

    flock /tmp/heavy.lock python benchmarks/structured_vs_llama.py --out results/structured-vs-llama.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import httpx
import jsonschema

from live import free_port, wait_healthy
from mixserve import SamplingParams
from mixserve.data.schemas import SCHEMAS, prompt
from mixserve.env import cache_root, machine_info
from mixserve.llm import LLM
from mixserve.models.registry import resolve_model
from mixserve.structured_output import StructuredOutputs

MAX_TOKENS = 512


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_llama(binary: Path, gguf: Path) -> list[dict]:
    port = free_port()
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", "2", "-c", "4096", "-np", "1", "--port", str(port),
                             "--host", "127.0.0.1", "--jinja"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, interval_s=0.2)
        rows = []
        for what, schema in SCHEMAS:
            body = {"messages": [{"role": "user", "content": prompt(what, schema)}], "temperature": 0,
                    "max_tokens": MAX_TOKENS, "response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "x", "schema": schema}}}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
            if r.status_code != 200:
                rows.append({"schema": what, "refused": r.text[:200]})
                continue
            j = r.json()
            c = j["choices"][0]
            t = j.get("timings", {})
            rows.append({"schema": what, "finish": c["finish_reason"], "valid": valid(c["message"]["content"], schema),
                         "tokens": t.get("predicted_n"),
                         "tpot_ms": t["predicted_ms"] / t["predicted_n"] if t.get("predicted_n") else None})
        return rows
    finally:
        proc.terminate()
        proc.wait(30)


def run_mixserve(model: str) -> list[dict]:
    llm = LLM(model, progress=False)
    tok = llm.engine.tokenizer
    llm.generate("warm", SamplingParams(max_tokens=4, structured=StructuredOutputs(choice=["a"])))
    rows = []
    for what, schema in SCHEMAS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt(what, schema)}], tokenize=False,
                                       add_generation_prompt=True)
        o = llm.generate(text, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                              structured=StructuredOutputs(json=schema)))[0]
        n = len(o.token_ids)
        rows.append({"schema": what, "finish": o.finish_reason, "valid": valid(o.text, schema), "tokens": n,
                     "tpot_ms": 1e3 * (o.metrics["e2e"] - o.metrics["ttft"]) / (n - 1) if n > 1 else None})
    return rows


def summary(rows: list[dict]) -> dict:
    served = [r for r in rows if "refused" not in r]
    tp = [r["tpot_ms"] for r in served if r["tpot_ms"] is not None and (r["tokens"] or 0) >= 8]
    return {"schemas": len(rows), "refused": len(rows) - len(served),
            "valid": sum(r["valid"] for r in served), "length": sum(r["finish"] == "length" for r in served),
            "tpot_ms_mean": round(sum(tp) / len(tp), 2) if tp else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--out")
    a = ap.parse_args()
    info = machine_info()
    print(json.dumps(info), flush=True)
    binary = Path(a.llama_server) if a.llama_server else cache_root() / "llama.cpp" / "bin" / "llama-server"
    out = {"machine": info, "model": a.model}
    out["mixserve"] = run_mixserve(a.model)
    print("mixserve:", summary(out["mixserve"]), flush=True)
    if binary.exists():
        out["llama.cpp"] = run_llama(binary, Path(resolve_model(a.model).path))
        print("llama.cpp:", summary(out["llama.cpp"]), flush=True)
        for r in out["llama.cpp"]:
            if "refused" in r:
                print("  llama.cpp refused", r["schema"], ":", r["refused"][:120])
    else:
        print(f"llama.cpp skipped: no llama-server at {binary} (LLAMA_SERVER=1 bash benchmarks/build_llama_cpp.sh)")
    out["summary"] = {k: summary(out[k]) for k in ("mixserve", "llama.cpp") if k in out}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)  # a fresh clone has no results/
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
