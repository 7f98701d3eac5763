"""Quantized KV cache formats: what one cached token costs, how the tensors are allocated, and the
plain-torch quantize / dequantize the native kernels are tested against.

`kv_cache_dtype` takes vLLM's names:

- `auto`: the model's KV dtype (bfloat16 for a bf16 model, float32 otherwise), as before.
- `int8`: symmetric absmax int8, one float32 scale per group of `kv_cache_group_size` values of a
  token's head (default: the whole head, one scale per token and KV head). The scales sit beside the
  blocks in a parallel tensor `[num_blocks, block_size, num_kv_heads, head_dim // group]`. A group of a
  whole head lets the attention kernel fold the scale into the score (K) and into the softmax weight (V):
  no per-element multiply, and 4 bytes of scale per 64-256 bytes of values.
- `fp8` (= `fp8_e4m3`), `fp8_e5m2`: `torch.float8_e4m3fn` / `torch.float8_e5m2` values with a
  power-of-two scale per group (default: per token and KV head, like int8) stored in one byte, its
  biased exponent (2^(byte - 127), the layout of OCP MX's E8M0 scales), chosen so the group's absmax
  lands in (max / 2, max] of the format's range: 65 bytes per 64-value head, 1.97x the tokens of bf16.
  vLLM's default, one per-tensor scale of 1.0, holds only while K/V sit inside the format's range:
  larger values saturate, and a head of small values loses its mantissa bits (e4m3's step is a fixed
  2^-9 below 2^-6; values below 2^-10 flush to 0). With a scale per head any magnitude keeps them. A
  power of two scales exactly: quantizing divides by it before the one rounding, and the kernels fold
  it into the score (K) and the softmax weight (V) as for int8.

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
# FP8_MAX = 0.875 * 2^(top + 1): the exponent rule's constant (csrc/attention_kernels.cpp: kE4m3Top ...)
FP8_TOP = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15}
INT8_MAX = 127.0
_QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class KVCacheSpec:
    """The storage format of the KV cache: one per engine, applied to every attention layer."""

    name: str  # resolved: "float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"
    dtype: torch.dtype  # element type of the K/V blocks
    group_size: int | None = None  # values per scale (None: the whole head)
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
        return KVCacheSpec(name, _STORAGE[name], group_size, bf16_model=model_dtype == torch.bfloat16)

    @staticmethod
    def of(spec_or_dtype: "KVCacheSpec | torch.dtype") -> "KVCacheSpec":
        if isinstance(spec_or_dtype, KVCacheSpec):
            return spec_or_dtype
        return KVCacheSpec(str(spec_or_dtype).replace("torch.", ""), spec_or_dtype)

    @property
    def quantized(self) -> bool:
        return self.dtype in _QUANTIZED

    @property
    def has_scales(self) -> bool:  # every quantized format keeps scales beside its blocks
        return self.quantized

    @property
    def scale_dtype(self) -> torch.dtype | None:
        """int8: float32 scales; fp8: uint8 exponents (see `fp8_scale_exponents`); float caches: none."""
        if not self.quantized:
            return None
        return torch.float32 if self.dtype == torch.int8 else torch.uint8

    def group(self, head_dim: int) -> int:
        g = self.group_size or head_dim
        if head_dim % g:
            raise ValueError(f"kv_cache_group_size {g} must divide the head size {head_dim}.")
        return g

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, value_is_key: bool = False) -> int:
        """K and V of one token in one layer, scales included; K alone where V is the same tensor."""
        values = num_kv_heads * head_dim * self.dtype.itemsize
        scales = 0
        if self.has_scales:
            scales = num_kv_heads * (head_dim // self.group(head_dim)) * self.scale_dtype.itemsize
        return (1 if value_is_key else 2) * (values + scales)

    def allocate(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, value_is_key: bool = False,
        device: torch.device | None = None,
    ) -> "KVCache":
        """`value_is_key`: the layer's values are its keys (MLA's latent): one tensor serves as both, and
        the writes of V put the same bits where K's put them."""
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        key = lazy_zeros(shape, self.dtype, device)
        value = key if value_is_key else lazy_zeros(shape, self.dtype, device)
        key_scale = value_scale = None
        if self.has_scales:
            sshape = (num_blocks, block_size, num_kv_heads, head_dim // self.group(head_dim))
            key_scale = lazy_zeros(sshape, self.scale_dtype, device)
            value_scale = key_scale if value_is_key else lazy_zeros(sshape, self.scale_dtype, device)
        return KVCache(key, value, key_scale, value_scale, bf16_model=self.bf16_model or self.dtype == torch.bfloat16)

    def describe(self, head_dim: int | None = None) -> str:
        if self.has_scales:
            g = self.group_size or head_dim
            scales = "float32 scales" if self.dtype == torch.int8 else "power-of-two scales in one byte"
            return f"{self.name} (group {g if g else 'head_dim'}, {scales})"
        return self.name


@dataclass
class KVCache:
    """One attention layer's cache: K and V blocks [num_blocks, block_size, num_kv_heads, head_dim] and,
    for a quantized cache, their scales [num_blocks, block_size, num_kv_heads, head_dim // group] (else
    None): float32 for int8, exponent bytes for fp8."""

    key: torch.Tensor
    value: torch.Tensor
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None
    bf16_model: bool = False  # the model's weights are bf16 (see KVCacheSpec.bf16_model)

    def tensors(self) -> list[torch.Tensor]:
        """Each distinct tensor once (V may be K itself)."""
        unique: dict[int, torch.Tensor] = {}
        for t in (self.key, self.value, self.key_scale, self.value_scale):
            if t is not None:
                unique.setdefault(id(t), t)
        return list(unique.values())


def cache_is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype in _QUANTIZED


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as uint8 views: torch's CPU index_copy_ has no fp8 kernel (bytes copy the same)."""
    return t.view(torch.uint8) if t.dtype in FP8_MAX else t


def pow2(exponents: torch.Tensor) -> torch.Tensor:
    """Integer exponents in [-126, 127] -> 2^e as float32, built from the bits (exact). -127 gives 0: a
    scale byte of 0 (a slot never written, from the zeroed pool) reads as 0, as in the kernels."""
    return ((exponents.to(torch.int32) + 127) << 23).view(torch.float32)


def fp8_scale_exponents(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The power-of-two scale 2^e of an fp8 group with absolute maximum `amax`: the smallest e with
    amax / 2^e <= the format's maximum (448 = 0.875 * 2^9 for e4m3, 57344 = 0.875 * 2^16 for e5m2), so
    the group's largest value lands in (max / 2, max]. e is 0 for an all-zero group or one holding a NaN
    or an infinity, and clamped to [-126, 126], where 2^e and 2^-e are normal floats. Returns int32 e."""
    top = FP8_TOP[dtype]
    mantissa, k = torch.frexp(amax)  # amax = mantissa * 2^k, mantissa in [0.5, 1)
    e = torch.where(mantissa <= 0.875, k - top - 1, k - top)
    e = torch.where((amax > 0) & torch.isfinite(amax), e, torch.zeros_like(e))
    return e.clamp_(-126, 126).to(torch.int32)


def quantize(
    x: torch.Tensor, dtype: torch.dtype, num_groups: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[..., head_dim] float -> (values in `dtype`, scales [..., num_groups]; None for a float dtype).

    int8: float32 scale = absmax / 127 per group, q = round(x / scale) (half to even), 0 where the group
    is all 0. fp8: uint8 scale byte e + 127 (see `fp8_scale_exponents`), q = x * 2^-e saturated to the
    format's range and rounded to nearest even (the multiply is exact: one rounding)."""
    x = x.float()
    if dtype not in _QUANTIZED:
        return x.to(dtype), None
    g = x.unflatten(-1, (num_groups, x.shape[-1] // num_groups))
    amax = g.abs().amax(dim=-1)
    if dtype == torch.int8:
        scale = amax / INT8_MAX
        safe = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(g / safe.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return q.flatten(-2), scale
    e = fp8_scale_exponents(amax, dtype)
    m = FP8_MAX[dtype]
    q = (g * pow2(-e).unsqueeze(-1)).clamp_(-m, m).to(dtype)
    return q.flatten(-2), (e + 127).to(torch.uint8)


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
    if scale.dtype == torch.uint8:
        # fp8: widened exactly, then times a power of two: exact in float32; in bf16 too but for groups
        # scaled below ~2^-118, whose smallest values fall under bf16's subnormals
        g = widen(q, dtype).unflatten(-1, (scale.shape[-1], -1))
        return (g * pow2(scale.to(torch.int32) - 127).to(dtype).unsqueeze(-1)).flatten(-2)
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
