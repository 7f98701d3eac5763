"""What a GGUF file's `{arch}.*` metadata says about the model's math, checked before it is trusted.

A key this loader does not translate would be dropped silently and the model would compute something
else than the file describes (a soft-cap, an attention scale, a sliding window, experts): every key
under the architecture's prefix is either translated, known to be harmless, or an error naming it.
The same holds for tensors (`gguf.py` refuses tensors without a place in the model) and for rope
scaling: llama.cpp's converter stores Llama-3.x scaling only as per-frequency factors in the
`rope_freqs` tensor, read here and applied by the rotary layer.
"""

from __future__ import annotations

import math
from typing import Any

# Keys under `{arch}.` that the config translation reads (see gguf.py's _DECODER_KEYS and below).
TRANSLATED_KEYS = frozenset({
    "block_count", "context_length", "embedding_length", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
    "rope.scale_linear", "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
    "rope.scaling.attn_factor",
    # checked to hold their neutral value (see check_metadata)
    "attention.scale", "expert_count", "expert_used_count",
    # descriptive only: whether the model was fine-tuned with its rope scaling
    "rope.scaling.finetuned",
})

# what the llama-like loaders translate (yarn is read only where a family's table module does: gpt-oss)
ROPE_SCALING_TYPES = ("none", "linear")


def uniform(meta: dict[str, Any], key: str) -> Any:
    """A per-layer list that holds one value is that value; differing per-layer values are an error."""
    value = meta.get(key)
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise ValueError(
                f"GGUF metadata {key} differs between layers ({value[:8]}...); per-layer sizes are not "
                "supported."
            )
        return value[0]
    return value


def check_metadata(
    meta: dict[str, Any], arch: str, extra_keys: frozenset[str] = frozenset(), moe: bool = False,
    rope_types: tuple[str, ...] = ROPE_SCALING_TYPES,
) -> None:
    """`moe`: the architecture's loader reads expert_count / expert_used_count (else they must be 0);
    `rope_types`: the rope.scaling.type values the architecture's loader translates."""
    prefix = arch + "."
    unknown = sorted(
        k for k in meta if k.startswith(prefix) and k[len(prefix) :] not in TRANSLATED_KEYS | extra_keys
    )
    if unknown:
        raise ValueError(
            f"GGUF metadata {', '.join(unknown)} is not supported for architecture {arch!r}: the model would "
            "compute something else than the file describes, so it is not loaded."
        )
    kind = meta.get(prefix + "rope.scaling.type")
    if kind is not None and kind not in rope_types:
        raise ValueError(
            f"GGUF rope scaling type {kind!r} is not supported for architecture {arch!r} (supported: "
            f"{', '.join(rope_types)}, and Llama-3 scaling stored as the rope_freqs tensor)."
        )
    attn_factor = meta.get(prefix + "rope.scaling.attn_factor")
    if attn_factor is not None and not math.isclose(float(attn_factor), 1.0):
        # llama.cpp scales the rotated q/k by it for every rope type; the rotary layer here does not
        raise ValueError(f"GGUF metadata {prefix}rope.scaling.attn_factor={attn_factor} is not supported.")
    for key in ("expert_count", "expert_used_count"):
        if not moe and meta.get(prefix + key, 0):
            raise ValueError(
                f"GGUF metadata {prefix}{key}={meta[prefix + key]}: mixture-of-experts GGUF files are not "
                "supported (load the Hugging Face checkpoint instead)."
            )


def check_attention_scale(meta: dict[str, Any], arch: str, head_dim: int) -> None:
    scale = meta.get(f"{arch}.attention.scale")
    if scale is not None and not math.isclose(float(scale), head_dim**-0.5, rel_tol=1e-5):
        raise ValueError(
            f"GGUF metadata {arch}.attention.scale={scale} differs from 1/sqrt(head_dim) = "
            f"{head_dim**-0.5:.6g}; "
            "a custom attention scale is not supported for this architecture."
        )


def head_dims(meta: dict[str, Any], arch: str, hidden: int, heads: int, partial_rotary: bool = False) -> int:
    """The head size, with the rotary and value sizes checked against it. `partial_rotary`: the
    architecture rotates part of each head (GLM-4), so the rotary width is not a head size (the caller
    checks it)."""
    key_len = uniform(meta, f"{arch}.attention.key_length")
    value_len = uniform(meta, f"{arch}.attention.value_length")
    rope_dim = meta.get(f"{arch}.rope.dimension_count")
    head_dim = int(key_len or (None if partial_rotary else rope_dim) or hidden // heads)
    if value_len is not None and int(value_len) != head_dim:
        raise ValueError(f"GGUF key and value head sizes differ ({head_dim} vs {value_len}); not supported.")
    if rope_dim is not None and int(rope_dim) != head_dim and not partial_rotary:
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rope_dim} differs from the head size {head_dim} (partial "
            "rotary); not supported for this architecture."
        )
    return head_dim


def rope_freq_factors(tensors: dict[str, Any], read, rotary_dim: int) -> list[float] | None:
    """Per-frequency rope divisors from `rope_freqs.weight` (or per-layer copies of it), if any."""
    names = [
        n for n in tensors
        if n == "rope_freqs.weight" or (n.startswith("blk.") and n.endswith(".rope_freqs.weight"))
    ]
    if not names:
        return None
    values = [read(n).reshape(-1) for n in names]
    first = values[0]
    if any(v.shape != first.shape or not bool((v == first).all()) for v in values[1:]):
        raise ValueError("GGUF rope_freqs differ between layers; per-layer rope factors are not supported.")
    if first.numel() != rotary_dim // 2:
        raise ValueError(
            f"GGUF rope_freqs has {first.numel()} factors, expected {rotary_dim // 2} (head_dim / 2)."
        )
    if not bool((first > 0).all()):
        raise ValueError("GGUF rope_freqs holds non-positive factors.")
    return [float(x) for x in first.tolist()]
