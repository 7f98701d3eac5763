"""Dequantize GGUF tensor data (raw ggml blocks) into float32 torch tensors.

F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the k-quants Q4_K, Q5_K, Q6_K and MXFP4 (gpt-oss's experts) are done with a
handful of vectorized torch ops on the whole tensor; every other type gguf-py can dequantize falls back
to its numpy reference implementation. Results match gguf-py's `gguf.quants.dequantize` bit for bit on
the native types.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import gguf
import numpy as np
import torch

from perfxlm.quant.mxfp4 import dequantize_gguf_blocks

Q = gguf.GGMLQuantizationType

# ggml type -> (elements per block, bytes per block)
_BLOCK: dict[Q, tuple[int, int]] = {
    Q.Q4_0: (32, 18),
    Q.Q4_1: (32, 20),
    Q.Q5_0: (32, 22),
    Q.Q5_1: (32, 24),
    Q.Q8_0: (32, 34),
    Q.Q4_K: (256, 144),
    Q.Q5_K: (256, 176),
    Q.Q6_K: (256, 210),
    Q.MXFP4: (32, 17),
}
_FLOAT: dict[Q, torch.dtype] = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}

NATIVE_TYPES: frozenset[Q] = frozenset(_BLOCK) | frozenset(_FLOAT)


def _reference_types() -> frozenset[Q]:
    traits = getattr(gguf.quants, "_type_traits", {})
    return frozenset(t for t, cls in traits.items() if "dequantize_blocks" in vars(cls))


# what `dequantize` accepts: the native types plus those gguf-py's numpy reference can do
SUPPORTED_TYPES: frozenset[Q] = NATIVE_TYPES | _reference_types()


def supported_type_names() -> list[str]:
    return sorted(t.name for t in SUPPORTED_TYPES)


def _as_type(ggml_type: Q | int) -> Q:
    try:
        return Q(int(ggml_type))
    except (ValueError, TypeError):
        raise ValueError(f"Unknown GGML tensor type {ggml_type!r}; cannot dequantize it.") from None


def check_supported(qtype: Q) -> None:
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(
            f"GGML tensor type {qtype.name} is not supported "
            f"(supported: {', '.join(supported_type_names())})."
        )


def _type_sizes(qtype: Q) -> tuple[int, int]:
    if qtype in _BLOCK:
        return _BLOCK[qtype]
    if qtype in _FLOAT:
        return 1, _FLOAT[qtype].itemsize
    try:
        return gguf.GGML_QUANT_SIZES[qtype]
    except KeyError:
        raise ValueError(f"GGML type {qtype.name} has no known block layout; cannot dequantize it.") from None


def _raw_bytes(raw: np.ndarray | memoryview | bytes | torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(flat uint8 tensor over `raw`, whether it is a private copy)."""
    if isinstance(raw, torch.Tensor):
        flat = raw.detach().contiguous().reshape(-1).view(torch.uint8)
        return flat, flat.data_ptr() != raw.data_ptr()
    arr = raw if isinstance(raw, np.ndarray) else np.frombuffer(raw, dtype=np.uint8)
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    if not flat.flags.writeable:
        # torch warns on read-only memory, and a tensor aliasing a read-only mapping would crash on an
        # in-place write; the raw bytes are small next to the float output, so copy them.
        return torch.from_numpy(flat.copy()), True
    return torch.from_numpy(flat), not np.may_share_memory(flat, arr)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """One fp16 scalar per block, as (n_blocks, 1) float32."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n_blocks, 16) packed bytes -> (n_blocks, 32) values: low nibbles are elements 0..15, high 16..31."""
    out = torch.empty(qs.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[:, :16])
    torch.bitwise_right_shift(qs, 4, out=out[:, 16:])
    return out


_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """(n, k) bytes -> (n, 8k) single bits, little-endian: bit i of the packed word is element i."""
    return packed.unsqueeze(-1).bitwise_right_shift(_BIT_SHIFTS).bitwise_and_(1).reshape(packed.shape[0], -1)


def _split_nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """(n, k) bytes -> (n, k // run, 2, run): per run of `run` bytes, its low nibbles then its high ones."""
    q = qs.reshape(qs.shape[0], -1, 1, run)
    return torch.cat((q & 0x0F, q >> 4), dim=2)


# Widening to float32 first and scaling in place is ~2x faster on CPU than a mixed-dtype broadcast.
def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].view(torch.int8).float().mul_(_half(blocks, 0))


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _nibbles(blocks[:, 2:]).float().sub_(8).mul_(_half(blocks, 0))


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    # two separately rounded ops, not a fused multiply-add, so results equal ggml / gguf-py exactly
    return _nibbles(blocks[:, 4:]).float().mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _q5(blocks: torch.Tensor, qh_at: int) -> torch.Tensor:
    # 4 bytes of fifth bits (bit i belongs to element i), then 16 bytes of nibbles as in Q4_0
    high = _bits(blocks[:, qh_at : qh_at + 4]).bitwise_left_shift_(4)
    return _nibbles(blocks[:, qh_at + 4 :]).bitwise_or_(high)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    return _q5(blocks, 2).float().sub_(16).mul_(_half(blocks, 0))


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    return _q5(blocks, 4).float().mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, as float32 (n, 8, 1)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.float().unsqueeze(-1), mn.float().unsqueeze(-1)


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """q (n, 8, 32) uint8 -> d * scale * q - dmin * min per 32-element sub-block."""
    sc, mn = _k_scales(blocks[:, 4:16])
    d = sc.mul_(_half(blocks, 0).unsqueeze(-1))
    dm = mn.mul_(_half(blocks, 2).unsqueeze(-1))
    return q.float().mul_(d).sub_(dm).reshape(-1, 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_affine(blocks, _split_nibbles(blocks[:, 16:], 32).reshape(-1, 8, 32))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _split_nibbles(blocks[:, 48:], 32).reshape(-1, 8, 32)
    # 32 bytes of fifth bits: bit j of byte i belongs to element i of sub-block j
    qh = blocks[:, 16:48].unsqueeze(1).bitwise_right_shift(_BIT_SHIFTS.view(1, 8, 1)).bitwise_and_(1)
    return _k_affine(blocks, low.bitwise_or_(qh.bitwise_left_shift_(4)))


_Q6_HIGH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = _split_nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    high = blocks[:, 128:192].reshape(n, 2, 1, 32).bitwise_right_shift(_Q6_HIGH_SHIFTS).bitwise_and_(3)
    q = low.bitwise_or_(high.reshape(n, 8, 32).bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    scale = blocks[:, 192:208].view(torch.int8).float().mul_(_half(blocks, 208)).unsqueeze(-1)  # (n, 16, 1)
    return q.reshape(n, 16, 16).float().mul_(scale).reshape(n, 256)


_BLOCK_DEQUANT: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_1: _q4_1,
    Q.Q5_0: _q5_0,
    Q.Q5_1: _q5_1,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.MXFP4: dequantize_gguf_blocks,
}


def dequantize(
    raw: np.ndarray | memoryview | bytes, ggml_type: Q | int, shape: Sequence[int]
) -> torch.Tensor:
    """Raw GGUF tensor data -> float32 tensor of the logical (torch-order) `shape`.

    `raw` is the tensor's data as `gguf.GGUFReader` exposes it (`ReaderTensor.data`: a uint8 block
    array, or an already typed float array for F32/F16), or any buffer over the same bytes. `shape`
    is the torch shape, i.e. the reverse of the ggml `ne` order GGUF lists.
    """
    qtype = _as_type(ggml_type)
    check_supported(qtype)
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    block_elems, block_bytes = _type_sizes(qtype)
    if shape and shape[-1] % block_elems:
        raise ValueError(
            f"Row length {shape[-1]} of a {qtype.name} tensor is not a multiple of its block size "
            f"{block_elems}."
        )
    data, owned = _raw_bytes(raw)
    want = n // block_elems * block_bytes
    if data.numel() != want:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {want} bytes of data, got {data.numel()}."
        )

    if qtype == Q.F32:
        # never hand back a tensor aliasing the caller's buffer (it may be a writable file mapping)
        out = data.view(torch.float32).reshape(shape)
        return out if owned else out.clone()
    if qtype in _FLOAT:
        return data.view(_FLOAT[qtype]).float().reshape(shape)
    if qtype in _BLOCK_DEQUANT:
        return _BLOCK_DEQUANT[qtype](data.reshape(-1, block_bytes)).reshape(shape)
    return _dequantize_reference(data, qtype, shape, block_elems, block_bytes)


def _dequantize_reference(
    data: torch.Tensor, qtype: Q, shape: tuple[int, ...], block_elems: int, block_bytes: int
) -> torch.Tensor:
    row_bytes = (shape[-1] if shape else 1) // block_elems * block_bytes
    blocks = data.numpy().reshape(-1, row_bytes)
    try:
        values = gguf.quants.dequantize(blocks, qtype)
    except NotImplementedError:
        raise ValueError(
            f"Dequantizing GGML type {qtype.name} is not supported "
            f"(supported: {', '.join(supported_type_names())})."
        ) from None
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
