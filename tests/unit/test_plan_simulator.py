"""The simulator on tiny traces worked out by hand (constant step time 1 s)."""
import pytest

from mixserve.plan.simulator import SimConfig, SimRequest, SpecSettings, simulate
from mixserve.plan.step_time import StepBatch, Table

ONE = lambda b: 1.0  # noqa: E731


def test_hand_worked_preemption():
    # block_size 2, 5 blocks (10 slots), budget 8 tokens. A: prompt 3, 4 out; B: 2, 3; C: 2, 2.
    # step 0: admit A (3 tokens, 2 blocks), B (2, 1 block), C (2, 1 block): 1 free; all sample.
    # step 1: A decodes pos 3 (fits its 2 blocks); B pos 2 needs a 2nd block: takes the last;
    #         C pos 2 needs a block, none free: C (the newest) is preempted, its block freed;
    #         nothing is admitted in a step that preempted. A and B sample.
    # step 2: A pos 4 needs a 3rd block: takes the free one; B pos 3 fits; C waits for 2 blocks
    #         (prompt + its first token recomputed), 0 free. A samples its 3rd, B its 3rd: done,
    #         freeing 2 blocks.
    # step 3: A pos 5 fits; C readmitted, recomputes 3 tokens in 2 blocks and samples its 2nd
    #         token: done; A samples its 4th: done.
    reqs = [SimRequest(3, 4), SimRequest(2, 3), SimRequest(2, 2)]
    cfg = SimConfig(num_blocks=5, block_size=2, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=100)
    res = simulate(reqs, cfg, ONE)
    assert res.token_steps == [[0, 1, 2, 3], [0, 1, 2], [0, 3]]
    assert res.preemptions == [0, 0, 1]
    assert res.num_preemptions == 1
    assert res.peak_kv_blocks == 5
    assert [(s[0], s[1], s[2], s[3]) for s in res.steps] == [(0, 1, 7, 3), (1, 2, 2, 2), (2, 3, 2, 2), (3, 4, 4, 2)]
    m = res.metrics
    assert [x.ttft for x in m] == [1.0, 1.0, 1.0]
    assert [x.e2e for x in m] == [4.0, 3.0, 4.0]
    assert m[2].tpot == 3.0  # (4 - 1) / (2 - 1)
    assert res.report["output_tokens"] == 9 and res.duration_s == 4.0


def test_arrivals_and_idle_gap():
    # A (2, 2) at 0: prefill in step 0 [0, 1], decode in step 1 [1, 2]. Idle until B arrives
    # at 5: step 2 [5, 6] prefills B and samples its only token.
    reqs = [SimRequest(2, 2, 0.0), SimRequest(2, 1, 5.0)]
    res = simulate(reqs, SimConfig(num_blocks=10, block_size=2), ONE)
    assert res.token_steps == [[0, 1], [2]]
    assert [s[:2] for s in res.steps] == [(0, 1), (1, 2), (5, 6)]
    assert res.metrics[1].ttft == 1.0 and res.metrics[1].e2e == 1.0


def test_chunked_prefill():
    # budget 4: a 10-token prompt is prefilled in chunks 4, 4, 2; the last samples (step 2).
    res = simulate([SimRequest(10, 2)], SimConfig(num_blocks=10, block_size=4, max_num_batched_tokens=4), ONE)
    assert res.token_steps == [[2, 3]]
    assert [s[2] for s in res.steps] == [4, 4, 2, 1]


def test_contiguous_reservation_admits_fewer():
    # 8 blocks of 4 slots; max_model_len 16 reserves 4 blocks a sequence: 2 run at once, while
    # paged gives each of the 4 requests its 2 blocks (5 tokens + 1) and runs all 4 together.
    reqs = [SimRequest(4, 2) for _ in range(4)]
    kw = dict(num_blocks=8, block_size=4, max_model_len=16)
    paged = simulate(reqs, SimConfig(**kw), ONE)
    contig = simulate(reqs, SimConfig(**kw, allocator="contiguous"), ONE)
    fit = simulate(reqs, SimConfig(**kw, allocator="contiguous", reserve="max-tokens"), ONE)
    assert paged.peak_running_seqs == 4 and len(paged.steps) == 2
    assert contig.token_steps == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert fit.token_steps == paged.token_steps


def test_rejects_what_never_fits():
    res = simulate([SimRequest(30, 10), SimRequest(2, 2)], SimConfig(num_blocks=4, block_size=4), ONE)
    assert res.rejected == [0] and res.metrics[0] is None and res.token_steps[1] == [0, 1]


def test_speculation_alpha_zero_is_plain_decoding():
    reqs = [SimRequest(3, 5)]
    spec = simulate(reqs, SimConfig(num_blocks=10, block_size=4, spec=SpecSettings(0.0, 3, mode="fixed")), ONE)
    assert spec.token_steps == [[0, 1, 2, 3, 4]]
    # alpha close to 1 with k = 3: 4 tokens per verification step after the prefill
    spec = simulate(reqs, SimConfig(num_blocks=10, block_size=4, spec=SpecSettings(0.999999, 3, mode="fixed")),
                    ONE)
    assert spec.token_steps == [[0, 1, 1, 1, 1]]


def test_table_interpolation():
    t = Table([1, 4], [1.0, 2.0])
    assert t(0) == 1.0 and t(2.5) == 1.5 and t(8) == 4.0


def test_step_batch_counts():
    b = StepBatch([5, 9], [(4, 4)], 3)
    assert b.num_tokens == 6 and b.num_seqs == 3


def test_bad_config():
    with pytest.raises(ValueError, match="allocator"):
        SimConfig(num_blocks=1, allocator="buddy")


@pytest.mark.parametrize("caching", [False, True])
def test_matches_the_real_engine(tmp_path, caching):
    """The same trace through LLMEngine (a tiny random model) and through the simulator: every
    output token comes out in the same step, preemptions included, and with prefix caching the
    same hits (a preempted request finds its own blocks again; two share a prefix)."""
    import random

    from mixserve import SamplingParams
    from mixserve.engine.args import EngineArgs
    from mixserve.engine.llm_engine import LLMEngine
    from tests.unit.test_engine_tiny import make_tiny

    folder, _ = make_tiny(tmp_path, "qwen2", tie=True)
    rng = random.Random(1)
    lens = [(rng.randint(3, 40), rng.randint(2, 30)) for _ in range(8)]
    eng = LLMEngine(EngineArgs(model=folder, dtype="float32", block_size=4, kv_cache_memory=24 * 4 * 512,
                               max_num_seqs=5, max_num_batched_tokens=32, progress=False,
                               enable_prefix_caching=caching))
    assert eng.num_blocks == 24
    toks = [[rng.randrange(256) for _ in range(p)] for p, _ in lens]
    common = [rng.randrange(256) for _ in range(12)]  # three full blocks
    for j in (2, 5):
        toks[j] = common + toks[j]
        lens[j] = (len(toks[j]), lens[j][1])
    ids = [eng.add_request(t, SamplingParams(max_tokens=o, ignore_eos=True)) for t, (_, o) in zip(toks, lens)]
    steps = {i: [] for i in ids}
    n = 0
    while eng.has_unfinished():
        for o in eng.step():
            steps[o.request_id] += [n] * (len(o.token_ids) - len(steps[o.request_id]))
        n += 1
    assert eng.scheduler.num_preemptions > 0  # the budget is small enough to preempt
    res = simulate([SimRequest(p, o, token_ids=t) for (p, o), t in zip(lens, toks)],
                   SimConfig(num_blocks=24, block_size=4, max_num_seqs=5, max_num_batched_tokens=32,
                             max_model_len=eng.max_model_len, prefix_caching=caching), ONE)
    assert res.token_steps == [steps[i] for i in ids]
    assert res.num_preemptions == eng.scheduler.num_preemptions
    assert res.peak_kv_blocks == eng.block_manager.peak_used
    bm = eng.block_manager
    assert (res.prefix_queries, res.prefix_hits, res.recompute_hits) == (
        bm.prefix_queries, bm.prefix_hits, bm.recompute_hits)
    assert (bm.recompute_hits > 0) == caching


def test_constrained_requests_pay_their_masks_in_the_steps_they_sample():
    """Structured output: a step's time grows by the masks of its constrained sampling rows (here
    1 s a row on top of 1 s a step); the free requests' steps do not."""
    seen = []

    def step(b: StepBatch) -> float:
        seen.append((b.sampled_rows, b.masked_rows))
        return 1.0 + b.masked_rows

    cfg = SimConfig(num_blocks=40, block_size=4)
    free = simulate([SimRequest(4, 3), SimRequest(4, 3)], cfg, step)
    assert all(m == 0 for _, m in seen)
    seen.clear()
    mixed = simulate([SimRequest(4, 3), SimRequest(4, 3, constrained=True)], cfg, step)
    assert any(m == 1 for _, m in seen) and all(m <= s for s, m in seen)
    assert mixed.report["duration_s"] > free.report["duration_s"]


def test_mask_time_from_a_profile_fit():
    from mixserve.plan.step_time import StepModel

    class M(StepModel):
        def __init__(self):
            self.mask_fit = (0.001, 0.0002)

    m = M()
    assert m.mask_time(0) == 0.0 and m.mask_time(1) == pytest.approx(0.0012) and m.mask_time(10) == pytest.approx(0.003)
