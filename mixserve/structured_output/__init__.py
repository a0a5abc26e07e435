"""Structured output (issue 33): outputs constrained to a JSON schema, a regex, a choice or a grammar.

- spec.py: `StructuredOutputs`, what a request asks for (SamplingParams.structured);
- compiler.py: `GrammarCompiler`, the constraint compiled once per model and constraint (llguidance);
- masks.py: a step's masks, filled without the GIL and applied to the logits in one op.

The engine's hooks (engine/llm_engine.py): a request's constraint is compiled in `check_request`
and its sequence gets a matcher at `add_request`; each step masks the constrained rows before
sampling (`Sampler`) and verification; a sampled token advances the matcher, and a row whose
grammar can go no further ends with "stop". Speculative drafts are cut at their first token the
grammar forbids. Preemption keeps the matcher (the tokens are kept), prefix caching ignores it
(K/V do not depend on the grammar).
"""
from mixserve.structured_output.spec import StructuredOutputs

__all__ = ["StructuredOutputs"]
