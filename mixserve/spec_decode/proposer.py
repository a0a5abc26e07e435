"""Proposers for speculative decoding: a small draft model over its own paged KV cache, or n-gram
prompt lookup (Saxena 2023, "prompt lookup decoding") that needs no model at all.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from mixserve.engine.model_runner import BatchItem, ModelRunner
from mixserve.engine.sampler import (SamplingMetadata, exponential_noise, greedy_ids, probs_from_logits, process_logits,
                                     race)
from mixserve.kv.block_manager import BlockManager
from mixserve.sequence import Sequence


@dataclass
class Proposal:
    """k proposed tokens for one sequence and the distributions they were drawn from.

    q: float32 [k, V] processed draft probabilities, or None when the row is greedy or seeded
    (only the tokens matter: rejection.accept_greedy / accept_coupled) or the proposer is
    deterministic (then q is one-hot, built on demand).
    """

    tokens: list[int]
    q: torch.Tensor | None = None


MetaFn = Callable[[list[Sequence], list[list[int]]], SamplingMetadata]


class DraftModelProposer:
    """Runs a draft model autoregressively for k steps over the whole batch at once.

    The draft keeps its own block manager and KV cache with as many blocks as the target, so it
    can never run out where the target did not. Per sequence it tracks how many tokens its cache
    holds (`computed`); each round first catches up on the tokens it has not seen (the last
    accepted token, or a whole prompt), which is one flat batch with the first proposal step.

    Args:
        runner: ModelRunner over the draft model; block_manager: the draft's allocator.
        meta_fn: builds SamplingMetadata for sequences with extra (proposed) output tokens, so the
            draft's q is processed exactly like the target's p (penalties, temperature, top-k/p).
    """

    def __init__(self, runner: ModelRunner, block_manager: BlockManager, meta_fn: MetaFn):
        self.runner = runner
        self.bm = block_manager
        self.meta_fn = meta_fn
        self.computed: dict[int, int] = {}
        self.num_forwards = 0
        self.step_time: float | None = None  # seconds of one plain draft step, last round
        # (rows, seconds) of each draft forward of the last propose(): the first also catches up on
        # the tokens the draft has not seen, so its rows are more than one per sequence
        self.forwards: list[tuple[int, float]] = []

    def lag(self, seq: Sequence) -> int:
        """Tokens of `seq` (all but its last, which every proposal feeds) not yet in the draft cache:
        the rows a proposal's first forward adds to catch up (after plain steps, a whole run of them)."""
        c = self.computed.get(seq.seq_id)
        return 0 if c is None else max(0, seq.num_tokens - 1 - c)

    def _start(self, seq: Sequence) -> int:
        """Tokens of `seq` in the draft cache; on first sight, the draft's own prefix-cache hit
        (the same rule as the target's: full blocks by chained hash, never the last token)."""
        c = self.computed.get(seq.seq_id)
        if c is None:
            cached = self.bm.find_cached(seq.token_ids, seq.cache_salt)
            if not self.bm.can_admit(cached, len(cached) * self.bm.block_size + 1):
                cached = []
            c = self.computed[seq.seq_id] = self.bm.acquire(seq.seq_id, cached, seq.cache_salt)
        return c

    def _run(self, items: list[BatchItem]):
        """One draft forward; then the full blocks it wrote go into the draft's prefix cache
        (drafted tokens included: a block's K/V is right for its tokens, accepted or not)."""
        out = self.runner.run(items)
        for it in items:
            self.bm.commit(it.seq_id, it.token_ids, it.end)
        return out

    def prefill(self, chunks: list[tuple[Sequence, int, int]]) -> list[BatchItem]:
        """Draft items mirroring target prefill chunks (positions [start, end)), no logits."""
        items = []
        for seq, start, end in chunks:
            if self._start(seq) != start:
                continue  # behind: it catches up at its first proposal instead
            self.bm.append_slots(seq.seq_id, start, end)
            items.append(BatchItem(seq.seq_id, seq.token_ids, start, end, 0))
            self.computed[seq.seq_id] = end
        return items

    def propose(self, seqs: list[Sequence], ks: list[int], extra_items: list[BatchItem] = ()) -> list[Proposal]:
        """Propose ks[i] tokens for seqs[i] (each has all but its last token in the target cache).
        `extra_items` (draft prefill chunks) ride along in the first forward."""
        k = max(ks, default=0)
        if k == 0:
            if extra_items:
                self._run(list(extra_items))
            return [Proposal([]) for _ in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        times = []
        self.forwards = []
        first_plain = False  # the first forward ran one row per sequence (nothing to catch up)
        for step in range(k):
            t0 = time.perf_counter()
            active = [i for i, ki in enumerate(ks) if ki > step]
            items = list(extra_items) if step == 0 else []
            for i in active:
                s, d = seqs[i], drafts[i]
                toks = s.token_ids + d
                start = self._start(s) if step == 0 else len(toks) - 1
                self.bm.append_slots(s.seq_id, start, len(toks))
                items.append(BatchItem(s.seq_id, toks, start, len(toks), 1))
            logits, rows = self._run(items)
            self.num_forwards += 1
            by_id = {it.seq_id: r for r, it in enumerate(rows)}
            aseqs = [seqs[i] for i in active]
            logits = logits[[by_id[s.seq_id] for s in aseqs]]
            meta = self.meta_fn(aseqs, [drafts[i] for i in active])
            processed = process_logits(logits, meta)
            probs = None if all(s.params.greedy for s in aseqs) else probs_from_logits(processed)
            for r, i in enumerate(active):
                s = seqs[i]
                if s.params.greedy:
                    t = int(greedy_ids(processed[r]))
                elif meta.generators[r] is not None:
                    # seeded: the noise the target will use at this position (accept_coupled),
                    # so no q is needed
                    t = int(race(probs[r], exponential_noise(meta.generators[r], probs.shape[1])))
                else:
                    t = int(torch.multinomial(probs[r], 1))  # unseeded: the global generator
                    qs[i].append(probs[r])
                drafts[i].append(t)
                self.computed[s.seq_id] = s.num_tokens + len(drafts[i]) - 1
            times.append(time.perf_counter() - t0)
            self.forwards.append((sum(it.end - it.start for it in items), times[-1]))
            if step == 0:
                first_plain = len(items) == self.forwards[0][0]
        # The first forward also catches up on unseen tokens and prefill chunks; a later one is
        # the plain one-token step, and so is a first one of one row per sequence.
        plain = times[1:] + (times[:1] if first_plain else [])
        self.step_time = min(plain) if plain else None
        return [Proposal(d, torch.stack(q) if q else None) for d, q in zip(drafts, qs)]

    def rollback(self, seq: Sequence, valid_tokens: int) -> None:
        """Keep only the first `valid_tokens` positions of the draft cache for `seq`."""
        c = min(self.computed.get(seq.seq_id, 0), valid_tokens)
        self.computed[seq.seq_id] = c
        self.bm.truncate(seq.seq_id, c)

    def free(self, seq: Sequence) -> None:
        self.computed.pop(seq.seq_id, None)
        self.bm.free(seq.seq_id)


class NgramProposer:
    """Prompt-lookup proposer: find the most recent earlier occurrence of the sequence's last n
    tokens (n from `max_n` down to `min_n`) and propose the k tokens that followed it. Pays on
    edits and code that repeat their context; proposes nothing when no n-gram matches.
    Deterministic, so its q is one-hot (accept with probability p(x)).
    """

    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self.num_forwards = 0
        self.step_time = 0.0  # no model: proposing is free next to a forward pass
        self.forwards: list[tuple[int, float]] = []

    def lag(self, seq: Sequence) -> int:
        """Prompt lookup reads the tokens as they are: it never lags."""
        return 0

    def prefill(self, chunks) -> list[BatchItem]:
        return []

    def propose(self, seqs: list[Sequence], ks: list[int], extra_items=()) -> list[Proposal]:
        return [Proposal(self._lookup(s.token_ids, k)) for s, k in zip(seqs, ks)]

    def _lookup(self, toks: list[int], k: int) -> list[int]:
        n_tok = len(toks)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = toks[-n:]
            for i in range(n_tok - n - 1, -1, -1):
                if toks[i:i + n] == pattern:
                    return toks[i + n:i + n + k]
        return []

    def rollback(self, seq: Sequence, valid_tokens: int) -> None:
        pass

    def free(self, seq: Sequence) -> None:
        pass
