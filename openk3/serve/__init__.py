"""Serving: the inference engine (offline `LLM`, step-level `LLMEngine`), its hybrid paged cache, prefix caching
and speculative decoding (docs/serving.md)."""

from openk3.serve.engine import LLM, LLMEngine
from openk3.serve.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "RequestOutput", "SamplingParams"]
