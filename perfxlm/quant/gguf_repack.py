"""GGUF quantized blocks -> `QuantizedWeight`, by moving bits (no float detour).

Each type maps onto the affine form w = scale * u + min without changing a value (`dequantize()` equals
`gguf.quants.dequantize` bit for bit):
- Q4_0: u = q (0..15), Q4_0's nibble layout kept byte for byte; scale d (float16), centred codes: the
  min -8 d is implied, not stored (4.5 bits per weight streamed, as the file holds them, not 5).
- Q4_1: u = q, scale d, min m (float16).
- Q8_0: 8-bit u = q + 128, scale d (float16), centred codes: the min -128 d is implied (8.5 bits per
  weight streamed, not 9; AVX2's shifted int8 dots need no min correction at all).
- Q5_0: 5-bit u = q (0..31), the file's bytes moved: each row's qs (Q4_0's nibble layout) then its qh
  words, their bits put in the fifth-bit plane's order (`code_layout.plane_from_words`: a permutation
  within each word, which the kernels unpack with shifts); scale d (float16), centred codes
  (the min -16 d implied): 5.5 bits per weight streamed, as the file holds them (8-bit codes with a
  stored min streamed 9).
- Q5_1: as Q5_0, with its min m stored (float16): 6 bits per weight.
- Q4_K: 4-bit u, group 32; two-level scales (`quant/super_scales.py`): the 6-bit sc and m as bytes, d and
  dmin float16 per 256; scale d * sc, min -dmin * m, multiplied in float32 by the kernels as gguf-py does
  (4.625 bits per weight streamed; one float32 scale and min per group streamed 6).
- Q5_K: as Q4_K with 5-bit u (0..31): 5.625 bits per weight.
- Q6_K: 6-bit u = q (0..63: nibbles, then the fifth and sixth bit planes), centred (the min -32 d * sc
  implied), group 16; two-level scales: sc int8, d float16 per 256: 6.56 bits per weight streamed, as the
  file holds them (8-bit codes streamed 8.56; float32 scale and min per 16: 12).
- MXFP4: 4-bit codes into the E2M1 level table, group 32, scale 2^(e - 128) (float32; `quant/mxfp4.py`).
The 5- and 6-bit forms run the 4-bit kernels plus a few more instructions per 32 codes for each bit plane
(int8 block products included).
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from perfxlm.ops import gguf_dequant as gd
from perfxlm.quant import mxfp4, super_scales
from perfxlm.quant.code_layout import plane_from_words
from perfxlm.quant.weight import QuantizedWeight, pack_fives, pack_nibbles, pack_sixes

Q = gguf.GGMLQuantizationType

REPACKED_TYPES: frozenset[Q] = frozenset(
    (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)
)


def _blocks(raw: np.ndarray | torch.Tensor, block_bytes: int) -> torch.Tensor:
    data, _ = gd._raw_bytes(raw)
    return data.reshape(-1, block_bytes)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """One float16 per block, (n_blocks,)."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).reshape(-1)


def _fives(b: torch.Tensor, qh_at: int, n: int) -> torch.Tensor:
    """Q5_0 / Q5_1 blocks (n_blocks, bytes), qh at `qh_at` and qs after it -> 5-bit codes [n, 5 K / 8]: each
    row's qs bytes (the nibbles in Q4_0's layout), then its qh words (bit i of a block's little-endian word
    is element i's fifth bit) permuted into the plane's order."""
    qs = b[:, qh_at + 4 : qh_at + 20].reshape(n, -1)
    qh = b[:, qh_at : qh_at + 4].reshape(n, -1)
    return torch.cat([qs, plane_from_words(qh)], dim=1)


def repack(raw: np.ndarray | torch.Tensor, qtype: Q, shape: tuple[int, ...]) -> QuantizedWeight:
    """A 2-D GGUF tensor (torch shape [N, K]), or a stack [E, N, K], of a type in REPACKED_TYPES as a weight-only QuantizedWeight."""
    qtype = Q(int(qtype))
    if qtype not in REPACKED_TYPES:
        raise ValueError(
            f"GGML type {qtype.name} cannot be kept quantized "
            f"(supported: {', '.join(sorted(t.name for t in REPACKED_TYPES))})."
        )
    if len(shape) == 3:  # an expert stack [E, N, K]: its rows repacked as one matrix, then split by expert
        e, n, k = (int(s) for s in shape)
        w = repack(raw, qtype, (e * n, k))
        return QuantizedWeight(
            w.codes.view(e, n, -1), w.scales.view(e, n, -1), None if w.mins is None else w.mins.view(e, n, -1),
            w.levels, w.bits, w.group, w.act, n, k,
        )  # fmt: skip
    if len(shape) != 2:
        raise ValueError(f"only matrices and expert stacks are kept quantized; got shape {tuple(shape)}")
    n, k = (int(s) for s in shape)
    block_elems, block_bytes = gd._BLOCK[qtype]
    if k % block_elems:
        raise ValueError(f"row length {k} of a {qtype.name} tensor is not a multiple of {block_elems}")
    if qtype == Q.MXFP4:
        return mxfp4.from_gguf(gd._raw_bytes(raw)[0], (n, k))
    b = _blocks(raw, block_bytes)
    if b.shape[0] != n * k // block_elems:
        raise ValueError(f"{qtype.name} tensor of shape {tuple(shape)}: wrong number of bytes")

    if qtype == Q.Q4_0:
        codes, group, bits = b[:, 2:18], 32, 4
        scales, mins = _f16(b, 0), None
    elif qtype == Q.Q4_1:
        codes, group, bits = b[:, 4:20], 32, 4
        scales, mins = _f16(b, 0), _f16(b, 2)
    elif qtype == Q.Q8_0:
        codes, group, bits = b[:, 2:34] ^ 0x80, 32, 8  # int8 q + 128
        scales, mins = _f16(b, 0), None
    elif qtype == Q.Q5_0:
        codes, group, bits = _fives(b, 2, n), 32, 5
        scales, mins = _f16(b, 0), None
    elif qtype == Q.Q5_1:
        codes, group, bits = _fives(b, 4, n), 32, 5
        scales, mins = _f16(b, 0), _f16(b, 2)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        u = gd._split_nibbles(b[:, 16:144] if qtype == Q.Q4_K else b[:, 48:], 32).reshape(-1, 8, 32)
        if qtype == Q.Q5_K:
            qh = b[:, 16:48].unsqueeze(1).bitwise_right_shift(gd._BIT_SHIFTS.view(1, 8, 1)).bitwise_and_(1)
            u = u.bitwise_or_(qh.bitwise_left_shift_(4))
        sc, mn = gd._k_scales(b[:, 4:16])  # (n_blocks, 8, 1) float32 holding 0..63
        per_row = k // 256
        scales = super_scales.join(sc.to(torch.uint8).reshape(n, -1), _f16(b, 0).reshape(n, per_row))
        mins = super_scales.join(mn.to(torch.uint8).reshape(n, -1), _f16(b, 2).reshape(n, per_row))
        if qtype == Q.Q4_K:
            codes, bits = pack_nibbles(u.reshape(-1, 256)), 4
        else:
            codes, bits = pack_fives(u.reshape(n, k)), 5
        return QuantizedWeight(codes.contiguous().reshape(n, k * bits // 8), scales, mins, None, bits, 32, "float", n, k)
    if qtype == Q.Q6_K:
        nb = b.shape[0]
        low = gd._split_nibbles(b[:, :128], 64).reshape(nb, 8, 32)
        high = b[:, 128:192].reshape(nb, 2, 1, 32).bitwise_right_shift(gd._Q6_HIGH_SHIFTS).bitwise_and_(3)
        u = low.bitwise_or_(high.reshape(nb, 8, 32).bitwise_left_shift_(4)).reshape(n, k)
        sub = b[:, 192:208].contiguous().view(torch.int8).reshape(n, -1)
        scales = super_scales.join(sub, _f16(b, 208).reshape(n, k // 256))
        return QuantizedWeight(pack_sixes(u), scales, None, None, 6, 16, "float", n, k)
    return QuantizedWeight(
        codes.contiguous().reshape(n, k * bits // 8), scales.contiguous().reshape(n, k // group),
        None if mins is None else mins.contiguous().reshape(n, k // group), None, bits, group, "float", n, k,
    )  # fmt: skip
