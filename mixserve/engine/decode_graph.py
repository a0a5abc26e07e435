"""The decode step captured once as a compiled graph, so a step is the weights' reading and little else.

An eager decode step of the 0.5B runs ~1,080 small torch ops (norms, RoPE, residual adds, SiLU,
KV writes, attention's gather) at a few microseconds each: 8 ms per step beside ~45 ms of weight
reading at one row (BENCHMARKS.md, issue 14). Here `LlamaForCausalLM.decode` is compiled by
torch.compile (Inductor, C++ codegen): the elementwise work fuses into a few C++ loops per layer,
the linears stay our chosen kernels (oneDNN's through `layers/graph_ops.py`, int4 through
PyTorch's op) and attention is one op per layer (`layers/paged_decode.py`: the KV write and the
paged kernel). Shapes are dynamic in the row count, a count of 1 included, so one graph serves the
single stream and every batch; the batch's tensors are written into persistent buffers, not rebuilt
per step.

Steps whose items span at most `MAX_ITEM_ROWS` positions each and want logits run here, each
position a row with its own context: decode rows, and a speculative verification's k + 1 positions
or a draft's catch-up (issue 34: on the eager path a 1.5B's 3-row verification cost 1.56x its
compiled 1-row step). Prefill chunks, batches past `max_rows` and prompt scoring take the eager path,
which stays the reference (`--enforce-eager`); a row's attention is the paged kernel's either way
in batch-invariant mode (layers/paged_decode.paged_rows), so the tokens are the same. Whether the
graph runs at all is a measured choice per machine (`decode_graph` in layers/kernel_choice.py):
compiled against eager steps of this model.
Inductor's compiled code is cached under `<cache root>/inductor` (unless TORCHINDUCTOR_CACHE_DIR
says otherwise), so only a machine's first start pays the compile (stated by `describe`).
"""
from __future__ import annotations

import contextlib
import logging
import statistics
import sys
import threading
import time
import types

import torch

from mixserve.env import pin_inductor_cache

log = logging.getLogger("mixserve")

# the most positions of one item a step runs as rows of the graph (a verification is k + 1 of them);
# longer items are prefill chunks, which the eager path's many-row kernels take
MAX_ITEM_ROWS = 16


def graph_supported(model) -> str | None:
    """None when `model` can run the captured decode step, else why not."""
    from mixserve.layers.paged_decode import available

    if not hasattr(model, "decode"):
        return "the model has no decode-only forward"
    if not available():
        return "the paged decode kernel did not build (no C++ compiler?)"
    if getattr(model, "dtype", None) not in (torch.float32, torch.bfloat16):
        return "only float32 and bfloat16 are captured"
    return None


def max_graph_rows(model, limit: int) -> int:
    """The most rows a captured step takes: below every int4 layer's switch to dequantize + GEMM
    (that path leaves the graph) and at most `limit` (the engine's max_num_seqs)."""
    rows = limit
    for m in model.modules():
        d = getattr(m, "dense_rows", None)
        if d is not None:
            rows = min(rows, d - 1)
    return max(rows, 0)


def _weight_guards_dropped(entries) -> list[bool]:
    """Dynamo's guards without those on the model's weights (named `self.<module path>` in the
    entries it passes): they re-check every weight tensor on every call, and the weights do not
    change once the kernels are chosen, which is before a graph is made. Guards on the inputs, the
    shapes and the KV caches (rebound when another engine shares the model) stay. Only in the
    graph's own frame (its `self` the model, its code this graph's copy, `_own_function`): a frame
    after a graph break (an int4 layer's) runs code every model of the process shares, and without
    its weights' guards a second engine of another dtype ran the first one's compiled code (wrong
    tokens, or non-finite logits; a break-it round) - those frames keep every guard."""
    own = any(e.name in ("self", "L['self']") and e.has_value and callable(getattr(e.value, "decode", None))
              for e in entries)
    if not own:
        return [True] * len(entries)
    return [not (e.guard_type == "TENSOR_MATCH" and e.name.startswith(("self.", "L['self']"))
                 and "_cache" not in e.name) for e in entries]


def _symbolic(t: torch.Tensor, dim: int) -> None:
    """Compile `t`'s size along `dim` as a symbol, not a constant (DecodeGraph._first_call says which
    sizes), a size of 1 included: `backed_size_oblivious` (set around the first call) keeps Dynamo
    from specialising it, so one graph serves 1 row and many."""
    torch._dynamo.mark_dynamic(t, dim)


def _own_function(fn):
    """A copy of the plain function `fn` (an unbound method) over a copy of its code object.
    Dynamo keeps compiled graphs, and their recompile budget, per code object: compiling a bound
    method would put every DecodeGraph of the process under one shared wrapper frame (after ~4
    engines the budget ran out and steps silently ran uncompiled), and its guards would name the
    weights `L['fn'].__self__...`, past `_weight_guards_dropped`. Called as fn(model, ...), the
    copy's frame names the model `L['self']`."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class _StanceGate:
    """Keeps guard-skipping calls and guarded ones (which may trace and compile) of this process's
    decode graphs apart: Dynamo's stance is process-wide, so another thread's compile under a
    skipping call's stance fails ("Recompilation triggered"), and its guarded call could take a
    stale entry. A guarded call waits for the skipping calls under way (a step each); a call that
    could skip runs guarded instead while a guarded one is under way (a background compile)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._unguarded = 0
        self._guarded = 0

    def enter_unguarded(self) -> bool:
        with self._cv:
            if self._guarded:
                return False
            self._unguarded += 1
            return True

    def exit_unguarded(self) -> None:
        with self._cv:
            self._unguarded -= 1
            self._cv.notify_all()

    @contextlib.contextmanager
    def guarded(self):
        with self._cv:
            self._guarded += 1
            self._cv.wait_for(lambda: self._unguarded == 0)
        try:
            yield
        finally:
            with self._cv:
                self._guarded -= 1


_GATE = _StanceGate()


class DecodeGraph:
    """A compiled `model.decode` with persistent input buffers.

    Args:
        model: LlamaForCausalLM with bound KV caches.
        block_size: tokens per KV block; max_blocks: block-table width (max_model_len / block_size).
        max_rows: the most rows a step may have here (`max_graph_rows`).
    """

    def __init__(self, model, block_size: int, max_blocks: int, max_rows: int):
        pin_inductor_cache()
        from mixserve.layers import rmsnorm

        # the norm's and SwiGLU's C++ ops built and registered now: deciding that inside the first
        # trace (a build and register_fake, which Dynamo cannot trace) broke the graph in the
        # layers' loop, and Dynamo then ran the whole step eager with each layer's pieces compiled
        # apart (~117 frames a step; the 1.5B's step 27.0 -> 24.5 ms once fixed; issue 43, seventh round)
        rmsnorm.rows_kernel()
        self.model = model
        self.block_size = block_size
        self.max_rows = max_rows
        # one graph for every row count: two (1 row, 2+ rows) cost a second trace and compile at
        # every start (Dynamo traces on every start, the cache only skips Inductor)
        # Inductor's wrapper asserts the size, stride and alignment of every input on every call:
        # ~350 checks a step for the weights alone (~0.5 ms at one row, profiled), for tensors whose
        # shapes are fixed at load; the batch buffers and the caches stay guarded by Dynamo
        opts = {"guard_filter_fn": _weight_guards_dropped, "size_asserts": False, "alignment_asserts": False}
        if getattr(model, "batch_invariant", False):
            # eager's bf16 roundings between fused elementwise ops, so a graph's row is an eager row
            # (layers/batch_invariance.py)
            opts["emulate_precision_casts"] = True
        # Static but for the sizes `_first_call` marks: the row count, the KV cache's block count,
        # the table width and the RoPE tables' length. dynamic=True made every size a symbol, the
        # weights' too, and equal sizes one symbol (a KV head count of 2 was the row count of the
        # warm-up), so the graph changed with coincidences of sizes.
        self.fn = torch.compile(_own_function(type(model).decode), dynamic=False, options=opts)
        self.input_ids = torch.zeros(max_rows, dtype=torch.long)
        self.positions = torch.zeros(max_rows, dtype=torch.long)
        self.slots = torch.zeros(max_rows, dtype=torch.long)
        self.lens = torch.ones(max_rows, dtype=torch.long)
        self.tables = torch.zeros(max_rows, max_blocks, dtype=torch.long)
        self.logit_rows = torch.zeros(max_rows, dtype=torch.long)
        self.compile_s: dict[str, float] = {}  # the graph's first call ("graph"): seconds
        self._traced = None  # _state() at the last call that ran Dynamo's guards
        # (rows, logit rows) that ran with Dynamo's guards under _traced
        self._guarded_rows: set[tuple[int, int]] = set()
        self.num_steps = 0  # steps run here
        self.span_steps = 0  # of them, steps with an item of several positions (a verification, a catch-up)
        self.unguarded_steps = 0  # of them, steps that skipped Dynamo's guards (run)

    def accepts(self, items) -> bool:
        """True for a batch of at most max_rows positions whose items each span 1 .. MAX_ITEM_ROWS
        positions and want logits for 1 .. all of them (decode rows, a verification, a catch-up)."""
        return 0 < self.rows(items) <= self.max_rows and all(
            1 <= it.num_logits <= it.end - it.start <= MAX_ITEM_ROWS for it in items)

    @staticmethod
    def rows(items) -> int:
        """Rows a step of `items` runs here: one per position."""
        return sum(it.end - it.start for it in items)

    def run(self, items, block_table) -> torch.Tensor:
        """Float32 logits in `items`' order, each item's last num_logits positions in turn
        [sum of num_logits, vocab]; block_table(seq_id) -> its blocks."""
        bs = self.block_size
        ids, pos, slots, tables, wanted = [], [], [], [], []
        width = 1
        for it in items:
            bt = block_table(it.seq_id)
            for p in range(it.start, it.end):
                if p >= it.end - it.num_logits:
                    wanted.append(len(ids))
                ids.append(it.token_ids[p])
                pos.append(p)
                slots.append(bt[p // bs] * bs + p % bs)
                t = bt[:p // bs + 1]
                width = max(width, len(t))
                tables.append(t)
        n, m = len(ids), len(wanted)
        self.span_steps += n > len(items)
        self.input_ids[:n] = torch.tensor(ids)
        self.positions[:n] = torch.tensor(pos)
        self.slots[:n] = torch.tensor(slots)
        self.lens[:n] = self.positions[:n] + 1
        self.tables[:n, :width] = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        self.logit_rows[:m] = torch.tensor(wanted)
        t0 = time.perf_counter() if not self.compile_s else None
        args = (self.input_ids[:n], self.positions[:n], self.slots[:n], self.tables[:n], self.lens[:n],
                self.logit_rows[:m])
        state = self._state()
        if state != self._traced:
            self._traced, self._guarded_rows = state, set()
        if t0 is None and (n, m) in self._guarded_rows and _GATE.enter_unguarded():
            # Dynamo's ~2,700 guards (module attributes, dict keys, input tensors) cost ~0.4-0.6 ms
            # of a 0.5B's 12-13 ms step. The model is fixed once the kernels are chosen, and the only
            # size that changes between steps is the row count (the table width, the caches' and
            # RoPE's sizes are the engine's): a row count that passed the guards once, with the
            # same _state, passes them again, so they are skipped (keyed by the row count and the
            # logit rows', both symbols). A call Dynamo would compile again anyway raises before
            # it runs, and runs guarded instead.
            try:
                with torch.inference_mode(), torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                    out = self.fn(self.model, *args)
                self.num_steps += 1
                self.unguarded_steps += 1
                return out
            except RuntimeError as e:
                if "Recompilation triggered" not in str(e):
                    raise
                self._guarded_rows.clear()
            finally:
                _GATE.exit_unguarded()
        if t0 is not None:
            from torch._dynamo.utils import counters  # Dynamo is loaded by the compile anyway

            breaks = dict(counters["graph_break"])
        with _GATE.guarded(), torch.inference_mode(), \
                self._first_call(args) if t0 is not None else contextlib.nullcontext():
            out = self.fn(self.model, *args)
        self._guarded_rows.add((n, m))  # passed Dynamo's guards (or compiled again where they failed)
        if t0 is not None:
            self.compile_s["graph"] = time.perf_counter() - t0
            # a break splits the step into graphs, each with its own guards and wrapper (a break in
            # the layers' loop left the whole step eager: ~2.5 ms of the 1.5B's 27 ms): said, as the
            # step still gives the same tokens
            new = {k: n - breaks.get(k, 0) for k, n in counters["graph_break"].items() if n > breaks.get(k, 0)}
            if new:
                log.warning("decode graph: %d graph break(s) in its first trace (a step runs as several graphs, "
                            "slower): %s", sum(new.values()), "; ".join(str(k).splitlines()[0] for k in new))
        self.num_steps += 1
        return out

    def _state(self) -> tuple:
        """What may change under a compiled graph between steps without Dynamo's guards seeing it
        (they are skipped while this stays as it was at the last guarded calls): the KV cache tensors
        bound to the model (another engine sharing the model binds its own), the batch-invariant
        mode, the RoPE tables and the default dtype (every call runs in inference mode)."""
        m = self.model
        return (tuple(id(c) for layer in m.layers for c in (layer.k_cache, layer.v_cache)),
                getattr(m, "batch_invariant", False), id(m.rope.cos), torch.get_default_dtype())

    @contextlib.contextmanager
    def _first_call(self, args):
        """Around a graph's first call, which traces and compiles it (or loads it from Inductor's
        cache): which sizes are symbols is decided here, and only here, so that the graph, and
        Inductor's cache key, depend on nothing but the model and the dtype (issue 32: another
        --kv-cache-memory, --max-model-len or --max-num-seqs compiles nothing new)."""
        tables = args[3]
        for t in args:
            _symbolic(t, 0)
        _symbolic(tables, 1)
        # the inputs are views of the persistent buffers, and Dynamo traces a view with its base:
        # the bases' sizes (max_num_seqs, max_model_len) are symbols too, or they enter the graph
        for t in (self.input_ids, self.positions, self.slots, self.lens, self.tables, self.logit_rows):
            _symbolic(t, 0)
        _symbolic(self.tables, 1)
        m = self.model
        for t in [m.rope.cos, m.rope.sin_signed] + [c for layer in m.layers for c in (layer.k_cache, layer.v_cache)]:
            _symbolic(t, 0)
        import torch.fx.experimental._config as fx_config

        # Dynamo's automatic dynamic shapes would make sizes symbols by what earlier graphs of this
        # process saw (its state is keyed by the code's file and line, which every copy shares);
        # duck sizing would make equal sizes one symbol. Either makes the graph depend on history
        # or coincidence. backed_size_oblivious: a marked size of 1 (one row, a one-block table) is
        # a symbol like any other, not specialised, so one graph serves every row count.
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False), \
                fx_config.patch(use_duck_shape=False, backed_size_oblivious=True):
            yield


def dummy_decode_steps(runner, rows: int, context: int, steps: int, run) -> list[float]:
    """Seconds of `steps` decode steps of `rows` rows at `context` tokens through `run(items,
    block_table)`, on the cache's first blocks, zeroed afterwards: for timing and warm-up before
    the engine has admitted a request."""
    bs = runner.block_size
    per_row = -(-(context + steps + 1) // bs)
    tables = [list(range(i * per_row, (i + 1) * per_row)) for i in range(rows)]
    out = []
    for s in range(steps):
        # BatchItem's fields (model_runner imports this module)
        items = [types.SimpleNamespace(seq_id=i, token_ids=[1] * (context + steps + 1), start=context + s,
                                       end=context + s + 1, num_logits=1, score=None) for i in range(rows)]
        t0 = time.perf_counter()
        run(items, lambda i: tables[i])
        out.append(time.perf_counter() - t0)
    for kc, vc in zip(runner.k_caches, runner.v_caches):
        kc[:per_row * rows].zero_()
        vc[:per_row * rows].zero_()
    return out


def warm_up(runner, graph: DecodeGraph, scratch: int | None = None) -> None:
    """Compile (or load from Inductor's cache) the graph now, as a GPU server captures its graphs,
    so that no request's step waits for it, and run it at 1 and 2 rows. scratch: a KV block no
    sequence is ever given (ModelRunner.pad_block): every warm-up row reads and writes only that
    block, so the warm-up may run while the engine steps (BackgroundGraph); None uses the cache's
    first blocks, before any request is admitted."""
    if scratch is not None:
        for rows in (1, 2):
            if rows <= graph.max_rows:
                items = [types.SimpleNamespace(seq_id=i, token_ids=[1] * 4, start=2, end=3, num_logits=1, score=None)
                         for i in range(rows)]
                graph.run(items, lambda i: [scratch])
        return
    for rows in (1, 2):
        if rows <= graph.max_rows and rows * -(-4 // runner.block_size) <= runner.num_blocks:
            dummy_decode_steps(runner, rows, 2, 1, graph.run)


class BackgroundGraph:
    """A decode graph compiled (or loaded from Inductor's cache) on a daemon thread while the
    engine steps eagerly, so that the first token never waits for it (issue 32). Dynamo traces
    the model on every start, ~34 s for the 0.5B on 2 AVX2 cores, against ~8 s for everything
    else. The warm-up touches only the runner's scratch block; the runner installs the graph at
    the start of a step once `ready` is set (ModelRunner.run), so a step runs wholly eager or
    wholly compiled, and both give the same tokens (the compiled path equals eager, tested).

    At exit the thread is abandoned, never waited for: what Inductor finished is in its cache.
    """

    # While Dynamo traces (pure Python, holding the GIL), each torch op of an eager step releases
    # the GIL and then waits up to the switch interval (5 ms by default) to get it back: ~300
    # waits a step made the 0.5B's eager steps 1.6 s instead of 0.15 s. A 0.1 ms interval for as
    # long as a background compile runs bounds that wait.
    SWITCH_INTERVAL_S = 1e-4
    _lock = threading.Lock()
    _running = 0  # background compiles in this process (under _lock), and the interval before the first
    _saved_interval = 0.0

    def __init__(self, runner, make_graph):
        self.graph: DecodeGraph | None = None
        self._make_graph = make_graph  # made on the thread too: torch.compile's imports take ~2.5 s
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.ready = threading.Event()
        with BackgroundGraph._lock:
            if BackgroundGraph._running == 0:
                BackgroundGraph._saved_interval = sys.getswitchinterval()
                sys.setswitchinterval(min(BackgroundGraph._saved_interval, self.SWITCH_INTERVAL_S))
            BackgroundGraph._running += 1
        self.thread = threading.Thread(target=self._run, args=(runner,), name="mixserve-decode-graph", daemon=True)
        self.thread.start()

    def _run(self, runner) -> None:
        t0 = time.perf_counter()
        try:
            self.graph = self._make_graph()
            with torch.inference_mode():
                warm_up(runner, self.graph, scratch=runner.pad_block)
        except Exception as e:  # Inductor could not compile here: the engine stays eager
            self.error = e
        finally:
            self.seconds = time.perf_counter() - t0
            with BackgroundGraph._lock:
                BackgroundGraph._running -= 1
                if BackgroundGraph._running == 0:
                    sys.setswitchinterval(BackgroundGraph._saved_interval)
            self.ready.set()


class GraphTrial:
    """The decode graph's choice measured on live traffic (issue 32: a first start never waits for
    the graph's timing). Where the choice is not yet known and the graph compiles in the background
    (BackgroundGraph), the installed graph is on trial: decode steps the graph accepts alternate
    eager, compiled, eager, ... and each eager step and the compiled step after it, at the same row
    count, make a pair. After `PAIRS` pairs (the first one, the graph's first live call, dropped)
    the medians decide it by kernel_choice's rule (MARGIN, with the built graph as the default that
    eager must beat) and the choice is cached as any measured one: the graph stays or is dropped.
    Both paths give the same tokens (the compiled
    path equals eager, tested), so a trial changes no output. Interleaving makes the pairs share
    whatever else loads the machine, which a timing before serving cannot do."""

    PAIRS = 8

    def __init__(self, chooser, key: str):
        self.chooser, self.key = chooser, key
        self.pairs: list[tuple[float, float]] = []  # (eager s, compiled s)
        self._eager: tuple[int, float] | None = None  # the last eager step: (rows, seconds)
        self._skip = 1

    def wants_compiled(self) -> bool:
        """Whether the next accepted step runs compiled (it follows an eager one)."""
        return self._eager is not None

    def add(self, compiled: bool, rows: int, seconds: float) -> None:
        """One accepted step's wall seconds: `rows` rows, on the compiled path or not."""
        if not compiled:
            self._eager = (rows, seconds)
            return
        last, self._eager = self._eager, None
        if last is not None and last[0] == rows:
            if self._skip:
                self._skip -= 1
            else:
                self.pairs.append((last[1], seconds))

    def done(self) -> bool:
        return len(self.pairs) >= self.PAIRS

    def decide(self) -> tuple[str, dict[str, float]]:
        """("compiled" or "eager", {name: median seconds per step}), recorded in the chooser's cache."""
        timings = {"eager": statistics.median(p[0] for p in self.pairs),
                   "compiled": statistics.median(p[1] for p in self.pairs)}
        # the graph on trial is built: it stays unless eager beats it by the margin. Its saving is
        # a step's fixed overhead, a small share of the wide steps that live traffic brings: on
        # the AMX Xeon, 64 queued requests timed it 2.6% faster than eager at ~64 rows (270 ms a
        # step), under the 3% margin, and the cached "eager" then ran single streams without it
        return self.chooser.record(self.key, timings, "compiled", "measured on live steps"), timings


ROUNDS = 3  # decode_graph_candidates: eager and compiled steps in turn, this many times


def decode_graph_candidates(runner, make_graph, max_rows: int, rows=(1, 8), context: int = 128,
                            steps: int = 4, max_model_len: int | None = None) -> dict:
    """Timers for kernel_choice's `decode_graph` choice: median seconds of a decode step of this
    runner's model at each of `rows` (geometric mean), eager ("eager") and captured ("compiled"),
    measured together on the first timer's call: the graph compiled first, then ROUNDS rounds of
    both arms in turn. make_graph() -> the DecodeGraph (made on that call: a choice taken from
    the cache or an override times nothing and makes no graph here); max_rows: its row limit.
    The compile is not timed. Uses the cache's first blocks
    and zeroes them afterwards (the engine has not admitted a request yet). max_model_len: the
    engine's context limit; the timed context is shortened to fit it (the RoPE tables end there)."""
    from mixserve.layers.kernel_choice import geomean

    limit = max_model_len if max_model_len is not None else context + steps + 3
    if limit < 8:  # too short a context to time a step in (1 token of context, 1 step, 2 warm-ups)
        return {"eager": lambda: 1.0}
    steps = max(1, min(steps, limit - 4))
    context = max(1, min(context, limit - steps - 3))
    bs = runner.block_size
    per_row = -(-(context + steps + 3) // bs)
    rows = [r for r in rows if r <= max_rows and r * per_row <= runner.num_blocks]
    if not rows:
        rows = [1]
        context = max(1, min(min(per_row, runner.num_blocks) * bs, limit) - steps - 3)

    done: dict[str, float] = {}

    def measure() -> None:
        # Both arms in turn, after the compile: timed one after the other, the compiled arm ran
        # right behind a minute of tracing (Inductor's compile workers starting, the allocator's
        # state) and lost to eager on the 0.5B where it is 10-20% faster at 1 and 8 rows (by hand,
        # 2026-12-06). Each round times eager then compiled steps at every row count; medians
        # over the rounds' steps. The first two steps of each run (oneDNN's first calls) are not timed.
        graph = make_graph()
        dummy_decode_steps(runner, rows[0], context, 2, graph.run)  # the compile, or the cache's load
        per: dict[str, dict[int, list[float]]] = {"eager": {r: [] for r in rows}, "compiled": {r: [] for r in rows}}
        for _ in range(ROUNDS):
            for r in rows:
                for name, run in (("eager", runner.run_eager), ("compiled", graph.run)):
                    per[name][r] += dummy_decode_steps(runner, r, context, steps + 2, run)[2:]
        for name, by_rows in per.items():
            done[name] = geomean(statistics.median(v) for v in by_rows.values())

    def timer(name: str):
        def run():
            if not done:
                measure()
            return done[name]
        return run

    return {"eager": timer("eager"), "compiled": timer("compiled")}
