"""plan --suggest (issue 34): the search, its answer's rules, and command lines the engine runs, on
made-up profiles and a tiny random model with SmolLM2's tokenizer."""
import json
import shlex
from dataclasses import replace

import pytest
import torch

from mixserve.cli import build_parser, engine_args, main
from mixserve.plan.planner import PlanSettings, parse_slo
from mixserve.plan.simulator import SimRequest
from mixserve.plan.step_time import MeasuredModel
from mixserve.plan.suggest import Config, Drafter, Suggester, available_formats, commands, CommandContext
from tests.unit.test_plan_planner import CFG, fake_profile


def reqs(n=24, prompt=200, out=64):
    return [SimRequest(prompt + 7 * (i % 5), out, 0.0, "t") for i in range(n)]


def profile(int4_factor=0.5, cfg=CFG):
    """fake_profile, with int4 `int4_factor` times bf16 at every row count."""
    p = fake_profile(cfg)
    for name, t in p["linear"]["int4"].items():
        t["seconds"] = [s * int4_factor for s in p["linear"]["bf16"][name]["seconds"]]
    return p


def suggester(prof, slo=None, quality=None, floor=None, **kw):
    sm = MeasuredModel(CFG, prof)
    fmts, why = available_formats(sm, "hf", None, quality=quality, floor=floor)
    ps = PlanSettings(slo=parse_slo(slo) if slo else {}, kv_bytes=1 << 30, bisect_iters=6)
    return Suggester(CFG, sm, {}, reqs(), ps, fmts, exclusions=why, model_kind="hf", search_requests=None, **kw)


def test_a_faster_format_is_suggested_and_the_default_is_reported():
    s = suggester(profile(0.5)).run()
    assert s.best["config"]["weights"] in ("int4-rtn", "int4-awq")
    assert s.default["config"]["weights"] == "bf16"
    gain = s.best["predicted"]["throughput_output_tokens_per_s"] / s.default["predicted"]["throughput_output_tokens_per_s"]
    assert gain > 1.15 and s.verdict.startswith("change")
    assert s.configurations_simulated >= 6
    # each runner-up names what differs and why it lost
    assert s.runners_up and all(r["reason"] and r["differs_by"] for r in s.runners_up)
    assert any("bf16" in " ".join(r["differs_by"]) for r in s.runners_up)


def test_a_gain_within_the_planners_error_keeps_the_default():
    # int4 5% faster: under the 15% the planner can claim
    s = suggester(profile(0.95)).run()
    assert s.best["config"] == s.default["config"]
    assert s.verdict.startswith("the default is best") and "within the planner's own error" in s.verdict
    # ... and a smaller min_gain lets it through
    s2 = suggester(profile(0.95), min_gain=0.01).run()
    assert s2.best["config"]["weights"].startswith("int4")


def test_an_slo_no_configuration_meets_gets_that_answer_with_the_closest():
    s = suggester(profile(0.5), slo="ttft_p90=1us,tpot_p90=1us").run()
    assert not s.slo_met
    assert s.verdict.startswith("no configuration meets the SLO")
    miss = s.best["predicted"]["slo_miss"]
    assert miss["over_x"] > 1 and miss["limit_s"] == pytest.approx(1e-6)
    # the closest is the one that misses least: no searched configuration misses by less
    s2 = suggester(profile(0.5), slo="ttft_p90=1us,tpot_p90=1us")
    s2.run()
    misses = [e["slo_miss"]["over_x"] for e in s2.cache.values() if e.get("slo_miss")]
    assert miss["over_x"] <= min(misses) * 1.0001


def test_goodput_objective_meets_the_slo_at_the_predicted_rate():
    s = suggester(profile(0.5), slo="ttft_p90=2s,tpot_p90=100ms").run()
    p = s.best["predicted"]
    assert s.slo_met and p["goodput_requests_per_s"] > 0
    assert p["at_goodput_rate"]["tpot_s"]["p90"] <= 0.1 and p["at_goodput_rate"]["ttft_s"]["p90"] <= 2.0


def test_quality_floor_excludes_a_format_over_it_or_without_a_record():
    ok = {"code": {"delta": 0.1, "ci95": [0.0, 0.2], "significant": False}}
    bad = {"code": {"delta": 0.1, "ci95": [0.0, 0.2], "significant": False},
           "chat_nonen": {"delta": 1.7, "ci95": [1.2, 2.2], "significant": True}}
    s = suggester(profile(0.5), quality={"int4-awq": ok, "int4-rtn": bad}, floor=0.5)
    assert "int4-rtn" not in s.formats and "int4-awq" in s.formats
    res = s.run()
    why = {x["weights"]: x["reason"] for x in res.excluded}
    assert "chat_nonen +1.700" in why["int4-rtn"]
    assert res.best["config"]["weights"] == "int4-awq"
    # no record for a format: the floor cannot be checked, so it is not suggested
    s = suggester(profile(0.5), quality={}, floor=0.5)
    assert set(s.formats) == {"bf16"}
    assert "no eval-ppl comparison" in {x["weights"]: x["reason"] for x in s.run().excluded}["int4-awq"]


def test_no_chunk_budget_past_the_rows_the_profile_timed():
    s = suggester(profile(0.5))  # tables to 64 rows: every budget tried (256 up) would extrapolate
    assert s.values("max_num_batched_tokens", s.default) == [s.default.max_num_batched_tokens]
    prof = profile(0.5)
    for f in prof["linear"].values():
        for t in f.values():
            t["rows"], t["seconds"] = t["rows"] + [1024], t["seconds"] + [t["seconds"][-1] * 16]
    s = suggester(prof)
    assert s.values("max_num_batched_tokens", s.default) == [256, 512, 1024, 2048]


def test_speculation_is_searched_with_a_drafter_and_kept_off_without():
    s = suggester(profile(1.0))
    assert s.values("speculation", s.default) == [("off", 0)]
    d = Drafter("ngram", alpha=0.9, cost=0.0)
    s = suggester(profile(1.0), drafter=d)
    vals = s.values("speculation", s.default)
    assert ("auto", 8) in vals and ("fixed", 4) in vals
    # a draft model cannot sit beside the contiguous allocator: never offered together
    s = suggester(profile(1.0), drafter=Drafter("some-draft", 0.9, 0.1))
    c = s.normalized(Config(allocator="contiguous", speculation=("fixed", 4)))
    assert c.speculation == ("off", 0) and not c.prefix_caching


def test_commands_pin_the_format(tmp_path):
    ctx = CommandContext(model="m.gguf", trace="t.jsonl", dtype="bfloat16", kv_cache_memory="1GiB",
                         model_kind="gguf", slo={"ttft_p90": 2.0, "tpot_p99": 0.1})
    c = commands(Config(weights="gguf"), ctx, None, goodput_rate=1.5)
    assert "--gguf-weights native" in c["serve"] and "--dtype bfloat16" in c["serve"]
    # with an SLO, bench runs the engine's own flags in its process, at the rate, judged per request;
    # the served line replays the same against the serve line's endpoint
    assert "--url" not in c["bench"] and "--gguf-weights native" in c["bench"]
    for line in (c["bench"], c["bench_served"]):
        assert "--request-rate 1.5" in line and "--slo tpot=100ms,ttft=2s" in line
    assert "--url" in c["bench_served"] and "--gguf-weights" not in c["bench_served"]
    c = commands(Config(weights="int4-awq"), ctx, None)
    assert c["prepare"] and c["prepare"][0].startswith("mixserve quantize --model m.gguf --method awq")
    assert "--gguf-weights dequantize" in c["serve"]
    c = commands(Config(weights="int4-rtn", speculation=("auto", 8)), replace(ctx, slo={}), Drafter("ngram", 0.5, 0.0))
    assert "--quantization rtn" in c["serve"] and "--draft-model ngram --num-speculative-tokens 8 --speculation auto" \
        in c["serve"] and c["bench"].startswith("mixserve bench --model")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    from tests.unit.test_engine_tiny import make_tiny_smol

    return make_tiny_smol(tmp_path_factory.mktemp("sg") / "tiny-suggest", smollm2_path, max_positions=1024)


def suggest_on_tiny(tiny, tmp_path, *extra) -> int:
    """`plan --suggest --json` on the tiny model: a made-up profile of its shapes, six short requests."""
    from mixserve.models.config import ModelConfig

    prof = tmp_path / "hw.json"
    prof.write_text(json.dumps({**profile(0.5, ModelConfig.from_folder(tiny)), "dtype": "float32"}))
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_tokens": 20 + 3 * i, "max_tokens": 6}) + "\n" for i in range(6)))
    return main(["plan", "--suggest", "--json", "--trace", str(trace), "--model", tiny, "--hardware", str(prof),
                 "--kv-cache-memory", "16MiB", *extra])


def test_suggest_cli_prints_commands_the_engine_runs(tiny, tmp_path, capsys):
    rc = suggest_on_tiny(tiny, tmp_path, "--spec-alpha", "0.5")
    out = capsys.readouterr()
    assert rc == 0, out.err
    doc = json.loads(out.out)  # one JSON document on stdout, the logs on stderr
    best = doc["best"]
    for k in ("throughput_output_tokens_per_s", "ttft_s", "tpot_s"):
        assert k in best["predicted"]
    assert doc["default"]["serve_command"] and isinstance(doc["runners_up"], list)
    assert "--kv-cache-memory 16MiB" in best["serve_command"]
    # every flag of the serve line is the engine's: parsed by the CLI, accepted by EngineArgs
    argv = shlex.split(best["serve_command"])
    assert argv[:2] == ["mixserve", "serve"]
    a = build_parser().parse_args(argv[1:])
    ea = engine_args(a)
    assert ea.max_num_seqs == best["config"]["max_num_seqs"]
    assert ea.max_num_batched_tokens == best["config"]["max_num_batched_tokens"]
    # ... and the bench line runs (offline: no SLO given) on the tiny model
    bench = shlex.split(best["bench_command"])
    assert bench[:2] == ["mixserve", "bench"] and "--url" not in bench
    rc = main(bench[1:] + ["--output", str(tmp_path / "bench.json"), "--kernels", "eager"])
    assert rc == 0
    rep = json.loads((tmp_path / "bench.json").read_text())
    assert rep["output_tokens_per_s"] > 0


def test_with_an_slo_the_bench_line_runs_in_process_at_the_rate(tiny, tmp_path, capsys):
    """With an SLO the printed bench line runs the engine in its own process, the requests arriving
    at the predicted goodput rate, and reports goodput; it was an online line only, so a prediction
    made for the engine alone was checked against a server sharing its cores with the client."""
    rc = suggest_on_tiny(tiny, tmp_path, "--slo", "ttft_p90=30s,tpot_p90=5s")
    out = capsys.readouterr()
    assert rc == 0, out.err
    best = json.loads(out.out)["best"]
    rate = best["predicted"]["goodput_requests_per_s"]
    bench = shlex.split(best["bench_command"])
    assert "--url" not in bench and bench[bench.index("--request-rate") + 1] == f"{rate:.4g}"
    assert "--url" in best["bench_served_command"]
    rc = main(bench[1:] + ["--output", str(tmp_path / "bench.json"), "--kernels", "eager"])
    assert rc == 0
    rep = json.loads((tmp_path / "bench.json").read_text())
    assert rep["config"]["arrivals"] == "rate" and rep["config"]["request_rate"] == float(f"{rate:.4g}")
    assert rep["good_requests"] == 6 and rep["slo"] == {"ttft": 30.0, "tpot": 5.0}
    # the requests came on the rate's times: the run lasts at least until the last arrival
    from mixserve.bench.arrivals import arrival_offsets
    assert rep["duration_s"] >= arrival_offsets(6, float(f"{rate:.4g}"), 1.0, 0)[-1]


def test_bench_refuses_what_does_not_apply_in_process(tiny, capsys):
    for extra, what in ((["--max-concurrency", "2"], "max_concurrency"), (["--request-rate", "0"], "request_rate"),
                        (["--slo", "ttft=fast"], "slo"), (["--compare-allocators", "--request-rate", "2"],
                                                          "compare_allocators")):
        rc = main(["bench", "--model", tiny, "--dataset", "humaneval", "--num-prompts", "2"] + extra)
        assert rc == 2 and what in capsys.readouterr().err, extra
    for extra, what in ((["--compare-allocators", "--request-rate", "Inf", "--slo", "ttft=1s"], "compare_allocators"),
                        (["--url", "http://127.0.0.1:9", "--conversations-at-once", "2"], "conversations_at_once"),
                        (["--url", "http://127.0.0.1:9", "--request-rate", "2", "--burstiness", "inf"], "burstiness")):
        rc = main(["bench", "--model", tiny, "--dataset", "humaneval", "--num-prompts", "2"] + extra)
        assert rc == 2 and what in capsys.readouterr().err, extra


def test_suggest_flags_are_checked(tiny, tmp_path, capsys):
    rc = main(["plan", "--json", "--trace", "x.jsonl", "--model", tiny, "--hardware", "h200"])
    assert rc == 2 and "only with --suggest" in capsys.readouterr().err
    rc = main(["plan", "--suggest", "--max-ppl-increase", "-1", "--trace", "x.jsonl", "--model", tiny,
               "--hardware", "h200"])
    assert rc == 2 and "max_ppl_increase" in capsys.readouterr().err


def test_hw_probe_of_a_gguf_model_predicts_its_native_steps_from_the_gguf_tables(tmp_path):
    """`hw probe` on a GGUF model (native by default) crashed reading the embedding's `.weight`, and
    predicted the native engine's steps from the bf16 tables (issue 34: a 1-row step "took 25.5 ms,
    but the matmul and attention timings add up to 50.9 ms")."""
    from mixserve.plan.hardware import engine_format, probe
    from tests.unit.test_gguf_native import write_tiny_gguf

    from mixserve.models.registry import resolve_model
    from mixserve.plan.cost_model import default_format
    from mixserve.plan.hardware import default_probe_formats

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    r = resolve_model(str(path))
    if default_format(r).name != "gguf":
        pytest.skip("this CPU dequantizes a GGUF by default (no native kernel): the probe then times bf16 steps")
    # unless told, the probe times the format the engine runs by default: a GGUF natively (it timed
    # bf16 and int4 only, and its engine steps ran the dequantized copy `serve` does not start)
    assert default_probe_formats(r, "cpu") == ("bf16", "int4", "gguf")
    assert default_probe_formats(r, "cuda") == ("bf16", "int4")
    prof = probe(str(path), rows=[1, 2, 4], repeats=1, max_context=64, log=lambda m: None)
    assert set(prof["linear"]) == {"bf16", "int4", "gguf"}
    assert prof["overhead"]["format"] == "gguf"
    # prefill attention on its (queries, cached prefix) grid, within the probed context
    g = prof["attention"]["span"]["grid"]
    assert g["queries"] == [4, 16, 64] and g["prefix"] == [0, 32] and all(c <= 64 for r in g["context"] for c in r)
    # attention timed as the invariant engine runs it: every row, prefill ones too, on the paged kernel
    assert prof["attention"]["invariant"] is True and prof["attention"]["decode"]["kernel"].startswith("paged")
    assert {p["seqs"] for p in prof["overhead"]["points"]} >= {1, 64}
    from mixserve.plan.hardware import engine_fingerprint, overhead_engine

    assert prof["engine_fingerprint"] == engine_fingerprint()  # what the timings hold for

    eng = overhead_engine(str(path), torch.float32, gguf_weights="dequantize", context=256)
    assert engine_format(eng.model, str(path)).name == "bf16"


def test_break_it_findings():
    """A helper's break-it round on --suggest (issue 34)."""
    # the SLO is the whole trace's answer: a search sample of short requests met it, the long rest does not
    trace = [SimRequest(10, 8, 0.0, "s")] * 4 + [SimRequest(3000, 8, 0.0, "l")] * 20
    sm = MeasuredModel(CFG, profile(0.5))
    fmts, why = available_formats(sm, "hf", None)
    ps = PlanSettings(slo=parse_slo("ttft_p90=1s"), kv_bytes=1 << 30, bisect_iters=4)
    res = Suggester(CFG, sm, {}, trace, ps, fmts, exclusions=why, search_requests=4).run()
    assert not res.slo_met and res.verdict.startswith("no configuration meets the SLO")
    # no request fits: an error, not an answer about nothing
    with pytest.raises(ValueError, match="none of the"):
        Suggester(CFG, sm, {}, reqs(), replace(ps, max_model_len=8), fmts, search_requests=None).run()
    # a KV budget under one block: the engine would not start, so no command is printed for it
    with pytest.raises(ValueError, match="hold no KV block"):
        Suggester(CFG, sm, {}, reqs(), replace(ps, kv_bytes=1024), fmts)
    # a NaN perplexity change is not under any floor
    nan = {"code": {"delta": float("nan"), "ci95": [0.0, 0.1], "significant": False}}
    fmts, why = available_formats(sm, "hf", None, quality={"int4-rtn": nan, "int4-awq": nan}, floor=0.3)
    assert set(fmts) == {"bf16"} and "code" in why["int4-rtn"]
    # an AWQ folder made from a path with a space: prepare writes what serve reads
    c = commands(Config(weights="int4-awq"), CommandContext(model="/data/my model", trace="t.jsonl"), None)
    out = shlex.split(c["prepare"][0])[-1]
    assert out == "awq-data_my_model" and shlex.split(c["serve"])[shlex.split(c["serve"]).index("--model") + 1] == out


def test_a_setting_pruned_in_the_search_is_set_back_where_it_does_not_pay():
    """The memo answered simplify (no floor) with a figure pruned during the search (goodput 0 at a
    floor 3% over the incumbent), so a move that no longer mattered stayed: ShareGPT with
    tpot_p90=50ms on the 0.5B got "prefix caching off, allocator contiguous, max-num-seqs 4" where
    max-num-seqs 4 alone scores the same. And simplify made one pass in the dimensions' order, so
    prefix caching, held off by the contiguous allocator, was not tried again once the allocator
    was set back."""
    s = suggester(profile(1.0), slo="ttft_p90=100s,tpot_p90=100s")
    c = s.normalized(replace(s.default, allocator="contiguous"))
    assert s.evaluate(c, floor_rate=1e9)["pruned"]
    e = s.evaluate(c)
    assert not e.get("pruned") and e["goodput_requests_per_s"] > 0
    assert s.evaluate(c, floor_rate=1e9) is e  # the whole figure then answers any floor
    # every setting ties with the default's under so loose an SLO: all set back
    found = s.normalized(replace(s.default, allocator="contiguous", max_num_seqs=4))
    s = suggester(profile(1.0), slo="ttft_p90=100s,tpot_p90=100s")
    s.evaluate(replace(found, allocator="paged"), floor_rate=1e9)  # pruned in the search
    assert s.simplify(found) == s.default


def test_simplify_holds_each_step_to_the_searchs_figure():
    """Each set-back was held to 99% of the configuration before it, so small losses compounded (a
    break-it round: 100 -> 96.4 over four settings)."""
    s = suggester(profile(1.0))
    dims = ("max_num_seqs", "max_num_batched_tokens", "prefix_caching")
    found = replace(s.default, max_num_seqs=4, max_num_batched_tokens=256, prefix_caching=False)

    def fake(c, final=False, floor_rate=None):  # each setting set back loses 0.8%
        moved = sum(getattr(c, d) != getattr(s.default, d) for d in dims)
        return {"fits": True, "throughput_output_tokens_per_s": 100 * 0.992 ** (3 - moved), "config": c}

    s.evaluate = fake
    out = s.simplify(found)
    assert sum(getattr(out, d) != getattr(s.default, d) for d in dims) == 2  # one back (99.2), not two (98.4)


def test_slo_durations_are_printed_as_bench_reads_them():
    from mixserve.bench.online import parse_slo as bench_slo
    from mixserve.plan.suggest.commands import _dur

    for v in (1e6, 2.0, 0.05, 1e-9, 0.1234567):
        assert abs(bench_slo(f"ttft={_dur(v)}")["ttft"] - v) <= 1e-6 * v, _dur(v)


def test_a_profile_timed_on_other_engine_code_is_said_stale(tiny, tmp_path, capsys):
    """A profile's timings hold for the engine code that was timed: one from other code (or from before
    profiles named theirs) gets a note in --suggest's answer that says to probe again; one from this
    code gets none."""
    from mixserve.models.config import ModelConfig
    from mixserve.plan.hardware import engine_fingerprint, load_step_model

    cfg = ModelConfig.from_folder(tiny)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_tokens": 20 + 3 * i, "max_tokens": 6}) + "\n" for i in range(6)))
    notes = {}
    for name, fp in (("old", None), ("other", "0123456789ab"), ("this", engine_fingerprint())):
        prof = tmp_path / f"{name}.json"
        doc = {**profile(0.5, cfg), "dtype": "float32", "engine_fingerprint": fp}
        if fp is None:
            del doc["engine_fingerprint"]
        prof.write_text(json.dumps(doc))
        rc = main(["plan", "--suggest", "--json", "--trace", str(trace), "--model", tiny, "--hardware", str(prof),
                   "--kv-cache-memory", "16MiB"])
        out = capsys.readouterr()
        assert rc == 0, out.err
        notes[name] = [n for n in json.loads(out.out)["notes"] if "hw probe again" in n or "`mixserve hw probe`" in n]
        _, hw = load_step_model(str(prof), cfg)
        assert bool(notes[name]) == (name != "this") == any("may have changed" in w for w in hw["warnings"])
    assert "0123456789ab" in notes["other"][0] and engine_fingerprint() in notes["other"][0]


def test_the_engine_fingerprint_follows_the_engines_code_only(tmp_path, monkeypatch):
    """Any module the engine runs counts (quant/, host_memory.py, not only engine/ and layers/); the
    server, the benchmarks and the planner do not; a hand-edited profile's string of warnings stays one."""
    import shutil
    from pathlib import Path

    import mixserve
    from mixserve.plan.hardware import _profile_warnings, engine_fingerprint

    src = tmp_path / "mixserve"  # a copy of the package to edit
    shutil.copytree(Path(mixserve.__file__).parent, src, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(mixserve, "__file__", str(src / "__init__.py"))
    base = engine_fingerprint()
    for rel, changes in (("server/api.py", False), ("plan/planner.py", False), ("quant/loading.py", True),
                         ("host_memory.py", True), ("layers/linear.py", True)):
        f = src / rel
        old = f.read_bytes()
        f.write_bytes(old + b"\n# edited\n")
        assert (engine_fingerprint() != base) == changes, rel
        f.write_bytes(old)
    assert engine_fingerprint() == base
    assert _profile_warnings({"warnings": "disturbed probe"}) == ["disturbed probe"]


def test_benchmarks_plan_the_engines_default_format(tmp_path, tiny, monkeypatch):
    """A GGUF model runs natively by default, so a prediction of the default engine plans its tensors as
    stored; an HF folder runs bf16."""
    from mixserve.models.registry import resolve_model
    from mixserve.plan.cost_model import BF16, default_format
    from tests.unit.test_gguf_native import write_tiny_gguf

    from mixserve.models.loader import use_native_gguf

    g = default_format(resolve_model(str(write_tiny_gguf(tmp_path / "tiny.gguf"))))
    if use_native_gguf(None, None):  # this CPU loads a GGUF natively by default (AVX512-VNNI or AVX2)
        assert g.name == "gguf" and g.label  # its tensors as stored (the label names their types)
    else:  # dequantized by default (no AVX2, FMA and F16C, or no C++ compiler)
        assert g == BF16
    assert default_format(resolve_model(tiny)) == BF16
    monkeypatch.setenv("MIXSERVE_ISA", "avx2")  # the AVX2-only kind runs a GGUF natively too (issue 43)
    assert default_format(resolve_model(str(tmp_path / "tiny.gguf"))).name == g.name


def test_a_bench_report_is_strict_json_when_a_figure_is_undefined(tiny, tmp_path):
    """One-token outputs have no TPOT: the report wrote a bare NaN, which RFC 8259 JSON readers
    (jq, JavaScript) reject; undefined figures are now null, and the table prints them as "-"."""
    from mixserve.bench.metrics import format_table

    out = tmp_path / "one.json"
    rc = main(["bench", "--model", tiny, "--dataset", "humaneval", "--num-prompts", "2", "--output-len-cap", "1",
               "--output", str(out), "--kernels", "eager"])
    assert rc == 0
    text = out.read_text()

    def no_constant(name):
        raise ValueError(f"{name} in a bench report")

    rep = json.loads(text, parse_constant=no_constant)
    assert rep["tpot_s"]["mean"] is None and rep["tpot_s"]["count"] == 0, rep["tpot_s"]
    assert rep["ttft_s"]["mean"] is not None and rep["num_requests"] == 2
    assert "TPOT" in format_table(rep)  # a report read back prints (null as "-")
