"""6-bit centred codes for float weights: llama.cpp's Q6_K (and, on rows that are not whole super-blocks, a
float16 scale per 32), as int4 holds its embedding table and LM head.

Q4_K_M keeps the LM head (the largest matrix of a small model, read whole every decode step) at 6 bits,
where the engine's int4 had kept it at Q8_0's 8.5. Q6_K's rule (ggml `quantize_row_q6_K_ref`):
1. per group of 16, a scale s searched as `make_qx_quants(16, 32, rmse_type=1)`: codes
   l = clamp(round(x / s'), -32, 31) for the 19 trial scales s' = max / -(32 + 0.1 i), i = -9..9 (max: the
   value of largest magnitude), each refit by least squares weighted by x^2, the best kept;
2. per super-block of 256, d = max_scale / -128 rounded to float16 (max_scale: the group scale of largest
   magnitude) and the signed byte sub = min(127, round(s / d));
3. the codes recomputed against d x sub (float32, the product the kernels form): u = l + 32, 0..63.
That is the form GGUF Q6_K tensors are repacked into (`gguf_repack`): 6.5625 bits per weight. Rows whose
width is not a multiple of 256 (where llama.cpp falls back to Q8_0) take step 1's search over groups of
32 and a float16 scale each, codes against it: 6.5 bits per weight, the same kernels.
"""

from __future__ import annotations

import torch

from perfxlm.quant import super_scales
from perfxlm.quant.weight import BLOCK4, QuantizedWeight, pack_sixes

NMAX = 32  # codes l in [-32, 31], stored as u = l + 32
GROUP_K = 16  # Q6_K's weights per sub-scale
ROWS_PER_CHUNK = 1024  # output rows per pass: the trial scales' temporaries stay a few MB
_EPS = 1e-15  # ggml's GROUP_MAX_EPS: a group whose values are all below it is zero


def _sums(g: torch.Tensor, weight: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w x l) and sum(w l l) per group, float32, accumulated element by element in ggml's order (the
    trials' scores differ by a few ulps where one value dominates a group: another order picks another)."""
    sumlx = torch.zeros(g.shape[0], dtype=torch.float32)
    suml2 = torch.zeros_like(sumlx)
    for j in range(g.shape[1]):
        sumlx += weight[:, j] * g[:, j] * l[:, j]
        suml2 += weight[:, j] * l[:, j] * l[:, j]
    return sumlx, suml2


def _search(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups float32 [R, n] -> each group's searched scale [R] (step 1; 0 for an all-zero group), in
    float32 as ggml's make_qx_quants computes it, and the codes u [R, n] of its best trial (0 for an
    all-zero group): what ggml keeps where the stored scale comes out 0."""
    amax, at = g.abs().max(dim=-1)
    top = torch.gather(g, -1, at.unsqueeze(-1))  # the value of largest magnitude, signed
    live = amax >= _EPS
    top = torch.where(live.unsqueeze(-1), top, torch.ones_like(top))
    weight = g * g
    tenth = torch.tensor(0.1, dtype=torch.float32)
    scale = best = codes = None
    for i in (0, *range(-9, 0), *range(1, 10)):  # ggml's order: the first trial, then is = -9..9
        step = -(NMAX + tenth * i)  # in float32, as ggml's -(nmax + 0.1f * is)
        l = torch.round(g * (step / top)).clamp_(-NMAX, NMAX - 1)
        sumlx, suml2 = _sums(g, weight, l)
        trial = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)),
                            torch.zeros_like(sumlx))
        if scale is None:
            scale, best, codes = trial, trial * sumlx, l + NMAX
            continue
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, trial, scale)
        best = torch.where(better, trial * sumlx, best)
        codes = torch.where(better.unsqueeze(-1), l + NMAX, codes)
    codes = torch.where(live.unsqueeze(-1), codes, torch.zeros_like(codes)).to(torch.uint8)
    return torch.where(live, scale, torch.zeros_like(scale)), codes


def _codes(g: torch.Tensor, scale: torch.Tensor, searched: torch.Tensor) -> torch.Tensor:
    """Groups [R, n] against stored float32 scales [R] -> u = l + 32; where a scale is 0 (every value
    of the group 0), the search's codes, as ggml leaves them."""
    safe = torch.where(scale != 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    u = torch.round(g / safe).clamp_(-NMAX, NMAX - 1).add_(NMAX).to(torch.uint8)
    return torch.where((scale != 0).unsqueeze(-1), u, searched)


def _q6_k_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows float32 [R, K] (K a multiple of 256) -> (codes u [R, K], two-level scale bytes)."""
    r, k = w.shape
    g = w.reshape(-1, GROUP_K)
    found, searched = _search(g)
    scales = found.view(r, k // super_scales.SUPER_BLOCK, -1)  # [R, S, 16]
    at = scales.abs().argmax(dim=-1, keepdim=True)
    top = torch.gather(scales, -1, at)  # the sub-scale of largest magnitude, signed
    live = top.abs() >= _EPS
    iscale = -128.0 / torch.where(live, top, torch.ones_like(top))
    d = torch.where(live, 1.0 / iscale, torch.zeros_like(iscale)).half()  # [R, S, 1]
    sub = torch.where(live, torch.round(iscale * scales).clamp_(max=127), torch.zeros_like(scales)).to(torch.int8)
    stored = sub.float().mul_(d.float())  # one rounding, as the kernels and gguf-py form it
    # a super-block with no scale is all zero bytes in ggml (codes 0 too)
    searched = torch.where(live.expand_as(scales).reshape(-1, 1), searched, torch.zeros_like(searched))
    codes = _codes(g, stored.reshape(-1), searched).view(r, k)
    return codes, super_scales.join(sub.reshape(r, -1), d.reshape(r, -1))


def _float16_rows(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows float32 [R, K] -> (codes u [R, K], float16 scales [R, K / group]): step 1, codes against the
    rounded scale."""
    r, k = w.shape
    g = w.reshape(-1, group)
    found, searched = _search(g)
    d = found.half()
    if not bool(torch.isfinite(d).all()):
        raise ValueError("6-bit codes: a group scale does not fit float16")
    return _codes(g, d.float(), searched).view(r, k), d.view(r, -1)


def fits_q6_k(in_features: int) -> bool:
    """Whether rows of `in_features` weights take Q6_K's two-level form (whole super-blocks)."""
    return in_features % super_scales.SUPER_BLOCK == 0


def quantize(w: torch.Tensor) -> QuantizedWeight:
    """A float matrix [N, K] (K a multiple of 32) -> 6-bit centred codes: Q6_K's form where K is a
    multiple of 256, else a float16 scale per 32."""
    if w.dim() != 2 or w.shape[-1] % BLOCK4:
        raise ValueError(f"6-bit codes take matrices whose rows are whole blocks of {BLOCK4}; got {tuple(w.shape)}")
    n, k = w.shape
    two_level = fits_q6_k(k)
    group = GROUP_K if two_level else BLOCK4
    codes, scales = [], []
    for r0 in range(0, n, ROWS_PER_CHUNK):
        part = w[r0 : r0 + ROWS_PER_CHUNK].float()
        u, s = _q6_k_rows(part) if two_level else _float16_rows(part, group)
        codes.append(pack_sixes(u))
        scales.append(s)
    return QuantizedWeight(torch.cat(codes), torch.cat(scales).contiguous(), None, None, 6, group, "float", n, k)
