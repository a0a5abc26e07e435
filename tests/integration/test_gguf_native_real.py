"""Native GGUF weights on the real files (issue 16): greedy output against the dequantized model,
float32, on 2 HumanEval prompts x 40 tokens.

The native kernel's effective weights are exactly the dequantized ones (tests/unit/test_gguf_native.py);
the one numeric change is its int8 activations (one scale per 32 channels). So the outputs may part
only where the reference's top two tokens are closer than that change can move them. The change is
measured here, not assumed: the reference's greedy sequences are scored by the native model
(teacher forcing, the kernel at every row count), and the noise is the largest change of the
reference's top-2 logit gap. The test asserts the native model picks the reference's token wherever
the reference's gap exceeds that noise, and reports the first greedy divergence and its gap."""
import os

import pytest

from mixserve import SamplingParams
from mixserve.layers import gguf_kernels, gguf_linear
from mixserve.llm import LLM

# On the variant a default start runs natively: AVX512-VNNI, or AVX2 on a CPU without it (and under
# MIXSERVE_ISA=avx2). Both compute the same bits (tests/unit/test_gguf_native.py checks both against
# one numpy emulation of the float order). Without a native kernel there is nothing native to compare.
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(not gguf_kernels.default_native(),
                                 reason="no native GGUF kernel here (it needs AVX2, FMA, F16C and a C++ compiler)")]

TOKENS = 40  # 64 before issue 43 ran it on AVX2 machines too (the suite's 15 minutes, issue 32)
# the kernel at every row count (as a decode step runs it), also for the teacher-forced prefill
KERNEL_EVERYWHERE = "gguf_dense_rows=never,float_head_rows=never"


def gap(lp) -> float:
    return lp.top[0][1] - lp.top[1][1]


# the 1.5B (4 minutes on 2 cores, a 6 GB float32 reference) only where asked for: CI's suite must
# stay well under 30 minutes, and the 0.5B's file holds more of the block types (Q5_0, Q8_0, Q6_K, Q4_K)
LARGE = pytest.mark.skipif(not os.environ.get("MIXSERVE_TEST_LARGE"), reason="set MIXSERVE_TEST_LARGE=1 for the 1.5B")


@pytest.mark.parametrize("model", ["qwen2.5-coder-0.5b-instruct",
                                   pytest.param("qwen2.5-coder-1.5b-instruct", marks=LARGE)])
def test_native_greedy_equals_dequantized_up_to_measured_activation_noise(model):
    from mixserve.data.datasets import load_humaneval

    prompts = [r.prompt for r in load_humaneval(2)]
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=2)
    ref_llm = LLM(model, dtype="float32", kv_cache_memory="256MiB", progress=False, gguf_weights="dequantize")
    ids = [ref_llm.tokenizer.encode(p) for p in prompts]
    ref = ref_llm.generate(ids, sp)
    del ref_llm
    nat = LLM(model, dtype="float32", kv_cache_memory="256MiB", progress=False, gguf_weights="native",
              kernels=KERNEL_EVERYWHERE)
    assert "GGUF weights native" in nat.engine.describe()
    got = nat.generate(ids, sp)
    # teacher forcing: the native model's distribution at each of the reference's positions
    scored = nat.generate([p + r.token_ids for p, r in zip(ids, ref)], SamplingParams(max_tokens=0, prompt_logprobs=8))
    noise, agree, report = 0.0, [], []
    for p, r, s in zip(ids, ref, scored):
        at = s.prompt_logprobs[len(p) - 1:]  # entry j predicts the reference's generated token j
        assert len(at) == TOKENS and [a.token_id for a in at] == r.token_ids
        for lr, ln in zip(r.logprobs, at):
            # the reference's top-1 minus top-2 logit, and the same two tokens' difference natively
            # (a second token fallen out of the native top 8 counts at the 8th's value: a lower bound)
            second = dict(ln.top).get(lr.top[1][0], ln.top[-1][1])
            noise = max(noise, abs(gap(lr) - (ln.logprob - second)))
            agree.append(ln.top[0][0] == lr.top[0][0])
    for r, g in zip(ref, got):
        d = next((j for j, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), None)
        report.append("equal" if d is None else f"first divergence at token {d}, reference top-2 gap "
                                                f"{gap(r.logprobs[d]):.4f}")
        if d is not None:  # greedy may part only at a near-tie (the tie rule's 0.01, or the noise)
            assert gap(r.logprobs[d]) < max(0.01, noise), (model, d, gap(r.logprobs[d]), noise)
    # two int8 levels per activation row (gguf_linear.ACT_LEVELS) move a logit gap by about a
    # thousandth (emulated: 0.001 on these 128 positions; one level: 0.137)
    if gguf_linear.ACT_LEVELS >= 2:
        assert noise < 0.05, noise
    assert noise < 0.5, noise
    assert sum(agree) >= 0.95 * len(agree), (sum(agree), len(agree))
    print(f"{model}: activation noise (max change of the top-2 gap) {noise:.4f}; teacher-forced top-1 "
          f"agreement {sum(agree)}/{len(agree)}; greedy: {'; '.join(report)}")
