"""Which replica takes a request: prefix affinity, power of two choices, round-robin.

Pure functions, no Ray: the Ray Serve request router (replicas/ray_router.py) and the planner's
N-replica simulation (plan/simulator.py) make the same choice from the same inputs.

Prefix affinity is rendezvous (highest-random-weight) hashing of a route key over the replica
names: every router process maps a key to the same replica without sharing state, and when a
replica leaves or joins only the keys it owned move (Thaler & Ravishankar, "Using name-based
mappings to increase hit rates", IEEE/ACM ToN 1998). The route key is a hash of the prompt's first
full KV blocks after the chat template, so requests that can share cached blocks meet on one
replica; SGLang's router and vLLM's prefix-aware router make the same bet with a prefix tree.
Affinity yields to load: when the preferred replica's queue is longer than the shortest by more
than `margin` requests, the request goes by power of two choices instead (Mitzenmacher, "The
power of two choices in randomized load balancing", IEEE TPDS 2001).
"""
from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass
from typing import Sequence

POLICIES = ("prefix", "pow2", "round-robin")


def route_key(token_ids: Sequence[int], block_size: int, max_blocks: int, salt: str | None = None) -> int | None:
    """The route key of a prompt: a 64-bit hash of its first min(max_blocks, full blocks) blocks
    of `block_size` token ids (and the salt, since salted blocks are shared only within one salt).
    None when the prompt has no full block: nothing cacheable to steer by."""
    if block_size < 1 or max_blocks < 1:
        raise ValueError(f"block_size and max_blocks must be >= 1 (got {block_size}, {max_blocks})")
    n = min(len(token_ids) // block_size, max_blocks) * block_size
    if n == 0:
        return None
    h = hashlib.sha256((salt or "").encode() + b"\0")
    h.update(struct.pack(f"<{n}q", *token_ids[:n]))
    return int.from_bytes(h.digest()[:8], "little")


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


def choose(policy: str, names: Sequence[str], queue_len: dict[str, int], key: int | None = None,
           margin: int = 4, turn: int = 0, rng: random.Random | None = None) -> Choice:
    """Rank replicas for one request.

    policy: one of POLICIES. names: the live replicas. queue_len: requests each one holds
    (running + waiting; missing counts as 0). key: the request's route_key (prefix policy).
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
    if policy == "prefix" and key is not None:
        pref = rendezvous(key, order)
        if q[pref] <= min(q.values()) + margin:
            return Choice([pref] + by_load([n for n in order if n != pref]), "affinity")
        reason = "load"
    else:
        reason = "no_prefix" if policy == "prefix" else "pow2"
    two = rng.sample(order, min(2, len(order)))
    ranked = by_load(two)
    return Choice(ranked + by_load([n for n in order if n not in ranked]), reason)
