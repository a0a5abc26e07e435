"""Kernels chosen by measuring them on the machine at hand, never by a constant tuned on another.

The project's machines differ (a Zen 5 and an AVX-512/AMX Xeon of the same size): oneDNN's
prepacked bf16 GEMM is 1.37x plain `F.linear` on one and 0.87x on the other, batched-matmul decode
attention 7x PyTorch's SDPA on one and 0.7x on the other. So each choice is a short timing of the
candidates on the model's own shapes, made once per CPU model and torch version and cached:

- `dense_linear/<dtype>/<out>x<in>`: "plain" (F.linear) or "onednn" (weight prepacked once into
  oneDNN's blocked layout), timed at 1, 16 and 128 rows;
- `decode_attention/<dtype>/<heads>x<kv_heads>x<head_dim>`: "sdpa" (PyTorch's fused kernel),
  "bmm" (layers/attention.py `_decode_attention`), both over the gathered context, or "paged"
  (layers/paged_decode.py, the block table read in place), at 1 and 16 rows of 512 context;
- `int4_kernel/<dtype>/<out>x<in>g<group>`: "torch" (PyTorch's int4 kernel, bf16 activations) or
  "vnni" (layers/int4_vnni.py: int8 activations x int4 weights, AVX512-VNNI), at 1 and 4 rows;
- `int4_dense_rows/<dtype>/<out>x<in>[/vnni]/deq<rev>`: the row count from which dequantize + dense
  GEMM beats the chosen few-row int4 kernel ("never": that kernel at every row count); the key names
  the dequantization kernel's revision, so timings of an older one are not reused;
- `decode_graph/<dtype>/<model shape>/<weights: dense, int4g<group>, gguf-<kernel>>/g2`: "eager" steps or the "compiled" decode graph
  (engine/decode_graph.py), timed as whole decode steps of the model at 1 and 8 rows.

Weights are timed on rotating copies whose total exceeds the last-level cache (`llc_bytes`), as a
decode step streams every weight once: a cache-hot timing flatters whichever kernel reads more
bytes. The plain eager path ("plain", "sdpa", "never") is always a candidate and another wins only
when it is faster by `MARGIN`, so no choice is slower than eager PyTorch beyond timing noise.

Order of authority: an override (`MIXSERVE_KERNELS="dense_linear=plain,decode_attention=bmm"`, a
key prefix per entry, or "eager" for the eager path everywhere), then the cache
(`$MIXSERVE_KERNEL_CACHE`, else `<cache root>/kernels/choices.json`; a corrupt or foreign entry is
ignored and remeasured), then a measurement.

A start measures for `budget_s` seconds at most (default 20, `$MIXSERVE_KERNEL_BUDGET`; issue 32:
a first start on a new machine timed kernels for minutes): a choice left when it is spent runs its
eager candidate, uncached, and a later start (or `mixserve prepare`, which has no budget) times it.
The decode graph's choice is outside the budget: its timing is an Inductor compile whose length
is unknown until it has run once. With the graph warmed up in the background it is not timed before
serving at all: the engine times it on live steps (engine/decode_graph.py GraphTrial) and `record`s it.
"""
from __future__ import annotations

import json
import math
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

import mixserve.startup as startup
from mixserve.env import cache_root, cpu_isa_key, cpu_model, note_unkept, usable_cores

log = logging.getLogger("mixserve")

CACHE_VERSION = 1
MARGIN = 0.03  # a candidate must beat the eager one by 3% (timing noise on a shared 2-core VM)
BUDGET_S = 20.0  # seconds of kernel timing one start may spend (issue 32's bound for a first start)
UNBUDGETED = ("decode_graph/",)  # keys whose timing is a compile of unknown length: outside the budget
EAGER = {"dense_linear": "plain", "decode_attention": "sdpa", "int4_kernel": "torch", "int4_dense_rows": "never",
         "decode_graph": "eager", "float_head": "plain", "float_head_rows": "never",
         # native GGUF weights have no PyTorch kernel: eager runs ours at every row count, no
         # software prefetch
         "gguf_prefetch": "0", "gguf_dense_rows": "never", "gguf_many": "vnni",
         "gguf_passes": "one"}


def machine_key() -> str:
    """The kernel choices' cache identity: "<CPU model> [isa <cpu_isa_key()>] | torch <version>", and
    " | forced <isa>" where $MIXSERVE_ISA forces a variant (env.forced_isa): its kernels differ (the
    GGUF kernel's AVX2 build, oneDNN capped at AVX2), so the choices timed for the CPU's own ISA
    (prefetch, row switches, the decode graph) are not theirs, nor theirs the CPU's."""
    from mixserve.env import forced_isa

    forced = forced_isa()
    return (f"{cpu_model()} [isa {cpu_isa_key()}] | torch {torch.__version__}"
            + (f" | forced {forced}" if forced else ""))


def llc_bytes() -> int:
    """Size in bytes of the largest CPU cache (sysfs); 64 MiB where sysfs does not say."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
            best = max(best, int(text.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or 64 << 20


def cap_threads() -> int:
    """Never more intra-op threads than usable cores (oversubscription stalls every GEMM on a
    2-core VM). Returns the thread count in force."""
    n = usable_cores()
    if torch.get_num_threads() > n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


# GEMM primitives oneDNN keeps per process (ideep's LRU_CACHE_CAPACITY and oneDNN's own cache)
PRIMITIVE_CACHE_CAPACITY = 16


def bound_primitive_caches(capacity: int = PRIMITIVE_CACHE_CAPACITY) -> None:
    """Cap the primitive caches of PyTorch's oneDNN path (ideep's `LRU_CACHE_CAPACITY`, oneDNN's
    `ONEDNN_PRIMITIVE_CACHE_CAPACITY`; both default to 1,024 entries) unless the user set them;
    read at the first oneDNN call, so call this before one. Each cached primitive is one GEMM
    shape, and a prefill's token count changes the shape every step: with the defaults a server
    grew by ~30 MiB a minute for as long as new token counts kept coming (benchmarks/soak.py), and
    600 random row counts over the 0.5B's linear shapes held 2.0 GB (benchmarks/primitive_cache.py),
    capped at 16 about 0.2 GB (at 64 an engine still grew for minutes). A step uses
    about five shapes (the same for every layer), so 16 keeps the last three steps' primitives."""
    for name in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))


def cap_isa() -> str | None:
    """Apply $MIXSERVE_ISA (env.forced_isa): "avx2" caps PyTorch's GEMMs at AVX2 too, both of its
    libraries: oneDNN (ONEDNN_MAX_CPU_ISA; the bf16 GEMMs) and MKL (MKL_ENABLE_INSTRUCTIONS; float32
    `F.linear` is MKL's sgemm, which on an AVX-512 CPU ran 1.5x faster than capped, 2026-12-07, so
    the forced arm's `--batch-invariant off` was not an AVX2 machine's). Each library reads its
    variable at its first call: call this before one. Returns the forced ISA."""
    from mixserve.env import forced_isa

    isa = forced_isa()
    if isa == "avx2":
        os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = "AVX2"
    return isa


def amx_permitted(cpu_flags: str | None = None, request: Callable[[], bool] | None = None) -> bool:
    """True when the CPU has AMX tiles and the kernel granted this process their use (Linux asks
    each process to request the AMX state with arch_prctl; torch._C._cpu._init_amx does it).
    Where the request fails, oneDNN is capped below AMX (ONEDNN_MAX_CPU_ISA) so that it never
    issues an AMX instruction it may not run, the fault that kills llama.cpp's AMX build."""
    from mixserve.env import cpu_flags as read_cpu_flags

    if "amx_tile" not in (read_cpu_flags() if cpu_flags is None else set(cpu_flags.split())):
        return False
    request = request or getattr(torch._C._cpu, "_init_amx", lambda: False)
    try:
        ok = bool(request())
    except Exception:
        ok = False
    if not ok:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    return ok


def parse_overrides(text: str) -> dict[str, str]:
    """'dense_linear=plain,decode_attention=bmm' -> {key prefix: candidate}; 'eager' -> EAGER.
    Raises ValueError on an entry without '=', an empty name, or a key of no known choice (a
    typo would otherwise be ignored silently)."""
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        if part == "eager":
            out.update(EAGER)
            continue
        if "=" not in part:
            raise ValueError(f"kernels: {part!r} is not KEY=NAME (e.g. dense_linear=plain) or 'eager'")
        k, v = (x.strip() for x in part.split("=", 1))
        if k.split("/")[0] not in EAGER or not v:
            raise ValueError(f"kernels: {part!r}: the key must start with one of {', '.join(EAGER)} and name a "
                             "kernel (e.g. dense_linear=plain)")
        out[k] = v
    return out


@dataclass
class Choice:
    """One decision: the candidate used for `key`, how it was decided ("override", "cache",
    "measured", "measured, not cached" where a timing came out NaN, or "prior" where nothing was
    timed: KernelChooser's timing "prior"), and the measured seconds
    per call of each candidate (empty for an override)."""

    key: str
    name: str
    source: str
    timings: dict[str, float] = field(default_factory=dict)


def default_cache_path() -> Path:
    env = os.environ.get("MIXSERVE_KERNEL_CACHE")
    return Path(env) if env else cache_root() / "kernels" / "choices.json"


class KernelChooser:
    """Decides kernels once per (CPU model, torch version, key) and remembers them.

    Args:
        path: the JSON cache (default_cache_path()); overrides: {key prefix: name}, default from
            $MIXSERVE_KERNELS; machine: cache identity, default "<CPU model> [isa <cpu_isa_key()>] | torch <version>".
        timing: "measure" (time the candidates of a choice the cache lacks, and cache the result)
            or "prior" (time nothing: a choice the cache lacks is its eager candidate, not cached;
            for test suites and replicas that must start at once); default $MIXSERVE_KERNEL_TIMING,
            else "measure".
        budget_s: seconds of measurement this chooser may spend (wall time of the timings, the
            decode graph's excepted); a choice asked for after it is spent is its eager candidate,
            not cached. Default $MIXSERVE_KERNEL_BUDGET, else BUDGET_S; math.inf for no bound.
    Raises ValueError for another timing, or a budget that is not a number >= 0.
    """

    def __init__(self, path: str | os.PathLike | None = None, overrides: dict[str, str] | None = None,
                 machine: str | None = None, timing: str | None = None, budget_s: float | None = None):
        self.path = Path(path) if path is not None else default_cache_path()
        self.timing = timing or os.environ.get("MIXSERVE_KERNEL_TIMING") or "measure"
        if self.timing not in ("measure", "prior"):
            raise ValueError(f"kernel timing: must be measure or prior (got {self.timing!r}; "
                             "from $MIXSERVE_KERNEL_TIMING where not passed)")
        if budget_s is None:
            env = os.environ.get("MIXSERVE_KERNEL_BUDGET", "")
            try:
                budget_s = float(env) if env else BUDGET_S
            except ValueError:
                raise ValueError(f"MIXSERVE_KERNEL_BUDGET (environment): seconds, a number >= 0 or inf "
                                 f"(got {env!r})") from None
        if not budget_s >= 0:  # NaN too
            raise ValueError(f"kernel timing budget: seconds, a number >= 0 or inf (got {budget_s!r})")
        self.budget_s = budget_s
        self.spent_s = 0.0  # wall seconds of measurement so far (the budgeted keys')
        self.over_budget: list[str] = []  # keys left to their eager candidate once the budget was spent
        if overrides is None:
            try:
                overrides = parse_overrides(os.environ.get("MIXSERVE_KERNELS", ""))
            except ValueError as e:
                raise ValueError(f"MIXSERVE_KERNELS (environment): {e}") from None
        self.overrides = overrides
        # the instruction set too: "AMD EPYC" names machines with and without AVX-512
        self.machine = machine or machine_key()
        self.choices: dict[str, Choice] = {}

    def _override(self, key: str) -> str | None:
        hits = [p for p in self.overrides if key == p or key.startswith(p + "/")]
        return self.overrides[max(hits, key=len)] if hits else None

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else {}
        except (OSError, ValueError):
            return {}

    def _foreign(self) -> str | None:
        """Why the cache file must not be overwritten (a folder, or another version's cache that
        another mixserve may be using), else None."""
        if self.path.is_dir():
            return "it is a directory"
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        if isinstance(data, dict) and isinstance(data.get("version"), int) and data["version"] != CACHE_VERSION:
            return f"it is a version-{data['version']} cache (this mixserve writes version {CACHE_VERSION})"
        return None

    def _write(self, key: str, choice: Choice) -> None:
        why = self._foreign()
        if why:  # measured again next start, and nothing of the other cache lost
            if not getattr(self, "_warned", False):
                log.warning("kernel choices not cached in %s: %s; set MIXSERVE_KERNEL_CACHE to another file",
                            self.path, why)
                self._warned = True
            return
        data = self._read() or {"version": CACHE_VERSION, "machines": {}}
        if not isinstance(data.get("machines"), dict):
            data["machines"] = {}
        entry = data["machines"].setdefault(self.machine, {})
        if not isinstance(entry, dict):
            entry = data["machines"][self.machine] = {}
        entry[key] = {"name": choice.name, "timings": choice.timings}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            try:
                os.replace(tmp, self.path)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as e:  # an unwritable cache costs a remeasurement next time, nothing more
            note_unkept("kernel choices", f"{self.path}: {e.strerror or e}")

    def choose(self, key: str, candidates: dict[str, Callable[[], float]], eager: str) -> str:
        """The candidate to use for `key`.

        candidates: name -> a callable that times that candidate and returns seconds per call;
        eager: the name of the plain eager path, kept unless another beats it by MARGIN.
        Raises ValueError for an override naming no candidate.
        """
        if key in self.choices:
            return self.choices[key].name
        forced = self._override(key)
        if forced is not None:
            if forced not in candidates:
                raise ValueError(f"kernels: {key} has no candidate {forced!r} (candidates: {', '.join(candidates)})")
            self.choices[key] = Choice(key, forced, "override")
            return forced
        if self._from_cache(key, candidates):
            return self.choices[key].name
        if self.timing == "prior":
            self.choices[key] = Choice(key, self._eager(key, candidates, eager), "prior")
            return eager
        budgeted = not key.startswith(UNBUDGETED)
        if budgeted and self.spent_s >= self.budget_s:
            if not self.over_budget:
                log.warning("kernels: this start's timing budget (%.0f s, MIXSERVE_KERNEL_BUDGET) is spent; the "
                            "choices left run their eager kernels, uncached, and are timed at a later start "
                            "(`mixserve prepare` times them all)", self.budget_s)
            self.over_budget.append(key)
            self.choices[key] = Choice(key, self._eager(key, candidates, eager), "prior (timing budget spent)")
            return eager
        # one process of a machine times at a time (two at once would each slow the other's
        # timings and cache inflated figures); another one runs the prior meanwhile, uncached
        lock = self._try_lock()
        if lock is False:
            log.warning("kernels: another process is timing kernels (%s); %s runs %s here for now, not cached",
                        self.path.name + ".lock", key, eager)
            self.choices[key] = Choice(key, self._eager(key, candidates, eager), "prior (another process was timing)")
            return eager
        try:
            if self._from_cache(key, candidates):  # that process may have just timed this one
                return self.choices[key].name
            return self._measure(key, candidates, eager)
        finally:
            if lock is not None:
                lock.close()

    @staticmethod
    def _eager(key: str, candidates: dict, eager: str) -> str:
        if eager not in candidates:
            raise ValueError(f"kernels: {key}: the eager candidate {eager!r} is not among {', '.join(candidates)}")
        return eager

    def _from_cache(self, key: str, candidates: dict) -> bool:
        """Take `key`'s cached choice into self.choices where there is a valid one. A cached choice
        stands only for the same candidates (a new kernel gets measured) and finite timings."""
        cached = self._read().get("machines", {})
        cached = cached.get(self.machine, {}) if isinstance(cached, dict) else {}
        hit = cached.get(key) if isinstance(cached, dict) else None
        if (isinstance(hit, dict) and hit.get("name") in candidates and isinstance(hit.get("timings"), dict)
                and set(hit["timings"]) == set(candidates)
                and all(isinstance(v, (int, float)) and not math.isnan(v) for v in hit["timings"].values())):
            self.choices[key] = Choice(key, hit["name"], "cache", dict(hit["timings"]))
            return True
        return False

    def _try_lock(self):
        """An open file holding an exclusive lock on `<cache>.lock`; False when another process
        holds it; None where no lock file can be made (a read-only or odd cache path: time anyway)."""
        import fcntl

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path.with_name(self.path.name + ".lock"), "a")
        except OSError:
            return None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return False
        except OSError:
            f.close()
            return None
        return f

    def _measure(self, key: str, candidates: dict, eager: str) -> str:
        # a warning, not info: a first start is silent for up to a minute otherwise
        budget = "" if key.startswith(UNBUDGETED) or math.isinf(self.budget_s) else \
            f"; {self.spent_s:.0f} of this start's {self.budget_s:.0f} s spent"
        # the graph's first timed call compiles it: a minute of no other line on 2 cores
        compiles = "; the compiled candidate compiles first (Inductor, up to a minute the first time)" \
            if key.startswith("decode_graph") else ""
        log.warning("timing kernels for %s: %d candidates (once per machine, cached in %s%s)%s", key,
                    len(candidates), self.path, budget, compiles)
        # a timing that raises propagates before anything is written; one that came out NaN is left
        # out, and the choice is not cached: a failed measurement is never remembered (issue 46)
        from mixserve.layers.cpp_build import wait_for_background_builds

        wait_for_background_builds()  # its compilers would inflate the timings (and trip the load check)
        t0, ticks0 = time.perf_counter(), cpu_ticks()
        try:
            timings = {name: float(fn()) for name, fn in candidates.items()}
        finally:
            dt = time.perf_counter() - t0
            startup.add("kernel timing", dt)
            if not key.startswith(UNBUDGETED):
                self.spent_s += dt
        # hw probe's load check, per measurement: timings taken while other processes ran are
        # inflated unevenly (each candidate met a different share of their work), so the choice
        # serves this process and is timed again next start, never cached
        # (not the decode graph's: its first timed calls compile, on Inductor's worker processes)
        others = other_cores(ticks0, cpu_ticks()) if not key.startswith(UNBUDGETED) else None
        busy = None
        if others is not None and others > BUSY_CORES:
            busy = f"other processes used {others:.1f} cores while it was timed"
        return self.record(key, timings, eager, uncached=busy)

    def known(self, key: str, candidates: dict) -> str | None:
        """`key`'s choice where an override or the cache decides it (then taken as `choose` would
        take it), else None: the caller may measure it its own way and `record` the timings
        (the decode graph's trial on live steps, engine/decode_graph.py GraphTrial).
        Raises ValueError for an override naming no candidate."""
        if key in self.choices:
            return self.choices[key].name
        forced = self._override(key)
        if forced is not None or self._from_cache(key, candidates):
            return self.choose(key, candidates, next(iter(candidates)))
        return None

    def record(self, key: str, timings: dict[str, float], eager: str, source: str = "measured",
               uncached: str | None = None) -> str:
        """Decide `key` from `timings` (name -> seconds per call, however measured) by the rule
        `choose` applies (the fastest, unless it beats `eager` by less than MARGIN), remember it
        and cache it. A NaN timing is left out and nothing is cached; nor is anything where
        `uncached` gives a reason. Returns the choice.
        Raises RuntimeError when every timing is NaN."""
        failed = [name for name, t in timings.items() if math.isnan(t)]
        timings = {name: t for name, t in timings.items() if name not in failed}
        if not timings:
            raise RuntimeError(f"kernels: every candidate for {key} timed as NaN")
        best = min(timings, key=timings.get)
        if best != eager and eager in timings and timings[best] > (1 - MARGIN) * timings[eager]:
            best = eager
        if failed:
            uncached = f"{', '.join(failed)} timed as NaN"
        if uncached:
            log.warning("kernels: %s: %s; using %s for this process, not cached", key, uncached, best)
            note_unkept("kernel choices", f"{key}: {uncached}")  # `prepare` exits 1 naming it
            self.choices[key] = Choice(key, best, f"{source}, not cached: {uncached}", timings)
            return best
        self.choices[key] = choice = Choice(key, best, source, timings)
        self._write(key, choice)
        return best

    def describe(self) -> list[str]:
        """One line per decision: key, choice, how decided, and each candidate's time."""
        lines = []
        for c in self.choices.values():
            t = ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in c.timings.items())
            lines.append(f"{c.key}: {c.name} ({c.source}{'; ' + t if t else ''})")
        return lines


BUSY_CORES = 0.5  # other processes' CPU use (in cores) above which a timing is not cached


def cpu_ticks() -> tuple[int, int, int] | None:
    """(busy ticks of all CPUs, all ticks of all CPUs, this process's ticks), in clock ticks
    (USER_HZ), from /proc/stat and /proc/self/stat (proc(5)); None where they cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            # after the command name, which may hold spaces: field 14 (utime) and 15 (stime)
            rest = f.read().rsplit(")", 1)[1].split()
        own = int(rest[11]) + int(rest[12])
    except (OSError, ValueError, IndexError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is in user)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return total - idle, total, own


def other_cores(before, after) -> float | None:
    """Cores' worth of CPU time that processes other than this one used between two `cpu_ticks()`;
    None where either is None or under 0.2 s passed (a few ticks say nothing)."""
    if before is None or after is None:
        return None
    busy, total, own = (a - b for a, b in zip(after, before))
    cpus = os.cpu_count() or 1
    if total < 0.2 * os.sysconf("SC_CLK_TCK") * cpus:
        return None
    return max(0.0, busy - own) / (total / cpus)


def rotating_copies(make: Callable[[], object], nbytes: int, max_copies: int = 512) -> list:
    """Copies made by `make()` (each `nbytes`) until their total exceeds 1.5x the last-level cache,
    so that cycling over them reads each from memory as a decode step does. max_copies bounds the
    count for tiny shapes, which are cache-resident in use too."""
    n = max(2, min(max_copies, -(-int(1.5 * llc_bytes()) // max(1, nbytes))))
    return [make() for _ in range(n)]


def time_calls(copies: list, call: Callable[[object], object], min_passes: int = 3,
               min_seconds: float = 0.05, budget: float = 0.3) -> float:
    """Median seconds per `call(copy)` over passes that each cycle once through `copies`.

    A call that is slow enough to be compute-bound (a 512-row GEMM) gains nothing from rotation,
    so passes use only as many copies (at least 2) as keep min_passes of them within `budget`
    seconds: a kernel choice on a new machine stays a matter of seconds, not minutes."""
    call(copies[0])  # the first call of a shape may build a oneDNN primitive: not timed
    t0 = time.perf_counter()
    call(copies[1 % len(copies)])
    first = time.perf_counter() - t0
    use = copies[:max(2, min(len(copies), int(budget / (min_passes * max(first, 1e-9)))))]
    per_pass = []
    t_end = time.perf_counter() + min_seconds
    while (len(per_pass) < min_passes or time.perf_counter() < t_end) and len(per_pass) < 50:
        t0 = time.perf_counter()
        for c in use:
            call(c)
        per_pass.append((time.perf_counter() - t0) / len(use))
    per_pass.sort()
    return per_pass[len(per_pass) // 2]


def geomean(xs) -> float:
    xs = list(xs)
    return float(torch.tensor(xs, dtype=torch.float64).log().mean().exp())


# Row counts at which an LM head's two float32 paths are timed to place their switch
FLOAT_HEAD_ROWS = (1, 2, 4, 8, 16, 64)


def switch_candidates(rows: tuple[int, ...], time_at) -> dict:
    """Timers for a switch point between a few-row path and a many-row path: candidate "never"
    (the few-row path at every row count) and "R" for R in `rows` (the many-row path from R rows
    on), each the geometric mean over `rows` of its seconds per call there. `time_at(r, many)`
    times one path at r rows; both are timed once per row count, and once the many-row path has
    won at two row counts in a row the few-row path is not timed further up (it only loses more,
    and can take seconds a call)."""
    timed: dict[int, tuple[float, float]] = {}

    def measure():
        if timed:
            return timed
        many_ahead = 0
        for r in rows:
            few = float("inf") if many_ahead >= 2 else time_at(r, False)
            many = time_at(r, True)
            many_ahead = many_ahead + 1 if many < few else 0
            timed[r] = (few, many)
        return timed

    def cost(threshold):
        return lambda: geomean(t[1] if threshold is not None and r >= threshold else t[0]
                               for r, t in measure().items())

    return {"never": cost(None), **{str(r): cost(r) for r in rows}}
