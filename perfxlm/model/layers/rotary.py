"""Rotary position embedding (rotate-half / NeoX layout, as Hugging Face Llama uses), optionally on only
the first `rotary_dim` channels of each head (Phi-3/4's partial_rotary_factor)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from perfxlm.ops import native
from perfxlm.ops.gpu import fused_elementwise


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either transformers 4.x (`rope_theta`, `rope_scaling`)
    or 5.x (`rope_parameters`) configs. `layer_type`: where the parameters are given per layer type
    (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}), that type's."""
    params = _for_layer_type(getattr(hf_config, "rope_parameters", None), layer_type)
    scaling = _for_layer_type(getattr(hf_config, "rope_scaling", None), layer_type)
    merged = {**scaling, **params}
    theta = merged.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    return float(theta), merged


def _for_layer_type(params: dict[str, Any] | None, layer_type: str | None) -> dict[str, Any]:
    params = dict(params or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    return params


def _rope_type(scaling: dict[str, Any]) -> str:
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return "longrope" if rope_type == "su" else rope_type  # Phi-3's older name for the same scheme


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = _scaled_inv_freq(head_dim, theta, scaling)
    factors = scaling.get("freq_factors")
    if factors is None:
        return inv_freq
    # Per-frequency divisors, as llama.cpp stores Llama-3.x scaling (GGUF `rope_freqs`): they replace the
    # llama3 formula, so they combine only with plain or linear rope.
    if _rope_type(scaling) not in ("default", "linear"):
        raise ValueError(f"rope freq_factors cannot be combined with rope scaling {_rope_type(scaling)!r}.")
    factors_t = torch.tensor(factors, dtype=torch.float32)
    if factors_t.shape != inv_freq.shape:
        raise ValueError(f"rope freq_factors has {factors_t.numel()} values, expected {inv_freq.numel()}.")
    return inv_freq / factors_t


def _scaled_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = _rope_type(scaling)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are scaled down by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported "
        "(supported: default, linear, llama3, longrope/su, yarn)."
    )


def _yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (DeepSeek-V2/V3, Qwen long context): frequencies past `beta_fast` rotations over the original
    context kept, those under `beta_slow` divided by `factor`, a linear ramp between, as transformers."""
    factor = scaling["factor"]
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _attention_factor(scaling: dict[str, Any]) -> float:
    """What YaRN multiplies cos and sin by: `attention_factor`, else mscale / mscale_all_dim's ratio."""
    if _rope_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def _longrope_tables(
    dim: int, max_position: int, theta: float, scaling: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """LongRoPE (Phi-3): the short factors below the original context length, the long ones past it,
    both scaled by the attention factor. Per position, as vLLM does; transformers instead switches the
    whole sequence to the long factors once it grows past the original length (the same below it)."""
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    t = torch.arange(max_position, dtype=torch.int64).float()
    short = torch.outer(
        t[:original], 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
    )
    long = torch.outer(t[original:], 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base))
    freqs = torch.cat((short, long))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict[str, Any],
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        # Plain attributes, not buffers: computed on the CPU even when the model is built on meta.
        with torch.device("cpu"):
            if _rope_type(scaling) == "longrope":
                self.cos_cache, self.sin_cache = _longrope_tables(
                    self.rotary_dim, max_position, theta, scaling
                )
            else:
                inv_freq = _inv_freq(self.rotary_dim, theta, scaling)
                t = torch.arange(max_position, dtype=torch.int64).float()
                freqs = torch.outer(t, inv_freq)
                emb = torch.cat((freqs, freqs), dim=-1)  # [max_position, rotary_dim]
                attention_factor = _attention_factor(scaling)
                self.cos_cache = emb.cos() * attention_factor
                self.sin_cache = emb.sin() * attention_factor
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, config: Any, head_dim: int, layer_type: str | None = None) -> "RotaryEmbedding":
        theta, scaling = rope_parameters(config, layer_type)
        partial = (
            scaling.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0
        )
        if _rope_type(scaling) in ("longrope", "yarn") and "original_max_position_embeddings" not in scaling:
            scaling["original_max_position_embeddings"] = config.original_max_position_embeddings
        if _rope_type(scaling) == "yarn" and scaling.get("factor") is None:
            scaling["factor"] = config.max_position_embeddings / scaling["original_max_position_embeddings"]
        factors = getattr(config, "rope_freq_factors", None)  # from a GGUF file's rope_freqs tensor
        if factors is not None:
            scaling["freq_factors"] = factors
        return cls(head_dim, config.max_position_embeddings, theta, scaling, int(head_dim * partial))

    def _tables(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables in `dtype` on the device of the step's positions (a GPU model's copy made once)."""
        key = (dtype, device)
        if key not in self._cast:
            self._cast[key] = (self.cos_cache.to(device, dtype), self.sin_cache.to(device, dtype))
        return self._cast[key]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, 1, head_dim] tables for this step: looked up once per forward, used by every layer."""
        cos_table, sin_table = self._tables(dtype, positions.device)
        return cos_table[positions].unsqueeze(1), sin_table[positions].unsqueeze(1)


def interleaved_to_halves(rows: Any, head_dim: int, rotary_dim: int, offset: int = 0) -> Any:
    """A q or k projection (weight [heads * head_dim, K], or its bias) whose heads rotate channel pairs
    (2i, 2i + 1) (GPT-J's interleaved rotary: GLM, DeepSeek), with its rows reordered so that the same
    rotation is this module's rotate-half over pairs (i, i + rotary_dim / 2). q and k are reordered
    alike, so their dot products, and attention, are unchanged; the rotary channels start `offset` into
    each head (DeepSeek's come after the unrotated ones), the others keep their places.
    `rows`: a tensor, or a perfxlm.quant.QuantizedWeight (reordered by `index_rows`)."""
    if rows.shape[0] % head_dim:
        raise ValueError(f"{rows.shape[0]} projection rows are not whole heads of {head_dim}.")
    end = offset + rotary_dim
    within = torch.cat((torch.arange(offset), torch.arange(offset, end, 2), torch.arange(offset + 1, end, 2),
                        torch.arange(end, head_dim)))  # fmt: skip
    heads = rows.shape[0] // head_dim
    order = (torch.arange(heads).unsqueeze(1) * head_dim + within).reshape(-1)
    return rows[order] if isinstance(rows, torch.Tensor) else rows.index_rows(order)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; q and k heads may come concatenated along dim 1.

    May rotate x in place (the native kernel does, on float32 activations) and returns the result."""
    rotary_dim = cos.shape[-1]
    if x.dtype == torch.float32 and x.stride(-1) == 1 and cos.dtype == torch.float32:
        ops = native.kernels_for(x)
        if ops is not None:  # in place; with partial rotary the channels past rotary_dim pass through
            ops.rotary_embedding(x, cos, sin)
            return x
    if fused_elementwise(x):
        from perfxlm.ops.gpu.rotary import rotary_embedding  # imports triton: only for a GPU's tensors

        return rotary_embedding(x, cos, sin)  # in place, partial rotary included
    if rotary_dim < x.shape[-1]:  # partial rotary: the remaining channels pass through
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
