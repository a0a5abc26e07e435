"""mixserve: an LLM inference engine that measures your own traffic mix."""
from mixserve.sampling_params import SamplingParams
from mixserve.structured_output import StructuredOutputs

__all__ = ["LLM", "SamplingParams", "StructuredOutputs"]


def __getattr__(name):
    # torch and transformers load slowly; import the engine only when it is asked for.
    if name == "LLM":
        from mixserve.llm import LLM

        return LLM
    raise AttributeError(name)
