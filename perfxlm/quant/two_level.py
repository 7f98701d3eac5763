"""int4's super-block form: searched group scales and mins held as GGUF K-quants hold theirs.

`quantize_int4_search` stores a float16 scale and min per group of 32: 4 + 32 / 32 = 5 bits per weight.
llama.cpp's Q4_K stores a 6-bit scale and min per 32 and a float16 factor of each per 256 (4.5 bits);
the engine holds K-quants' sub-scales as whole bytes (`perfxlm.quant.super_scales`: 4.625 bits per weight
streamed), and every tier's kernels read that form. This quantizer writes it for float weights whose
rows are whole super-blocks of 256:
1. each group's scale s and min m searched as int4's (`search.search_affine`, activation-weighted);
2. mins above 0 clipped to 0 (the form stores a min as the negation of an unsigned byte times a factor:
   a group that is all positive starts at 0, as in llama.cpp's make_qkx searches);
3. per super-block, the factor d = max s / 255 rounded to float16 and the byte round(s / d), the same for
   -m: bytes where Q4_K has 6 bits, so the second level adds at most half a 255th of the block's largest
   scale (Q4_K's 63 steps: four times that);
4. the codes recomputed against the stored values (sub x factor in float32, the product the kernels
   form), then one weighted least-squares refit of each group's scale and min on those codes, rounded to
   the same factors; each group keeps whichever of the two has the least weighted squared error (the
   weights `search.element_weights` gives: the error measure of step 1).
Rows of other widths keep the float16 form (`fits`).
"""

from __future__ import annotations

import torch

from perfxlm.quant import super_scales
from perfxlm.quant.search import element_weights, search_affine
from perfxlm.quant.weight import BLOCK4, QuantizedWeight, pack_nibbles

SUB_TOP = 255  # sub-scales and sub-mins are whole bytes
TOP = 15  # 4-bit codes
ROWS_PER_CHUNK = 1024  # output rows per pass of steps 2-4: their temporaries stay a few MB


def fits(in_features: int, group: int) -> bool:
    """Whether a weight with `in_features` inputs in groups of `group` can take the two-level form: rows
    of whole super-blocks, a group of whole 32-blocks dividing 256."""
    sb = super_scales.SUPER_BLOCK
    return in_features % sb == 0 and group % BLOCK4 == 0 and sb % group == 0


def _bytes(values: torch.Tensor, per: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Non-negative float32 [R, G] -> (bytes [R, G] uint8, float16 factors [R, G // per]) with values ~=
    byte x factor; None where a factor does not fit float16."""
    r, groups = values.shape
    v = values.view(r, groups // per, per)
    factors = (v.amax(-1) / SUB_TOP).half()
    if not bool(torch.isfinite(factors).all()):
        return None
    f = factors.float().unsqueeze(-1)
    sub = torch.where(f > 0, torch.round(v / torch.where(f > 0, f, torch.ones_like(f))), torch.zeros_like(v))
    return sub.clamp_(0, SUB_TOP).to(torch.uint8).view(r, groups), factors


def _stored(sub: torch.Tensor, factors: torch.Tensor, per: int) -> torch.Tensor:
    """bytes [R, G] x factors [R, S] -> float32 [R, G], one rounding (as the kernels and gguf-py)."""
    return sub.float().mul_(factors.float().repeat_interleave(per, dim=-1))


def _requantize(values: torch.Tensor, factors: torch.Tensor, per: int) -> torch.Tensor:
    """Non-negative float32 [R, G] -> bytes against fixed float16 factors [R, S]."""
    f = factors.float().repeat_interleave(per, dim=-1)
    sub = torch.where(f > 0, torch.round(values / torch.where(f > 0, f, torch.ones_like(f))), torch.zeros_like(values))
    return sub.clamp_(0, SUB_TOP).to(torch.uint8)


def _codes(g: torch.Tensor, s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round((g - m.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, TOP)


def _error(g: torch.Tensor, w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return (w * (s.unsqueeze(-1) * u + m.unsqueeze(-1) - g).square()).sum(-1)


def _refit(g: torch.Tensor, w: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least squares g ~ s u + m per group on fixed codes, with m <= 0 (a positive fit refit
    through 0); groups with one code value keep s = 0 and m their weighted mean (clipped to <= 0)."""
    w, u, g = w.double(), u.double(), g.double()  # float32 sums cancel in the determinant
    sw, swu, swu2 = w.sum(-1), (w * u).sum(-1), (w * u * u).sum(-1)
    swx, swux = (w * g).sum(-1), (w * u * g).sum(-1)
    det = sw * swu2 - swu * swu
    ok = det > 1e-12 * (sw * swu2).clamp(min=1e-30)
    den = torch.where(ok, det, torch.ones_like(det))
    s = torch.where(ok, (sw * swux - swx * swu) / den, torch.zeros_like(det))
    m = torch.where(ok, (swu2 * swx - swu * swux) / den, swx / sw.clamp(min=1e-30))
    through0 = m > 0
    s0 = swux / swu2.clamp(min=1e-30)
    s = torch.where(through0, s0, s).clamp_(min=0)
    return s.float(), torch.where(through0, torch.zeros_like(m), m).float()


def _chunk(g: torch.Tensor, w: torch.Tensor, s: torch.Tensor, m: torch.Tensor, per: int):
    """Steps 2-4 for output rows g [R, G, group] (their element weights w, searched s, m [R, G]) -> codes
    [R, G, group], scale bytes, scale factors, min bytes, min factors; None where a factor overflows."""
    s = s.clamp(min=0)
    m = m.clamp(max=0)  # step 2
    scales, mins = _bytes(s, per), _bytes(-m, per)
    if scales is None or mins is None:
        return None
    (ss, fs), (sm, fm) = scales, mins
    s1, m1 = _stored(ss, fs, per), -_stored(sm, fm, per)
    u1 = _codes(g, s1, m1)
    e1 = _error(g, w, s1, m1, u1)
    rs, rm = _refit(g, w, u1)  # step 4: one alternating step on the stored codes
    ss2, sm2 = _requantize(rs, fs, per), _requantize(-rm, fm, per)
    s2, m2 = _stored(ss2, fs, per), -_stored(sm2, fm, per)
    u2 = _codes(g, s2, m2)
    better = _error(g, w, s2, m2, u2) < e1
    u = torch.where(better.unsqueeze(-1), u2, u1)
    return u, torch.where(better, ss2, ss), fs, torch.where(better, sm2, sm), fm


def quantize_int4(w: torch.Tensor, group: int, importance: torch.Tensor | None = None) -> QuantizedWeight | None:
    """float [..., N, K] (K a multiple of 256, `fits`) -> 4-bit asymmetric codes with two-level scales and
    mins (bytes per group, float16 factors per 256). `importance`: None, or the mean square activation of
    each input channel [K], as for `quantizers.quantize_int4_search`. None where a factor would leave
    float16's range (the caller keeps the float form)."""
    *lead, n, k = w.shape
    if not fits(k, group):
        raise ValueError(f"two-level int4 needs in_features ({k}) a multiple of {super_scales.SUPER_BLOCK} "
                         f"and a group ({group}) of whole {BLOCK4}-blocks dividing it")
    imp = None
    if importance is not None:
        if tuple(importance.shape) != (k,):
            raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({k},)")
        imp = importance.float().reshape(k // group, group)
    groups, per = k // group, super_scales.SUPER_BLOCK // group
    rows = w.float().reshape(-1, groups, group)
    _, s, m = search_affine(rows.reshape(-1, group), TOP, imp, half=False)  # step 1
    s, m = s.float().view(-1, groups), m.float().view(-1, groups)
    parts = []
    for r0 in range(0, rows.shape[0], ROWS_PER_CHUNK):
        g = rows[r0 : r0 + ROWS_PER_CHUNK]
        weights = element_weights(g, None if imp is None else imp.unsqueeze(0))
        part = _chunk(g, weights, s[r0 : r0 + ROWS_PER_CHUNK], m[r0 : r0 + ROWS_PER_CHUNK], per)
        if part is None:
            return None
        parts.append(part)
    u, ss, fs, sm, fm = (torch.cat(t) for t in zip(*parts))
    codes = pack_nibbles(u.reshape(-1, k).to(torch.uint8)).reshape(*lead, n, k // 2)
    scales = super_scales.join(ss, fs).reshape(*lead, n, -1)
    mins = super_scales.join(sm, fm).reshape(*lead, n, -1)
    return QuantizedWeight(codes.contiguous(), scales.contiguous(), mins.contiguous(), None, 4, group, "float", n, k)
