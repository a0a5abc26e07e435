"""A request's whole state in one object; everything else is derived per step."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from mixserve.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request being generated.

    token_ids holds prompt + generated tokens. `num_computed_tokens` counts the tokens whose K/V
    are in the cache; a decode step computes exactly the last token, a prefill chunk several.
    Preemption by recompute resets num_computed_tokens to 0 (its blocks are freed); the tokens
    themselves are kept, so the sequence resumes with the same output.
    Times are time.perf_counter() seconds.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.perf_counter)
    seq_id: int = field(default_factory=lambda: next(_ids))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    token_ids: list[int] = field(init=False)
    generator: torch.Generator | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    emitted_chars: int = 0  # characters of `text` already handed out as new_text (streaming)
    # incremental detokenization offsets into output ids (see engine/detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    # speculative decoding counters (tokens): proposed, accepted, and evaluated = positions the
    # target actually judged (a run stops at its first rejection), per Leviathan et al. §3
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_evaluated: int = 0
    spec_steps: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
