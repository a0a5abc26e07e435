"""Offline API: `LLM(model=...).generate(prompts, sampling_params)`."""
from __future__ import annotations

from tqdm import tqdm

from mixserve.engine.args import EngineArgs
from mixserve.engine.llm_engine import LLMEngine, RequestOutput
from mixserve.sampling_params import SamplingParams


class LLM:
    """Load a model once and generate for batches of prompts with continuous batching.

    Args:
        model: built-in name, GGUF path or HF folder. Other keyword arguments are EngineArgs
            fields (dtype, block_size, kv_cache_memory, max_num_seqs, max_num_batched_tokens, ...).
    Raises:
        FileNotFoundError / ValueError: the model cannot be found or read.
    """

    def __init__(self, model: str = EngineArgs.model, **kwargs):
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) and return outputs in prompt order.

        sampling_params: one for all prompts or a list, one per prompt.
        Raises ValueError (before anything runs) if any request cannot be served.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if isinstance(sampling_params, tuple):
            sampling_params = list(sampling_params)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.engine.add_request(p, sp))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req")
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [final[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = False):
        """Apply the model's chat template to one conversation or a list, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)
