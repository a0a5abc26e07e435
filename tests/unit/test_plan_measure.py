"""plan --measure: speculative acceptance and draft cost measured on a trace sample with the real
engine (tiny random models made in the test), and AWQ quality read from an eval-ppl report."""
import json

import pytest

from mixserve.data.datasets import BenchRequest
from mixserve.plan.measure import load_quality, measure_speculation, sample_trace
from tests.unit.test_engine_tiny import make_tiny, prompts


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("pm")
    target, _ = make_tiny(d / "t", "qwen2", tie=False)
    draft, _ = make_tiny(d / "d", "qwen2", tie=True)
    return target, draft


def reqs(n=4, max_tokens=24):
    return [BenchRequest(p, max_tokens, len(p), "t") for p in prompts(n, seed=7, lo=8, hi=20)]


def test_sample_trace_is_seeded_in_order_and_capped():
    r = list(range(50))
    a, b = sample_trace(r, 8, seed=3), sample_trace(r, 8, seed=3)
    assert a == b and a == sorted(a) and len(set(a)) == 8
    assert sample_trace(r, 8, seed=4) != a
    assert sample_trace(r[:5], 8) == r[:5]
    with pytest.raises(ValueError, match="measure_requests"):
        sample_trace(r, 0)


def test_self_draft_measures_alpha_one(pair):
    target, _ = pair
    m = measure_speculation(target, reqs(), draft_model=target, k=3, max_tokens=16, dtype="float32",
                            kv_cache_memory="8MiB")
    # a draft identical to the target is always accepted (greedy)
    assert m["alpha"] == 1.0 and m["accepted"] == m["evaluated"] > 0
    assert m["output_tokens"] == 4 * 16  # each request cut to max_tokens
    assert m["draft_cost"] > 0  # a real forward pass, timed by the engine


def test_other_draft_measures_partial_acceptance(pair):
    target, draft = pair
    m = measure_speculation(target, reqs(), draft_model=draft, k=3, max_tokens=16, dtype="float32",
                            kv_cache_memory="8MiB")
    assert 0 <= m["alpha"] < 1 and m["evaluated"] > 0
    assert m["accepted"] == round(m["alpha"] * m["evaluated"])


def test_measure_refuses_k0(pair):
    with pytest.raises(ValueError, match="k >= 1"):
        measure_speculation(pair[0], reqs(), draft_model="ngram", k=0)


def test_load_quality(tmp_path):
    rep = {"slices": {"code": {"ppl": 5.1}, "chat": {"ppl": 9.0}},
           "vs_baseline": {"code": {"delta": 0.2, "ci95": [0.1, 0.3], "significant": True},
                           "chat": {"delta": 0.1, "ci95": [-0.1, 0.3], "significant": False}}}
    p = tmp_path / "q.json"
    p.write_text(json.dumps(rep))
    q = load_quality(p)
    assert q["code"] == {"ppl": 5.1, "delta": 0.2, "ci95": [0.1, 0.3], "significant": True}
    assert not q["chat"]["significant"]
    del rep["vs_baseline"]
    p.write_text(json.dumps(rep))
    with pytest.raises(ValueError, match="no comparison with a baseline"):
        load_quality(p)
    for bad in ({"slices": {"c": {"ppl": 3.1}}, "vs_baseline": {"c": {"delta": 0.1}}},
                {"slices": {"c": 3.1}, "vs_baseline": {"c": {"delta": 0.1, "ci95": [0, 1], "significant": True}}}):
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="not an eval-ppl comparison"):
            load_quality(p)
    p.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_quality(p)
    with pytest.raises(ValueError, match="cannot read"):
        load_quality(tmp_path / "missing.json")


def test_plan_table_says_what_was_measured_and_given():
    from mixserve.plan.planner import PlanSettings, make_plan
    from mixserve.plan.report import format_table
    from mixserve.plan.simulator import SimRequest, SpecSettings
    from mixserve.plan.step_time import MeasuredModel
    from tests.unit.test_plan_planner import CFG, fake_profile

    trace = [SimRequest(100, 20)] * 4
    plan, _ = make_plan(CFG, MeasuredModel(CFG, fake_profile()), {"kind": "measured", "label": "measured here",
                                                                 "model": "fake"},
                        trace, PlanSettings(kv_bytes=32 << 20, max_model_len=2048, slo={}), SpecSettings(0.5, 3),
                        log=lambda m: None)
    text = format_table(plan)
    assert "alpha 0.5 and draft cost c 0 (0: prompt lookup, no draft model) as given, not measured" in text
    assert "AWQ quality: not given" in text
    plan["spec_measured"] = {"requests": 8, "draft_model": "ngram", "k": 4, "temperature": 0.0, "alpha": 0.42,
                             "accepted": 42, "evaluated": 100, "draft_cost": 0.0}
    plan["awq_quality"] = {"code": {"ppl": 5.1, "delta": 0.2, "ci95": [0.1, 0.3], "significant": True}}
    text = format_table(plan)
    assert "measured on 8 requests of this trace (ngram, k=4, temperature 0): alpha 0.420 (42/100" in text
    assert "  code  ppl    5.100    +0.200 [+0.100, +0.300] *" in text
