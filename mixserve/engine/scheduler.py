"""Continuous (iteration-level) batching with a token budget and preemption by recompute.

Orca (Yu et al., OSDI 2022) schedules at every iteration; vLLM (Kwon et al., SOSP 2023, §4.5)
adds paged memory and preemption. One budget of `max_num_batched_tokens` is shared by decode
rows (1 token), prefill chunks (a prompt longer than what is left of the budget is split over
steps: chunked prefill) and, later, speculative verification rows. Running sequences go first
(oldest first); when a block is missing, the newest running sequence is preempted: its blocks
are freed and it goes back to the front of the waiting queue to be recomputed, losing nothing.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mixserve.kv.block_manager import BlockManager
from mixserve.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    """`num_new_tokens` tokens of `seq`, from position seq.num_computed_tokens, run this step."""

    seq: Sequence
    num_new_tokens: int
    lookahead: int = 0  # extra slots reserved for speculative tokens (verified in the same step)

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so a new token is sampled."""
        return self.end == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """Decides, each step, which sequences run and how many tokens each.

    Args:
        block_manager: the KV block allocator.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens in one step (decode rows count 1).
        max_model_len: context limit in tokens (caps speculative lookahead).
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int = 1 << 62):
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_free: list = []  # callbacks(seq) when a sequence's blocks are freed (draft caches)

    def add(self, seq: Sequence) -> None:
        self.bm.reserve_for(seq.seq_id, seq.num_prompt_tokens + seq.params.max_tokens)
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, lookahead: int = 0) -> SchedulerOutput:
        """Pick this step's work. `lookahead` extra slots (and budget) are reserved for every
        decode row, for the k speculative tokens verified with it."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            la = 0
            if seq.num_uncomputed_tokens == 1:
                # never speculate past what the request may still emit or the context can hold
                room = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens)
                la = max(0, min(lookahead, room - 1, budget - 1))
            start = seq.num_computed_tokens
            if la and not self.bm.can_append(seq.seq_id, start, start + n + la):
                la = 0  # speculation is optional: drop it before preempting anyone
            while not self.bm.can_append(seq.seq_id, start, start + n + la):
                victim = self.running[-1]
                self._preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.copies += self.bm.append_slots(seq.seq_id, start, start + n + la)
                out.scheduled.append(ScheduledSeq(seq, n, la))
                budget -= n + la
                i += 1
                continue
            break
        # Admit new work only when nothing was preempted: otherwise it would take the blocks back.
        if not out.num_preempted:
            budget = self._admit(out, budget)
            # A waiting sequence may hold blocks: a parallel sample (n > 1) released with its
            # leader's prompt blocks, queued behind sequences preempted later. With nothing
            # running, nothing would ever free them and the head could wait forever (the engine
            # stepped without progress): they give their blocks back and recompute, as preempted.
            if not out.scheduled and not self.running and self._release_waiting_blocks():
                self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting sequences in order while they fit; returns the budget left."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            start = seq.num_computed_tokens
            cached: list[int] = []
            fresh = start == 0 and not self.bm.tables.get(seq.seq_id)
            # prompt scoring needs every prompt position computed, so it takes no cached prefix
            if fresh and seq.params.prompt_logprobs is None:
                cached = self.bm.find_cached(seq.token_ids, seq.cache_salt)
                start = len(cached) * self.bm.block_size
            n = min(seq.num_tokens - start, budget)
            if not (self.bm.can_admit(cached, start + n) if cached else self.bm.can_append(seq.seq_id, start, start + n)):
                break
            self.waiting.popleft()
            if fresh:
                first = seq.num_preemptions == 0
                seq.num_computed_tokens = self.bm.acquire(seq.seq_id, cached, seq.cache_salt,
                                                          seq.num_prompt_tokens if first else 0)
                if first:
                    seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
            out.copies += self.bm.append_slots(seq.seq_id, start, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return budget

    def _release_waiting_blocks(self) -> bool:
        """Free the blocks of every waiting sequence that holds some (it recomputes from 0).
        Returns whether any did."""
        freed = False
        for seq in self.waiting:
            if self.bm.tables.get(seq.seq_id):
                self._free(seq)
                seq.num_computed_tokens = 0
                freed = True
        return freed

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def commit(self, seqs) -> None:
        """Register the full blocks the last step computed in the prefix cache."""
        for seq in seqs:
            if not seq.is_finished:
                self.bm.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED

    def _free(self, seq: Sequence) -> None:
        self.bm.free(seq.seq_id)
        for fn in self.on_free:
            fn(seq)
