"""Speculative sampling's accept/reject rule keeps the target distribution exactly."""
import torch

from mixserve.spec_decode.rejection import accept_coupled, accept_greedy, accept_sampled

V = 6
N = 20000


def dists():
    g = torch.Generator().manual_seed(0)
    P = torch.softmax(torch.randn(4, V, generator=g) * 1.5, -1)  # target at positions 0..3
    Q = torch.softmax(torch.randn(4, V, generator=g) * 1.5, -1)  # a mismatched draft
    return P, Q


def simulate(rule, K=2, n=N, seed=1):
    """Generate 3 tokens per run with speculative rounds; target/draft distributions depend only on
    the absolute position, so each position's marginal must equal P[position]."""
    P, Q = dists()
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(3, V)
    for _ in range(n):
        out = []
        while len(out) < 3:
            t = len(out)
            k = min(K, 3 - t)
            draft = [int(torch.multinomial(Q[t + i], 1, generator=g)) for i in range(k)]
            j, toks = rule(P[t:t + k + 1], Q[t:t + k], draft, g)
            out += toks
        for pos in range(3):
            counts[pos, out[pos]] += 1
    return counts / n, P


def tv(a, b):
    return 0.5 * (a - b).abs().sum(-1)


def always_accept(p, q, draft, g):
    return len(draft), list(draft) + [int(torch.multinomial(p[len(draft)], 1, generator=g))]


def test_correct_rule_matches_target():
    freq, P = simulate(accept_sampled)
    d = tv(freq, P[:3])
    # 20k draws over 6 outcomes: sampling noise in TV is ~0.01; 0.025 is a comfortable bound
    assert (d < 0.025).all(), d


def test_wrong_rule_fails_the_same_bound():
    freq, P = simulate(always_accept, n=5000)
    d = tv(freq, P[:3])
    assert (d[:2] > 0.05).all(), d


def test_identical_draft_accepts_everything():
    P, _ = dists()
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        draft = [int(torch.multinomial(P[i], 1, generator=g)) for i in range(3)]
        j, toks = accept_sampled(P, P[:3], draft, g)
        assert j == 3 and toks[:3] == draft and len(toks) == 4


def test_zero_draft_probability_rejected():
    p = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    q = torch.tensor([[1.0, 0.0]])
    j, toks = accept_sampled(p, q, [0])
    assert j == 0 and toks == [1]


def test_greedy_rule():
    assert accept_greedy([5, 6, 7], [5, 6]) == (2, [5, 6, 7])
    assert accept_greedy([5, 9, 7], [5, 6]) == (1, [5, 9])
    assert accept_greedy([4, 9, 7], [5, 6]) == (0, [4])
    assert accept_greedy([4], []) == (0, [4])


def test_coupled_rule_is_leviathans_for_a_fixed_draft():
    """accept_coupled with a deterministic draft x accepts with probability p(x) and otherwise
    emits p without x, renormalised (Leviathan's rule for one-hot q); the emitted token is the
    race sample of p, so it is the same with or without the draft."""
    from mixserve.engine.sampler import exponential_noise, race

    P, _ = dists()
    x = int(P[0].argmax())
    g = torch.Generator().manual_seed(2)
    acc, rejected_to = 0, torch.zeros(V)
    for _ in range(N // 2):
        noise = torch.stack([exponential_noise(g, V) for _ in range(2)])
        j, toks = accept_coupled(P[:2], [x], noise)
        assert toks[0] == int(race(P[0], noise[0]))  # k-invariant: what plain sampling draws
        acc += j
        if not j:
            rejected_to[toks[0]] += 1
    assert abs(acc / (N // 2) - P[0, x].item()) < 0.02
    resid = P[0].clone()
    resid[x] = 0
    assert tv(rejected_to / rejected_to.sum(), resid / resid.sum()) < 0.03
