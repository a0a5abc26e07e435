"""The accept/reject rule of speculative sampling (Leviathan et al., ICML 2023, Algorithm 1;
Chen et al. 2023, Algorithm 2).

For draft tokens x_1..x_K proposed from distributions q_1..q_K and target distributions
p_1..p_{K+1} (all *processed*: penalties, temperature, top-k/top-p/min-p already applied):
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection, sample from
normalize(max(0, p_i - q_i)) and stop; if all K are accepted, sample a bonus token from p_{K+1}.
The emitted tokens then follow p exactly (Leviathan et al., Appendix A.1). Greedy: accept while
x_i == argmax p_i, then emit argmax of the first non-matching (or bonus) position.

`verify` picks the rule for one sequence: greedy, coupled (seeded) or sampled.

Seeded requests use `accept_coupled` instead: every position's token is the exponential race
of the target's p with noise drawn for that position alone, so the text does not depend on k.
"""
from __future__ import annotations

import torch

from mixserve.engine.sampler import exponential_noise, greedy_ids, probs_from_logits, race


def accept_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, list[int]]:
    """Greedy verification.

    target_argmax: K+1 ids (argmax of the target at each verified position); draft: K ids.
    Returns (number of accepted draft tokens j, the j + 1 tokens to emit).
    """
    j = 0
    while j < len(draft) and draft[j] == target_argmax[j]:
        j += 1
    return j, list(draft[:j]) + [target_argmax[j]]


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft: list[int],
                   generator: torch.Generator | None = None) -> tuple[int, list[int]]:
    """Speculative sampling for one sequence.

    Args:
        p: float32 [K+1, V] target probabilities (rows sum to 1).
        q: float32 [K, V] draft probabilities the draft tokens were sampled from.
        draft: K proposed token ids.
        generator: RNG for the uniform draws and the resample (per-request seed).
    Returns:
        (j accepted draft tokens, the j + 1 tokens to emit).
    """
    K = len(draft)
    if K:
        idx = torch.tensor(draft, device=p.device)
        rows = torch.arange(K, device=p.device)
        px = p[rows, idx]
        qx = q[rows, idx]
        # drawn on the host: a request's generator is a CPU one, so its text is the same on every device
        u = torch.rand(K, generator=generator, device="cpu").to(p.device)
        # accept iff u * q(x) <= p(x), i.e. u <= p/q without dividing by a tiny q
        ok = (u * qx <= px).tolist()
    else:
        ok = []
    j = 0
    while j < K and ok[j]:
        j += 1
    if j < K:
        resid = (p[j] - q[j]).clamp_min_(0)
        total = resid.sum()
        # p == q on the support makes the residual empty; then any rejection had probability 0,
        # so this branch only runs on float noise: fall back to p.
        dist = resid / total if total > 0 else p[j]
    else:
        dist = p[K]
    if generator is not None and dist.device.type != "cpu":
        dist = dist.cpu()  # the request's generator is a CPU one (see above)
    tok = int(torch.multinomial(dist, 1, generator=generator))
    return j, list(draft[:j]) + [tok]


def accept_coupled(p: torch.Tensor, draft: list[int], noise: torch.Tensor) -> tuple[int, list[int]]:
    """Drafter-invariant verification for seeded requests (Daliri, Musco & Suresh 2024,
    "Coupling without communication and drafter-invariant speculative decoding").

    The target's token at each position is y_i = race(p_i, E_i) (exponential race, an exact
    sample of p_i) with noise E_i drawn for that output position only; draft token x_i is
    accepted iff x_i == y_i, and the first mismatch emits y_i. Every emitted token is thus
    exactly the token plain sampling would draw with the same noise, whatever k and the
    proposer: the output follows p exactly and a seed gives the same text for any k.
    For a deterministic proposer (q one-hot, n-gram) this accepts x with probability p(x) and
    resamples from p without x, i.e. Leviathan et al.'s rule; a draft model that draws x_i as
    race(q_i, E_i) with the same noise is accepted with probability >= (1 - TV) / (1 + TV)
    instead of Leviathan's 1 - TV (Daliri et al., Thm. 2): the price of reproducibility.

    Args:
        p: [K+1, V] target probabilities (rows sum to 1).
        draft: K proposed token ids.
        noise: float64 [K+1, V] Exp(1) draws, row i for output position i (sampler.exponential_noise).
    Returns:
        (j accepted draft tokens, the j + 1 tokens to emit).
    """
    ys = race(p, noise).tolist()
    return accept_greedy(ys, draft)


def verify(logits: torch.Tensor, draft: list[int], q: torch.Tensor | None, greedy: bool,
           generators: list[torch.Generator | None]) -> tuple[int, list[int]]:
    """Verify one sequence's draft with the rule its sampling asks for.

    Args:
        logits: float [K+1, V] *processed* target logits (sampler.process_logits) at the K draft
            positions and the bonus position.
        draft: K proposed token ids (K may be 0: then this samples one token).
        q: float32 [K, V] draft distributions, or None for a deterministic proposer (n-gram),
            whose q is one-hot on its tokens.
        greedy: the request is greedy (temperature 0): accept_greedy.
        generators: the K+1 positions' generators (Sequence.generator_at); seeded when the first
            is not None: accept_coupled, so a seed gives the same text whatever k is.
    Returns:
        (j accepted draft tokens, the j + 1 tokens to emit).
    """
    if greedy:
        return accept_greedy(greedy_ids(logits).tolist(), draft)
    if generators[0] is not None:
        noise = torch.stack([exponential_noise(g, logits.shape[1]) for g in generators])
        return accept_coupled(probs_from_logits(logits), draft, noise)
    if q is None and draft:
        q = torch.nn.functional.one_hot(torch.tensor(draft, device=logits.device), logits.shape[1]).float()
    return accept_sampled(probs_from_logits(logits), q, draft)
