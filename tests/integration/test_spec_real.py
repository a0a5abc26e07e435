"""Speculative decoding on real models: greedy output equals plain greedy (float32)."""
import os

import pytest

from mixserve import SamplingParams
from mixserve.llm import LLM

pytestmark = pytest.mark.integration


def test_smollm2_self_draft_accepts_everything(smollm2_path):
    llm = LLM(smollm2_path, dtype="float32", kv_cache_memory="256MiB", draft_model=smollm2_path,
              num_speculative_tokens=4, speculation="fixed", progress=False, gguf_weights="dequantize")
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    spec = llm.generate(["def fib(n):", "The capital of France is"], sp)
    llm.engine.controller.mode = "off"
    plain = llm.generate(["def fib(n):", "The capital of France is"], sp)
    for s, p in zip(spec, plain):
        assert s.token_ids == p.token_ids
        m = s.metrics
        assert m["spec_proposed"] > 0 and m["spec_accepted"] == m["spec_evaluated"]


# the 1.5B target: a 1.1 GB pull and a 6 GB float32 conversion on a fresh cache root, so opt-in as
# the 1.5B native test; the draft/target mechanics on real weights stay in the suite (SmolLM2 self
# draft here, the 0.5B self and n-gram drafts in test_batch_invariance_real.py)
@pytest.mark.skipif(not os.environ.get("MIXSERVE_TEST_LARGE"), reason="set MIXSERVE_TEST_LARGE=1 for the 1.5B")
def test_qwen_pair_humaneval_greedy_equals_plain():
    from mixserve.data.datasets import load_humaneval

    llm = LLM("qwen2.5-coder-1.5b-instruct", dtype="float32", kv_cache_memory="512MiB",
              draft_model="qwen2.5-coder-0.5b-instruct", num_speculative_tokens=4, speculation="fixed",
              progress=False, gguf_weights="dequantize")
    prompts = [r.prompt for r in load_humaneval(2)]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = llm.generate(prompts, sp)
    llm.engine.controller.mode = "off"
    plain = llm.generate(prompts, sp)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics["spec_accepted"] for o in spec) > 0
    assert llm.engine.runner.num_forwards == llm.engine.num_steps



def _capture(engine, into: dict):
    """logits_hook storing each logits row under the token prefix it predicts from."""
    def hook(logits, rows):
        r = 0
        for it in rows:
            for t in range(it.num_logits):
                pos = it.end - it.num_logits + t
                into[tuple(it.token_ids[:pos + 1])] = logits[r + t].clone()
            r += it.num_logits
    engine.logits_hook = hook


@pytest.mark.parametrize("invariant", ["on", "off"])
def test_smollm2_bf16_spec_greedy_equals_plain_up_to_measured_noise(smollm2_path, invariant, monkeypatch):
    """bf16, --batch-invariant off: a (k+1)-row verification forward and a 1-row decode step round
    the body's activations differently, so their logits differ by a small noise; speculative greedy
    may then leave plain greedy only where plain's top-2 gap is within that noise. The noise is
    measured here: the same prefixes scored both ways (each prompt alone, and the batch of 4), as
    the change of the gap between plain's top two tokens; the near-tie threshold is its largest
    value. With batch invariance on (the default) there is no noise: every logit is the same bits
    both ways, and speculative greedy is plain greedy outright."""
    prompts = ["def quicksort(arr):", "The three laws of thermodynamics are", "Once upon a time, in a",
               "import json\n\ndef load(path):"]
    # fixed kernels, none timed (issue 32: timing every bf16 kernel took ~20 of this test's 49 s): the
    # paged decode kernel, plain F.linear, no decode graph (its compile is tested elsewhere). With the
    # eager kernels everywhere (SDPA decode attention) none of the batch of four matched outright on an
    # AVX2-only CPU (a spent timing budget) and `same >= 1` below failed; with these kernels one does there (2026-12-05)
    monkeypatch.setenv("MIXSERVE_KERNEL_TIMING", "prior")
    llm = LLM(smollm2_path, dtype="bfloat16", kv_cache_memory="256MiB", draft_model=smollm2_path,
              num_speculative_tokens=4, speculation="fixed", progress=False, gguf_weights="dequantize",
              batch_invariant=invariant, kernels="decode_graph=eager,decode_attention=paged")
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)  # 40 before issue 32's cuts

    def run(mode, ps):
        llm.engine.controller.mode = mode
        cap = {}
        _capture(llm.engine, cap)
        return llm.generate(ps, sp), cap

    gap_changes, logit_diffs, gaps, accepted = [], [], [], 0
    batch = {}
    # two prompts alone (one-row forwards) and the batch of four: enough positions for the noise's
    # maximum (the batch's own prefixes, where a divergence is judged, are measured too); every prompt
    # alone as well took 25 s more on an AVX2-only CPU (issue 32)
    for ps in [[p] for p in prompts[:2]] + [prompts]:
        spec, cs = run("fixed", ps)
        plain, cp = run("off", ps)
        accepted += sum(o.metrics["spec_accepted"] for o in spec)
        for key in cs.keys() & cp.keys():
            a, b = cp[key].topk(2).indices.tolist()
            gaps.append((cp[key][a] - cp[key][b]).item())
            gap_changes.append(abs((cs[key][a] - cs[key][b]) - (cp[key][a] - cp[key][b])).item())
            logit_diffs.append((cs[key] - cp[key]).abs().max().item())
        if len(ps) == 4:
            batch = {"spec": spec, "plain": plain, "plain_logits": cp}
    threshold = max(gap_changes)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"\nbf16 noise, 1-row vs 5-row forwards over {len(gap_changes)} positions: top-2 gap change max "
          f"{threshold:.4f} (median {med(gap_changes):.4f}); max |logit diff| over the vocabulary max "
          f"{max(logit_diffs):.4f} (median {med(logit_diffs):.4f}); plain's median top-2 gap {med(gaps):.4f}")
    assert accepted > 0 and len(gap_changes) > 100
    if invariant == "on":
        assert max(logit_diffs) == 0.0
        assert [o.token_ids for o in batch["spec"]] == [o.token_ids for o in batch["plain"]]
        return
    assert 0 < threshold < med(gaps)  # the noise exists, and excuses only near-ties
    same = 0
    for s, p in zip(batch["spec"], batch["plain"]):
        ids_s, ids_p = s.token_ids, p.token_ids
        i = next((j for j, (x, y) in enumerate(zip(ids_s, ids_p)) if x != y), None)
        if i is None:
            same += 1
            continue
        ref = batch["plain_logits"][tuple(p.prompt_token_ids + ids_p[:i])]
        top2 = ref.topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < threshold, f"diverged at token {i} where plain's top-2 gap {gap:.4f} >= {threshold:.4f}"
    # some of the batch matches outright: 2-4 of 4 with AVX-512 bf16 dot products; 1 on an AVX2-only
    # machine, whose bf16 matmuls round more (gap change up to 0.76 there), every divergence a near-tie
    assert same >= 1
