"""x @ W^T in Triton with W kept in GGUF's packed blocks, dequantized tile by tile inside the matmul.

The weight is the file's bytes as they are, `[out_features, in_features / 32 * block_bytes]` uint8, so a
Q4_0 projection reads 4.5 bits per weight from memory instead of 16. Supported: Q8_0 (fp16 scale d, 32
int8 values: d * q) and Q4_0 (fp16 d, 16 bytes holding 32 nibbles, values 0-15 of a block in the low
nibbles and 16-31 in the high ones: d * (q - 8)). Each K step consumes one block; its two halves are
separate 16-wide dots, which matches Q4_0's nibble order without shuffling registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

QK = 32  # values per block in both formats
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18}


@triton.jit
def _block_scale(w_row, b, n_mask):
    """The fp16 scale d at the head of block b of each row, as float32: [BLOCK_N]."""
    lo = tl.load(w_row + b, mask=n_mask, other=0).to(tl.uint16)
    hi = tl.load(w_row + b + 1, mask=n_mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_matmul_kernel(
    x, w, y, M, N, K, stride_xm, stride_ym, row_bytes,
    Q4: tl.constexpr, BLOCK_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = m < M
    n_mask = n < N
    j = tl.arange(0, 16)
    w_row1 = w + n.to(tl.int64) * row_bytes  # [BLOCK_N]: each row's first byte
    w_row = w_row1[:, None]
    x_row = x + m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, K // 32):
        b = kb * BLOCK_BYTES
        d = _block_scale(w_row1, b, n_mask)
        x_lo = tl.load(x_row + kb * 32 + j[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + kb * 32 + 16 + j[None, :], mask=m_mask[:, None], other=0.0).to(tl.float32)
        if Q4:
            qs = tl.load(w_row + b + 2 + j[None, :], mask=n_mask[:, None], other=0)
            w_lo = (qs & 15).to(tl.float32) - 8.0
            w_hi = (qs >> 4).to(tl.float32) - 8.0
        else:
            w_lo = tl.load(w_row + b + 2 + j[None, :], mask=n_mask[:, None], other=0).to(tl.int8, bitcast=True)
            w_hi = tl.load(w_row + b + 18 + j[None, :], mask=n_mask[:, None], other=0).to(tl.int8, bitcast=True)
            w_lo = w_lo.to(tl.float32)
            w_hi = w_hi.to(tl.float32)
        part = tl.dot(x_lo, tl.trans(w_lo), input_precision="ieee")
        part += tl.dot(x_hi, tl.trans(w_hi), input_precision="ieee")
        acc += part * d[None, :]
    out = y + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(out, acc.to(y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gguf_matmul(x: torch.Tensor, weight: torch.Tensor, qtype: str) -> torch.Tensor:
    """x [..., K] @ W^T for a GGUF-packed W [N, K / 32 * block_bytes] uint8 -> [..., N] in x's dtype."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"gguf_matmul supports {', '.join(BLOCK_BYTES)}, got {qtype!r}.")
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"the weight must be the file's packed blocks, 2-D uint8; got {weight.dtype} {tuple(weight.shape)}.")
    in_features = x.shape[-1]
    row_bytes = weight.shape[1]
    if in_features % QK or row_bytes != in_features // QK * BLOCK_BYTES[qtype]:
        raise ValueError(
            f"{qtype} rows of {row_bytes} bytes do not hold {in_features} inputs "
            f"({in_features // QK * BLOCK_BYTES[qtype]} bytes and a multiple of {QK} expected)."
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows, out_features = x2.shape[0], weight.shape[0]
    y = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    block_m = 16 if num_rows <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(out_features, block_n))
    _gguf_matmul_kernel[grid](
        x2, weight, y, num_rows, out_features, in_features, x2.stride(0), y.stride(0), row_bytes,
        Q4=qtype == "Q4_0", BLOCK_BYTES=BLOCK_BYTES[qtype], BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return y.reshape(*lead, out_features)
