"""Quantizers: float weights [..., N, K] -> `QuantizedWeight`.

Every quantizer works group by group (`group` consecutive weights of a row share a scale and a min;
group == K is one scale per output channel) and rounds half to even (`torch.round`):
- int8, symmetric: s = absmax / 127, q = round(w / s) in -127..127, stored u = q + 128, min = -128 s.
- int8, asymmetric (DashInfer's uint8 with a zero point): the range [min(w, 0), max(w, 0)] over 255
  steps, s = range / 255, zero point z = round(-lo / s), u = clamp(round(w / s) + z, 0, 255),
  min = -z s (0 is exact).
- int4, symmetric (llama.cpp's Q4_0 rule, all 16 levels used): m = the weight of largest magnitude,
  d = m / -8, u = clamp(round(w / d) + 8, 0, 15), min = -8 d.
- int4, asymmetric, plain (llama.cpp's Q4_1 rule): s = (max - min) / 15 over the group's own range,
  the min stored as a float (no integer zero point: with 16 levels, keeping 0 exact costs accuracy).
- int4, asymmetric, searched (the default for int4): the scale and min of each group that make the
  weighted squared error least, llama.cpp's Q4_K search (`perfxlm.quant.search`); the weights come from
  activation statistics when given (`importance`: the mean square of each input channel).
- nf4 (bitsandbytes' NormalFloat4): s = absmax, u = the nearest of 16 levels to w / s, min = 0; QLoRA's
  double quantization of the absmax values is in `perfxlm.quant.nf4`; with activation statistics, the
  scale of each group is searched instead (`perfxlm.quant.search.search_levels`).
- w8a8: int8 symmetric weights (per channel by default), activations quantized per token at run time.
int8 keeps float32 scales; int4 and nf4 round theirs to float16 first (half the overhead, as GGUF does)
and compute the codes against the rounded scales, falling back to float32 where a value would not fit.
"""

from __future__ import annotations

import torch

from perfxlm.quant import joining
from perfxlm.quant.nf4 import NF4_LEVELS, double_quantize_absmax, nf4_codes
from perfxlm.quant.search import search_affine, search_centred, search_levels
from perfxlm.quant.weight import QuantizedWeight, pack_codes

_NF4_MIDPOINTS = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2


def _groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """[..., N, K] -> float32 [..., N, K // group, group] and the leading shape [..., N]."""
    k = w.shape[-1]
    if group < 1 or k % group:
        raise ValueError(f"group size {group} does not divide in_features {k}")
    return w.float().reshape(*w.shape[:-1], k // group, group), tuple(w.shape[:-1])


def _safe(s: torch.Tensor) -> torch.Tensor:
    return torch.where(s == 0, torch.ones_like(s), s)


def _to_half_if_exact(scales: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s16, m16 = scales.half(), mins.half()
    if torch.isfinite(s16).all() and torch.isfinite(m16).all():
        return s16, m16
    return scales, mins


def _build(codes, scales, mins, bits, group, shape, act="float", levels=None) -> QuantizedWeight:
    """mins None: centred codes (the min implied by the scale, not stored)."""
    *lead, n, k = shape
    codes = pack_codes(codes.reshape(*lead, n, k).to(torch.uint8), bits)
    return QuantizedWeight(
        codes.contiguous(), scales.reshape(*lead, n, k // group).contiguous(),
        None if mins is None else mins.reshape(*lead, n, k // group).contiguous(), levels, bits, group, act, n, k,
    )  # fmt: skip


def quantize_symmetric_int8(
    w: torch.Tensor, group: int, act: str = "float", centred: bool = False, half: bool = False
) -> QuantizedWeight:
    """`centred`: the min -128 s implied, not stored (Q8_0's form); `half`: float16 scales where they fit
    (codes against the rounded scale), as Q8_0 stores them."""
    g, _ = _groups(w, group)
    s = g.abs().amax(dim=-1) / 127.0
    if half and bool(torch.isfinite(s.half()).all()):
        s = s.half()
    q = torch.round(g / _safe(s.float()).unsqueeze(-1)).clamp_(-127, 127)
    return _build(q.add_(128), s, None if centred else s * -128.0, 8, group, w.shape, act)


def _asymmetric(w: torch.Tensor, group: int, top: int, half: bool, zero_point: bool = True) -> tuple:
    g, _ = _groups(w, group)
    if zero_point:  # the range holds 0, which an integer zero point keeps exact
        lo = g.amin(dim=-1).clamp(max=0.0)
        hi = g.amax(dim=-1).clamp(min=0.0)
        s = (hi - lo) / top
        z = torch.round(-lo / _safe(s)).clamp_(0, top)
        mins = -z * s
    else:  # llama.cpp's Q4_1 rule: the group's own [min, max], the min kept as a float
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        s = (hi - lo) / top
        mins = lo
    if half:
        s, mins = _to_half_if_exact(s, mins)
    # codes against the stored values: u = round((w - min) / s)
    u = torch.round((g - mins.float().unsqueeze(-1)) / _safe(s.float()).unsqueeze(-1)).clamp_(0, top)
    return u, s, mins


def quantize_asymmetric_int8(w: torch.Tensor, group: int) -> QuantizedWeight:
    u, s, mins = _asymmetric(w, group, 255, half=False)
    return _build(u, s, mins, 8, group, w.shape)


def quantize_symmetric_int4(w: torch.Tensor, group: int) -> QuantizedWeight:
    g, _ = _groups(w, group)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(g, -1, idx).squeeze(-1) / -8.0
    d16 = d.half()
    if torch.isfinite(d16).all():  # float16 where d fits (the min -8 d is implied: centred codes)
        d = d16
    u = torch.round(g / _safe(d.float()).unsqueeze(-1)).add_(8).clamp_(0, 15)
    return _build(u, d, None, 4, group, w.shape)


def quantize_asymmetric_int4(w: torch.Tensor, group: int) -> QuantizedWeight:
    # 15 steps are coarse: a float min (Q4_1) spends none of them on keeping 0 exact
    u, s, mins = _asymmetric(w, group, 15, half=True, zero_point=False)
    return _build(u, s, mins, 4, group, w.shape)


def quantize_int4_search(
    w: torch.Tensor, group: int, importance: torch.Tensor | None = None
) -> QuantizedWeight:
    """Asymmetric 4-bit codes with searched group scales and mins (float16). `importance`: None, or the
    mean square activation of each input channel, float [K]."""
    g, lead = _groups(w, group)
    flat = g.reshape(-1, group)
    imp = None
    if importance is not None:
        k = w.shape[-1]
        if tuple(importance.shape) != (k,):
            raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({k},)")
        imp = importance.float().reshape(k // group, group)  # one row's groups, tiled over the rows
    u, s, mins = search_affine(flat, 15, imp)
    return _build(u, s, mins, 4, group, w.shape)


def _importance_groups(importance: torch.Tensor | None, k: int, group: int) -> torch.Tensor | None:
    if importance is None:
        return None
    if tuple(importance.shape) != (k,):
        raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({k},)")
    return importance.float().reshape(k // group, group)  # one row's groups, tiled over the rows


def quantize_int5_search(
    w: torch.Tensor, group: int, importance: torch.Tensor | None = None
) -> QuantizedWeight:
    """5-bit codes, centred (llama.cpp's Q5_0 form: w = s (u - 16), one float16 scale per group and no
    min, 5 + 16 / group bits per weight), the scale searched for the least weighted squared error
    (`perfxlm.quant.search.search_centred`);
    `importance` as for `quantize_int4_search`."""
    g, _ = _groups(w, group)
    imp = _importance_groups(importance, w.shape[-1], group)
    q, d = search_centred(g.reshape(-1, group), 5, imp)
    return _build(q.add_(16), d, None, 5, group, w.shape)


def quantize_symmetric_int5(w: torch.Tensor, group: int) -> QuantizedWeight:
    """5-bit centred codes by llama.cpp's Q5_0 rule: d = (the weight of largest magnitude) / -16, u =
    clamp(round(w / d) + 16, 0, 31), a float16 d per group. One pass over the weights: for a table with
    no activation statistics to weigh (an embedding's 28M values took the search 20 minutes)."""
    g, _ = _groups(w, group)
    idx = g.abs().argmax(dim=-1, keepdim=True)
    d = (torch.gather(g, -1, idx).squeeze(-1) / -16.0).half()
    u = torch.round(g / _safe(d.float()).unsqueeze(-1)).add_(16).clamp_(0, 31)
    return _build(u, d, None, 5, group, w.shape)


def quantize_nf4_search(
    w: torch.Tensor, group: int, importance: torch.Tensor | None = None
) -> QuantizedWeight:
    """NF4 codes with a float16 scale per group searched for the least weighted squared error
    (`perfxlm.quant.search.search_levels`); `importance` as for `quantize_int4_search`."""
    g, _ = _groups(w, group)
    imp = None
    if importance is not None:
        k = w.shape[-1]
        if tuple(importance.shape) != (k,):
            raise ValueError(f"importance has shape {tuple(importance.shape)}, expected ({k},)")
        imp = importance.float().reshape(k // group, group)
    u, s = search_levels(g.reshape(-1, group), NF4_LEVELS, imp)
    return _build(u, s, torch.zeros_like(s), 4, group, w.shape, levels=NF4_LEVELS.clone())


def quantize_nf4(w: torch.Tensor, group: int, double_quant: bool = False) -> QuantizedWeight:
    """NF4 codes; `double_quant`: QLoRA's double-quantized absmax (`perfxlm.quant.nf4`), stored as float32
    scales so values equal bitsandbytes'; else the absmax rounded to float16 and codes against it."""
    if double_quant:
        if w.dim() == 3:  # an expert stack: each expert is its own tensor, as bitsandbytes quantizes it
            parts = [quantize_nf4(e, group, True) for e in w]
            return joining.stack_experts(parts)
        g, _ = _groups(w, group)
        absmax = g.abs().amax(dim=-1)
        u = nf4_codes(g, absmax)
        s = double_quantize_absmax(absmax)
        return _build(u, s, torch.zeros_like(s), 4, group, w.shape, levels=NF4_LEVELS.clone())
    g, _ = _groups(w, group)
    s, mins = _to_half_if_exact(g.abs().amax(dim=-1), torch.zeros(g.shape[:-1]))
    normed = g / _safe(s.float()).unsqueeze(-1)
    u = torch.bucketize(normed, _NF4_MIDPOINTS)  # the nearest level (ties to the lower one)
    return _build(u, s, mins, 4, group, w.shape, levels=NF4_LEVELS.clone())
