"""Turn one decode step's logits into next tokens (greedy or sampled) plus optional logprobs.

Pipeline per row, in this order (vLLM v1 / HF conventions):

0. structured output: a constrained row's tokens that its grammar forbids are set to -inf
   (`SamplingMetadata.token_mask`, structured_output/masks.py), before everything else.
1. min_tokens: the ids in `SamplingMetadata.min_tokens_mask_ids` (EOS and stop token ids while
   the output is shorter than `min_tokens`) are set to -inf.
2. repetition penalty (Keskar et al. 2019, CTRL) over prompt + output tokens: a positive logit
   is divided by the penalty, a negative one multiplied (HF / vLLM form).
3. frequency and presence penalties (OpenAI API): `logit -= frequency * count + presence * (count > 0)`,
   counting output tokens only.
4. temperature: logits divided by it; greedy rows (temperature 0) are left untempered.
5. top-k: keep the k highest logits (ties with the k-th are kept).
6. top-p (Holtzman et al. 2020, nucleus sampling): keep the smallest prefix of the sorted
   distribution whose mass reaches p.
7. min-p (Nguyen et al. 2024): drop tokens whose probability is below min_p times the top one's.

Steps 4-7 are skipped for greedy rows because none of them can move the argmax. Filters are
applied as -inf entries, so `probs_from_logits` gives the renormalised sampling distribution.
Steps 5-7 apply in HF's warper order: top-p is computed on the top-k-renormalised mass and
min-p after both (min-p and top-k commute; top-p and min-p do not).

Logprobs are always taken from the RAW model logits (log_softmax before any penalty,
temperature or filter), which is vLLM v1's default ("raw_logprobs") and what
`SamplingParams.logprobs` promises; for a constrained row, the raw logits after its grammar's mask
(step 0), so a forbidden token has logprob -inf.

Each step runs only when some row in the batch needs it; an all-greedy batch with no penalties
and no min_tokens mask is a single argmax over [N, V], with no copy of the logits.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from mixserve.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row inputs the sampler needs besides the logits (row i describes logits[i]).

    Attributes:
        params: one SamplingParams per row.
        prompt_ids: prompt token ids per row (read only for the repetition penalty).
        output_ids: token ids generated so far per row (penalties).
        generators: per-row CPU torch.Generator for seeded requests, else None to use the
            global RNG. The engine passes a fresh one per token position
            (Sequence.generator_at), so a seeded row's token depends only on (seed, position)
            and its probabilities.
        min_tokens_mask_ids: per row, token ids to forbid because the output is still shorter
            than min_tokens (EOS + stop_token_ids); empty list when none. Ids outside
            [0, V) are ignored, since such a token can never be sampled anyway.
        token_mask: int32 [N, ceil(V / 32)] grammar bitmasks (structured_output/masks.py), read
            for `constrained_rows` only; None when no row is constrained.
        constrained_rows: the rows whose grammar masks their logits.
    """

    params: list[SamplingParams]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]
    generators: list[torch.Generator | None]
    min_tokens_mask_ids: list[list[int]]
    token_mask: torch.Tensor | None = None
    constrained_rows: list[int] = field(default_factory=list)


def apply_token_mask(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, SamplingMetadata]:
    """(logits with the constrained rows' forbidden tokens at -inf, meta without the masks): a new
    tensor where a row is constrained (the input is never modified), else `logits` itself; the
    meta returned has nothing left to mask, so masking is done once per step."""
    if not meta.constrained_rows:
        return logits, meta
    from mixserve.structured_output import masks

    return (masks.apply(logits, meta.constrained_rows, meta.token_mask),
            dataclasses.replace(meta, token_mask=None, constrained_rows=[]))


@dataclass
class TokenLogprobs:
    """Log-probabilities for one sampled token, under the raw (unprocessed) distribution.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability.
        rank: 1 + the number of tokens strictly more likely than it (1 = most likely; tied
            tokens share the better rank, as in vLLM).
        top: the n most likely (token_id, logprob) pairs, descending; n = params.logprobs (fewer
            where a grammar allows fewer: forbidden tokens, at -inf, are left out)
            (empty when n is 0).
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """Result of one sampling step.

    Attributes:
        token_ids: the chosen token per row.
        logprobs: per row, TokenLogprobs, or None where params.logprobs is None.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def _check(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 2-D tensor [N, V], got {shape}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    n = logits.shape[0]
    for name in ("params", "prompt_ids", "output_ids", "generators", "min_tokens_mask_ids"):
        got = len(getattr(meta, name))
        if got != n:
            raise ValueError(f"SamplingMetadata.{name} has {got} rows but logits has {n}")


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _pairs(rows: list[int], sources: list[list[list[int]]], device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten the token lists of `rows` (concatenated over `sources`) into (row, token) index tensors."""
    flat: list[int] = []
    lens: list[int] = []
    for i in rows:
        n = 0
        for src in sources:
            ids = src[i]
            flat.extend(ids)  # list.extend runs in C; the per-token Python loop would dominate
            n += len(ids)
        lens.append(n)
    # one upload (tokens, rows, lengths), then the rows repeated on the device
    t = torch.tensor(flat + rows + lens, dtype=torch.long, device=device)
    tok, row, ln = t.split([len(flat), len(rows), len(lens)])
    return torch.repeat_interleave(row, ln, output_size=len(flat)), tok


def _check_ids(tok: torch.Tensor, vocab: int, what: str) -> None:
    if tok.numel() and (int(tok.min()) < 0 or int(tok.max()) >= vocab):
        raise ValueError(f"{what} token id out of range [0, {vocab}): min {int(tok.min())}, max {int(tok.max())}")


def _apply_min_tokens(out: torch.Tensor, meta: SamplingMetadata) -> None:
    rows = [i for i, ids in enumerate(meta.min_tokens_mask_ids) if ids]
    if not rows:
        return
    r, t = _pairs(rows, [meta.min_tokens_mask_ids], out.device)
    keep = (t >= 0) & (t < out.shape[1])
    out[r[keep], t[keep]] = _NEG_INF


def _apply_repetition(out: torch.Tensor, meta: SamplingMetadata) -> None:
    rows = [i for i, p in enumerate(meta.params) if p.repetition_penalty != 1.0]
    if not rows:
        return
    r, t = _pairs(rows, [meta.prompt_ids, meta.output_ids], out.device)
    if not t.numel():
        return
    _check_ids(t, out.shape[1], "prompt/output")
    pen = torch.tensor([p.repetition_penalty for p in meta.params], dtype=out.dtype, device=out.device)[r]
    # Only the seen (row, token) entries are touched, so the cost is O(tokens), not O(N * V).
    # Repeated pairs all write the same value computed from the original logit, so a token is
    # penalised once however often it occurs.
    vals = out[r, t]
    out[r, t] = torch.where(vals > 0, vals / pen, vals * pen)


def _apply_freq_presence(out: torch.Tensor, meta: SamplingMetadata) -> None:
    params = meta.params
    rows = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rows:
        return
    r, t = _pairs(rows, [meta.output_ids], out.device)
    if not t.numel():
        return
    vocab = out.shape[1]
    _check_ids(t, vocab, "output")
    keys, counts = torch.unique(r * vocab + t, return_counts=True)
    ur, ut = keys // vocab, keys % vocab
    freq = torch.tensor([p.frequency_penalty for p in params], dtype=out.dtype, device=out.device)
    pres = torch.tensor([p.presence_penalty for p in params], dtype=out.dtype, device=out.device)
    out[ur, ut] = out[ur, ut] - (freq[ur] * counts.to(out.dtype) + pres[ur])


def _apply_temperature(out: torch.Tensor, params: list[SamplingParams]) -> None:
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if all(t == 1.0 for t in temps):
        return
    out.div_(torch.tensor(temps, dtype=out.dtype, device=out.device).unsqueeze(1))


def _apply_top_k_top_p(out: torch.Tensor, params: list[SamplingParams]) -> None:
    n, vocab = out.shape
    rows = [i for i, p in enumerate(params)
            if not p.greedy and (0 < p.top_k < vocab or p.top_p < 1.0)]
    if not rows:
        return
    ks = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
    ps = [params[i].top_p for i in rows]
    whole = len(rows) == n
    idx = None if whole else torch.tensor(rows, dtype=torch.long, device=out.device)
    sub = out if whole else out.index_select(0, idx)
    k_t = torch.tensor(ks, dtype=torch.long, device=out.device).unsqueeze(1)

    if all(p >= 1.0 for p in ps):
        # top-k only: a partial top-k(max k) is far cheaper than a full sort of V ~ 152k.
        kth = sub.topk(max(ks), dim=-1).values.gather(1, k_t - 1)
        sub.masked_fill_(sub < kth, _NEG_INF)
    else:
        # One sort serves both filters.
        srt, order = sub.sort(dim=-1, descending=True)
        if any(k < vocab for k in ks):
            # Threshold on the k-th value, not on position, so ties at the boundary are kept
            # and the result does not depend on how the sort orders equal values.
            srt.masked_fill_(srt < srt.gather(1, k_t - 1), _NEG_INF)
        probs = srt.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A token is dropped once the more likely tokens already reach p; the top token has
        # mass_before == 0 < p, so at least one token always survives.
        p_t = torch.tensor(ps, dtype=out.dtype, device=out.device).unsqueeze(1)
        srt.masked_fill_(mass_before >= p_t, _NEG_INF)
        sub = torch.empty_like(sub).scatter_(1, order, srt)
    if whole:
        if sub is not out:
            out.copy_(sub)
    else:
        out.index_copy_(0, idx, sub)


def _apply_min_p(out: torch.Tensor, params: list[SamplingParams]) -> None:
    if not any(not p.greedy and p.min_p > 0.0 for p in params):
        return
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p): no softmax needed.
    # log(0) = -inf disables the filter for the other rows.
    log_min = [math.log(p.min_p) if (not p.greedy and p.min_p > 0.0) else _NEG_INF for p in params]
    thresh = out.max(dim=-1, keepdim=True).values + torch.tensor(
        log_min, dtype=out.dtype, device=out.device).unsqueeze(1)
    out.masked_fill_(out < thresh, _NEG_INF)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Apply the grammar masks, min_tokens masking, penalties, temperature, top-k, top-p and min-p.

    Args:
        logits: [N, V] raw model logits; float32 expected, other float dtypes are upcast.
        meta: per-row parameters; every list has N entries.

    Returns:
        A new [N, V] float32 tensor (the input is never modified) in which filtered tokens are
        -inf. Greedy rows (temperature 0) get min_tokens masking and penalties only: they are
        neither tempered nor filtered, since only their argmax is used.

    Raises:
        ValueError: logits not 2-D, a metadata list whose length is not N, or a prompt/output
            token id outside [0, V) in a row that has a penalty.
        TypeError: non-floating logits.

    Sources: repetition penalty, Keskar et al. 2019 (CTRL); top-p, Holtzman et al. 2020
    (nucleus sampling); min-p, Nguyen et al. 2024. Order and ties: see the module docstring.
    """
    _check(logits, meta)
    logits, meta = apply_token_mask(logits, meta)
    out = logits.to(dtype=torch.float32, copy=True, memory_format=torch.contiguous_format)
    params = meta.params
    _apply_min_tokens(out, meta)
    _apply_repetition(out, meta)
    _apply_freq_presence(out, meta)
    _apply_temperature(out, params)
    _apply_top_k_top_p(out, params)
    _apply_min_p(out, params)
    return out


def greedy_ids(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first index of the largest value, as torch.argmax), int64.

    Through `max(dim).indices`: on the Intel Xeon kind PyTorch's CPU argmax kernel was several times
    slower than max over 64 rows of a 152k vocabulary (2 threads); greedy sampling at 64 rows fell
    from 12.2 to 6.7 ms per step (benchmarks/step_profile.py, BENCHMARKS.md).
    """
    return x.max(dim=-1).indices


def exponential_noise(generator: torch.Generator, vocab: int) -> torch.Tensor:
    """float64 [vocab] i.i.d. Exp(1) draws from `generator` (CPU).

    float64, because a float32 uniform is 0 with probability 2**-24 per entry, which over a
    150k vocabulary would hand a visible share of draws to whichever token got E = 0.
    """
    # on the host: a request's generator is a CPU one, so its text is the same on every device
    return torch.empty(vocab, dtype=torch.float64, device="cpu").exponential_(generator=generator)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax_i probs[..., i] / noise[..., i] for Exp(1) noise: an exact sample of `probs`
    (the "exponential race", equivalent to the Gumbel-max trick; Gumbel 1954, Maddison et al.
    2014). probs [..., V] (any float dtype, rows sum to 1), noise [..., V] float64 on any
    device. Returns int64 [...] token ids."""
    return greedy_ids(probs.to(torch.float64) / noise.to(probs.device))


def probs_from_logits(processed: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim: processed [N, V] logits -> float32 [N, V] probabilities.

    -inf entries get probability 0. A row that is entirely -inf yields NaN (torch.softmax).
    """
    return torch.softmax(processed.float(), dim=-1)


class Sampler:
    """Picks one token per row: argmax for greedy rows, a multinomial draw otherwise.

    Seeded rows draw V exponentials from their own generator and take the exponential race
    (`race`) on their own probability row, so the token depends only on that generator's
    stream (per position: see SamplingMetadata.generators) and that row's probabilities, never
    on which other requests share the batch. Speculative verification draws the same noise
    for the same position (spec_decode/rejection.accept_coupled), which is what makes a seeded text
    independent of how many tokens were speculated. Unseeded rows share one multinomial draw
    from the global RNG.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample next tokens.

        Args:
            logits: [N, V] raw model logits (float32; other float dtypes are upcast). Not modified.
            meta: per-row parameters and history; every list has N entries.

        Returns:
            SamplerOutput with N token ids and N logprob entries (None where not requested).
            Logprobs come from log_softmax of the raw logits, before penalties, temperature
            and filters (vLLM v1 default); for a constrained row, of the raw logits after its
            grammar's mask.

        Raises:
            ValueError / TypeError: as `process_logits`.
            RuntimeError: from torch.multinomial when a sampled row's probabilities are
                invalid (NaN/inf logits, or every token masked).
        """
        _check(logits, meta)
        raw = logits if logits.dtype == torch.float32 else logits.float()
        # constrained rows masked once, here: their logprobs are those of the masked logits
        raw, meta = apply_token_mask(raw, meta)
        n = raw.shape[0]
        params = meta.params
        device = raw.device

        greedy_rows = [i for i, p in enumerate(params) if p.greedy]
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
        needs_processing = (bool(sampled_rows) or any(_has_penalty(p) for p in params)
                            or any(meta.min_tokens_mask_ids))
        # Hot path (all greedy, nothing to apply): argmax straight off the raw logits, no copy.
        processed = process_logits(raw, meta) if needs_processing else raw

        if not sampled_rows:
            tokens = greedy_ids(processed)
        else:
            tokens = torch.empty(n, dtype=torch.long, device=device)
            if greedy_rows:
                g_idx = torch.tensor(greedy_rows, dtype=torch.long, device=device)
                tokens[g_idx] = greedy_ids(processed.index_select(0, g_idx))
            s_idx = torch.tensor(sampled_rows, dtype=torch.long, device=device)
            probs = probs_from_logits(processed if not greedy_rows else processed.index_select(0, s_idx))
            # local position j in `probs` corresponds to batch row sampled_rows[j]
            unseeded = [j for j, i in enumerate(sampled_rows) if meta.generators[i] is None]
            drawn = torch.empty(len(sampled_rows), dtype=torch.long, device=device)
            if unseeded:
                u_idx = torch.tensor(unseeded, dtype=torch.long, device=device)
                u_probs = probs if len(unseeded) == len(sampled_rows) else probs.index_select(0, u_idx)
                drawn[u_idx] = torch.multinomial(u_probs, 1).squeeze(1)
            for j, i in enumerate(sampled_rows):
                gen = meta.generators[i]
                if gen is not None:
                    drawn[j] = race(probs[j], exponential_noise(gen, probs.shape[1]))
            tokens[s_idx] = drawn

        token_list = tokens.tolist()
        return SamplerOutput(token_ids=token_list, logprobs=self.logprobs(raw, tokens, token_list, params))

    @staticmethod
    def logprobs(raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                 params: list[SamplingParams]) -> list[TokenLogprobs | None]:
        """Raw-distribution log-probabilities of `tokens` [N] under `raw` logits [N, V] (float32),
        plus the top-n alternatives for rows whose params ask for logprobs (None elsewhere)."""
        return token_logprobs(raw, tokens, token_list, [p.logprobs for p in params])


def _ties_by_id(row: torch.Tensor, kth: float, top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """`top` (a row's k best (token id, logprob), its last one tied with the next) with the tie at
    its k-th value `kth` settled by the lower token ids: which tied ids a topk of more than k
    returns depends on that k, so otherwise a row's alternatives would depend on the largest n in
    the batch. row: float32 [V] logprobs. Returns k (token id, logprob) pairs."""
    tied = (row == kth).nonzero().squeeze(1).tolist()  # ascending ids
    keep = [t for t in top if t[1] > kth]
    return keep + [(t, kth) for t in tied[:len(top) - len(keep)]]


def token_logprobs(raw: torch.Tensor, tokens: torch.Tensor, token_list: list[int],
                   n_tops: list[int | None]) -> list[TokenLogprobs | None]:
    """TokenLogprobs of `tokens` [N] (int64; token_list the same ids) under `raw` logits [N, V]
    (float32, log_softmax taken here), with the n_tops[i] most likely alternatives for row i;
    None for rows whose n_tops[i] is None."""
    result: list[TokenLogprobs | None] = [None] * len(n_tops)
    rows = [i for i, n in enumerate(n_tops) if n is not None]
    if not rows:
        return result
    idx = torch.tensor(rows, dtype=torch.long, device=raw.device)
    lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)
    tok_lp = lp.gather(1, tokens.index_select(0, idx).unsqueeze(1))
    ranks = ((lp > tok_lp).sum(dim=-1) + 1).tolist()
    tok_lp_list = tok_lp.squeeze(1).tolist()
    n_top = min(max(n_tops[i] for i in rows), raw.shape[1])
    if n_top > 0:
        top_v, top_i = lp.topk(n_top, dim=-1)
        top_v_list, top_i_list = top_v.tolist(), top_i.tolist()
        # each row's k-th value, and how many of the row's logprobs equal it: more than its top k
        # holds means topk chose among ties, a choice that depends on the batch's largest n
        ks = torch.tensor([min(n_tops[i] or 1, n_top) for i in rows], device=lp.device)
        kth = top_v.gather(1, (ks - 1).unsqueeze(1))
        tied = (lp == kth).sum(-1).tolist()
    for j, i in enumerate(rows):
        k = min(n_tops[i] or 0, raw.shape[1])
        top = list(zip(top_i_list[j][:k], top_v_list[j][:k])) if k else []
        if k and tied[j] > sum(v == top_v_list[j][k - 1] for _, v in top):
            top = _ties_by_id(lp[j], top_v_list[j][k - 1], top)
        top.sort(key=lambda t: (-t[1], t[0]))  # equal logprobs in id order, not topk's
        # a constrained row's forbidden tokens (-inf) are no alternatives (nor valid JSON numbers)
        top = [t for t in top if t[1] != float("-inf")]
        result[i] = TokenLogprobs(token_id=token_list[i], logprob=tok_lp_list[j], rank=int(ranks[j]), top=top)
    return result
