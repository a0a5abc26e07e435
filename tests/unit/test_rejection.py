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


def test_verify_picks_the_rule_the_request_asks_for():
    from mixserve.engine.sampler import exponential_noise, race
    from mixserve.spec_decode.rejection import verify

    logits = torch.log(torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]]))
    # greedy: accept while the draft is the argmax, then the argmax
    assert verify(logits, [1, 0], None, True, [None] * 3) == (2, [1, 0, 2])
    assert verify(logits, [2, 0], None, True, [None] * 3) == (0, [1])
    # seeded: the coupled rule, so each emitted token is the race with that position's noise
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    again = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    j, toks = verify(logits, [], None, False, gens[:1])
    assert j == 0 and toks == race(torch.softmax(logits[:1], -1), exponential_noise(again[0], 3)[None]).tolist()
    # unseeded with a deterministic proposer (q None): a token the target gives probability 0 is
    # never accepted, one it gives probability 1 always is
    sure = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]).clamp_min(1e-30).log()
    assert verify(sure, [2], None, False, [None, None]) == (1, [2, 0])
    assert verify(sure, [1], None, False, [None, None]) == (0, [2])
