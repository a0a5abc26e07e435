"""How far int8 activations move the logits: the native GGUF kernel's arithmetic emulated in PyTorch.

The native kernel (layers/gguf_kernels.py) multiplies the exact effective weights by activations
quantized to int8 per 32 channels (scale max|x| / 127, round half to even), in `levels` levels (each
level quantizes what the previous left over). Here every body linear of the float32 dequantized
model quantizes its input that way first (the LM head stays exact, as the kernel's three-level head
nearly is), so the effect is measured on any machine, AVX-512 or not:

- shared/cases/seeded-output-depends-on-batch.md case 2: the greedy chat answer and the first
  token's top two under 0, 1 and 2 levels (0: the float32 reference);
- the largest change of the reference's top-2 logit gap over its own greedy tokens (teacher forced)
  on HumanEval prompts: the noise the tie rule (0.01) must cover.

    python benchmarks/act_levels.py --model qwen2.5-coder-0.5b-instruct --prompts 2 --tokens 64
"""
from __future__ import annotations

import argparse

import torch

from mixserve import SamplingParams
from mixserve.env import machine_info
from mixserve.layers.linear import DenseLinear
from mixserve.llm import LLM

CASE2 = [{"role": "user", "content": "Repeat exactly: 霓虹灯 🎉👩‍💻 naïve café 𠜎𠜱𠝹"}]
_LEVELS = {"n": 0}
_plain = DenseLinear._forward


def quantize_levels(x: torch.Tensor, levels: int) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) -> the sum of its `levels` int8 quantizations, float32."""
    rest = x.reshape(-1, x.shape[-1]).float()
    out = torch.zeros_like(rest)
    for _ in range(levels):
        b = rest.view(rest.shape[0], -1, 32)
        d = b.abs().amax(-1, keepdim=True) / 127
        q = torch.round(b / torch.where(d > 0, d, torch.ones_like(d)))
        deq = (q * d).view_as(rest)
        out, rest = out + deq, rest - deq
    return out.view_as(x)


def _emulated(self, x):
    if _LEVELS["n"] and not self.float_out:
        x = quantize_levels(x, _LEVELS["n"]).to(x.dtype)
    return _plain(self, x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    from mixserve.data.datasets import load_humaneval

    print(machine_info(), flush=True)
    DenseLinear._forward = _emulated
    llm = LLM(a.model, dtype="float32", gguf_weights="dequantize", kv_cache_memory="256MiB", max_model_len=1024,
              progress=False)
    tok = llm.tokenizer
    chat = tok.apply_chat_template(CASE2, tokenize=True, add_generation_prompt=True)["input_ids"]
    he = [tok.encode(r.prompt) for r in load_humaneval(a.prompts)]
    ref = llm.generate(he, SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True, logprobs=2))
    for levels in (0, 1, 2):
        _LEVELS["n"] = levels
        o = llm.generate([chat], SamplingParams(temperature=0, max_tokens=12, logprobs=2))[0]
        top = [(tok.decode([t]), round(v, 5)) for t, v in o.logprobs[0].top]
        line = f"levels {levels}: case 2 answer {o.text!r}, first token top-2 {top}"
        if levels:
            scored = llm.generate([p + r.token_ids for p, r in zip(he, ref)],
                                  SamplingParams(max_tokens=0, prompt_logprobs=8))
            noise = 0.0
            for p, r, s in zip(he, ref, scored):
                for lr, ln in zip(r.logprobs, s.prompt_logprobs[len(p) - 1:]):
                    second = dict(ln.top).get(lr.top[1][0], ln.top[-1][1])
                    noise = max(noise, abs((lr.top[0][1] - lr.top[1][1]) - (ln.logprob - second)))
            line += f"; max top-2 gap change over {sum(len(r.token_ids) for r in ref)} teacher-forced positions {noise:.4f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
