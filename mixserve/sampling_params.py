"""Per-request sampling parameters (the OpenAI / vLLM set)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from mixserve.structured_output.spec import StructuredOutputs


@dataclass
class SamplingParams:
    """How one request is sampled and when it stops.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax), as does anything below 1e-5.
        top_k: keep the k most likely tokens; -1 or 0 disables.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p; 1.0 disables.
        min_p: drop tokens whose probability is below min_p times the top token's; 0 disables.
        presence_penalty: subtracted once from the logit of every token already generated (OpenAI).
        frequency_penalty: subtracted from a token's logit per occurrence in the output (OpenAI).
        repetition_penalty: CTRL-style (Keskar et al. 2019) penalty on tokens seen in prompt or
            output: positive logits divided by it, negative multiplied; 1.0 disables.
        seed: per-request random seed; the same seed gives the same sample regardless of batching.
        max_tokens: maximum number of generated tokens; 0 runs the prompt's prefill only (with
            prompt_logprobs: scoring a text) and ends with finish_reason "length".
        min_tokens: end-of-sequence and stop token ids are masked until this many tokens exist.
        ignore_eos: keep generating past the model's end-of-sequence ids.
        stop: strings that end generation; they are cut from the returned text.
        stop_token_ids: extra token ids that end generation (kept in token_ids, not in text).
        logprobs: if not None, return the sampled token's log-probability and the top-n
            alternatives (n = logprobs) under the model's unmodified distribution.
        skip_special_tokens: drop special tokens when detokenizing.
        prompt_logprobs: if not None, the log-probability of every prompt token after the first
            given the ones before it, with the top-n alternatives (n = prompt_logprobs), computed in
            the prompt's own prefill (vLLM's name): RequestOutput.prompt_logprobs.
        structured: the output must match a JSON schema, regex, choice or grammar
            (structured_output.StructuredOutputs): every step masks the tokens it forbids, and the
            request ends with "stop" once the grammar can go no further (even with ignore_eos).
            Logprobs are then those of the masked logits (before temperature); min_tokens does not
            apply (the grammar decides where the output may end).

    Raises:
        ValueError: from `validate()` when a value is out of range, naming the field.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    structured: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not (isinstance(self.stop, (list, tuple))
                                          and all(isinstance(x, str) for x in self.stop)):
            raise ValueError(f"stop: must be a string or a list of strings (got {self.stop!r})")
        self.stop = [x for x in (self.stop or []) if x]
        ids = self.stop_token_ids or []
        if not (isinstance(ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in ids)):
            raise ValueError(f"stop_token_ids: must be a list of non-negative integers (got {ids!r})")
        self.stop_token_ids = list(ids)
        self.validate()

    @property
    def greedy(self) -> bool:
        # below _MIN_TEMPERATURE, 1/T overflows float32: such a temperature is greedy in all but
        # name, and is served as greedy (as vLLM does) rather than refused (OpenAI accepts [0, 2])
        return self.temperature < _MIN_TEMPERATURE

    def validate(self) -> None:
        """Check types and ranges; raise ValueError naming the offending field."""
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why} (got {getattr(self, name)!r})")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                bad(name, "must be a finite number")
        for name in ("max_tokens", "min_tokens", "top_k"):
            if not _is_int(getattr(self, name)):
                bad(name, "must be an integer")
        if self.max_tokens < 0:
            bad("max_tokens", "must be >= 0")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", "must be <= max_tokens")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not -1 <= self.top_k < 2**31:
            bad("top_k", "must be -1 (off), 0 (off) or a positive integer below 2**31")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be > 0")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "must be an integer in [0, 20]")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "must be an integer in [0, 20]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            bad("seed", "must be an integer in [0, 2**63)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            bad("structured", "must be a StructuredOutputs")


_MIN_TEMPERATURE = 1e-5


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
