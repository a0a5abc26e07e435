"""Compiling a request's constraint against the model's tokenizer, once per constraint (llguidance).

One `GrammarCompiler` per engine. It holds llguidance's view of the tokenizer (LLTokenizer),
built once, on first use, with the width of the model's logits: the 0.5B's logits are 151,936
wide against a 151,665-token vocabulary, and the padding ids are then always masked. It also
holds the compiled grammars, cached per constraint (`StructuredOutputs.key`), and an LLExecutor
that fills a step's masks on its own threads without the GIL (masks.py).

A grammar compiles on a worker thread with a time limit (`timeout_s`) and llguidance's resource
limits (LLParserLimits): an expensive schema is refused with a reason instead of stalling the
caller. The engine compiles in `check_request`, which the server calls off the engine's thread;
`matcher()` then hands each sequence a copy of the compiled matcher (a deep copy, no compile).
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from mixserve.structured_output import masks
from mixserve.structured_output.spec import StructuredOutputs, short_error

log = logging.getLogger("mixserve")

# A grammar text this long is refused before llguidance reads it: schemas users send are KBs; the
# server's body limit bounds it too, but the Python API has none
MAX_GRAMMAR_BYTES = 1 << 20
MAX_CACHE_BYTES = 64 << 20  # the cached constraints' texts at most (their compiled grammars are larger)
# The compile thread's stack: llguidance builds a grammar recursively, and a chain of 1,200 $refs or
# 3,000 Lark rules (tens of KB of schema) overflowed a default 8 MB thread stack, killing the process
# (found by trying it); at ~7 KB a level this holds any grammar of MAX_GRAMMAR_BYTES. Address space
# only: the pages a compile does not touch are never committed.
STACK_BYTES = 512 << 20
_SPECIAL_REF = re.compile(r"<\[(\d+)\]>")


def tokenizer_json(tokenizer) -> str:
    """The tokenizer as `tokenizers`' JSON (what llguidance's LLTokenizer reads): from mixserve's own
    Tokenizer (models/tokenizer.py) or a transformers fast tokenizer. Raises ValueError for any other
    (a slow tokenizer has no such JSON)."""
    rust = getattr(tokenizer, "_tok", None) or getattr(tokenizer, "backend_tokenizer", None)
    if rust is None or not hasattr(rust, "to_str"):
        raise ValueError("structured output needs a fast (tokenizers) tokenizer; this model's is "
                         f"{type(tokenizer).__name__}")
    import copy

    rust = copy.copy(rust)  # padding and truncation settings are the caller's: not in the copy we read
    rust.no_padding()
    rust.no_truncation()
    return rust.to_str()


class GrammarCompiler:
    """Compiles constraints into llguidance matchers for one model (thread-safe).

    Args:
        new_tokenizer: gives the model's tokenizer (mixserve's Tokenizer or an HF fast tokenizer),
            called once: an instance of its own, since one tokenizer must not serve two threads.
        vocab_size: the width of the model's logits (ids at and past the tokenizer's vocabulary
            are never allowed).
        eos_ids: the model's end-of-sequence ids: allowed where the grammar accepts.
        timeout_s: the longest a compile may take before the request is refused.
        cache_size: compiled grammars kept (least recently used dropped).
        threads: threads of the mask executor (LLExecutor).
    """

    def __init__(self, new_tokenizer, vocab_size: int, eos_ids: list[int], timeout_s: float = 10.0,
                 cache_size: int = 256, threads: int = 2):
        self._new_tokenizer = new_tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_ids = list(eos_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self.threads = max(1, threads)
        self._lock = threading.Lock()
        self._view = None
        self._executor = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_bytes = 0
        self.real_vocab = self.vocab_size  # the tokenizer's own vocabulary (view() sets it)
        self._special: list[tuple[int, str]] | None = None
        ok = np.ones(self.vocab_size, dtype=bool)
        ok[[i for i in self.eos_ids if 0 <= i < self.vocab_size]] = False
        self._no_eos = masks.pack_np(ok)  # ANDed where a grammar cannot end yet (row_mask)
        old = threading.stack_size()
        threading.stack_size(STACK_BYTES)
        try:  # the pool's one thread is made now, with the large stack
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixserve-grammar")
            self._pool.submit(lambda: None).result()
        finally:
            threading.stack_size(old)
        self.compile_times: list[float] = []  # seconds per compiled (not cached) constraint

    def view(self):
        """llguidance's LLTokenizer for this model, built on first use (~1 s for a 150k vocabulary)."""
        with self._lock:
            if self._view is None:
                from llguidance import LLTokenizer

                t0 = time.perf_counter()
                tok = self._new_tokenizer()
                self._view = LLTokenizer(tokenizer_json(tok), n_vocab=self.vocab_size, eos_token=self.eos_ids)
                try:  # ids from here to the logits' width are padding: never allowed (keep_mask)
                    self.real_vocab = min(self.vocab_size, len(tok))
                except TypeError:
                    pass
                log.info("structured output: the tokenizer's view built in %.2f s", time.perf_counter() - t0)
            return self._view

    @property
    def executor(self):
        """The LLExecutor that fills masks in parallel (masks.py)."""
        with self._lock:
            if self._executor is None:
                from llguidance import LLExecutor

                self._executor = LLExecutor(self.threads)
            return self._executor

    def compile(self, spec: StructuredOutputs):
        """The compiled matcher of `spec` (shared: copy it with `matcher()` before use), from the
        cache or compiled now on the worker thread.

        Raises:
            ValueError: naming spec.source, where llguidance refuses the schema or grammar (its
                message), the grammar text is over MAX_GRAMMAR_BYTES, or the compile takes longer
                than timeout_s.
        """
        kept = spec.__dict__.get("_compiled")
        if kept is not None and kept[0] is self:
            return kept[1]
        try:
            key = spec.key()
        except RecursionError:
            raise ValueError(f"{spec.source}: the schema is nested too deeply") from None
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                object.__setattr__(spec, "_compiled", (self, hit))
                return hit
        view = self.view()
        t0 = time.perf_counter()
        # the grammar text too is made on the large stack (llguidance reads the schema there)
        fut = self._pool.submit(_build, view, spec)
        try:
            m, first, err = fut.result(timeout=self.timeout_s)
        except FutureTimeout:
            # the worker thread runs on to llguidance's own limits; the next compile waits for it
            raise ValueError(f"{spec.source}: the grammar took over {self.timeout_s:g} s to compile") from None
        if err:
            raise ValueError(err if err.startswith(spec.source) else f"{spec.source}: {short_error(err)}")
        self.compile_times.append(time.perf_counter() - t0)
        named = {int(i) for i in _SPECIAL_REF.findall(spec.grammar or "")}
        if named & set(self.eos_ids):  # the engine ends a request at its end token: no grammar goes past one
            raise ValueError(f"{spec.source}: the grammar names an end token (<[{min(named & set(self.eos_ids))}]>); "
                             f"a request ends at its end token, where its grammar accepts")
        if any(i >= self.real_vocab for i in named):
            raise ValueError(f"{spec.source}: the grammar names token <[{max(named)}]>, past this vocabulary's "
                             f"{self.real_vocab} tokens (padding ids are never generated)")
        keep = self.row_mask(spec, m).numpy()
        if not bool((first[:len(keep)] & keep).any()):
            raise ValueError(f"{spec.source}: the grammar can start only with a special token's text (such as "
                             f"an end token's), which is not generated as text")
        # one token taken on a copy: a lexer that explodes at its first step ("too many expressions
        # constructed", a regex like (a{1000}){1000}) is refused here, not in a request's first step
        ok = np.flatnonzero(masks.allowed_np(first[:len(keep)] & keep, self.vocab_size))
        probe = m.deep_copy()
        if len(ok) and not probe.consume_token(int(ok[0])):
            raise ValueError(f"{spec.source}: {short_error(probe.get_error())}")
        with self._lock:
            self._cache[key] = m
            self._cache_bytes += len(key)
            # by count and by the constraints' text (a 200 KB schema a request kept ~4 MB here)
            while len(self._cache) > self.cache_size or (self._cache_bytes > MAX_CACHE_BYTES and len(self._cache) > 1):
                old_key, _ = self._cache.popitem(last=False)
                self._cache_bytes -= len(old_key)
        object.__setattr__(spec, "_compiled", (self, m))
        return m

    def trigger_token(self, spec: StructuredOutputs) -> int | None:
        """The token id of spec.after (None where the constraint starts at once). Raises ValueError
        naming spec.source where that text is not exactly one token of this vocabulary."""
        if spec.after is None:
            return None
        ids = self.view().tokenize_str(spec.after)
        if len(ids) != 1:
            raise ValueError(f"{spec.source}: {spec.after!r} is {len(ids)} tokens of this model's vocabulary; "
                             f"a constraint can start only after one token")
        return ids[0]

    def is_one_token(self, text: str) -> bool:
        """Whether `text` is one token of this vocabulary (what StructuredOutputs.after needs)."""
        return len(self.view().tokenize_str(text)) == 1

    def lark_literal(self, text: str) -> str:
        """`text` as a Lark term that matches it in this vocabulary: the token itself (`<[id]>`) where
        it is one special token (llguidance matches a string literal against bytes; its mask lets a
        literal "<tool_call>" through as Qwen's special token of that text, and consuming that token
        then fails: llguidance 1.9.1), else a string literal."""
        view = self.view()
        ids = view.tokenize_str(text)
        if len(ids) == 1 and view.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return json.dumps(text, ensure_ascii=False)

    def keep_mask(self, spec: StructuredOutputs) -> torch.Tensor:
        """int32 [words]: the tokens a constrained row of `spec` may take, ANDed with its grammar's
        mask: all but the special tokens (EOS excepted) that its grammar does not name as tokens
        (`<[id]>`, or a special token's text written bare, outside quotes). llguidance 1.9.1's mask
        lets a literal "<|im_end|>" through as the special token of that text, and then refuses to
        consume it; such text is then spelled with ordinary tokens."""
        kept = spec.__dict__.get("_keep")
        if kept is not None and kept[0] is self:
            return kept[1]
        view = self.view()
        if self._special is None:
            self._special = [(i, view.decode_str([i])) for i in range(self.vocab_size)
                             if i < view.vocab_size and view.is_special_token(i) and i not in self.eos_ids]
        text = spec.grammar or ""
        named = {int(m) for m in _SPECIAL_REF.findall(text)}
        if spec.after is not None:
            named |= {self.trigger_token(spec)}
        from mixserve.structured_output import masks

        allowed = np.ones(self.vocab_size, dtype=bool)  # numpy: this may run off the engine's thread (masks.py)
        allowed[self.real_vocab:] = False  # padding ids
        for i, t in self._special:
            if i in named or (text and re.search(r"(?<![\"'\w])" + re.escape(t) + r"(?![\"'\w])", text)):
                continue
            allowed[i] = False
        keep = torch.from_numpy(masks.pack_np(allowed))
        object.__setattr__(spec, "_keep", (self, keep))  # kept with the constraint, as its grammar
        return keep

    def row_mask(self, spec: StructuredOutputs, matcher) -> torch.Tensor:
        """What to AND with a row's grammar mask: keep_mask(spec), less EOS where the matcher cannot
        end yet (a literal of EOS's text, as "<|im_end|>", otherwise lets EOS through, and the matcher
        then refuses it; llguidance 1.9.1)."""
        keep = self.keep_mask(spec)
        return keep if matcher.is_accepting() else torch.from_numpy(keep.numpy() & self._no_eos)

    def matcher(self, spec: StructuredOutputs):
        """A fresh matcher for one sequence (its own state), at the grammar's start."""
        return self.compile(spec).deep_copy()


def _build(view, spec: StructuredOutputs):
    """(matcher, its first mask as int32 [words], "") or (None, None, error message): a matcher at its
    start, its first mask computed here, off the engine's thread, so that a grammar whose lexer
    fails on the first step is refused here rather than in a step."""
    from llguidance import LLMatcher

    try:
        text = spec.grammar_text()
    except ValueError as e:
        return None, None, str(e)
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        return None, None, f"the grammar is {len(text.encode())} bytes; at most {MAX_GRAMMAR_BYTES} are compiled"
    try:
        m = LLMatcher(view, text, log_level=0)
    except Exception as e:  # noqa: BLE001 -- llguidance's message is the reason given
        return None, None, str(e)
    if m.is_error():
        return None, None, m.get_error()
    first = np.frombuffer(m.compute_bitmask(), dtype=np.int32)
    if m.is_error():
        return None, None, m.get_error()
    return m, first, ""
