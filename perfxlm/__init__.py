"""perfxlm: a vLLM-compatible LLM inference engine, fast on CPU."""

from perfxlm.beam_search import BeamSearchOutput, BeamSearchSequence
from perfxlm.config import EngineConfig
from perfxlm.engine.async_engine import AsyncLLM
from perfxlm.engine.handle import Engine, RequestHandle
from perfxlm.inputs import AsyncEngineArgs, EngineArgs, TextPrompt, TokensPrompt
from perfxlm.llm import LLM
from perfxlm.lora.request import LoRARequest
from perfxlm.outputs import (
    ClassificationOutput, ClassificationRequestOutput, CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput,
    Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput, ScoringOutput, ScoringRequestOutput,
)
from perfxlm.pooling_params import PoolingParams
from perfxlm.sampling_params import BeamSearchParams, GuidedDecodingParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM", "AsyncLLM", "Engine", "EngineConfig", "RequestHandle", "SamplingParams", "RequestOutput",
    "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutputKind", "__version__",
    "EngineArgs", "AsyncEngineArgs", "TextPrompt", "TokensPrompt", "StructuredOutputsParams", "GuidedDecodingParams",
    "LoRARequest",
    "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence",
    "PoolingParams", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput", "EmbeddingRequestOutput",
    "ClassificationOutput", "ClassificationRequestOutput", "ScoringOutput", "ScoringRequestOutput",
]
