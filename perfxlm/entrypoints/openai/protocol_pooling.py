"""Request schemas of the pooling endpoints: OpenAI's embeddings, vLLM's /score, /classify and /pooling, and
the Jina / Cohere rerank body."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from perfxlm.entrypoints.openai.protocol import RequestModel

Inputs = str | list[str] | list[int] | list[list[int]]


class PoolingFields(RequestModel):
    model: str | None = None
    # vLLM extensions: cut inputs to the first N tokens (-1: the model's window) instead of refusing them
    truncate_prompt_tokens: int | None = None
    user: str | None = None  # an end-user identifier; recorded nowhere


class EmbeddingRequest(PoolingFields):
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM extension


class PoolingRequest(PoolingFields):
    input: Inputs
    encoding_format: Literal["float", "base64"] = "float"
    task: Literal["embed", "classify", "token_embed", "reward"] | None = None


class ClassificationRequest(PoolingFields):
    input: Inputs
    use_activation: bool | None = None


class ScoreRequest(PoolingFields):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(PoolingFields):
    query: str
    documents: list[str] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=0)  # 0 or unset: every document
    return_documents: bool = True
