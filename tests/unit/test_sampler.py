"""Unit tests for mixserve.engine.sampler (CPU, small vocabularies, seconds to run)."""
from __future__ import annotations

import math

import pytest
import torch

from mixserve.engine import sampler as sampler_mod
from mixserve.engine.sampler import (
    Sampler,
    SamplingMetadata,
    probs_from_logits,
    process_logits,
)
from mixserve.sampling_params import SamplingParams


def meta_for(params, prompt_ids=None, output_ids=None, generators=None, min_tokens_mask_ids=None):
    n = len(params)
    return SamplingMetadata(
        params=list(params),
        prompt_ids=prompt_ids if prompt_ids is not None else [[] for _ in range(n)],
        output_ids=output_ids if output_ids is not None else [[] for _ in range(n)],
        generators=generators if generators is not None else [None] * n,
        min_tokens_mask_ids=min_tokens_mask_ids if min_tokens_mask_ids is not None else [[] for _ in range(n)],
    )


def logits_from_probs(probs):
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32)


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


# --- greedy -----------------------------------------------------------------------------------

def test_greedy_is_argmax_and_skips_processing(monkeypatch):
    torch.manual_seed(0)
    logits = torch.randn(8, 100)

    def boom(*a, **k):
        raise AssertionError("all-greedy batch without penalties must not call process_logits")

    monkeypatch.setattr(sampler_mod, "process_logits", boom)
    out = Sampler()(logits, meta_for([SamplingParams(temperature=0.0)] * 8))
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_rows_in_mixed_batch_are_argmax_and_untempered():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(temperature=0.0, top_p=0.1), SamplingParams(temperature=2.0)]
    out = Sampler()(logits, meta_for(params))
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    proc = process_logits(logits, meta_for(params))
    assert torch.equal(proc[0], logits[0])          # greedy: no temperature, no filters
    assert torch.equal(proc[2], logits[2])          # top_p ignored for greedy rows
    torch.testing.assert_close(proc[3], logits[3] / 2.0)


def test_top_k_one_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(16, 200)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 16
    for seed in range(5):
        torch.manual_seed(seed)
        out = Sampler()(logits, meta_for(params))
        assert out.token_ids == logits.argmax(dim=-1).tolist()


# --- filters ----------------------------------------------------------------------------------

def test_top_p_keeps_the_nucleus():
    row = logits_from_probs([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = row.repeat(4, 1)
    params = [SamplingParams(top_p=0.7), SamplingParams(top_p=0.85),
              SamplingParams(top_p=0.4), SamplingParams(top_p=1.0)]
    proc = process_logits(logits, meta_for(params))
    assert kept(proc[0]) == {1, 3}        # 0.5 < 0.7 <= 0.8
    assert kept(proc[1]) == {1, 3, 2}     # 0.8 < 0.85 <= 0.95
    assert kept(proc[2]) == {1}           # top token alone reaches 0.4
    assert kept(proc[3]) == {0, 1, 2, 3}
    # surviving logits are untouched, so the nucleus renormalises correctly
    assert torch.equal(proc[0][[1, 3]], row[[1, 3]])
    probs = probs_from_logits(proc)
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 0.625, 0.0, 0.375]))


def test_top_k_and_top_p_per_row_in_one_batch():
    row = logits_from_probs([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = row.repeat(3, 1)
    params = [SamplingParams(top_k=2), SamplingParams(top_k=3, top_p=0.5),
              SamplingParams(top_k=4, top_p=0.9)]
    proc = process_logits(logits, meta_for(params))
    assert kept(proc[0]) == {0, 1}
    assert kept(proc[1]) == {0, 1}        # top-3 renormalised: 0.47, 0.29 -> nucleus 0.5 needs two
    # top-4 mass 0.95 -> renormalised 0.421, 0.263, 0.211, 0.105: 0.895 < 0.9 so all four stay
    assert kept(proc[2]) == {0, 1, 2, 3}


def test_top_k_only_path_keeps_ties_at_boundary():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    proc = process_logits(logits, meta_for([SamplingParams(top_k=2)]))
    assert kept(proc[0]) == {0, 2, 3}


def test_min_p_masks_low_probability_tokens():
    row = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    logits = row.repeat(3, 1)
    params = [SamplingParams(min_p=0.2), SamplingParams(min_p=0.5), SamplingParams(min_p=0.0)]
    proc = process_logits(logits, meta_for(params))
    assert kept(proc[0]) == {0, 1, 2}     # threshold 0.1
    assert kept(proc[1]) == {0, 1}        # threshold 0.25
    assert kept(proc[2]) == {0, 1, 2, 3}


def test_min_p_uses_tempered_distribution():
    row = logits_from_probs([0.5, 0.3, 0.15, 0.05])
    # at T=0.5 probabilities go as p^2: 0.25, 0.09, 0.0225, 0.0025 -> ratio to top 0.36, 0.09, 0.01
    proc = process_logits(row.unsqueeze(0), meta_for([SamplingParams(temperature=0.5, min_p=0.2)]))
    assert kept(proc[0]) == {0, 1}


# --- penalties and min_tokens -----------------------------------------------------------------

def test_penalties_hand_computed():
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    logits = row.repeat(2, 1)
    p = dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    params = [SamplingParams(temperature=0.0, **p), SamplingParams(temperature=2.0, **p)]
    meta = meta_for(params, prompt_ids=[[0], [0]], output_ids=[[1, 1, 3], [1, 1, 3]])
    proc = process_logits(logits, meta)
    expected = torch.tensor([
        2.0 / 2.0,                     # prompt token, positive: divided
        -1.0 * 2.0 - 0.5 * 2 - 0.25,   # negative: multiplied; then 2 occurrences + presence
        0.5,                           # unseen
        3.0 / 2.0 - 0.5 * 1 - 0.25,
        -2.0,                          # unseen
    ])
    torch.testing.assert_close(proc[0], expected)
    torch.testing.assert_close(proc[1], expected / 2.0)   # temperature after penalties


def test_repetition_only_and_frequency_only_rows_do_not_leak():
    row = torch.tensor([1.0, 1.0, 1.0, 1.0])
    logits = row.repeat(3, 1)
    params = [SamplingParams(temperature=0.0, repetition_penalty=4.0),
              SamplingParams(temperature=0.0, frequency_penalty=-1.0),
              SamplingParams(temperature=0.0)]
    meta = meta_for(params, prompt_ids=[[2], [2], [2]], output_ids=[[0, 0], [0, 0], [0, 0]])
    proc = process_logits(logits, meta)
    torch.testing.assert_close(proc[0], torch.tensor([0.25, 1.0, 0.25, 1.0]))
    torch.testing.assert_close(proc[1], torch.tensor([3.0, 1.0, 1.0, 1.0]))   # prompt not counted
    torch.testing.assert_close(proc[2], row)


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    meta = meta_for([SamplingParams(temperature=0.0, presence_penalty=2.0)], output_ids=[[0]])
    assert Sampler()(logits, meta).token_ids == [1]


def test_min_tokens_blocks_eos():
    eos, stop = 3, 5
    logits = torch.zeros(3, 8)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    params = [SamplingParams(temperature=0.0, min_tokens=4), SamplingParams(temperature=1.0, min_tokens=4),
              SamplingParams(temperature=0.0)]
    meta = meta_for(params, min_tokens_mask_ids=[[eos, stop], [eos, stop, 10_000], []])
    proc = process_logits(logits, meta)
    assert proc[0, eos] == -math.inf and proc[0, stop] == -math.inf
    assert torch.equal(proc[2], logits[2])
    torch.manual_seed(0)
    for _ in range(20):
        out = Sampler()(logits, meta)
        assert out.token_ids[0] not in (eos, stop)
        assert out.token_ids[1] not in (eos, stop)
        assert out.token_ids[2] == eos


# --- randomness -------------------------------------------------------------------------------

def _draws(logits, params, generators, steps):
    s = Sampler()
    seqs = [[] for _ in params]
    for _ in range(steps):
        out = s(logits, meta_for(params, generators=generators))
        for i, t in enumerate(out.token_ids):
            seqs[i].append(t)
    return seqs


def test_same_seed_same_draws_alone_or_in_batch():
    torch.manual_seed(3)
    vocab = 300
    target = torch.randn(vocab) * 2
    p = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234)

    alone = _draws(target.unsqueeze(0), [p], [torch.Generator().manual_seed(1234)], steps=10)[0]

    others = torch.randn(4, vocab) * 2
    batch_logits = torch.cat([others[:2], target.unsqueeze(0), others[2:]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_p=0.5, seed=7),
              p, SamplingParams(temperature=1.5), SamplingParams(temperature=0.7, min_p=0.1)]
    gens = [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(1234), None, None]
    torch.manual_seed(99)
    in_batch = _draws(batch_logits, params, gens, steps=10)[2]

    assert alone == in_batch
    assert len(set(alone)) > 1   # the row really is random, not collapsed to one token


def test_sampled_frequencies_match_softmax():
    base = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -3.0])
    n = 20_000
    params = [SamplingParams(temperature=0.7, top_k=4)] * n
    torch.manual_seed(4)
    out = Sampler()(base.repeat(n, 1), meta_for(params))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=6).float() / n
    expected = torch.softmax(base / 0.7, dim=-1)
    expected[[3, 5]] = 0.0          # outside top-4
    expected /= expected.sum()
    tv = 0.5 * (freq - expected).abs().sum().item()
    assert tv < 0.02, (freq, expected)
    assert freq[3] == 0 and freq[5] == 0


def test_seeded_rows_sample_the_right_distribution():
    base = torch.tensor([0.3, -0.2, 1.0, 0.0])
    n = 4_000
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    out = Sampler()(base.repeat(n, 1), meta_for(params, generators=gens))
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    tv = 0.5 * (freq - torch.softmax(base, dim=-1)).abs().sum().item()
    assert tv < 0.04, freq


# --- logprobs ---------------------------------------------------------------------------------

def test_logprobs_raw_topn_sorted_and_rank():
    torch.manual_seed(5)
    logits = torch.randn(3, 40)
    best = int(logits[0].argmax())
    # Row 0: greedy, but a heavy presence penalty on the raw best forces the 2nd-ranked token.
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0, logprobs=5),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.3, top_k=3, logprobs=0)]
    second = int(logits[0].topk(2).indices[1])
    logits[0, best] = logits[0, second] + 1.0        # margin smaller than the penalty
    meta = meta_for(params, output_ids=[[best], [], []])
    out = Sampler()(logits, meta)

    raw_lp = torch.log_softmax(logits, dim=-1)
    lp0 = out.logprobs[0]
    assert out.token_ids[0] == second and lp0.token_id == second
    assert lp0.rank == 2
    assert lp0.logprob == pytest.approx(raw_lp[0, second].item(), abs=1e-6)   # raw, not penalised
    assert len(lp0.top) == 5
    values = [v for _, v in lp0.top]
    assert values == sorted(values, reverse=True)
    ref_v, ref_i = raw_lp[0].topk(5)
    assert [t for t, _ in lp0.top] == ref_i.tolist()
    assert values == pytest.approx(ref_v.tolist(), abs=1e-6)

    assert out.logprobs[1] is None
    lp2 = out.logprobs[2]
    assert lp2.top == []
    assert lp2.token_id == out.token_ids[2]
    assert lp2.logprob == pytest.approx(raw_lp[2, lp2.token_id].item(), abs=1e-6)  # not tempered
    assert lp2.rank == 1 + int((raw_lp[2] > raw_lp[2, lp2.token_id]).sum())
    assert 1 <= lp2.rank <= 3


# --- contracts --------------------------------------------------------------------------------

def test_input_logits_not_modified():
    torch.manual_seed(6)
    logits = torch.randn(4, 64)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, logprobs=3),
              SamplingParams(temperature=0.9, top_k=10, top_p=0.8, min_p=0.05, frequency_penalty=1.0),
              SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.5, presence_penalty=-1.0, min_tokens=2)]
    meta = meta_for(params, prompt_ids=[[1, 2], [3], [4], [5]], output_ids=[[6], [7, 7], [], [8]],
                    generators=[None, torch.Generator().manual_seed(0), None, None],
                    min_tokens_mask_ids=[[], [], [], [0, 1]])
    proc = process_logits(logits, meta)
    Sampler()(logits, meta)
    assert torch.equal(logits, before)
    assert proc.dtype == torch.float32 and proc.data_ptr() != logits.data_ptr()


def test_half_precision_logits_are_upcast():
    logits = torch.randn(2, 32).to(torch.bfloat16)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0, top_p=0.9)]
    proc = process_logits(logits, meta_for(params))
    assert proc.dtype == torch.float32
    out = Sampler()(logits, meta_for(params))
    assert out.token_ids[0] == int(logits[0].float().argmax())


def test_bad_inputs_raise():
    params = [SamplingParams()] * 2
    with pytest.raises(ValueError, match="2-D"):
        Sampler()(torch.zeros(5), meta_for(params[:1]))
    with pytest.raises(ValueError, match="generators"):
        Sampler()(torch.zeros(2, 5), SamplingMetadata(params, [[], []], [[], []], [None], [[], []]))
    with pytest.raises(TypeError):
        process_logits(torch.zeros(2, 5, dtype=torch.long), meta_for(params))
    with pytest.raises(ValueError, match="out of range"):
        process_logits(torch.zeros(1, 5), meta_for([SamplingParams(repetition_penalty=1.2)], prompt_ids=[[7]]))


def test_greedy_ids_break_ties_as_argmax():
    """greedy_ids (max(dim).indices, faster on CPU) returns argmax's first index of the maximum,
    including ties, -inf rows with one finite entry and bf16 logits."""
    from mixserve.engine.sampler import greedy_ids

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (64, 1000), generator=g).float()  # many exact ties
    assert torch.equal(greedy_ids(x), x.argmax(-1))
    y = torch.full((3, 500), float("-inf"))
    y[:, 7] = y[:, 300] = 0.0
    assert greedy_ids(y).tolist() == [7, 7, 7]
    z = torch.randn(5, 151936, generator=g).to(torch.bfloat16)
    assert torch.equal(greedy_ids(z), z.argmax(-1))
    assert int(greedy_ids(torch.tensor([1.0, 3.0, 3.0]))) == 1
