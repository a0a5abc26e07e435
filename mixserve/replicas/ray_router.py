"""The engine deployment's request router: a subclass of Ray Serve's public RequestRouter API
(`ray.serve.request_router`), configured with `RequestRouterConfig(request_router_class=...)`.

It runs inside the process that holds the deployment handle (the ingress), so the ingress reads
its live replicas and their routing stats (the engine gauges each replica's
`record_routing_stats` reports) from here. Ray ships router classes to that process by value,
so module state is always reached through `import mixserve.replicas.ray_router` inside methods,
never through the class's own globals.

Queue length is Ray Serve's count of requests in flight to a replica (its cache, refreshed by
probes and by every request sent); the decision itself is `routing.choose`.
"""
from __future__ import annotations

import itertools
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

# routers alive in this process (one per handle; the ingress has one)
LIVE: list = []


def live_routers() -> list:
    """The routers of this process (see module docstring)."""
    import mixserve.replicas.ray_router as m

    return m.LIVE


class MixserveRouter(RequestRouter):
    """Ranks replicas with routing.choose. request_router_kwargs: policy (routing.POLICIES),
    margin (requests), table_size (route keys its PrefixTable keeps). A request's kwargs may carry
    `route_keys` (list of int or None, routing.route_keys)."""

    def initialize_state(self, policy: str = "prefix", margin: int = 4, table_size: int = 1 << 16,
                         **_: Any) -> None:
        from mixserve.replicas.routing import POLICIES, PrefixTable

        if policy not in POLICIES:
            raise ValueError(f"routing policy: one of {', '.join(POLICIES)} (got {policy!r})")
        self.policy = policy
        self.margin = margin
        self._turns = itertools.count()
        # recorded at the choice, for the first rank: Ray Serve calls on_request_routed only under
        # its rejection protocol, and the first rank is taken unless its queue is full
        self.table = PrefixTable(table_size)
        live_routers().append(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        from mixserve.replicas.routing import choose

        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        queue = {n: cache.get(r.replica_id) or 0 for n, r in by_name.items()}
        keys = pending_request.kwargs.get("route_keys") if pending_request is not None else None
        turn = next(self._turns) if self.policy == "round-robin" else 0
        c = choose(self.policy, list(by_name), queue, keys=keys, margin=self.margin, turn=turn, table=self.table)
        if pending_request is not None:  # the replica echoes it in a header (routing counter)
            pending_request.kwargs["routed"] = c.reason
        # only the first as its own rank: Ray takes the first rank with room, so the others are
        # the fallback when the chosen replica's queue is full (max_ongoing_requests)
        rest = [by_name[n] for n in c.ranked[1:]]
        return [[by_name[c.ranked[0]]]] + ([rest] if rest else [])

    def replicas_stats(self) -> dict[str, dict]:
        """{replica name: the routing stats it last reported} for the live replicas."""
        return {rid.unique_id: dict(r.routing_stats or {}) for rid, r in self.curr_replicas.items()}
