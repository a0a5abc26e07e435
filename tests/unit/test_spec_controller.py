"""The k chooser: expected tokens per second from measured step costs (Leviathan et al. §3.4)."""
import pytest

from mixserve.spec_decode.controller import SpecController, StepCostTable, expected_tokens


def test_expected_tokens_formula():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_cost_table_interpolates():
    t = StepCostTable()
    assert t.estimate(3) is None
    t.record(1, 1.0)
    t.record(4, 2.0)
    assert t.estimate(1) == 1.0 and t.estimate(4) == 2.0
    assert t.estimate(2) == pytest.approx(1.0 + (2 - 1) / 3)  # 2 rows never measured: interpolated
    assert t.estimate(16) == pytest.approx(8.0)  # proportional above the largest measured
    assert StepCostTable.bucket(5) == 5 and StepCostTable.bucket(17) == 32


def flat_costs(c, k_max=4):
    ctl = SpecController("auto", k_max)
    for _ in range(3):
        for rows in range(1, 6):
            ctl.target.record(rows, 1.0)  # a few rows cost the same as one: bandwidth-bound decode
        ctl.draft.record(1, c)
    return ctl


def test_auto_speculates_when_it_pays_and_stops_when_not():
    ctl = flat_costs(c=0.3)
    assert ctl.choose([0.9], 0) == 4  # E(4)/(1+1.2) = 1.86 beats plain
    assert ctl.choose([0.05], 0) == 0  # hardly anything accepted: the draft is pure cost
    mid = ctl.choose([0.6], 0)
    rates = {k: expected_tokens(0.6, k) / (1 + 0.3 * k) for k in range(5)}
    assert mid == max(rates, key=rates.get)


def test_auto_explores_unmeasured_costs_first():
    ctl = SpecController("auto", 2)
    assert ctl.choose([0.5], 0) == 2  # nothing measured: try the largest k
    for _ in range(3):
        ctl.target.record(3, 1.0)
        ctl.draft.record(1, 0.3)
    assert ctl.choose([0.5], 0) == 1  # 2 rows (k = 1) not measured yet


def test_a_first_outlier_does_not_stick():
    # oneDNN builds a primitive on a shape's first use: that timing must not decide k for good
    t = StepCostTable()
    t.record(5, 0.6)
    assert not t.has(5)
    t.record(5, 0.13)
    t.record(5, 0.13)
    assert t.has(5) and t.estimate(5) == pytest.approx(0.13)


def test_auto_refreshes_a_neighbour_now_and_then():
    ctl = flat_costs(c=0.3)
    ks = [ctl.choose([0.9], 0) for _ in range(ctl.REFRESH_EVERY)]
    assert ks[:-1] == [4] * (ctl.REFRESH_EVERY - 1) and ks[-1] == 3


def test_fixed_and_off():
    assert SpecController("fixed", 3).choose([0.1], 0) == 3
    assert SpecController("off", 3).choose([0.9], 0) == 0
    with pytest.raises(ValueError, match="speculation"):
        SpecController("sometimes", 3)


def test_global_alpha_prior():
    ctl = SpecController("auto", 4)
    for _ in range(50):
        ctl.observe(4, 4)
    assert ctl.alpha_global > 0.9
    assert ctl.alpha_for(0, 0) == pytest.approx(ctl.alpha_global)
    assert ctl.alpha_for(0, 100) < 0.1


def test_positional_acceptance_tempers_large_k():
    ctl = flat_costs(c=0.1)
    assert ctl.choose([0.8], 0) == 4
    # the first proposal is nearly always accepted, the second nearly never
    for _ in range(300):
        ctl.observe(1, 2)
    f = ctl.position_factors()
    assert f[0] > 1.5 and f[1] < 0.2
    a = ctl.alpha_for(0, 0)
    assert ctl.expected(a, 2) < ctl.expected(a, 1) + 0.2
    assert ctl.choose([a], 0) == 1


def test_bucket_point_sits_at_the_rows_measured():
    # 160 rows fall in the 256 bucket; placed at 256, estimate(160) would come out at 32's cost plus
    # only 4/7 of the difference, and k = 4 at a batch of 32 would look cheap
    t = StepCostTable()
    for _ in range(3):
        t.record(32, 1.0)
        t.record(160, 5.0)
    assert t.estimate(160) == pytest.approx(5.0)
    assert t.estimate(96) == pytest.approx(3.0)
    assert t.estimate(320) == pytest.approx(10.0)


def test_nonsense_timings_are_not_recorded():
    t = StepCostTable()
    for rows, s in ((0, 1.0), (-5, 1.0), (3, -1.0), (3, float("inf")), (3, float("nan"))):
        t.record(rows, s)
    assert t.estimate(3) is None and not t.has(3)
    for _ in range(3):  # a free proposer (prompt lookup) costs 0 s, and that must count as measured
        t.record(3, 0.0)
    assert t.has(3) and t.estimate(3) == 0.0


def test_free_proposer_ends_exploration_and_batch_compute_bound_picks_k0():
    # prompt lookup costs 0 s; at a batch of 32 rows every extra verified row costs as much as a
    # decoded one (compute-bound), so at alpha 0.5 speculating does not pay
    ctl = SpecController("auto", 4)
    for _ in range(3):
        for k in range(5):
            ctl.target.record(32 * (k + 1), 1e-3 * 32 * (k + 1))
        ctl.draft.record(32, 0.0)
    for _ in range(200):
        ctl.observe(1, 2)
    assert ctl.choose([0.5] * 32, 0) == 0
