"""GGUF block-quantized weights held as they are: one integer kernel for every type, built per ISA.

Two variants of the kernel, chosen by the build's instruction set: AVX512-VNNI (`vpdpbusd`,
`vpdpwssd`) and AVX2 (`vpmaddubsw` + `vpmaddwd`, issue 43; `MIXSERVE_ISA=avx2` forces it). The
layout (16-row panels), the activations' int16 quantization and the float order every kernel
shares are written down in layers/gguf_src.py, which holds the C++: a few-row kernel streams the
weights once for up to 4 activation rows a pass, a many-row kernel unpacks a tile of panels to
int16 once and runs every row against it; both form the same exact integer group sums and the same
float steps, so a row's bits depend neither on the row count nor on the variant.

The types (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; formats in ggml's `ggml-common.h` and the GGUF spec,
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md) keep the file's integers and scale
fields (repacked once at load, layers/gguf_linear.py, layers/gguf_blocks.py). Every product d * sc
and dm * mn is exact in float32 and s * q + m is one fused multiply-add of exact operands, so the
effective weights (`dequantize`) equal gguf's float32 dequantization bit for bit
(tests/unit/test_gguf_native.py).
"""
from __future__ import annotations

import logging
import os

import torch

from mixserve.env import cpu_flags, forced_isa
from mixserve.layers.cpp_build import Kernel, build_extension
from mixserve.layers.gguf_src import AVX2_SRC, SRC


_SRC = SRC.replace("@AVX2@", AVX2_SRC)

_state: dict = {}
log = logging.getLogger("mixserve")
# the least the kernel needs (its AVX2 variant), as /proc/cpuinfo names them; AVX512-VNNI and
# AVX512-BW, where -march=native turns them on, build the VNNI variant instead
NEEDS = frozenset({"avx2", "fma", "f16c"})
ISA_NAMES = {2: "avx512-vnni", 1: "avx2"}


def kernel() -> Kernel:
    """This kernel as this process builds it (one of cpp_build.BUNDLED): its variant is decided by
    $MIXSERVE_ISA at the first call and kept, since both variants register the same ops and a second
    library of them would abort the process (a later change is logged and has no effect)."""
    isa = forced_isa()
    if "kernel" not in _state:
        if isa == "avx2":  # -march=native less AVX-512: the AVX2 variant, in a build of its own
            _state["kernel"] = Kernel("mixserve_gguf_v6_avx2", _SRC, ("available", "isa_level"), NEEDS,
                                      ("-mno-avx512f",))
        else:
            _state["kernel"] = Kernel("mixserve_gguf_v6", _SRC, ("available", "isa_level"), NEEDS)
        _state["isa"] = isa
    elif isa != _state["isa"]:
        log.warning("MIXSERVE_ISA changed to %r after the native GGUF kernel was chosen (%r): kept for this process",
                    isa, _state["isa"])
        _state["isa"] = isa  # said once per change
    return _state["kernel"]


def bundled() -> bool:
    """Whether this kernel is built with the others of cpp_build.BUNDLED: where GGUF files load
    natively by default (may_default_native). Elsewhere (a CPU without AVX2, FMA or F16C) a start
    dequantizes and would compile it for nothing."""
    return may_default_native()


def build():
    """The built library (cpp_build.build_extension), nothing registered: what may run on another thread."""
    k = kernel()
    return build_extension(k.name, k.source, list(k.functions), needs=k.needs, extra_flags=k.extra_flags)


def may_default_native() -> bool:
    """False where default_native() is false for certain without building anything: a CPU whose
    flags lack AVX2, FMA or F16C (the least either variant needs)."""
    flags = cpu_flags()
    return not flags or NEEDS <= flags


def default_native() -> bool:
    """Whether a GGUF file loads natively when --gguf-weights is not given: wherever a variant of
    the kernel runs, AVX512-VNNI or AVX2. The AVX2 variant had been asked for by --gguf-weights native
    only, while its many-row kernel ran 1.3-1.6x the float32 invariant GEMM's time; with its sums
    kept in registers it runs the 0.5B's prefill in 0.85x the dequantized float32 path's time and
    decodes 1 and 8 rows in 0.31x and 0.62x, from a fifth of the bytes (64 rows: 1.18x; BENCHMARKS.md,
    issue 43, "native by default on AVX2"). Builds the kernel only where may_default_native()."""
    return may_default_native() and available()


def why_not_native() -> str:
    """The start-up line's reason a GGUF file was dequantized by default (default_native false)."""
    flags = cpu_flags()
    if flags and not NEEDS <= flags:
        return "no native kernel here: it needs AVX2, FMA and F16C"
    if os.environ.get("MIXSERVE_NO_CPP_KERNELS"):
        return "no native kernel here: MIXSERVE_NO_CPP_KERNELS turns the C++ kernels off"
    if not available():
        return "no native kernel here: its C++ build failed (its warning above says why)"
    return f"the native kernel here is its {isa()} variant; --gguf-weights native runs it"


def isa() -> str | None:
    """The instruction set the loaded kernel runs ("avx512-vnni" or "avx2"); None where there is none."""
    mod = _load()
    return ISA_NAMES.get(int(mod.isa_level())) if mod is not None else None


def _load():
    if "mod" not in _state:
        mod = build()
        mod = mod if mod is not None and mod.available() else None
        if mod is not None:
            torch.library.register_fake("mixserve::gguf_matmul")(
                lambda x, lo, hi, d, sc, dm, mn, N, G, S, HB, z, levels=2, prefetch=0, variant=0:
                x.new_empty(x.shape[0], N, dtype=torch.float32))
            torch.library.register_fake("mixserve::gguf_dequant")(
                lambda lo, hi, d, sc, dm, mn, N, G, S, HB, z, rows, all_rows, out: None)
        _state["mod"] = mod
    return _state["mod"]


def available() -> bool:
    """True where the kernel builds for this CPU (AVX2, FMA and F16C at least) and loads."""
    return _load() is not None


# int16 activation rows (a row is one, or two for the LM head's float32 logits) run by the few-row
# kernel's streaming passes, 4 rows a pass, before the many-row kernel (the C++ g_wide_rows' default)
DEFAULT_WIDE_ROWS = 8


def amx_built() -> bool:
    """Whether the loaded kernel holds its AMX-INT8 many-row variant (built where the compiler
    targets AMX-TILE and AMX-INT8 with AVX512-VNNI: -march=native on an AMX CPU)."""
    return _load() is not None and int(torch.ops.mixserve.gguf_amx(-1)) >= 0


def set_amx(on: bool) -> bool:
    """Allow (on) or forbid the many-row kernel's AMX-INT8 variant, for the weights that ask for it
    (GGUFWeight.many, chosen by timing: gguf_linear.choose); returns the setting before. Both
    variants give the same bits (layers/gguf_src.py). Allowing it first asks Linux for AMX's state
    (kernel_choice.amx_permitted: granted per process; an AMX instruction without it kills the
    process). Raises RuntimeError where `on` is asked for and amx_built() is false or the state is
    refused."""
    if on and not amx_built():
        raise RuntimeError("the native GGUF kernel here has no AMX-INT8 variant")
    if on:
        from mixserve.layers import kernel_choice

        # asks Linux for AMX's state (once a process); an AMX instruction without it is SIGILL
        if not kernel_choice.amx_permitted():
            raise RuntimeError("this process may not use AMX (Linux did not grant its state): "
                               "the AMX-INT8 variant stays off")
    if _load() is None:
        return False
    return int(torch.ops.mixserve.gguf_amx(int(bool(on)))) > 0


def enable_amx() -> bool:
    """Allow the AMX-INT8 many-row variant where it is built, no ISA is forced and the process may
    use AMX (kernel_choice.amx_permitted, which asks Linux for AMX's state); True where it is now
    allowed."""
    from mixserve.layers.kernel_choice import amx_permitted

    if forced_isa() == "avx2" or not amx_built() or not amx_permitted():
        return False
    set_amx(True)
    return True


def amx_allowed() -> bool:
    """Whether the AMX-INT8 many-row variant is allowed in this process (enable_amx, set_amx)."""
    return _load() is not None and int(torch.ops.mixserve.gguf_amx(-1)) > 0


def set_wide_rows(n: int) -> int:
    """Run up to `n` (>= 1) int16 activation rows by streaming passes through the weights (above it:
    the many-row kernel); returns the value before. Both give the same bits; this only moves time
    (benchmarks/gguf_wide_rows.py). The AVX2 variant streams at most 4. Raises RuntimeError without
    the kernel."""
    if _load() is None:
        raise RuntimeError(f"the native GGUF kernel is not available here: {why_not_native()}")
    return int(torch.ops.mixserve.gguf_wide_rows(int(n)))
