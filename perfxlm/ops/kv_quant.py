"""Quantized KV cache formats: what one cached token costs, how the tensors are allocated, and the
plain-torch quantize / dequantize the native kernels are tested against.

`kv_cache_dtype` takes vLLM's names:

- `auto`: the model's KV dtype (bfloat16 for a bf16 model, float32 otherwise), as before.
- `int8`: symmetric absmax int8, one float32 scale per group of `kv_cache_group_size` values of a
  token's head (default: the whole head, one scale per token and KV head). The scales sit beside the
  blocks in a parallel tensor `[num_blocks, block_size, num_kv_heads, head_dim // group]`. A group of a
  whole head lets the attention kernel fold the scale into the score (K) and into the softmax weight (V):
  no per-element multiply, and 4 bytes of scale per 64-256 bytes of values.
- `fp8` (= `fp8_e4m3`), `fp8_e5m2`: `torch.float8_e4m3fn` / `torch.float8_e5m2` storage with a
  per-tensor scale of 1.0 (vLLM's default without calibrated scales): values beyond the format's range
  (448 for e4m3, 57344 for e5m2) saturate; no scale tensor, so exactly half the bytes of bf16.

Values are quantized once, when written (`quantize`), and read in place by the decode kernel; the torch
paths gather a sequence's blocks and `dequantize` them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from perfxlm.worker.kv_memory import lazy_zeros

KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
_STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INT8_MAX = 127.0


@dataclass(frozen=True)
class KVCacheSpec:
    """The storage format of the KV cache: one per engine, applied to every attention layer."""

    name: str  # resolved: "float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"
    dtype: torch.dtype  # element type of the K/V blocks
    group_size: int | None = None  # int8: values per scale (None: the whole head)
    # A quantized cache of a bfloat16 model: its prefill attention may run in bf16 where the CPU plan
    # uses the hardware's bf16 GEMM, as a bf16 cache's does (a float32 model's stays float32).
    bf16_model: bool = False

    @staticmethod
    def resolve(kv_cache_dtype: str, model_dtype: torch.dtype, group_size: int | None = None) -> "KVCacheSpec":
        if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}.")
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"kv_cache_group_size must be a positive integer, got {group_size!r}.")
        if kv_cache_dtype == "auto":
            return KVCacheSpec(str(model_dtype).replace("torch.", ""), model_dtype)
        name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
        return KVCacheSpec(name, _STORAGE[name], group_size if name == "int8" else None,
                           bf16_model=model_dtype == torch.bfloat16)

    @staticmethod
    def of(spec_or_dtype: "KVCacheSpec | torch.dtype") -> "KVCacheSpec":
        if isinstance(spec_or_dtype, KVCacheSpec):
            return spec_or_dtype
        return KVCacheSpec(str(spec_or_dtype).replace("torch.", ""), spec_or_dtype)

    @property
    def quantized(self) -> bool:
        return self.dtype in (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)

    @property
    def has_scales(self) -> bool:
        return self.dtype == torch.int8

    def group(self, head_dim: int) -> int:
        g = self.group_size or head_dim
        if head_dim % g:
            raise ValueError(f"kv_cache_group_size {g} must divide the head size {head_dim}.")
        return g

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """K and V of one token in one layer, scales included."""
        values = num_kv_heads * head_dim * self.dtype.itemsize
        scales = num_kv_heads * (head_dim // self.group(head_dim)) * 4 if self.has_scales else 0
        return 2 * (values + scales)

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> "KVCache":
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key, value = lazy_zeros(shape, self.dtype), lazy_zeros(shape, self.dtype)
        key_scale = value_scale = None
        if self.has_scales:
            sshape = (num_blocks, block_size, num_kv_heads, head_dim // self.group(head_dim))
            key_scale, value_scale = lazy_zeros(sshape, torch.float32), lazy_zeros(sshape, torch.float32)
        return KVCache(key, value, key_scale, value_scale, bf16_model=self.bf16_model or self.dtype == torch.bfloat16)

    def describe(self, head_dim: int | None = None) -> str:
        if self.has_scales:
            g = self.group_size or head_dim
            return f"int8 (group {g if g else 'head_dim'}, float32 scales)"
        if self.quantized:
            return f"{self.name} (scale 1.0)"
        return self.name


@dataclass
class KVCache:
    """One attention layer's cache: K and V blocks [num_blocks, block_size, num_kv_heads, head_dim] and,
    for int8, their scales [num_blocks, block_size, num_kv_heads, head_dim // group] (else None)."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    bf16_model: bool = False  # the model's weights are bf16 (see KVCacheSpec.bf16_model)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.key, self.value, self.key_scale, self.value_scale) if t is not None]


def cache_is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8 or cache.dtype in FP8_MAX


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 views: torch's CPU index_copy_ has no fp8 kernel (bytes copy the same)."""
    return t.view(torch.uint8) if t.dtype in FP8_MAX else t


def quantize(x: torch.Tensor, dtype: torch.dtype, num_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., head_dim] float -> (values in `dtype`, float32 scales [..., num_groups] for int8 else None).

    int8: scale = absmax / 127 per group, q = round(x / scale) (half to even), 0 where the group is all 0.
    fp8: saturated to the format's range, rounded to nearest even (per-tensor scale 1.0)."""
    x = x.float()
    if dtype == torch.int8:
        g = x.unflatten(-1, (num_groups, x.shape[-1] // num_groups))
        scale = g.abs().amax(dim=-1) / INT8_MAX
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(g / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return q.flatten(-2), scale
    if dtype in FP8_MAX:
        m = FP8_MAX[dtype]
        return x.clamp(-m, m).to(dtype), None
    return x.to(dtype), None


def widen(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache values (float, bf16, fp8) as `dtype`. torch converts fp8 one element at a time (2.5 ms per
    million values here); fp8 is widened through fp16 bit patterns instead, as the decode kernel does, in
    vectorized integer ops (0.5-0.8 ms), exactly for every finite value."""
    if values.dtype == torch.float8_e5m2:  # the high byte of an fp16
        return (values.view(torch.uint8).to(torch.int16) << 8).view(torch.float16).to(dtype)
    if values.dtype == torch.float8_e4m3fn:
        # sign-extended and shifted by 7: sign in bit 15 (its copy in bit 14 cleared by the mask 0xBFFF),
        # exponent and mantissa in bits 13..7: an fp16 of the value times 2^-8
        bits = torch.bitwise_and(values.view(torch.int8).to(torch.int16) << 7, -16385)
        return bits.view(torch.float16).to(dtype).mul_(256)
    return values.to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of `quantize`: [..., head_dim] values (+ [..., num_groups] scales) -> `dtype`."""
    if scale is None:
        return widen(q, dtype)
    g = q.unflatten(-1, (scale.shape[-1], q.shape[-1] // scale.shape[-1])).float() * scale.unsqueeze(-1)
    return g.flatten(-2).to(dtype)


def gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, num_kv_heads, max_blocks * block_size, head_dim] in `dtype` (a
    view, heads second): only these blocks are copied, and dequantized where the cache is quantized."""
    batch = block_tables.shape[0]
    # index_select on a 2-D view: several times faster than advanced indexing on the 4-D cache.
    index = block_tables.reshape(-1)
    gathered = cache.view(cache.shape[0], -1).index_select(0, index)
    if scale is not None:
        scales = scale.view(scale.shape[0], -1).index_select(0, index).view(-1, scale.shape[-1])
        gathered = dequantize(gathered.view(-1, cache.shape[3]), scales, dtype)
    else:
        gathered = widen(gathered, dtype)
    return gathered.view(batch, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)
