"""A request's whole state in one object; everything else is derived per step."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from mixserve.sampling_params import SamplingParams

_ids = itertools.count()
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # SplitMix64's output function (Steele et al. 2014): nearby inputs give unrelated outputs
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_generator(seed: int, position: int) -> torch.Generator:
    """A CPU torch.Generator seeded from (seed, position) (seed: any int; position: token index
    >= 0). Distinct pairs give unrelated streams, so seed s at position t+1 and seed s+1 at t differ."""
    return torch.Generator().manual_seed(_splitmix64(_splitmix64(seed & _MASK64) ^ position))


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
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    emitted_chars: int = 0  # characters of `text` already handed out as new_text (streaming)
    # incremental detokenization offsets into output ids (see engine/detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list = field(default_factory=list)
    # prompt scoring (params.prompt_logprobs): TokenLogprobs of prompt token i + 1 at index i,
    # filled chunk by chunk during prefill; kept across preemption, so a recompute adds nothing
    prompt_logprobs: list = field(default_factory=list)
    # per output token whose text has been decoded, the index in `text` where that text starts
    # (engine/detokenizer.py); a token not listed yet has no text so far
    token_starts: list = field(default_factory=list)
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
    # prefix caching: the salt that separates tenants' cached blocks (a request's cache_salt) and
    # the prompt tokens the first admission found cached (OpenAI's usage.cached_tokens)
    cache_salt: str | None = None
    num_cached_tokens: int = 0
    # structured output: the llguidance matcher of params.structured, at the output so far (it has
    # consumed every output token; kept across preemption, as the tokens are)
    matcher: object | None = None
    # ... or, for a constraint that starts after a token (params.structured.after), that token's id
    # until the output holds it: then the matcher is made and this is None
    grammar_trigger: int | None = None
    # set by a step whose grammar mask (less the special tokens) allowed nothing: the request ends
    grammar_stuck: bool = False

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def generator_at(self, position: int) -> torch.Generator | None:
        """The random stream for the token at index `position` of `token_ids` (prompt included),
        or None when the request has no seed or is greedy (the global RNG / argmax is used).

        A fresh generator per position, seeded from (seed, position): the draws for one token
        never depend on how many draws earlier steps made, so speculative decoding with any k
        per step (and any proposer) gives the same text as plain decoding for a seed.
        """
        if self.params.seed is None or self.params.greedy:
            return None
        return position_generator(self.params.seed, position)

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
