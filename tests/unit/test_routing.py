"""The replica choice of `serve --replicas` (mixserve/replicas/routing.py), without Ray."""
import random
from collections import Counter

import pytest

from mixserve.replicas.routing import PrefixTable, choose, rendezvous, route_keys


def test_route_key_hashes_whole_blocks_only():
    ids = list(range(100))
    assert route_keys(ids[:15], 16, 4) == []  # no full block: nothing to steer by
    k = route_keys(ids, 16, 4)
    assert k == route_keys(ids[:64] + [7, 7, 7], 16, 4)  # only the first 4 blocks count
    assert k[0] != route_keys([1] + ids[1:], 16, 4)[0]
    assert route_keys(ids[:40], 16, 4) == route_keys(ids[:43], 16, 4)  # keys step by 4 tokens
    assert route_keys(ids[:40], 16, 4) != route_keys(ids[:44], 16, 4)
    assert route_keys(ids, 16, 4, salt="a")[0] != route_keys(ids, 16, 4, salt="b")[0] != k[0]
    with pytest.raises(ValueError):
        route_keys(ids, 0, 4)


def test_rendezvous_moves_only_the_keys_of_a_replica_that_left():
    names = [f"r{i}" for i in range(5)]
    keys = range(2000)
    before = {k: rendezvous(k, names) for k in keys}
    share = Counter(before.values())
    assert min(share.values()) > 300  # spread over all five
    after = {k: rendezvous(k, names[:-1]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r4" for k in moved)
    assert rendezvous(5, list(reversed(names))) == rendezvous(5, names)  # order does not matter


def test_prefix_affinity_yields_to_load_past_the_margin():
    names = ["a", "b", "c"]
    key = 12345
    pref = rendezvous(key, names)
    c = choose("prefix", names, {}, keys=[key], margin=2)
    assert c.ranked[0] == pref and c.reason == "affinity" and sorted(c.ranked) == names
    c = choose("prefix", names, {pref: 2}, keys=[key], margin=2)
    assert c.ranked[0] == pref and c.reason == "affinity"  # 2 more than the shortest: still kept
    loaded = {pref: 3}
    for seed in range(20):
        c = choose("prefix", names, loaded, keys=[key], margin=2, rng=random.Random(seed))
        assert c.reason == "load" and c.ranked[0] != pref  # any two sampled: the shorter queue wins
    c = choose("prefix", names, {}, keys=None)
    assert c.reason == "no_prefix"


def test_round_robin_cycles_and_pow2_takes_the_shorter_of_two():
    names = ["x", "y", "z"]
    firsts = [choose("round-robin", names, {}, turn=t).ranked[0] for t in range(6)]
    assert firsts == ["x", "y", "z", "x", "y", "z"]
    q = {"x": 5, "y": 0, "z": 9}
    for seed in range(30):
        c = choose("pow2", names, q, rng=random.Random(seed))
        assert c.reason == "pow2" and c.ranked[0] != "z"  # z loses to either of the others
    # equal queues: ties are broken at random, not always the same replica
    picks = {choose("pow2", names, {}, rng=random.Random(s)).ranked[0] for s in range(30)}
    assert picks == set(names)
    with pytest.raises(ValueError):
        choose("nearest", names, {})
    with pytest.raises(ValueError):
        choose("pow2", [], {})


def test_replica_only_flags_without_replicas_are_refused(capsys):
    from mixserve.cli import main

    # refused before any model is loaded: the model path need not exist
    for flags in (["--max-replicas", "3"], ["--ray-address", "auto"], ["--replica-cpus", "1"], ["--replica-gpus", "1"],
                  ["--routing", "pow2"], ["--route-margin", "2"], ["--replica-retries", "5"]):
        assert main(["serve", "--model", "/nonexistent.gguf", *flags]) == 2
        assert f"{flags[0]}: only with --replicas N" in capsys.readouterr().err


def test_plan_replica_flags_are_checked_before_the_trace_loads(capsys):
    from mixserve.cli import main

    base = ["plan", "--trace", "/nonexistent.jsonl", "--model", "/nonexistent.gguf", "--hardware", "h100-sxm"]
    for flags, msg in ((["--replicas", "1,0"], "replicas: counts must be >= 1"),
                       (["--target-rate", "5"], "target_rate: needs --replicas"),
                       (["--replicas", "2", "--target-rate", "-1"], "target_rate: must be a finite number > 0"),
                       (["--replicas", "2", "--slo", ""], "the replica count is chosen against an SLO")):
        assert main(base + flags) == 2
        assert msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # an argparse choice, as in serve
        main(base + ["--replicas", "2", "--routing", "random"])
    assert e.value.code == 2 and "invalid choice: 'random'" in capsys.readouterr().err


def test_chain_keys_are_prefixes_of_each_other():
    ids = list(range(200))
    keys = route_keys(ids, 16, 4)
    assert len(keys) == 16 and route_keys(ids[:40], 16, 4) == keys[:10]  # a short turn's keys lead the long one's
    assert route_keys(ids[:15], 16, 4) == []
    assert route_keys([9] + ids[1:], 16, 4)[0] != keys[0]


def test_next_turn_follows_a_short_first_turn_and_shared_prefixes_spread():
    names = [f"r{i}" for i in range(4)]
    system = list(range(1000, 1016))  # one block every chat starts with
    table = PrefixTable()
    homes = {}
    for conv in range(40):
        turn1 = system + [conv] * 20  # two full blocks, and part of a third: less than the route key's four
        c1 = choose("prefix", names, {}, keys=route_keys(turn1, 16, 4), table=table)
        turn2 = turn1 + [7] * 60  # the next turn: the whole first turn plus more
        c2 = choose("prefix", names, {}, keys=route_keys(turn2, 16, 4), table=table)
        assert c1.reason == c2.reason == "affinity"
        assert c2.ranked[0] == c1.ranked[0]  # the stateless key alone would move it 3 times in 4
        homes[conv] = c1.ranked[0]
    assert len(set(homes.values())) == 4  # the shared system block steers nothing: all replicas used
    # without the table the two turns' deepest keys differ and land apart for most conversations
    apart = sum(rendezvous(route_keys(system + [v] * 20, 16, 4)[-1], names)
                != rendezvous(route_keys(system + [v] * 20 + [7] * 60, 16, 4)[-1], names) for v in range(40))
    assert apart > 10


def test_prefix_table_forgets_the_oldest_and_skips_dead_replicas():
    t = PrefixTable(capacity=3)
    t.record([1, 2], "a")
    assert t.match([1, 2, 3], ["a", "b"]) == ("a", 2)
    assert t.match([1, 2, 3], ["b"]) == (None, 0)  # a's gone: its entries steer nothing
    t.record([4, 5], "b")  # 4 entries > 3: key 1 is forgotten
    assert len(t) == 3 and t.match([1], ["a", "b"]) == (None, 0) and t.match([4, 5], ["b"]) == ("b", 2)
    t.record([4, 6], "a")  # 4 now continues two ways: a fork
    assert t.match([4, 7], ["a", "b"]) == (None, 0) and t.match([4, 6, 8], ["a", "b"]) == ("a", 2)
    with pytest.raises(ValueError):
        PrefixTable(0)


def test_an_unreachable_ray_address_is_refused_at_once():
    import socket

    from mixserve.replicas.app import _check_reachable

    with socket.socket() as s:  # a port nothing listens on (bound, then closed)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for addr in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(RuntimeError, match="nothing answers"):
            _check_reachable(addr, timeout_s=2)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        _check_reachable(f"127.0.0.1:{srv.getsockname()[1]}", timeout_s=2)  # something answers: left to Ray
    _check_reachable("auto")  # Ray finds it


def test_replica_resources_and_counts_that_cannot_be_met_are_refused(capsys):
    from mixserve.cli import main

    # refused before any model is loaded or Ray starts
    for flags, why in ((["--replica-cpus", "nan"], "finite"), (["--replica-cpus", "inf"], "finite"),
                       (["--replica-gpus", "nan"], "finite"), (["--replicas", "3", "--max-replicas", "1"],
                                                                 "max_replicas (1) is below replicas (3)")):
        args = flags if "--replicas" in flags else ["--replicas", "2", *flags]
        assert main(["serve", "--model", "/nonexistent.gguf", *args]) == 2
        assert why in capsys.readouterr().err
