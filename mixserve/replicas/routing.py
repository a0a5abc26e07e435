"""Which replica takes a request: prefix affinity, power of two choices, round-robin.

Pure functions, no Ray: the Ray Serve request router (replicas/ray_router.py) and the planner's
N-replica simulation (plan/simulator.py) make the same choice from the same inputs.

Prefix affinity is rendezvous (highest-random-weight) hashing of a route key over the replica
names: every router process maps a key to the same replica without sharing state, and when a
replica leaves or joins only the keys it owned move (Thaler & Ravishankar, "Using name-based
mappings to increase hit rates", IEEE/ACM ToN 1998). The route keys are chain hashes of the
prompt's first KV blocks after the chat template, one per STEP tokens, so requests that can
share cached blocks meet on one replica.

A router also remembers where it sent each key (PrefixTable, an LRU map): a request whose keys
run through the end of an earlier request's keys (a conversation's next turn carries its first
turn's whole prompt) goes where that one went: a longest-prefix match, as SGLang's router and
vLLM's prefix-aware router make with a prefix tree. A match that ends where other requests already
continued differently (a shared system prompt) steers nothing: every replica soon caches such a
prefix, so those requests spread by rendezvous on their own deepest key. Affinity yields to load:
when the preferred replica's queue is longer than the shortest by more than `margin` requests, the request goes by power of two choices instead (Mitzenmacher, "The
power of two choices in randomized load balancing", IEEE TPDS 2001).
"""
from __future__ import annotations

import hashlib
import random
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

POLICIES = ("prefix", "pow2", "round-robin")


STEP = 4  # tokens per route key: finer than a block, so a next turn matches its short first turn


def route_keys(token_ids: Sequence[int], block_size: int, max_blocks: int,
               salt: str | None = None, step: int = STEP) -> list[int]:
    """The route keys of a prompt: 64-bit chain hashes of its leading token ids, one per `step`
    tokens, over its first min(max_blocks * block_size, len) tokens; key i hashes key i-1 and the
    i-th `step` tokens (and the salt, since salted blocks are shared only within one salt). Keys
    are finer than a KV block because a conversation's next turn carries the whole previous prompt,
    its partial last block included, and the replica that answered it holds the blocks that filled
    it. Empty when the prompt has no full block: nothing cached to steer by.
    Raises ValueError for block_size, max_blocks or step < 1."""
    if block_size < 1 or max_blocks < 1 or step < 1:
        raise ValueError(f"block_size, max_blocks and step must be >= 1 (got {block_size}, {max_blocks}, {step})")
    if len(token_ids) < block_size:
        return []
    n = min(len(token_ids), max_blocks * block_size) // step
    keys: list[int] = []
    prev = hashlib.sha256((salt or "").encode() + b"\0").digest()[:8]
    for b in range(n):
        prev = hashlib.sha256(prev + struct.pack(f"<{step}q", *token_ids[b * step:(b + 1) * step])).digest()[:8]
        keys.append(int.from_bytes(prev, "little"))
    return keys


_FORK = -1  # successor of a key that requests continued in more than one way


class PrefixTable:
    """Where a router sent each route key: an LRU map key -> (replica name, successor key).

    capacity: keys kept (the oldest are forgotten first). One table per router: routers in
    other processes fall back to rendezvous, which they agree on without sharing state.
    """

    def __init__(self, capacity: int = 1 << 16):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity})")
        self.capacity = capacity
        self._map: OrderedDict[int, list] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def match(self, keys: Sequence[int], names: Sequence[str]) -> tuple[str | None, int]:
        """(replica, matched keys) of the longest prefix of `keys` sent to a live replica (one
        of `names`) that no other request continued differently from; (None, 0) when none."""
        live = set(names)
        for d in range(len(keys), 0, -1):
            entry = self._map.get(keys[d - 1])
            if entry is None or entry[0] not in live:
                continue
            nxt = entry[1]
            if d < len(keys) and nxt is not None and nxt != keys[d]:
                return None, 0  # a shared prefix others went on from: no owner
            return entry[0], d
        return None, 0

    def record(self, keys: Sequence[int], name: str, move: bool = True) -> None:
        """Remember that a request with these route keys went to replica `name`. move=False (a
        request sent away for load) keeps the replica of the keys already known: one overflow
        does not move a hot prefix's home, only its new keys start where it went."""
        for i, k in enumerate(keys):
            entry = self._map.get(k)
            nxt = keys[i + 1] if i + 1 < len(keys) else None
            if entry is None:
                self._map[k] = [name, nxt]
            else:
                if move:
                    entry[0] = name
                if nxt is not None and entry[1] != nxt:
                    entry[1] = nxt if entry[1] is None else _FORK
                self._map.move_to_end(k)
        while len(self._map) > self.capacity:
            self._map.popitem(last=False)


def rendezvous(key: int, names: Sequence[str]) -> str:
    """The replica name with the highest hash weight for `key` (stable across processes)."""
    def weight(name: str) -> bytes:
        return hashlib.blake2b(key.to_bytes(8, "little") + name.encode(), digest_size=8).digest()
    return max(names, key=weight)


@dataclass
class Choice:
    """A routing decision: `ranked` replica names, best first (the caller takes the first that
    has room), and why: "affinity", "load" (affinity overridden by the margin), "no_prefix"
    (no full block: power of two choices), "pow2" or "round_robin"."""

    ranked: list[str]
    reason: str


def choose(policy: str, names: Sequence[str], queue_len: dict[str, int],
           keys: Sequence[int] | None = None, margin: int = 4, turn: int = 0,
           rng: random.Random | None = None, table: PrefixTable | None = None) -> Choice:
    """Rank replicas for one request.

    policy: one of POLICIES. names: the live replicas. queue_len: requests each one holds
    (running + waiting; missing counts as 0). keys: the request's route_keys (prefix policy). table: the router's PrefixTable: its longest match is preferred to the
    rendezvous of the deepest key, and the chosen replica is recorded in it.
    margin: how many more queued requests than the least-loaded replica the preferred one may
    hold and keep the request. turn: the round-robin counter (the caller increments it).
    Ties in queue length are broken at random (`rng`, default the module's).
    Raises ValueError for an unknown policy or no replicas.
    """
    if policy not in POLICIES:
        raise ValueError(f"routing policy: one of {', '.join(POLICIES)} (got {policy!r})")
    if not names:
        raise ValueError("no replicas to route to")
    rng = rng or random
    order = sorted(names)
    q = {n: queue_len.get(n, 0) for n in order}

    def by_load(cands: list[str]) -> list[str]:
        shuffled = rng.sample(cands, len(cands))  # random among equal queue lengths
        return sorted(shuffled, key=q.__getitem__)

    if policy == "round-robin":
        first = order[turn % len(order)]
        return Choice([first] + by_load([n for n in order if n != first]), "round_robin")
    keys = list(keys or ())
    c = None
    if policy == "prefix" and keys:
        pref = (table.match(keys, order)[0] if table is not None else None) or rendezvous(keys[-1], order)
        if q[pref] <= min(q.values()) + margin:
            c = Choice([pref] + by_load([n for n in order if n != pref]), "affinity")
        reason = "load"
    else:
        reason = "no_prefix" if policy == "prefix" else "pow2"
    if c is None:
        two = rng.sample(order, min(2, len(order)))
        ranked = by_load(two)
        c = Choice(ranked + by_load([n for n in order if n not in ranked]), reason)
    if table is not None and keys:
        table.record(keys, c.ranked[0], move=c.reason == "affinity")
    return c
