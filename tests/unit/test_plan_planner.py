"""Step-time models, the profile format and the planner on small made-up inputs."""
import json

import numpy as np
import pytest

from mixserve.models.config import ModelConfig
from mixserve.plan.cost_model import BF16, INT4, linear_shapes
from mixserve.plan.hardware import fit_nonneg, load_step_model
from mixserve.plan.planner import PlanSettings, Planner, Variant, binding, make_plan, parse_slo, plan_replicas
from mixserve.plan.report import format_table, write_report
from mixserve.plan.simulator import SimRequest, SpecSettings
from mixserve.plan.step_time import ACCELERATORS, MeasuredModel, RooflineModel, StepBatch

CFG = ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                  num_heads=14, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                  max_position_embeddings=32768, tie_word_embeddings=True, attention_bias=True)


def fake_profile(cfg=CFG):
    """Every linear 1 ms at 1-16 rows, growing to 4 ms at 64; int4 half of that at 1-16 rows.
    Attention 10 us + 1 ns per context token per layer; overhead 2 ms + 0.1 ms per sequence."""
    lin = {}
    for fmt, f in (("bf16", 1.0), ("int4", 0.5)):
        lin[fmt] = {s.name: {"rows": [1, 16, 64], "seconds": [1e-3 * f, 1e-3 * f, 4e-3],
                             "out_features": s.out_features, "in_features": s.in_features}
                    for s in linear_shapes(cfg)}
    from mixserve.plan.hardware import engine_fingerprint

    return {"kind": "measured", "model": "fake", "config": cfg.as_dict(), "linear": lin,
            "bandwidth_bytes_per_s": 20e9, "engine_fingerprint": engine_fingerprint(),  # timed "on this code"
            "attention": {"decode": {"fit": [10e-6, 0.0, 1e-9]}, "span": {"fit": [10e-6, 0.0, 1e-9]}},
            "overhead": {"fit": [2e-3, 1e-4, 0.0]}}


def test_measured_step_time_by_hand():
    sm = MeasuredModel(CFG, fake_profile())
    # 4 decode rows at context 100: linears 24 layers * 4 shapes * 1 ms = 96 ms; LM head (4 rows)
    # 1 ms; attention: one call over 4 rows padded to 7 blocks of 16 = 112 slots,
    # 24 * (10 us + 4 * 112 ns) = 250.75 us; overhead 2 ms + 4 * 0.1 ms = 2.4 ms
    t = sm.step_time(StepBatch([100] * 4, [], 4), BF16)
    assert t == pytest.approx(0.096 + 0.001 + 24 * 10.448e-6 + 0.0024)
    # int4: body linears halve (48 ms); the LM head stays bf16 (1 ms)
    t4 = sm.step_time(StepBatch([100] * 4, [], 4), INT4)
    assert t4 == pytest.approx(0.048 + 0.001 + 24 * 10.448e-6 + 0.0024)
    # 40 rows interpolate halfway between 16 (1 ms) and 64 (4 ms): 2.5 ms per linear
    assert sm.linear_time("qkv", 40, BF16) == pytest.approx(2.5e-3)


def test_roofline_decode_is_bandwidth_bound_prefill_compute_bound():
    sm = RooflineModel(CFG, ACCELERATORS["h100-sxm"])
    assert sm.bound("gate_up", 1) == "bandwidth"
    assert sm.bound("gate_up", 4096) == "compute"
    # one row of gate_up [9728 x 896]: 17,432,576 bytes / 3.35e12 B/s (+ activations) ~ 5.2 us
    t = sm.linear_time("gate_up", 1, BF16)
    assert t == pytest.approx((2 * 9728 * 896 + 2 * (896 + 9728)) / 3.35e12)


def test_fit_nonneg_drops_negative_terms():
    X = np.array([[1.0, 1], [1, 2], [1, 3]])
    y = np.array([3.0, 2.0, 1.0])  # decreasing: the slope would be negative
    c = fit_nonneg(X, y)
    assert c[1] == 0.0 and c[0] == pytest.approx(2.0)


def test_load_step_model(tmp_path):
    sm, hw = load_step_model("h200", CFG)
    assert hw["label"] == "datasheet, not measured here" and isinstance(sm, RooflineModel)
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(fake_profile()))
    sm, hw = load_step_model(str(p), CFG)
    assert isinstance(sm, MeasuredModel)
    other = ModelConfig(**{**CFG.as_dict(), "num_layers": 2})
    with pytest.raises(ValueError, match="hw probe"):
        load_step_model(str(p), other)
    with pytest.raises(ValueError, match="hardware"):
        load_step_model("tpu-v9", CFG)
    # damaged profiles are errors naming --hardware, not a KeyError traceback from MeasuredModel
    broken = {"no linear": {**fake_profile(), "linear": None}, "no attention": {"config": CFG.as_dict()},
              "list": [fake_profile()], "newer": {**fake_profile(), "version": 99}}
    for what, prof in broken.items():
        p.write_text(json.dumps(prof))
        with pytest.raises(ValueError, match="hardware: .*prof.json"):
            load_step_model(str(p), CFG)
    p.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match="hardware: .*prof.json is not a `mixserve hw probe` profile"):
        load_step_model(str(p), CFG)


def test_parse_slo():
    assert parse_slo("ttft_p99=2s, tpot_p50=150ms") == {"ttft_p99": 2.0, "tpot_p50": 0.15}
    with pytest.raises(ValueError, match="slo"):
        parse_slo("latency=3")
    with pytest.raises(ValueError, match="slo: 'ttft_p99=0ms' must be a time > 0"):
        parse_slo("ttft_p99=0ms,tpot_p99=1s")
    with pytest.raises(ValueError, match="slo: ttft_p99 given twice"):
        parse_slo("ttft_p99=2s,ttft_p99=1s")


def trace(n=40):
    rng = np.random.default_rng(0)
    return [SimRequest(int(rng.integers(20, 300)), int(rng.integers(10, 120))) for _ in range(n)]


def test_max_rate_meets_slo_and_twice_it_does_not():
    sm = MeasuredModel(CFG, fake_profile())
    ps = PlanSettings(kv_bytes=64 << 20, slo=parse_slo("ttft_p99=3s,tpot_p99=300ms"), bisect_iters=8)
    pl = Planner(CFG, sm, {"kind": "measured"}, trace(), ps)
    v = Variant("base")
    off = pl.run(v)
    mr = pl.max_rate(v, off)
    assert mr["limit"] == "slo" and 0 < mr["rate"] < off.report["requests_per_s"]
    assert pl.meets_slo(pl.run(v, mr["rate"]))
    assert not pl.meets_slo(pl.run(v, 2 * mr["rate"]))


def test_lax_slo_is_capped_at_capacity():
    # a short trace meets any lax SLO at any rate; the engine's offline rate caps it
    sm = MeasuredModel(CFG, fake_profile())
    pl = Planner(CFG, sm, {"kind": "measured"}, trace(10), PlanSettings(kv_bytes=64 << 20,
                                                                        slo=parse_slo("ttft_p99=1000s")))
    off = pl.run(Variant("base"))
    mr = pl.max_rate(Variant("base"), off)
    assert mr["limit"] == "capacity" and mr["rate"] == off.report["requests_per_s"]


def test_plan_end_to_end(tmp_path):
    sm = MeasuredModel(CFG, fake_profile())
    ps = PlanSettings(kv_bytes=32 << 20, max_model_len=2048, slo=parse_slo("ttft_p99=3s,tpot_p99=300ms"),
                      bisect_iters=5)
    plan, evals = make_plan(CFG, sm, {"kind": "measured", "label": "measured here", "model": "fake",
                                      "bandwidth_bytes_per_s": 20e9}, trace(), ps,
                            SpecSettings(0.7, 3), log=lambda m: None)
    by = {r["optimization"]: r for r in plan["ranking"]}
    # 32 MiB = 2730 tokens: a max-model-len reservation of 2048 tokens fits one sequence at a time
    paging = by["paging (vs contiguous, reserve max-model-len)"]
    assert paging["throughput_x"] > 2
    assert plan["variants"]["contiguous, reserve max-model-len"]["offline"]["extra"]["peak_running_seqs"] == 1
    # int4 linears are twice as fast at <= 16 rows: a lone stream speeds up
    awq = next(r for r in plan["ranking"] if r["optimization"].startswith("AWQ"))
    assert awq["single_stream_x"] > 1.5
    assert plan["binding"]["decode"]["bound"] in ("compute", "bandwidth", "overhead")
    assert "max rate" in format_table(plan)
    paths = write_report(plan, evals, tmp_path / "r")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["ranking"]


def test_binding_roofline():
    sm = RooflineModel(CFG, ACCELERATORS["a100-80gb"])
    d = binding(CFG, sm, {}, StepBatch([512], [], 1))
    p = binding(CFG, sm, {}, StepBatch([], [(2048, 2048)], 1))
    assert d["bound"] == "bandwidth" and p["bound"] == "compute"


def test_capacity_is_measured_with_every_request_at_t0_even_when_the_trace_has_arrivals():
    ps = PlanSettings(kv_bytes=64 << 20, slo={})
    reqs = [SimRequest(100, 20, 0.0, "a") for _ in range(6)]
    late = [SimRequest(100, 20, 30.0 * i, "a") for i in range(6)]  # one request every 30 s
    sm = MeasuredModel(CFG, fake_profile())
    at0 = Planner(CFG, sm, {}, reqs, ps).evaluate(Variant("base"), find_rate=False)
    spread = Planner(CFG, sm, {}, late, ps).evaluate(Variant("base"), find_rate=False)
    assert spread["offline"]["output_tokens_per_s"] == pytest.approx(at0["offline"]["output_tokens_per_s"])
    # the replayed arrivals are reported beside it, and are far slower (the trace spans 150 s)
    assert spread["trace_arrivals"]["duration_s"] > 150
    assert "trace_arrivals" not in at0
    plan, _ = make_plan(CFG, sm, {"kind": "measured", "label": "measured here", "model": "fake"}, late, ps,
                        SpecSettings(0.7, 3), log=lambda m: None)
    assert "arrival times replayed" in format_table(plan)


def test_probe_retimes_points_that_are_slower_than_more_rows():
    import time

    import torch

    from mixserve.plan.hardware import _recheck

    def timer(fn):  # the probe's timers take (x, passes) and return seconds per call
        def t(x, passes):
            t0 = time.perf_counter()
            fn(x)
            return time.perf_counter() - t0
        return t

    ts = [1.0, 1e-3, 1e-3]  # rows 1 was disturbed: 1 s against 1 ms at rows 2
    assert _recheck(timer(lambda x: x.sum()), [1, 2, 4], ts, 8, torch.float32, 3) == []
    assert ts[0] < 2e-3 and ts[1:] == [1e-3, 1e-3]
    ts = [1.3e-3, 1e-3]  # 1.3x the next one: re-timed too (the outlier that once moved the overhead fit)
    assert _recheck(timer(lambda x: x.sum()), [1, 2], ts, 8, torch.float32, 3) == [] and ts[0] < 1e-3
    ts = [1.0, 1e-4]  # a call that really takes 10 ms stays out of order, and is reported
    assert _recheck(timer(lambda x: time.sleep(0.01)), [1, 2], ts, 8, torch.float32, 2) == [1]


def test_plan_requests_that_never_fit():
    # CFG keeps 12 KiB of KV a token: 2 MiB = 170 tokens, less than one max-model-len region
    sm = MeasuredModel(CFG, fake_profile())
    hw = {"kind": "measured", "label": "measured here", "model": "fake", "bandwidth_bytes_per_s": 20e9}
    reqs = [SimRequest(20, 10), SimRequest(30, 20), SimRequest(4000, 200)]
    ps = PlanSettings(kv_bytes=2 << 20, max_model_len=4096, slo=parse_slo("ttft_p99=3s"), bisect_iters=3)
    logged = []
    # once: "simulator: nothing can be scheduled" (RuntimeError) from the contiguous max-model-len variant
    plan, _ = make_plan(CFG, sm, hw, reqs, ps, SpecSettings(0.7, 3), log=logged.append)
    assert plan["trace"]["rejected"] == 1 and any("1 of 3 requests never fit" in m for m in logged)
    contig = plan["variants"]["contiguous, reserve max-model-len"]
    assert contig["offline"]["extra"]["rejected"] == 3 and "max_rate" not in contig
    assert plan["variants"]["baseline (paged, bf16)"]["offline"]["num_requests"] == 2
    # once: NaN throughput and rates, then matplotlib's "Data cannot be log-scaled"
    with pytest.raises(ValueError, match="trace: none of the 1 requests fits: the shortest needs 4200 tokens"):
        make_plan(CFG, sm, hw, reqs[2:], ps, SpecSettings(0.7, 3), log=logged.append)


def test_decode_attention_is_charged_as_the_runner_groups_and_pads_it():
    from mixserve.plan.step_time import decode_groups

    # 8 rows at 100 and 8 at 10: after 8 rows the next (10) is under 0.7 * 100, so two calls,
    # padded to whole blocks of 16: 112 and 16 slots
    assert decode_groups([10] * 8 + [100] * 8, 16) == [(8, 112), (8, 16)]
    # fewer than 8 rows never split: the short row is padded to the long one
    assert decode_groups([100, 10], 16) == [(2, 112)]
    sm = MeasuredModel(CFG, fake_profile())  # 10 us per call + 1 ns per slot
    assert sm.decode_attention_time([100, 10]) == pytest.approx(10e-6 + 2 * 112e-9)
    assert sm.decode_attention_time([10] * 8 + [100] * 8) == pytest.approx(2 * 10e-6 + (8 * 112 + 8 * 16) * 1e-9)


def test_overhead_fit_takes_a_and_b_from_decode_steps_only():
    from mixserve.plan.hardware import fit_overhead

    # decode: 30 ms a step + 0.5 ms a sequence on top of the matmuls
    dec = [{"seqs": b, "tokens": b, "seconds": 0.05 + 0.030 + 0.0005 * b, "predicted_compute": 0.05}
           for b in (1, 4, 16, 64)]
    # prefills whose linear tables overpredict by 28 ms (a residual below zero) must not drag a or b
    pre = [{"seqs": 1, "tokens": 256, "seconds": 0.50, "predicted_compute": 0.528}]
    a, b, c = fit_overhead(dec, pre)
    assert a == pytest.approx(0.030) and b == pytest.approx(0.0005) and c == 0.0
    pre = [{"seqs": 1, "tokens": 100, "seconds": 0.2 + 0.0305 + 100e-5, "predicted_compute": 0.2}]
    assert fit_overhead(dec, pre)[2] == pytest.approx(1e-5)


def test_overhead_fit_weights_points_by_their_compute():
    """A 64-row step's residual carries the table error of a 3x larger compute: weighted by 1 /
    compute, a 12 ms error there leaves the 1-row intercept near its true 3 ms (plain least
    squares put it at 4.4 ms)."""
    from mixserve.plan.hardware import fit_overhead

    rows = (1, 2, 4, 8, 16, 32, 64)
    comp = {b: 0.045 * (1 + b / 32) for b in rows}
    dec = [{"seqs": b, "tokens": b, "seconds": comp[b] + 0.003 + 1e-4 * b - (0.012 if b == 64 else 0.0),
            "predicted_compute": comp[b]} for b in rows]
    a, b, _ = fit_overhead(dec, [])
    assert abs(a - 0.003) < 0.0006
    X = np.array([[1.0, r] for r in rows])
    y = np.array([p["seconds"] - p["predicted_compute"] for p in dec])
    assert abs(np.linalg.lstsq(X, y, rcond=None)[0][0] - 0.003) > 0.001  # what the weighting avoids


def test_decode_attention_grid():
    from mixserve.plan.step_time import Grid

    # per slot: 1 us at 1 row, 0.25 us at 4 rows (64 ctx); 0.5 us and 0.25 us at 256 ctx
    g = Grid([1, 4], [64, 256], [[64e-6, 128e-6], [64e-6, 256e-6]])
    assert g(1, 64) == pytest.approx(64e-6) and g(4, 256) == pytest.approx(256e-6)  # grid points exact
    assert g(2, 128) == pytest.approx((1e-6 + 0.5e-6 + 0.25e-6 + 0.25e-6) / 4 * 256)  # centre of the cell
    assert g(8, 512) == pytest.approx(0.25e-6 * 8 * 512)  # past the corner: edge per slot, proportional
    assert g(1, 16) == pytest.approx(64e-6)  # below the grid: the smallest call's time
    # a profile with a grid charges each decode group (rows, padded context) from it
    prof = fake_profile()
    prof["attention"]["decode"]["grid"] = {"rows": [1, 4], "context": [64, 256],
                                           "seconds": [[64e-6, 128e-6], [64e-6, 256e-6]]}
    sm = MeasuredModel(CFG, prof)
    assert sm.decode_attention_time([256] * 4) == pytest.approx(256e-6)
    with pytest.raises(ValueError, match="grid"):
        Grid([1, 4], [64], [[1.0]])


def test_span_attention_grid():
    """A prefill chunk's attention from the probe's (queries, cached prefix) grid: its cells exact;
    along the prefix linear in the cached tokens, past the last cell on that slope; across rows the
    time per query interpolated in log q, proportional to q below the smallest row, per query-key
    pair past the largest; never falling as the prefix grows (a break-it round found a 4-query span
    at prefix 64 put at 12x its time, between a prefix-0 cell of mostly fixed cost and prefix 256).
    A profile without the grid, or with one prefix only, keeps its fit; bad grids are refused."""
    from mixserve.plan.step_time import SpanGrid, _span_score_elements as pairs

    secs = [[4e-6, 36e-6], [20e-6, 400e-6]]
    g = SpanGrid([4, 16], [0, 256], secs)
    assert g(4, 4) == pytest.approx(4e-6) and g(16, 16 + 256) == pytest.approx(400e-6)  # cells exact
    assert g(4, 4 + 64) == pytest.approx(4e-6 + 32e-6 / 4)  # a quarter of the way along the prefix
    assert g(4, 4 + 512) == pytest.approx(36e-6 + 32e-6)  # past the last cell: on the last segment's slope
    assert g(8, 8) == pytest.approx((0.5 * 4e-6 / 4 + 0.5 * 20e-6 / 16) * 8)  # per query, halfway in log q
    assert g(2, 2 + 256) == pytest.approx(36e-6 / 2)  # below the smallest row: its time per query
    assert g(32, 32 + 256) == pytest.approx(400e-6 * pairs(32, 288) / pairs(16, 272))  # past the largest: per pair
    assert all(g(5, 5 + a) <= g(5, 5 + b) for a, b in [(0, 10), (10, 100), (100, 300), (300, 2000)])
    assert g(0, 10) == 0.0
    with pytest.raises(ValueError, match="finite"):
        g(float("nan"), 10)
    noisy = SpanGrid([4, 16], [0, 256], [[50e-6, 36e-6], [20e-6, 400e-6]])  # a disturbed prefix-0 cell
    assert noisy(4, 4) == pytest.approx(36e-6)  # lowered to the larger prefix's time
    cut = SpanGrid([4, 16], [0, 256], secs, contexts=[[4, 200], [16, 16]])  # 16 queries cut to prefix 0
    assert cut(4, 4 + 196) == pytest.approx(36e-6)  # the cell at the prefix it was timed at
    assert cut(16, 16 + 98) == pytest.approx(20e-6 + 32e-6 / 196 / 4 * 16 * 98)  # row 4's slope per query
    prof = fake_profile()
    old = MeasuredModel(CFG, prof).span_attention_time(16, 256)
    assert old == pytest.approx(10e-6 + 1e-9 * pairs(16, 256))  # the fit, without a grid
    prof["attention"]["span"]["grid"] = {"queries": [4, 16], "prefix": [0], "seconds": [[4e-6], [20e-6]]}
    assert MeasuredModel(CFG, prof).span_attention_time(16, 256) == pytest.approx(old)  # one prefix: the fit
    prof["attention"]["span"]["grid"] = {"queries": [4, 16], "prefix": [0, 256], "seconds": secs}
    assert MeasuredModel(CFG, prof).span_attention_time(16, 272) == pytest.approx(400e-6)
    with pytest.raises(ValueError, match="span grid"):
        SpanGrid([4, 16], [0], [[1e-6], [2e-6]])
    with pytest.raises(ValueError, match="span grid"):
        SpanGrid([4, 16], [0, 256], secs, contexts=[[2, 244], [16, 256]])


def test_a_self_contradicting_profile_is_flagged(tmp_path):
    # a probe on a busy machine: its tables add up to 1.6 s for a decode step measured at 61 ms
    prof = fake_profile()
    prof["overhead"]["points"] = [{"seqs": 1, "tokens": 1, "seconds": 0.061, "predicted_compute": 1.648},
                                  {"seqs": 8, "tokens": 8, "seconds": 0.07, "predicted_compute": 0.05},
                                  {"seqs": 1, "tokens": 256, "seconds": 0.5, "predicted_compute": 0.9}]
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(prof))
    _, hw = load_step_model(str(p), CFG)
    assert len(hw["warnings"]) == 1 and "decode step of 1 rows took 61.0 ms" in hw["warnings"][0]
    plan, _ = make_plan(CFG, MeasuredModel(CFG, prof), {**hw, "label": "measured here"}, trace()[:4],
                        PlanSettings(kv_bytes=32 << 20, max_model_len=2048, slo={}), SpecSettings(0.5, 3),
                        log=lambda m: None)
    assert "warning (hw probe): a decode step of 1 rows" in format_table(plan)
    p.write_text(json.dumps(fake_profile()))  # a consistent profile: no warning
    assert load_step_model(str(p), CFG)[1]["warnings"] == []


def test_speculation_gain_never_beats_tokens_per_step():
    # decode attention dear, span attention nearly free (a disturbed profile): a verification
    # step must still cost at least the plain decode step, so a lone stream gains at most E(k)
    prof = fake_profile()
    prof["attention"]["decode"] = {"fit": [5e-3, 0.0, 1e-6]}
    prof["attention"]["span"] = {"fit": [0.0, 0.0, 0.0]}
    sm = MeasuredModel(CFG, prof)
    pl = Planner(CFG, sm, {"kind": "measured"}, [SimRequest(200, 64)],
                 PlanSettings(kv_bytes=32 << 20, max_model_len=2048, slo={}))
    base = pl.run(Variant("b")).report["output_tokens_per_s"]
    spec = pl.run(Variant("s", spec=SpecSettings(0.6, 4, 0.0, "fixed"))).report["output_tokens_per_s"]
    assert 1.2 < spec / base <= (1 - 0.6 ** 5) / (1 - 0.6) + 1e-9


def test_linear_tables_are_made_monotone_and_bad_profiles_refused(tmp_path):
    from mixserve.plan.step_time import Table

    # a 1-row time above the 2-row one is a disturbed point: lowered, so more rows never cost less
    t = Table([1, 2, 4], [0.5e-3, 0.26e-3, 0.3e-3], monotone=True)
    assert t(1) == pytest.approx(0.26e-3) and t(2) == pytest.approx(0.26e-3) and t(4) == pytest.approx(0.3e-3)
    assert Table([1, 2], [0.5e-3, 0.26e-3])(1) == pytest.approx(0.5e-3)  # as measured without the flag
    p = tmp_path / "prof.json"
    bad = {"negative seconds": lambda pr: pr["linear"]["bf16"]["qkv"].update(seconds=[-1, 1, 1]),
           "no lm_head": lambda pr: pr["linear"]["bf16"].pop("lm_head"),
           "short fit": lambda pr: pr["overhead"].update(fit=[0.01]),
           "empty grid": lambda pr: pr["attention"]["decode"].update(grid={"rows": [], "context": [], "seconds": []}),
           "reversed grid": lambda pr: pr["attention"]["decode"].update(
               grid={"rows": [4, 1], "context": [64], "seconds": [[1e-3], [1e-4]]}),
           "block size 0": lambda pr: pr.update(block_size=0)}
    for what, edit in bad.items():
        prof = fake_profile()
        edit(prof)
        p.write_text(json.dumps(prof))
        with pytest.raises(ValueError, match="hardware: .*prof.json is not a complete"):
            load_step_model(str(p), CFG)


def test_bf16_only_profile_plans_without_awq():
    prof = fake_profile()
    del prof["linear"]["int4"]
    notes = []
    plan, _ = make_plan(CFG, MeasuredModel(CFG, prof), {"kind": "measured", "label": "measured here", "model": "f"},
                        trace()[:4], PlanSettings(kv_bytes=32 << 20, max_model_len=2048, slo={}),
                        SpecSettings(0.5, 3), log=notes.append)
    assert not any(r["optimization"].startswith("AWQ") for r in plan["ranking"])
    assert any("no int4 timings" in n for n in notes)
    with pytest.raises(ValueError, match="block_size"):
        PlanSettings(block_size=0)


def test_planned_block_size_pads_decode_groups(tmp_path):
    p = tmp_path / "prof.json"
    p.write_text(json.dumps(fake_profile()))
    small, _ = load_step_model(str(p), CFG)
    big, _ = load_step_model(str(p), CFG, block_size=256)
    # one row of 100 tokens: padded to 112 slots in blocks of 16, to 256 in blocks of 256
    assert small.decode_attention_time([100]) == pytest.approx(10e-6 + 112e-9)
    assert big.decode_attention_time([100]) == pytest.approx(10e-6 + 256e-9)


def test_plan_replicas_picks_the_fewest_that_meet_the_slo(tmp_path):
    sm = MeasuredModel(CFG, fake_profile())
    ps = PlanSettings(kv_bytes=64 << 20, slo=parse_slo("ttft_p99=3s,tpot_p99=300ms"), bisect_iters=5)
    pl = Planner(CFG, sm, {"kind": "measured"}, trace(), ps)
    one, _ = plan_replicas(pl, [1], log=lambda m: None)
    rate1 = one["rows"][0]["max_rate_per_s"]
    assert rate1 > 0 and one["needed"] is None  # no target: nothing picked
    # a target 1.5x one replica's max rate: one replica misses the SLO there, more replicas meet it
    out, evals = plan_replicas(pl, [1, 2, 4], target_rate=1.5 * rate1, log=lambda m: None)
    rows = {r["replicas"]: r for r in out["rows"]}
    assert not rows[1]["at_target"]["meets_slo"]
    assert rows[2]["at_target"]["meets_slo"] or rows[4]["at_target"]["meets_slo"]
    assert out["needed"] == min(n for n, r in rows.items() if r["at_target"]["meets_slo"])
    assert rows[2]["capacity_requests_per_s"] > 1.5 * rows[1]["capacity_requests_per_s"]
    assert rows[4]["max_rate_per_s"] > rows[1]["max_rate_per_s"]
    assert sum(rows[4]["requests_per_replica"]) == len(pl.reqs) and len(rows[4]["requests_per_replica"]) == 4
    with pytest.raises(ValueError, match="target_rate"):
        plan_replicas(pl, [1], target_rate=0.0)
    with pytest.raises(ValueError, match="target_rate"):
        plan_replicas(pl, [1], target_rate=float("inf"))
    # more replicas than requests measure nothing (and each holds a simulated KV cache)
    with pytest.raises(ValueError, match=f"{len(pl.reqs) + 1} replicas for a trace of {len(pl.reqs)} requests"):
        plan_replicas(pl, [1, len(pl.reqs) + 1], log=lambda m: None)
    # a trace too short to fill the replicas' batches says its figures are lower bounds
    assert all("lower bounds" in r["warning"] for r in out["rows"])  # len(trace) < n x 256


def test_plan_report_has_the_scale_out_section(tmp_path):
    sm = MeasuredModel(CFG, fake_profile())
    ps = PlanSettings(kv_bytes=32 << 20, max_model_len=2048, slo=parse_slo("ttft_p99=3s,tpot_p99=300ms"),
                      bisect_iters=3)
    plan, evals = make_plan(CFG, sm, {"kind": "measured", "label": "measured here", "model": "fake",
                                      "bandwidth_bytes_per_s": 20e9}, trace(20), ps, SpecSettings(0.7, 3),
                            log=lambda m: None, replicas=[1, 2], routing="pow2", target_rate=0.5)
    assert [r["replicas"] for r in plan["replicas"]["rows"]] == [1, 2] and plan["replicas"]["routing"] == "pow2"
    text = format_table(plan)
    assert "scale-out" in text and "replicas needed for 0.5 requests/s" in text
    paths = write_report(plan, evals, tmp_path / "r")
    assert (tmp_path / "r" / "replicas.png") in paths
    assert json.loads((tmp_path / "r" / "plan.json").read_text())["replicas"]["rows"][1]["replicas"] == 2
