"""Engine settings (`EngineArgs`, the CLI flags of the same names) and the parsers for their
size and dtype values."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from mixserve.env import forced_isa
from mixserve.kv.contiguous import RESERVE_MODES
from mixserve.layers.kernel_choice import parse_overrides
from mixserve.models.loader import is_awq_folder

_DEFAULT_KV_MEMORY = "1GiB"
# the kernel choices batch invariance pins (layers/batch_invariance.py), with the one an override
# may still name (None: none; the invariant kernels are no candidate of the measured choice)
INVARIANT_CHOICES = {"dense_linear": None, "float_head": None, "decode_attention": "paged",
                     "int4_dense_rows": "never", "gguf_dense_rows": "never", "float_head_rows": "never"}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '384MiB', '1.5GB' or a plain integer -> bytes. Raises ValueError on anything else."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 2GiB, 512MiB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """bfloat16 on CUDA (device None: where PyTorch sees a GPU) and where the CPU has native
    bf16-capable vector units (AVX-512), else float32; float32 under MIXSERVE_ISA=avx2 too, which
    stands for an AVX2-only CPU (oneDNN is capped at AVX2 there, where bf16 GEMMs ran 4x slower
    than the invariant path: a forced run in bf16 measured a configuration no AVX2 machine gets)."""
    if (torch.device(device).type == "cuda") if device is not None else torch.cuda.is_available():
        return torch.bfloat16
    if forced_isa() == "avx2":
        return torch.float32
    cap = torch.backends.cpu.get_cpu_capability()
    return torch.bfloat16 if cap.startswith(("AVX512", "AMX")) else torch.float32


def parse_dtype(name: str | torch.dtype | None, device: torch.device | str | None = None) -> torch.dtype:
    """--dtype -> torch.dtype; "auto" (None) is default_dtype(device). Raises ValueError."""
    if name is None or name == "auto":
        return default_dtype(device)
    if isinstance(name, torch.dtype):
        return name
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype: unknown {name!r}; use bfloat16 or float32")
    return table[name]


@dataclass
class EngineArgs:
    """Engine settings (the CLI flags of the same names).

    model: built-in name, GGUF path or HF folder. dtype: compute and KV dtype.
    block_size: tokens per KV block. kv_cache_memory: bytes for the KV cache (e.g. "1GiB").
    max_num_seqs: most running sequences. max_num_batched_tokens: token budget per step.
    max_model_len: longest prompt + output in tokens (default: the model's context length).
    shuffle_blocks_seed: hand out KV blocks in random order (tests).
    draft_model: built-in name / path of a draft model sharing the target's vocabulary, or
        "ngram" for prompt lookup; None disables speculative decoding.
    num_speculative_tokens: the largest k proposed per step. speculation: auto | fixed | off.
    draft_quantization: None (the draft model as stored: a GGUF natively, like the target) or
        "rtn": the draft rounded to int4 at load (group quant_group_size, its LM head too), so a
        draft step reads a quarter of its bf16 bytes; its quality only moves the acceptance rate,
        never the output, which rejection sampling keeps the target's (issue 34).
    quantization: None (as stored: dense, or int4 for an AWQ checkpoint), "rtn" (round-to-nearest
        int4 at load), "awq" (require an AWQ checkpoint). quant_group_size: group size for rtn.
    quant_lm_head: round the LM head to int4 at load (rtn, group quant_group_size) in an int4
        model whose LM head is stored dense; it is a quarter of the 1.5B's decode bytes in int4.
        None (the default): on for int4 models; False keeps the head in the compute dtype.
    gguf_weights: for a GGUF model, "native" (its quantized tensors as stored, run by the
        integer kernel, layers/gguf_kernels.py) or "dequantize" (a float32 copy dequantized
        once, cast to dtype: the reference); None (the default): native where the kernel exists
        and no quantization is asked for. The draft model follows the same setting.
    kv_allocator: "paged" (blocks on demand, PagedAttention) or "contiguous" (the baseline before
        it: one region per sequence reserved at admission, see kv/contiguous.py).
    reserve: contiguous region size: "max-model-len" (max_model_len tokens) or "max-tokens"
        (prompt + max_tokens). Ignored by the paged allocator.
    enable_prefix_caching: automatic prefix caching (kv/block_manager.py): full KV blocks are
        kept by content hash after their request ends and reused by later requests with the same
        prefix (the draft model's cache follows the same rule). Always off for the contiguous
        allocator, which cannot share blocks.
    max_scored_prompt_tokens: longest prompt for prompt logprobs (SamplingParams.prompt_logprobs,
        the server's echo + logprobs); a longer one is refused (check_request). Each scored token
        keeps its logprob and top-n alternatives until the request ends, and the answer lists them.
    kernels: "auto" (each kernel measured once per machine and cached, layers/kernel_choice.py;
        $MIXSERVE_KERNELS overrides), "eager" (PyTorch's plain eager kernels everywhere: the
        reference) or overrides "dense_linear=plain,decode_attention=bmm,...".
    device: "auto" (CUDA when PyTorch sees a GPU, else the CPU), "cpu" or "cuda[:N]"
        (mixserve/device.py). On CUDA a GGUF model runs dequantized (the native kernels are CPU
        code), dense linears run cuBLAS, int4 ones PyTorch's CUDA int4 kernel, and decode steps
        replay CUDA graphs (engine/cuda_graph.py) unless kernels is "eager".
    graph_warmup: "foreground" (the default here): a decode graph chosen from the cache or an
        override is compiled, or loaded from Inductor's cache, before the engine takes a request;
        "background": on a thread while steps run eager, installed between two steps when ready
        (engine/decode_graph.py BackgroundGraph; the CLI's default: the first token never waits
        for it). A graph the chooser has to time is compiled by the timing, in the foreground.
        "off": no decode graph this run, nothing timed for it (a run too short to gain from one:
        the CLI's `generate` of fewer than 128 tokens).
    batch_invariant: "on" (the default): a request's logits do not depend on the batch, its cached
        prefix, its prompt's chunking or the eager / compiled path (layers/batch_invariance.py; on
        the CPU); "off": the kernels measured fastest at each row count, whose rounding does.
    """

    model: str = "qwen2.5-coder-0.5b-instruct"
    dtype: str | torch.dtype | None = None
    block_size: int = 16
    kv_cache_memory: str | int = _DEFAULT_KV_MEMORY
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    shuffle_blocks_seed: int | None = None
    progress: bool = True
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    draft_quantization: str | None = None
    speculation: str = "auto"
    quantization: str | None = None
    quant_group_size: int = 128
    quant_lm_head: bool | None = None
    gguf_weights: str | None = None
    kv_allocator: str = "paged"
    reserve: str = "max-model-len"
    kernels: str = "auto"
    max_scored_prompt_tokens: int = 8192
    enable_prefix_caching: bool = True
    device: str = "auto"
    batch_invariant: str = "on"
    graph_warmup: str = "foreground"

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is in effect (asked for, and the allocator is paged)."""
        return bool(self.enable_prefix_caching) and self.kv_allocator == "paged"

    @property
    def load_gguf_weights(self) -> str | None:
        """gguf_weights as the loader takes it: on CUDA an unset value is "dequantize" (the native
        kernels are CPU code)."""
        from mixserve.device import resolve_device

        if self.gguf_weights is None and resolve_device(self.device).type == "cuda":
            return "dequantize"
        return self.gguf_weights

    @property
    def int4_lm_head(self) -> bool:
        """Whether an int4 model gets an int4 LM head (quant_lm_head unless turned off)."""
        return self.quant_lm_head is not False

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_scored_prompt_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}: must be an integer >= 1 (got {v!r})")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len: must be an integer >= 2 (got {self.max_model_len!r})")
        if self.speculation not in ("auto", "fixed", "off"):
            raise ValueError(f"speculation: must be auto, fixed or off (got {self.speculation!r})")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens: must be an integer >= 0 (got {self.num_speculative_tokens!r})")
        if self.quantization not in (None, "rtn", "awq"):
            raise ValueError(f"quantization: must be rtn or awq (got {self.quantization!r})")
        if not isinstance(self.quant_group_size, int) or self.quant_group_size < 32 or self.quant_group_size % 32:
            raise ValueError(f"quant_group_size: must be a multiple of 32 (got {self.quant_group_size!r})")
        if self.quant_lm_head is True and self.quantization is None and not is_awq_folder(self.model):
            raise ValueError("quant_lm_head: needs an int4 model (--quantization rtn|awq or an AWQ checkpoint)")
        if self.gguf_weights not in (None, "native", "dequantize"):
            raise ValueError(f"gguf_weights: must be native or dequantize (got {self.gguf_weights!r})")
        if self.gguf_weights == "native" and self.quantization:
            raise ValueError(f"gguf_weights: native cannot be combined with quantization {self.quantization} "
                             "(RTN and AWQ start from the dequantized weights); use dequantize")
        if self.kv_allocator not in ("paged", "contiguous"):
            raise ValueError(f"kv_allocator: must be paged or contiguous (got {self.kv_allocator!r})")
        if self.reserve not in RESERVE_MODES:
            raise ValueError(f"reserve: must be {' or '.join(RESERVE_MODES)} (got {self.reserve!r})")
        if self.draft_quantization not in (None, "rtn"):
            raise ValueError(f"draft_quantization: must be rtn (got {self.draft_quantization!r})")
        if self.draft_quantization and self.draft_model in (None, "ngram"):
            raise ValueError("draft_quantization: needs a draft model (--draft-model NAME; prompt lookup has no weights)")
        if self.kv_allocator == "contiguous" and self.draft_model not in (None, "ngram"):
            raise ValueError("kv_allocator: contiguous does not support a draft model (its cache is paged); "
                             "use --kv-allocator paged or --draft-model ngram")
        if self.graph_warmup not in ("foreground", "background", "off"):
            raise ValueError(f"graph_warmup: must be foreground, background or off (got {self.graph_warmup!r})")
        if self.batch_invariant not in ("on", "off"):
            raise ValueError(f"batch_invariant: must be on or off (got {self.batch_invariant!r})")
        parse_bytes(self.kv_cache_memory)
        from mixserve.device import resolve_device

        if resolve_device(self.device).type == "cuda" and self.gguf_weights == "native":
            raise ValueError("gguf_weights: native runs on the CPU only (its kernels are CPU code); "
                             "use --gguf-weights dequantize or --device cpu")
        if self.kernels != "auto":
            parse_overrides(self.kernels)
        # a CPU mode: on CUDA the measured choices (int4_dense_rows/cuda/...) stay the user's
        if self.batch_invariant == "on" and resolve_device(self.device).type == "cpu":
            if self.kernels != "auto":
                check_invariant_overrides(self.kernels, "kernels")
            else:  # the chooser reads the environment's overrides when the flag gives none
                check_invariant_overrides(os.environ.get("MIXSERVE_KERNELS", ""), "MIXSERVE_KERNELS")


def check_invariant_overrides(text: str, source: str) -> None:
    """Raise ValueError for an override in `text` ("KEY=NAME,...", as --kernels) that picks a
    kernel batch invariance pins (INVARIANT_CHOICES); `source` names where it came from."""
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        k, _, v = part.partition("=")
        kind = k.strip().split("/")[0]
        fixed = INVARIANT_CHOICES.get(kind)
        if part != "eager" and kind in INVARIANT_CHOICES and v.strip() != fixed:
            raise ValueError(f"{source}: {part!r} picks a kernel that batch invariance pins"
                             f"{f' (only {kind}={fixed})' if fixed else ''}; add --batch-invariant off to choose it")


