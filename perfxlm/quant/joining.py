"""Joining quantized weights: parts promoted losslessly to one form (`common_form`), rows of several
weights one after another (`cat_rows`: fused QKV, gate|up, padding rows), expert matrices stacked into one
[E, N, K] weight (`stack_experts`). Plain layout only: a layout is chosen after every join, at load's end.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from perfxlm.quant.weight import BLOCK4, QuantizedWeight, same_levels


def common_form(parts: Sequence["QuantizedWeight"]) -> list["QuantizedWeight"]:
    """`parts` promoted losslessly to one form: 8-bit codes if any part has 8 or the common group
    cannot hold 4-bit blocks, else the widest of 4 and 5 bits the parts have; the greatest common
    group, float32 scales if any part has them."""
    if not parts:
        raise ValueError("no parts")
    for p in parts:
        p._plain_only("common_form (cat_rows, stack)")
    k = parts[0].in_features
    if any(p.in_features != k for p in parts):
        raise ValueError(f"parts differ in in_features: {[p.in_features for p in parts]}")
    acts = {p.act for p in parts}
    if len(acts) > 1:
        raise ValueError(f"parts differ in activation handling: {sorted(acts)}")
    levels = [p.levels for p in parts]
    if any(lv is not None for lv in levels) and not all(
        lv is not None and same_levels(lv, levels[0]) for lv in levels
    ):
        raise ValueError("parts mix level tables and affine codes; no common form")
    same_form = len({(p.bits, p.group, p.scales.dtype, p.centred) for p in parts}) == 1
    if same_form and (all(p.two_level for p in parts) or all(p.exponent_scales for p in parts)):
        return list(parts)  # one byte-scaled form: rows concatenate as they are
    parts = [p.flat() for p in parts]
    group = math.gcd(*(p.group for p in parts))
    # 6-bit parts beside others take 8 (the form a fused Q6_K part had before 6-bit codes: its int8
    # block GEMV at groups of 16); so do groups finer than whole 32-blocks
    six_mixed = any(p.bits == 6 for p in parts) and any(p.bits != 6 for p in parts)
    bits = 8 if any(p.bits == 8 for p in parts) or six_mixed else max(p.bits for p in parts)
    if group % (BLOCK4 // 2 if bits == 6 else BLOCK4):
        bits = 8
    if bits == 8 and levels[0] is not None and any(p.bits == 4 for p in parts):
        raise ValueError("level-table (NF4) parts cannot be widened to 8-bit codes; no common form")
    if len({p.centred for p in parts}) > 1:  # centred beside stored mins: store them all
        parts = [p.with_mins() for p in parts]
    dtype = torch.float32 if any(p.scales.dtype == torch.float32 for p in parts) else torch.float16
    out = []
    for p in parts:
        p = p.widened(bits)
        out.append(p.regrouped(group).with_scale_dtype(dtype))
    return out

def cat_rows(parts: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
    """Rows of `parts` one after the other (fused QKV, gate|up), promoted to a common form first."""
    orders = [p.input_order for p in parts]
    if any(o is not None for o in orders) and not all(
        o is not None and torch.equal(o, orders[0]) for o in orders
    ):
        raise ValueError(
            "parts differ in input order (act-order permutations); they multiply one input, so a "
            "fused weight needs one order for all of them"
        )
    parts = common_form(parts)
    if len(parts) == 1:
        return parts[0]
    dim = parts[0].codes.dim() - 2
    first = parts[0]
    return first._like(
        torch.cat([p.codes for p in parts], dim), torch.cat([p.scales for p in parts], dim),
        None if first.mins is None else torch.cat([p.mins for p in parts], dim),
    )  # fmt: skip

def stack_experts(experts: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
    """Expert weights [N, K] each -> one stack [E, N, K], promoted to a common form first."""
    experts = common_form(experts)
    if any(e.num_experts is not None for e in experts):
        raise ValueError("only single matrices can be stacked")
    if len({e.out_features for e in experts}) != 1:
        raise ValueError("experts differ in out_features")
    first = experts[0]
    order = None  # each expert its own act-order (its own inputs' statistics), [E, K]
    if any(e.input_order is not None for e in experts):
        natural = torch.arange(first.in_features)
        order = torch.stack([natural if e.input_order is None else e.input_order for e in experts])
    return first._like(
        torch.stack([e.codes for e in experts]), torch.stack([e.scales for e in experts]),
        None if first.mins is None else torch.stack([e.mins for e in experts]), input_order=order,
    )  # fmt: skip
