"""Structured output's part of an engine step: the hooks engine/llm_engine.py calls (issue 33).

- `check` (check_request): a constraint compiles here, off the engine's thread, or is refused;
- `attach` (add_request): the sequence gets its matcher (or waits for its trigger token);
- `start` (before the forward): the step's masks begin on a worker thread;
- `masks` (sampling metadata): every constrained row's mask, drafts' positions included;
- `cut_draft` (speculation): a draft ends at its first token the grammar forbids, or before a trigger;
- `on_token` (after sampling): the matcher follows the output; says whether the grammar is done or failed.

Nothing here runs torch off the engine's thread (masks.py's reason).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from mixserve.structured_output import masks
from mixserve.structured_output.compiler import GrammarCompiler
from mixserve.structured_output.spec import short_error

log = logging.getLogger("mixserve")


class GrammarSteps:
    """One engine's structured output. `compiler`: its GrammarCompiler; `eos_ids`: the model's end
    tokens. Counters: `mask_s` seconds filling masks, `mask_rows` rows filled."""

    def __init__(self, compiler: GrammarCompiler, eos_ids: list[int]):
        self.compiler = compiler
        self.eos = eos_ids[0] if eos_ids else 0
        self.mask_s = 0.0
        self.mask_rows = 0
        self._pool: ThreadPoolExecutor | None = None

    def check(self, params) -> None:
        """Compile params.structured (cached). Raises ValueError naming the field: stop strings or
        tokens beside a constraint that starts at once, a constraint that does not compile, a
        trigger (`after`) that is not one token."""
        spec = params.structured
        # a constraint that starts after a token (tool calls under auto) leaves the text before it free
        for name in ("stop", "stop_token_ids"):
            if getattr(params, name) and spec.after is None:
                raise ValueError(f"{name}: a stop string or token would cut a constrained output short of "
                                 f"its grammar; give one or the other")
        self.compiler.compile(spec)
        self.compiler.trigger_token(spec)

    def attach(self, seq) -> None:
        """Give `seq` its matcher (a copy of the compiled one), or its trigger token to wait for."""
        seq.grammar_trigger = self.compiler.trigger_token(seq.params.structured)
        if seq.grammar_trigger is None:
            seq.matcher = self.compiler.matcher(seq.params.structured)

    def start(self, seqs: list):
        """The masks of `seqs` (the step's constrained sampling rows, one token each), begun now on a
        worker thread (llguidance fills them without the GIL) while the forward runs: a future of
        {seq_id: int32 mask row}, or None for no rows. The matchers do not move before sampling."""
        if not seqs:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mixserve-masks")

        def fill():
            t0 = time.perf_counter()
            mask = masks.fill(self.compiler.executor, [(k, s.matcher, []) for k, s in enumerate(seqs)], len(seqs),
                              self.compiler.vocab_size)
            m = mask.numpy()  # numpy on this thread (masks.py)
            for k, s in enumerate(seqs):
                m[k] &= self.compiler.row_mask(s.params.structured, s.matcher).numpy()
            self.mask_s += time.perf_counter() - t0
            self.mask_rows += len(seqs)
            return {s.seq_id: mask[k] for k, s in enumerate(seqs)}

        return self._pool.submit(fill)

    def masks(self, seqs: list, extra: list[list[int]], ready=None) -> tuple[torch.Tensor | None, list[int]]:
        """(int32 [N, words] masks, the constrained rows) for sampling rows `seqs` with proposed tokens
        `extra` (row i masks the token after extra[i]); `ready`: start()'s future, used for the rows it
        holds. A row left with no token (its text needs a special token's) takes an end token: the
        sequence is marked `grammar_stuck` and on_token ends it with the reason (at a draft's position
        the end token fails the grammar where verification reaches it), never sampling from nothing."""
        constrained = [(i, s.matcher, e) for i, (s, e) in enumerate(zip(seqs, extra)) if s.matcher is not None]
        if not constrained:
            return None, []
        done = ready.result() if ready is not None else {}
        left = [(i, m, e) for i, m, e in constrained if e or seqs[i].seq_id not in done]
        t0 = time.perf_counter()
        mask = masks.fill(self.compiler.executor, left, len(seqs), self.compiler.vocab_size)
        for i, m, e in left:  # the special tokens its grammar does not name (GrammarCompiler.row_mask)
            spec = seqs[i].params.structured
            mask[i] &= self.compiler.row_mask(spec, m) if not e else self.compiler.keep_mask(spec)
        if left:
            self.mask_s += time.perf_counter() - t0
            self.mask_rows += len(left)
        for i, _, e in constrained:
            if not e and seqs[i].seq_id in done:
                mask[i] = done[seqs[i].seq_id]
            if not bool(mask[i].any()):
                if not e:
                    seqs[i].grammar_stuck = True
                mask[i] = 0
                mask[i, self.eos // 32] = 1 << (self.eos % 32) if self.eos % 32 != 31 else -2**31
        return mask, [i for i, _, _ in constrained]

    def cut_draft(self, seq, draft: list[int], q):
        """(draft, q) for `seq`: cut before its trigger token (what follows it would go unmasked), or
        at its first token the grammar forbids."""
        if seq.grammar_trigger in draft:
            n = draft.index(seq.grammar_trigger)
        elif seq.matcher is not None and draft:
            n = seq.matcher.validate_tokens(draft)
        else:
            return draft, q
        return draft[:n], (q[:n] if q is not None and n < len(draft) else q)

    def on_token(self, seq, tok: int) -> tuple[bool, str | None]:
        """The matcher takes output token `tok`: (the grammar can go no further, or an error's reason
        where the sequence must end: its row was left with nothing, or the grammar failed in the
        step: llguidance's limits). A trigger token starts the constraint (the next step is masked)."""
        if seq.matcher is not None and seq.grammar_stuck:
            return False, ("the grammar allows no token here: its text needs a special token's text, which is "
                           "not generated as text")
        if seq.matcher is not None:
            if not seq.matcher.consume_token(tok):
                why = short_error(seq.matcher.get_error(), 300)
                log.error("request %s: its grammar failed at token %d: %s", seq.request_id, tok, why)
                return False, f"the grammar failed: {why}"
            return seq.matcher.is_stopped(), None
        if seq.grammar_trigger is not None and tok == seq.grammar_trigger:
            seq.grammar_trigger = None
            seq.matcher = self.compiler.matcher(seq.params.structured)
        return False, None
