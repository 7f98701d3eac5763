"""The values the `GraphOps` seam passes between the model reader (decoder.py) and the flavors: rotary
tables, attention shapes, projections' weights, head norms, the graph's inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Rope:
    """Rotary tables of the model, [max_position, rotary_dim] in rotate-half layout (cos of each frequency
    twice), as the engine's RotaryEmbedding holds them; rotary_dim <= head_dim (partial rotary)."""

    cos: np.ndarray
    sin: np.ndarray
    key: str = "rope"  # which table of the model (Gemma 3: local and global layers rotate with their own)

    @property
    def rotary_dim(self) -> int:
        return self.cos.shape[1]


@dataclass
class AttentionSpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None  # a query at position p sees keys in (p - window, p]
    soft_cap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    sinks: np.ndarray | None = None  # [num_heads] a learned logit per head in each softmax's sum (gpt-oss)
    # the module multiplies the query by `scale` before attending at scale 1 (OPT, rounding as transformers
    # does); the same product for a flavor that scales the scores instead, not the same rounding
    query_scaled: bool = False


@dataclass
class LinearWeight:
    """A projection's weight as the engine holds it: float [N, K] or a QuantizedWeight; bias or None."""

    weight: Any
    bias: np.ndarray | None
    name: str
    method: str | None = None  # a quantized weight's linear-method name (its format: "int4", "gguf", ...)


@dataclass
class HeadNorms:
    """Qwen3's RMSNorm over each q and k head, before rotary."""

    q_weight: np.ndarray
    k_weight: np.ndarray
    eps: float


@dataclass
class DecoderInputs:
    """The graph inputs every layer reads (onnxruntime-genai's names)."""

    input_ids: str  # int64 [batch, seq]
    attention_mask: str  # int64 [batch, past + seq]: 1 for tokens to attend to
    position_ids: str  # int64 [batch, seq]
