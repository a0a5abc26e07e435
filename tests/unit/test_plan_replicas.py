"""The simulator with N engine replicas behind serve --replicas' router (plan --replicas), on
hand-worked traces (constant step time 1 s)."""
import pytest

from mixserve.plan.planner import PlanSettings, parse_replicas
from mixserve.plan.simulator import SimConfig, SimRequest, SpecSettings, simulate

ONE = lambda b: 1.0  # noqa: E731


def test_round_robin_alternates_and_two_engines_halve_the_run():
    # max_num_seqs 1: each engine runs one request at a time, 2 steps each (prefill + 1 decode).
    # One engine: 4 requests in 8 s. Two: r0 takes 0 and 2, r1 takes 1 and 3, done at 4 s.
    reqs = [SimRequest(2, 2) for _ in range(4)]
    kw = dict(num_blocks=10, block_size=2, max_num_seqs=1)
    one = simulate(reqs, SimConfig(**kw), ONE)
    two = simulate(reqs, SimConfig(**kw, replicas=2, routing="round-robin"), ONE)
    assert one.duration_s == 8.0 and two.duration_s == 4.0
    assert two.replica_of == [0, 1, 0, 1]
    assert [m.e2e for m in two.metrics] == [2.0, 2.0, 4.0, 4.0]
    assert two.step_replica.count(0) == two.step_replica.count(1) == 4
    assert [r["requests"] for r in two.replicas] == [2, 2] and [r["busy_s"] for r in two.replicas] == [4.0, 4.0]
    assert two.route_reasons == {"round_robin": 4}
    assert two.report["extra"]["replicas"] == 2 and "replicas" not in one.report["extra"]


def _groups():
    # two prompt groups sharing 8 leading tokens (4 blocks of 2) each, 2 unique tokens after;
    # arrivals A0, A1, B0, B1, A2, B2, each long after the previous one finished
    shared = {"A": list(range(1000, 1008)), "B": list(range(2000, 2008))}
    order = ["A", "A", "B", "B", "A", "B"]
    return order, [SimRequest(10, 1, 10.0 * i, g, token_ids=shared[g] + [5000 + 2 * i, 5001 + 2 * i])
                   for i, g in enumerate(order)]


def test_prefix_routing_keeps_a_prefix_on_one_replica_and_gets_its_hits():
    order, reqs = _groups()
    kw = dict(num_blocks=100, block_size=2, prefix_caching=True, replicas=2, route_blocks=4)
    pre = simulate(reqs, SimConfig(**kw, routing="prefix"), ONE)
    rr = simulate(reqs, SimConfig(**kw, routing="round-robin"), ONE)
    for g in "AB":
        assert len({pre.replica_of[i] for i, x in enumerate(order) if x == g}) == 1
    # prefix: every request but the first of its group finds 8 tokens; round-robin sends A1 and
    # B1 where their group has not been yet, and only A2, B2 hit
    assert pre.prefix_hits == 4 * 8 and rr.prefix_hits == 2 * 8
    assert pre.prefix_queries == rr.prefix_queries == 60
    assert pre.route_reasons == {"affinity": 6}
    assert pre.report["extra"]["prefix_cache_hit_rate"] == pytest.approx(32 / 60)


def test_affinity_yields_to_load_past_the_margin():
    # four requests of one prefix at once, margin 0: the preferred replica keeps a request only
    # while its queue is no longer than the other's
    shared = list(range(100, 108))
    reqs = [SimRequest(9, 2, 0.0, token_ids=shared + [900 + i]) for i in range(4)]
    res = simulate(reqs, SimConfig(num_blocks=100, block_size=2, prefix_caching=True, replicas=2,
                                   route_margin=0), ONE)
    assert res.route_reasons == {"affinity": 2, "load": 2}
    assert sorted(r["requests"] for r in res.replicas) == [2, 2]
    # a wide margin keeps all four together
    res = simulate(reqs, SimConfig(num_blocks=100, block_size=2, prefix_caching=True, replicas=2,
                                   route_margin=8), ONE)
    assert res.route_reasons == {"affinity": 4} and sorted(r["requests"] for r in res.replicas) == [0, 4]


def test_closed_loop_turns_and_speculation_run_on_replicas():
    # a conversation's next turn arrives when the previous one finishes, wherever it ran
    reqs = [SimRequest(4, 3), SimRequest(8, 2, after=0), SimRequest(4, 3), SimRequest(8, 2, after=2)]
    res = simulate(reqs, SimConfig(num_blocks=50, block_size=2, replicas=3, spec=SpecSettings(0.5, 2, mode="fixed")),
                   ONE)
    assert all(m is not None for m in res.metrics)
    assert res.metrics[1].arrival_s == res.metrics[0].finish_s and res.metrics[3].arrival_s == res.metrics[2].finish_s
    assert sum(r["requests"] for r in res.replicas) == 4


def test_bad_replica_settings_are_refused():
    with pytest.raises(ValueError, match="replicas"):
        SimConfig(num_blocks=10, replicas=0)
    with pytest.raises(ValueError, match="routing"):
        SimConfig(num_blocks=10, routing="random")
    with pytest.raises(ValueError, match="route_margin"):
        SimConfig(num_blocks=10, route_margin=-1)
    for bad in (dict(replicas=2.5), dict(replicas=True), dict(replicas="2"), dict(route_margin=float("nan"))):
        with pytest.raises(ValueError, match="must be an integer"):
            SimConfig(num_blocks=10, **bad)
    assert parse_replicas("8, 1,2,2") == [1, 2, 8]
    for bad in ("0", "1,x", ""):
        with pytest.raises(ValueError, match="replicas"):
            parse_replicas(bad)
    with pytest.raises(ValueError, match="route_blocks"):
        PlanSettings(route_blocks=0)


def test_a_conversation_stays_put_though_its_first_turn_is_shorter_than_the_route_key():
    # 3 chats x 3 closed-loop turns on 2 replicas; blocks of 2, route key 4 blocks. Every chat
    # opens with one shared block, then 4 tokens of its own: 3 full blocks, fewer than the key's
    # 4, so turn 1's deepest key differs from turn 2's. The router's table keeps the chat on the
    # replica turn 1 went to; the shared block alone steers nothing.
    from mixserve.plan.simulator import stand_in_ids

    system = [900, 901]
    reqs: list[SimRequest] = []
    for c in range(3):
        prev, ids = None, system + [6000 + 10 * c + j for j in range(4)]
        for turn in range(3):
            r = SimRequest(len(ids), 2, 0.0, token_ids=ids, after=prev)
            reqs.append(r)
            prev = len(reqs) - 1
            ids = stand_in_ids(prev, r) + [2000 + 100 * c + 10 * turn + j for j in range(4)]
    kw = dict(num_blocks=200, block_size=2, prefix_caching=True, replicas=2, route_blocks=4)
    pre = simulate(reqs, SimConfig(**kw, routing="prefix"), ONE)
    rr = simulate(reqs, SimConfig(**kw, routing="round-robin"), ONE)
    for c in range(3):
        assert len({pre.replica_of[3 * c + t] for t in range(3)}) == 1, pre.replica_of
    assert pre.route_reasons == {"affinity": 9}
    assert pre.prefix_hits > rr.prefix_hits
    assert len(set(pre.replica_of)) == 2  # the chats still spread over both replicas
