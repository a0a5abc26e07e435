"""`mixserve serve --replicas N`: the Ray Serve application (an ingress deployment in front of an
engine deployment of N replicas) and the command's lifecycle.

Ray Serve does the distributed work: placing replicas by their resources, restarting a dead one
(its health check, replica.check_health), autoscaling between min and max replicas on ongoing
requests, and the HTTP proxy. mixserve adds the request router (replicas/ray_router.py), the
replica that owns an engine (replicas/replica.py) and the ingress (replicas/ingress.py).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

log = logging.getLogger("mixserve.replicas")

APP_NAME = "mixserve"


@dataclass
class ReplicaOptions:
    """How the replicas are laid out and routed to.

    num_replicas: engine replicas (fixed; see min/max for autoscaling). cpus, gpus: Ray resources
    each replica asks for. threads: torch threads per replica (default: cpus). routing: a
    routing.POLICIES name. margin: queued requests the prefix-preferred replica may hold beyond
    the least-loaded one. route_blocks: KV blocks' worth of tokens the route keys cover. retries: tries after the
    first for a request whose replica died before answering. min_replicas, max_replicas,
    target_ongoing_requests: Ray Serve autoscaling (all three None: fixed num_replicas).
    max_ongoing_requests: Ray Serve's cap of requests in flight per replica (beyond it the router
    picks another or waits). stats_period_s: how often replicas report the gauges routers and
    /metrics read. grace_s: shutdown grace for running requests (seconds). access_log: Ray
    Serve's per-request log lines.
    """

    num_replicas: int = 2
    cpus: float = 1.0
    gpus: float = 0.0
    threads: int | None = None
    routing: str = "prefix"
    margin: int = 4
    route_blocks: int = 4
    retries: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int = 1024
    stats_period_s: float = 1.0
    grace_s: float = 30.0
    access_log: bool = False

    def validate(self) -> None:
        from mixserve.replicas.routing import POLICIES

        if self.num_replicas < 1:
            raise ValueError(f"replicas: must be >= 1 (got {self.num_replicas})")
        if self.routing not in POLICIES:
            raise ValueError(f"routing: one of {', '.join(POLICIES)} (got {self.routing!r})")
        if not (0 <= self.cpus < math.inf and 0 <= self.gpus < math.inf) or (self.threads is not None
                                                                                and self.threads < 1):
            raise ValueError(f"replica cpus and gpus must be finite and >= 0, threads >= 1 (got cpus {self.cpus}, "
                             f"gpus {self.gpus}, threads {self.threads})")
        if self.max_replicas is not None and self.max_replicas < self.num_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.num_replicas}): "
                             "replicas is the count started with, within min..max")
        if self.margin < 0 or self.route_blocks < 1 or self.retries < 0:
            raise ValueError("route margin >= 0, route blocks >= 1 and retries >= 0 are required")
        auto = (self.min_replicas, self.max_replicas, self.target_ongoing_requests)
        if any(v is not None for v in auto):
            lo = self.min_replicas if self.min_replicas is not None else 1
            hi = self.max_replicas if self.max_replicas is not None else max(lo, self.num_replicas)
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"autoscaling: need 0 <= min_replicas <= max_replicas, max >= 1 (got {lo}, {hi})")
            if self.target_ongoing_requests is not None and not self.target_ongoing_requests > 0:
                raise ValueError("target_ongoing_requests: must be > 0")

    def autoscaling(self) -> dict | None:
        """Ray Serve's autoscaling_config, or None for a fixed replica count."""
        if all(v is None for v in (self.min_replicas, self.max_replicas, self.target_ongoing_requests)):
            return None
        lo = self.min_replicas if self.min_replicas is not None else 1
        cfg = {"min_replicas": lo, "max_replicas": self.max_replicas or max(lo, self.num_replicas),
               "initial_replicas": min(max(lo, self.num_replicas), self.max_replicas or self.num_replicas)}
        if self.target_ongoing_requests is not None:
            cfg["target_ongoing_requests"] = self.target_ongoing_requests
        return cfg


_signal = None  # the DrainSignal actor of this command (kept: its handle must outlive start())
_grace_s = 30.0


def _drain_signal_class():
    import asyncio

    import ray

    @ray.remote(num_cpus=0)
    class DrainSignal:
        """Set once by the command at SIGTERM/SIGINT. Every engine replica waits on it from its
        start and then drains itself (refuses new requests, gives running ones the grace period,
        ends the rest with a last chunk): Ray Serve's own stop waits for requests to end, without a
        bound of its own, before it runs the replica's destructor, so the grace must begin here."""

        def __init__(self):
            self._set = asyncio.Event()
            self._waiting: dict = {}  # replica name -> its actor handle (None: unknown)
            self._drained: set = set()
            self._gone: set = set()  # replicas that died (Ray Serve restarts them under new names)
            self._changed = asyncio.Event()

        async def wait(self, name: str = "", handle=None) -> None:
            self._waiting[name or f"anon-{len(self._waiting)}"] = handle
            await self._set.wait()

        async def set(self) -> None:
            self._set.set()

        async def done(self, name: str = "") -> None:
            """A replica has drained: its last answers have gone out."""
            self._drained.add(name)
            self._changed.set()

        async def _prune_dead(self) -> None:
            for n, h in list(self._waiting.items()):
                if h is None or n in self._drained or n in self._gone:
                    continue
                try:
                    await asyncio.wait_for(h.__ray_ready__.remote(), 2.0)
                except asyncio.TimeoutError:  # alive but busy: it still owes its drain
                    pass
                except Exception:  # noqa: BLE001 -- the actor died: it will never report
                    self._gone.add(n)

        async def wait_drained(self, timeout_s: float) -> bool:
            """Until every live replica that waited has drained (True) or timeout_s (False)."""
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while True:
                await self._prune_dead()
                if not (set(self._waiting) - self._drained - self._gone):
                    return True
                self._changed.clear()
                left = deadline - loop.time()
                if left <= 0:
                    return False
                try:  # wake at a report, or recheck for dead replicas every second
                    await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass

    return DrainSignal


def build_app(engine_args, server_cfg, opts: ReplicaOptions, drain_signal: str | None = None):
    """The Ray Serve application: Ingress(EngineReplica x N). drain_signal: the name of the
    DrainSignal actor (namespace replica.DRAIN_NAMESPACE) the replicas wait on; None: they drain only
    when Ray Serve stops them. Raises ValueError for bad options."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from mixserve.replicas.ingress import Ingress, IngressSettings
    from mixserve.replicas.replica import EngineReplica

    opts.validate()
    engine_args.validate()
    if server_cfg.record_mix and server_cfg.record_mix_t0 is None:
        # one clock for every replica's lines: the file is one trace (on each node's own disk)
        server_cfg = dataclasses.replace(server_cfg, record_mix_t0=time.time())
    auto = opts.autoscaling()
    threads = opts.threads or max(1, int(opts.cpus))
    logs = {"enable_access_log": opts.access_log, "log_level": "INFO" if opts.access_log else "WARNING"}
    replica = serve.deployment(
        EngineReplica, name="engine",
        num_replicas=None if auto else opts.num_replicas, autoscaling_config=auto,
        ray_actor_options={"num_cpus": opts.cpus, "num_gpus": opts.gpus,
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}},
        max_ongoing_requests=opts.max_ongoing_requests,
        # the replica ends what outlives its own grace period; Ray's kill waits past that
        graceful_shutdown_timeout_s=opts.grace_s + 15, graceful_shutdown_wait_loop_s=0.5,
        health_check_period_s=2, health_check_timeout_s=30, logging_config=logs,
        request_router_config=RequestRouterConfig(
            request_router_class="mixserve.replicas.ray_router:MixserveRouter",
            request_router_kwargs={"policy": opts.routing, "margin": opts.margin},
            request_routing_stats_period_s=opts.stats_period_s, request_routing_stats_timeout_s=10),
    )
    settings = IngressSettings(model=engine_args.model, block_size=engine_args.block_size,
                               route_blocks=opts.route_blocks, max_body_bytes=server_cfg.max_body_bytes,
                               retries=opts.retries, per_key_salt=server_cfg.prefix_cache_salt == "per-key",
                               api_keys=server_cfg.keys())
    ingress = serve.deployment(Ingress, name="ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000, graceful_shutdown_timeout_s=opts.grace_s + 30,
                               graceful_shutdown_wait_loop_s=0.5, logging_config=logs)
    return ingress.bind(replica.bind(engine_args, server_cfg, threads, opts.grace_s, drain_signal), settings)


def start(engine_args, server_cfg, opts: ReplicaOptions, host: str = "127.0.0.1", port: int = 8000,
          ray_address: str | None = None) -> bool:
    """Connect to Ray (`ray_address`, or a new local instance sized for the replicas), start
    Serve's HTTP proxy on host:port and deploy the application; returns once every replica is
    up. Returns whether a local Ray instance was started (stop() then shuts it down)."""
    try:
        import ray
        from ray import serve
    except ImportError as e:
        raise SystemExit(f"serve --replicas needs Ray Serve ({e}): pip install -e '.[ray]'") from None

    global _signal, _grace_s
    _signal, _grace_s = None, opts.grace_s
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    name = f"drain-{uuid.uuid4().hex[:12]}"
    app = build_app(engine_args, server_cfg, opts, drain_signal=name)
    local = ray_address is None
    if not local:
        _check_reachable(ray_address)
    # ray.init puts its own SIGTERM handler in (kill every Ray process, exit 1; its C++ one then
    # aborts). The caller's go back right after it, before any replica can answer a request: a
    # SIGTERM that came while Serve deployed would otherwise cut the streams it had already begun
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    if local:
        need = opts.cpus * max(opts.num_replicas, opts.max_replicas or 0)
        # "local": a new instance even when `ray start` left one running here (or RAY_ADDRESS
        # names one): without that Ray would join it, and stopping would shut down its Serve
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, int(need + 0.999)), include_dashboard=False,
                 configure_logging=True, logging_level=logging.WARNING)
    else:
        ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING)
    for sig, h in handlers.items():
        if h is not None:
            signal.signal(sig, h)
    if local and opts.gpus > 0:
        have = ray.cluster_resources().get("GPU", 0)
        if have < opts.gpus * opts.num_replicas:
            ray.shutdown()
            raise ValueError(f"replica_gpus: {opts.num_replicas} replica(s) x {opts.gpus} GPU need "
                             f"{opts.gpus * opts.num_replicas:g} GPUs; this machine's Ray sees {have:g}")
    from mixserve.replicas.replica import DRAIN_NAMESPACE

    _signal = _drain_signal_class().options(name=name, namespace=DRAIN_NAMESPACE).remote()
    serve.start(http_options={"host": host, "port": port},
                logging_config={"enable_access_log": opts.access_log, "log_level": "WARNING"})
    serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    return local


def _check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """Refuse an address nothing answers at within timeout_s (ray.init would retry for minutes).
    "auto" and addresses without a port are left to Ray. Raises RuntimeError."""
    if address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise RuntimeError(f"ray_address: nothing answers at {address} ({e}); start the cluster first "
                           "(ray start --head) or check the address") from None


def stop(local: bool) -> None:
    """Tell the replicas to drain (see DrainSignal), delete the application (Ray Serve waits for
    their requests to end), then shut Serve and the local Ray instance down, or only disconnect
    from a cluster we joined."""
    import ray
    from ray import serve

    try:
        if _signal is not None:
            # the replicas end their requests first, while the ingress and proxy still relay them;
            # deleting the application then has nothing left in flight to cut
            ray.get(_signal.set.remote(), timeout=30)
            bound = _grace_s + 15
            if not ray.get(_signal.wait_drained.remote(bound), timeout=bound + 30):
                log.warning("replicas did not all report drained within %.0f s", bound)
            time.sleep(0.5)  # the last chunks' way out through the ingress
        serve.delete(APP_NAME)
        if local:
            serve.shutdown()
    finally:
        ray.shutdown()


def run(engine_args, server_cfg, opts: ReplicaOptions, host: str, port: int, ray_address: str | None) -> int:
    """The command: start, serve until SIGTERM or SIGINT, then drain and stop."""
    done = threading.Event()
    starting = [True]

    def on_signal(signum, frame):
        done.set()
        if starting[0]:  # start() may wait for replicas that never come: stop waiting now
            raise KeyboardInterrupt(f"signal {signum} during start-up")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    try:
        local = start(engine_args, server_cfg, opts, host, port, ray_address)  # keeps these handlers
    except KeyboardInterrupt as e:
        starting[0] = False
        import ray

        if _signal is not None and ray.is_initialized():
            # the application may already answer (its health does before serve.run returns):
            # drain what runs, as after start-up; replicas still starting hold nothing up
            print(f"mixserve: {e}: draining", flush=True)
            stop(ray_address is None)
            return 0
        print(f"mixserve: {e}: shutting down", flush=True)
        ray.shutdown()
        return 0
    starting[0] = False
    print(f"mixserve: {opts.num_replicas} replica(s) of {engine_args.model} behind http://{host}:{port} "
          f"(routing {opts.routing})", flush=True)
    try:
        done.wait()
    finally:
        print("mixserve: draining", flush=True)
        stop(local)
    return 0
