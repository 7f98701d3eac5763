"""Affine codes whose scale and min are searched per group for the least weighted squared error.

The plain rule (llama.cpp's Q4_1: s = (max - min) / top, m = min) spends levels on a group's extremes
even when they are one outlier. Here, as in llama.cpp's make_qkx2_quants / make_qkx3_quants (Q4_K),
each group x_1..x_G with non-negative weights w_1..w_G tries several ranges: the codes of the plain
range stretched by (top + rmin + i rdelta) / top, i = 0..steps. For each candidate's codes u, the scale
and min are the weighted least-squares fit of x ~ s u + m (closed form), and its error
E = sum w (s u + m - x)^2 follows from the same five sums, so no candidate is dequantized.
The best fit is rounded to float16, the codes are recomputed against the stored values (the nearest
code is optimal for a fixed scale and min), the fit is refined once more on those codes, and each
group keeps whichever of {plain rule, searched fit, refined fit} has the least E on the stored
values: the result is never worse than the plain rule on the weighted objective.

The weights say which errors matter (`element_weights`): without calibration, llama.cpp's
calibration-free choice (sqrt(mean x^2) + |x|: large weights count more); with activation statistics,
the mean square of each input channel's activation (the error a weight adds to its output is its error
times that channel's activation, so this is the output's expected squared error per channel, the
diagonal of llama.cpp's importance matrix and AWQ's idea) times sqrt(sigma^2 + x^2) as llama.cpp's
imatrix path does.
"""

from __future__ import annotations

import torch

RMIN, RDELTA, STEPS = -1.0, 0.1, 20  # llama.cpp's Q4_K search: ranges stretched by 14/15 .. 16/15
CHUNK = 1 << 18  # weights per chunk: the candidate loop's temporaries stay in cache


def element_weights(g: torch.Tensor, importance: torch.Tensor | None) -> torch.Tensor:
    """How much each weight's squared error counts, float32 [..., G] like the groups `g`.

    `importance`: None, or the mean square activation of each weight's input channel, broadcastable
    to `g` (already laid out per group)."""
    sigma2 = g.square().mean(dim=-1, keepdim=True)
    if importance is None:
        return sigma2.sqrt() + g.abs()
    return importance * (2.0 * sigma2 + g.square()).sqrt()


def weighted_chunks(g: torch.Tensor, importance: torch.Tensor | None):
    """Groups [R, G] in chunks of about CHUNK weights, each with its element weights (`importance`'s rows
    tile the groups' rows): the searches' loop, so their temporaries stay in cache."""
    rows = max(1, CHUNK // g.shape[-1])
    for start in range(0, g.shape[0], rows):
        chunk = g[start : start + rows]
        imp = None
        if importance is not None:
            imp = importance[torch.arange(start, start + chunk.shape[0]) % importance.shape[0]]
        yield chunk, element_weights(chunk, imp)


def _sums(w: torch.Tensor, wx: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, ...]:
    wu = w * u
    return wu.sum(-1).double(), (wu * u).sum(-1).double(), (wx * u).sum(-1).double()


def _fit(sw, swx, swx2, swu, swu2, swux) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted least squares x ~ s u + m from the sums (float64): s, m and E (inf where undetermined)."""
    det = sw * swu2 - swu * swu
    ok = det > 0
    det = torch.where(ok, det, torch.ones_like(det))
    s = (sw * swux - swx * swu) / det
    m = (swu2 * swx - swu * swux) / det
    err = s * s * swu2 + 2 * s * m * swu - 2 * s * swux + m * m * sw - 2 * m * swx + swx2
    err = torch.where(ok & (s > 0), err, torch.full_like(err, float("inf")))
    return s, m, err


def _codes(g: torch.Tensor, s: torch.Tensor, m: torch.Tensor, top: int) -> torch.Tensor:
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round((g - m.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, top)


def _stored_error(g, w, s, m, u) -> torch.Tensor:
    return (w * (s.unsqueeze(-1) * u + m.unsqueeze(-1) - g).square()).sum(-1)


def _search_chunk(g: torch.Tensor, w: torch.Tensor, top: int, dtype: torch.dtype):
    lo, hi = g.amin(-1), g.amax(-1)
    span = hi - lo
    normed = (g - lo.unsqueeze(-1)) / torch.where(span > 0, span, torch.ones_like(span)).unsqueeze(-1)
    wx = w * g
    sw, swx, swx2 = w.sum(-1).double(), wx.sum(-1).double(), (wx * g).sum(-1).double()
    best_s, best_m = (span / top).double(), lo.double()
    best_err = torch.full_like(sw, float("inf"))
    for i in range(STEPS + 1):
        u = torch.round(normed * (top + RMIN + RDELTA * i)).clamp_(0, top)
        s, m, err = _fit(sw, swx, swx2, *_sums(w, wx, u))
        better = err < best_err
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        best_err = torch.where(better, err, best_err)

    def stored(s: torch.Tensor, m: torch.Tensor):
        s, m = s.to(dtype).float(), m.to(dtype).float()
        u = _codes(g, s, m, top)
        return s, m, u, _stored_error(g, w, s, m, u)

    # the plain rule first: ties keep it
    candidates = [stored(span / top, lo), stored(best_s.float(), best_m.float())]
    _, _, u, _ = candidates[1]
    s, m, _ = _fit(sw, swx, swx2, *_sums(w, wx, u))  # one alternating step on the stored codes
    refit = stored(s.float(), m.float())
    candidates.append(refit)
    s, m, u, err = candidates[0]
    for cs, cm, cu, cerr in candidates[1:]:
        better = (cerr < err) & torch.isfinite(cs) & torch.isfinite(cm) & (cs > 0)
        s, m, err = torch.where(better, cs, s), torch.where(better, cm, m), torch.where(better, cerr, err)
        u = torch.where(better.unsqueeze(-1), cu, u)
    return u, s, m


def _native():
    from perfxlm.ops import native  # late: the ops package imports this one's QuantizedWeight

    ops = native.kernels()
    return ops if ops is not None and hasattr(ops, "search_affine") else None


def search_affine(
    g: torch.Tensor, top: int, importance: torch.Tensor | None = None, half: bool = True,
    use_native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups float32 [R, G] -> codes [R, G] (0..top), scales and mins [R] (float16 where `half` and
    every value fits, else float32). `importance`: None, or float32 [P, G] with P dividing R, group r
    taking row r % P (a weight row's groups, the same for every output row; see `element_weights`).
    The native kernel where built (`use_native`), else the same search in plain torch."""
    g = g.float().contiguous()
    if importance is not None:
        importance = importance.float().contiguous()
        if importance.dim() != 2 or importance.shape[1] != g.shape[1] or g.shape[0] % importance.shape[0]:
            raise ValueError(f"importance {tuple(importance.shape)} does not tile groups {tuple(g.shape)}")
    ops = _native() if use_native else None
    if ops is not None:
        u, s, m = ops.search_affine(g, importance, top, STEPS, RMIN, RDELTA, half)
        if not half:
            return u, s, m
        if bool(torch.isfinite(s).all() and torch.isfinite(m).all()):
            return u, s.half(), m.half()
        return search_affine(g, top, importance, half=False)  # a value beyond float16's range
    dtype = torch.float16 if half else torch.float32
    us, ss, ms = [], [], []
    for chunk, weights in weighted_chunks(g, importance):
        u, s, m = _search_chunk(chunk, weights, top, dtype)
        us.append(u)
        ss.append(s)
        ms.append(m)
    u, s, m = torch.cat(us), torch.cat(ss), torch.cat(ms)
    if half:
        s16, m16 = s.half(), m.half()
        if bool(torch.isfinite(s16).all() and torch.isfinite(m16).all()):
            return u, s16, m16
        return search_affine(g, top, importance, half=False, use_native=False)
    return u, s, m


LEVEL_FACTORS = [1.0 - 0.0125 * i for i in range(21)]  # scales from absmax down to 0.75 absmax, both signs


def _nearest(normed: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    return torch.bucketize(normed.clamp(-1, 1), (levels[1:] + levels[:-1]) / 2)


def _levels_chunk(
    g: torch.Tensor, w: torch.Tensor, levels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = g.abs().amax(-1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    wx = w * g
    swx2 = (wx * g).sum(-1).double()
    best_s, best_err = safe.double(), torch.full_like(swx2, float("inf"))
    for sign in (1.0, -1.0):  # a negative scale puts the table's 8 positive levels on the negative side
        for f in LEVEL_FACTORS:
            lv = levels[_nearest(g / (sign * f * safe).unsqueeze(-1), levels)]
            swl2, swxl = (w * lv * lv).sum(-1).double(), (wx * lv).sum(-1).double()
            ok = swl2 > 0
            s = torch.where(ok, swxl / torch.where(ok, swl2, torch.ones_like(swl2)), best_s)  # least squares
            err = torch.where(ok, swx2 - swxl * swxl / torch.where(ok, swl2, torch.ones_like(swl2)), best_err)
            better = err < best_err
            best_s, best_err = torch.where(better, s, best_s), torch.where(better, err, best_err)

    def stored(s: torch.Tensor):
        s = s.half().float()
        safe_s = torch.where(s != 0, s, torch.ones_like(s))
        u = _nearest(g / safe_s.unsqueeze(-1), levels)
        return s, u, (w * (s.unsqueeze(-1) * levels[u] - g).square()).sum(-1)

    s, u, err = stored(torch.where(absmax > 0, absmax, torch.zeros_like(absmax)))  # the plain rule first
    cs, cu, cerr = stored(best_s.float())
    better = (cerr < err) & torch.isfinite(cs) & (cs != 0)
    return torch.where(better.unsqueeze(-1), cu, u), torch.where(better, cs, s)


def search_levels(
    g: torch.Tensor, levels: torch.Tensor, importance: torch.Tensor | None = None, use_native: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups float32 [R, G] -> codes [R, G] into the sorted table `levels` (NF4's 16, 5-bit codes' 32) and
    one float16 scale per group (value = scale * levels[u]), searched for the least weighted squared
    error: the absmax scale (the plain rule, which wins ties), scales down to 0.75 absmax of either sign,
    each refit by least squares on its codes. `importance` as in `search_affine`. The native kernel where
    built (`use_native`) and the weights are finite, else the same search in plain torch. ValueError
    where a scale would not fit float16."""
    g = g.float().contiguous()
    ops = _native_levels() if use_native else None
    if ops is not None and bool(torch.isfinite(g).all()):
        imp = None if importance is None else importance.float().contiguous()
        factors = torch.tensor(LEVEL_FACTORS, dtype=torch.float32)  # float32, as torch multiplies by them
        u, s = ops.search_levels(g, levels.float().contiguous(), imp, factors)
    else:
        u, s = _search_levels_torch(g, levels, importance)
    if not bool(torch.isfinite(s).all()) or bool((s.abs() > 65504).any()):
        raise ValueError(
            "nf4 with searched scales: a weight group beyond float16's range; supported there: "
            "double_quant true (float32 scales)."
        )
    return u, s.half()


def _native_levels():
    ops = _native()
    return ops if ops is not None and hasattr(ops, "search_levels") else None


def _search_levels_torch(
    g: torch.Tensor, levels: torch.Tensor, importance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    us, ss = [], []
    for chunk, weights in weighted_chunks(g, importance):
        u, s = _levels_chunk(chunk, weights, levels)
        us.append(u)
        ss.append(s)
    return torch.cat(us), torch.cat(ss)


# Centred integer codes (Q5_0's form, value = d * q, q in -half..half-1): the scale candidates of
# `search_centred`, as multiples of the plain rule's |d| = absmax / half; both signs are tried, so the
# extreme value may take the code of larger magnitude (-half) or the other end (half - 1) of the range.
# 1.06 .. 0.70 finely, then down to 0.3 coarsely: with activation weights, a group whose extreme value
# meets an idle input channel is best served by clipping that value hard
CENTRED_FACTORS = [1.06 - 0.01 * i for i in range(37)] + [0.65 - 0.05 * i for i in range(8)]
ANCHOR_FRACTIONS = (0.3, 0.1, 0.03)  # see `_centred_chunk`
ANCHOR_FACTORS = (1.0, 0.9, 0.8)
REFINE_STEPS = 2  # alternating least-squares steps on the best candidate's stored codes


def _centred_codes(g: torch.Tensor, d: torch.Tensor, half: int) -> torch.Tensor:
    safe = torch.where(d != 0, d, torch.ones_like(d))
    return torch.round(g / safe.unsqueeze(-1)).clamp_(-half, half - 1)


def _centred_chunk(g: torch.Tensor, w: torch.Tensor, half: int, dtype: torch.dtype):
    idx = g.abs().argmax(-1, keepdim=True)
    extreme = torch.gather(g, -1, idx).squeeze(-1)  # the value of largest magnitude, with its sign
    wx = w * g
    swx2 = (wx * g).sum(-1).double()
    best_d, best_err = (extreme / -half).double(), torch.full_like(swx2, float("inf"))
    # anchors: the group's extreme value, and the extremes among its weights that count at least a
    # fraction of its most important one (an extreme on an idle input channel is best clipped away)
    anchors = [(extreme, CENTRED_FACTORS)]
    wmax = w.amax(-1, keepdim=True)
    for frac in ANCHOR_FRACTIONS:
        kept = torch.where(w >= frac * wmax, g, torch.zeros_like(g))
        top_kept = torch.gather(kept, -1, kept.abs().argmax(-1, keepdim=True)).squeeze(-1)
        anchors.append((top_kept, ANCHOR_FACTORS))
    candidates = [(anchor, sign * f) for sign in (-1.0, 1.0) for anchor, factors in anchors for f in factors]
    for anchor, f in candidates:  # sign -1: llama.cpp's orientation (the anchor at code -half)
        q = _centred_codes(g, anchor * (f / half), half)
        swq2, swxq = (w * q * q).sum(-1).double(), (wx * q).sum(-1).double()
        ok = swq2 > 0
        den = torch.where(ok, swq2, torch.ones_like(swq2))
        err = torch.where(ok, swx2 - swxq * swxq / den, best_err)  # at the least-squares scale
        better = err < best_err
        best_d, best_err = torch.where(better, swxq / den, best_d), torch.where(better, err, best_err)

    def stored(d: torch.Tensor):
        d = d.to(dtype).float()
        q = _centred_codes(g, d, half)
        return d, q, (w * (d.unsqueeze(-1) * q - g).square()).sum(-1)

    d, q, err = stored(extreme / -half)  # the plain rule first: ties keep it
    cand = stored(best_d.float())
    for step in range(REFINE_STEPS + 1):
        cd, cq, cerr = cand
        better = (cerr < err) & torch.isfinite(cd) & (cd != 0)
        d, err = torch.where(better, cd, d), torch.where(better, cerr, err)
        q = torch.where(better.unsqueeze(-1), cq, q)
        if step == REFINE_STEPS:
            break
        swq2, swxq = (w * cq * cq).sum(-1), (wx * cq).sum(-1)  # refit the scale to these codes
        cand = stored(torch.where(swq2 > 0, swxq / torch.where(swq2 > 0, swq2, torch.ones_like(swq2)), cd))
    return q, d


def _centred_candidates(top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_centred_chunk`'s candidates in its order, for the native search: the anchor of each (0: the group's
    extreme value, 1 + i: the extreme among weights counting ANCHOR_FRACTIONS[i]) and its multiplier,
    (sign x factor) / top rounded to float32 as torch rounds a Python float it multiplies a tensor by."""
    anchors = [(0, CENTRED_FACTORS)] + [(1 + i, ANCHOR_FACTORS) for i in range(len(ANCHOR_FRACTIONS))]
    pairs = [(a, sign * f / top) for sign in (-1.0, 1.0) for a, factors in anchors for f in factors]
    return torch.tensor([a for a, _ in pairs]), torch.tensor([m for _, m in pairs], dtype=torch.float32)


def _native_centred():
    ops = _native()
    return ops if ops is not None and hasattr(ops, "search_centred") else None


def search_centred(
    g: torch.Tensor, bits: int, importance: torch.Tensor | None = None, half: bool = True,
    use_native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups float32 [R, G] -> centred codes q [R, G] (-2^(bits-1) .. 2^(bits-1) - 1, value d * q) and
    one scale d per group [R] (float16 where `half`; ValueError where one would not fit), searched for the
    least weighted squared error: the plain rule (d = the largest-magnitude value / -2^(bits-1),
    llama.cpp's Q5_0, which wins ties), then 45 scales from 1.06 down to 0.3 of it in either orientation,
    each refit by least squares on its codes, the best refined by alternating code / scale steps on the
    stored values. The same objective as `search_levels` on the integer table, in plain arithmetic (no
    table look-ups), so a whole model's 5-bit weights take seconds. `importance` as in `search_affine`. The
    native kernel where built (`use_native`) and the weights are finite, else the same search in torch."""
    g = g.float().contiguous()
    if importance is not None:
        importance = importance.float().contiguous()
        if importance.dim() != 2 or importance.shape[1] != g.shape[1] or g.shape[0] % importance.shape[0]:
            raise ValueError(f"importance {tuple(importance.shape)} does not tile groups {tuple(g.shape)}")
    top = 1 << (bits - 1)
    dtype = torch.float16 if half else torch.float32
    ops = _native_centred() if use_native else None
    if ops is not None and bool(torch.isfinite(g).all()):  # the same search, one pass per candidate
        anchor, mult = _centred_candidates(top)
        fracs = torch.tensor(ANCHOR_FRACTIONS, dtype=torch.float32)
        q, d = ops.search_centred(g, importance, top, anchor, mult, fracs, REFINE_STEPS, half)
    else:
        qs, ds = [], []
        for chunk, weights in weighted_chunks(g, importance):
            q, d = _centred_chunk(chunk, weights, top, dtype)
            qs.append(q)
            ds.append(d)
        q, d = torch.cat(qs), torch.cat(ds)
    if not bool(torch.isfinite(d).all()) or bool((d.abs() > 65504).any()):
        raise ValueError("a weight group whose scale is beyond float16's range")
    return q, d.to(dtype) if half else d
