"""perfxlm: a vLLM-compatible LLM inference engine, fast on CPU."""

from perfxlm.llm import LLM
from perfxlm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from perfxlm.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "RequestOutputKind", "__version__"]
