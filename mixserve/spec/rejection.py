"""The accept/reject rule of speculative sampling (Leviathan et al., ICML 2023, Algorithm 1;
Chen et al. 2023, Algorithm 2).

For draft tokens x_1..x_K proposed from distributions q_1..q_K and target distributions
p_1..p_{K+1} (all *processed*: penalties, temperature, top-k/top-p/min-p already applied):
accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection, sample from
normalize(max(0, p_i - q_i)) and stop; if all K are accepted, sample a bonus token from p_{K+1}.
The emitted tokens then follow p exactly (Leviathan et al., Appendix A.1). Greedy: accept while
x_i == argmax p_i, then emit argmax of the first non-matching (or bonus) position.
"""
from __future__ import annotations

import torch


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
        idx = torch.tensor(draft)
        rows = torch.arange(K)
        px = p[rows, idx]
        qx = q[rows, idx]
        u = torch.rand(K, generator=generator)
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
    tok = int(torch.multinomial(dist, 1, generator=generator))
    return j, list(draft[:j]) + [tok]
