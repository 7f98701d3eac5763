"""A fused projection whose parts keep their own formats: `SplitRows`, rows of several `QuantizedWeight`s
one after another (fused QKV, gate|up) held apart, each product run on its own part into its slice of
the one output.

Why: a Q4_K_M file keeps some layers' attn_v in Q6_K beside Q4_K q and k. Joined into one weight
(`joining.cat_rows`), 6-bit parts beside 4-bit ones widen everything to 8-bit codes in groups of 16: on a
Llama-3.2-1B-shaped file the fused QKV of those layers is 9.4 MB instead of ~3.8 MB, read by the plain
layout's kernel. Held apart, q|k stays one Q4_K weight and v one Q6_K weight, each in the K-quant row
groups. Only joins that would widen split (`splits`): parts of one form still join into one weight.

The seam: the loader joins shards with `join_rows` (a QuantizedWeight, or a SplitRows where forms mix);
`layout_choice` puts each part in its own layout (`map`); the quantized linear methods run each part's
product (`QuantizedLinearMethod.multiply`) and the fused decode layer hands csrc `project` every part's
eight native parts in a row (`native_parts`), which it runs part by part, concatenating the columns.
Both paths run the same `linear_q` call per part, so they give the same bits.

PERFXLM_SPLIT_JOINS=0 joins every mix into one widened weight (the form before this one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from perfxlm.quant import joining
from perfxlm.quant.weight import ActivationMode, QuantizedWeight

SPLIT_ENV = "PERFXLM_SPLIT_JOINS"


def split_enabled() -> bool:
    return os.environ.get(SPLIT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _form(w: QuantizedWeight) -> tuple:
    return (w.bits, w.group, w.scales.dtype, w.centred, w.two_level, w.levels is None, w.mins is None)


def splits(parts: Sequence[QuantizedWeight]) -> bool:
    """Whether joining `parts` into one weight would widen some: 6-bit codes beside other widths (8-bit
    codes in groups of 16 for all of them). Only plain matrices in order (no act-order, no stacks)."""
    if len(parts) < 2 or any(p.input_order is not None or p.num_experts is not None for p in parts):
        return False
    six = [p.bits == 6 for p in parts]
    return any(six) and not all(six)


def join_rows(parts: Sequence[QuantizedWeight]) -> "QuantizedWeight | SplitRows":
    """Rows of `parts` one after the other: one weight (`joining.cat_rows`) unless that would widen them
    (`splits`) and PERFXLM_SPLIT_JOINS allows, then a SplitRows of runs of neighbouring parts of one
    form, each run joined (q|k one Q4_K weight, v a Q6_K one)."""
    if not split_enabled() or not splits(parts):
        return joining.cat_rows(parts)
    runs: list[list[QuantizedWeight]] = []
    for p in parts:
        if runs and _form(runs[-1][-1]) == _form(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return SplitRows(tuple(joining.cat_rows(r) if len(r) > 1 else r[0] for r in runs))


@dataclass(eq=False)
class SplitRows:
    """Rows of `parts` one after another, each part its own quantized weight (own format, own layout)."""

    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError("SplitRows: at least two parts")
        if any(not isinstance(p, QuantizedWeight) for p in self.parts):
            raise ValueError("SplitRows: every part must be a QuantizedWeight")
        k = self.parts[0].in_features
        if any(p.in_features != k for p in self.parts):
            raise ValueError(f"SplitRows: parts differ in in_features: {[p.in_features for p in self.parts]}")
        if any(p.num_experts is not None or p.input_order is not None for p in self.parts):
            raise ValueError("SplitRows: parts must be matrices whose columns are the inputs in order")
        if len({p.act for p in self.parts}) > 1:
            raise ValueError(f"SplitRows: parts differ in activation handling: {[p.act for p in self.parts]}")

    # ---- what callers read of a weight ---------------------------------------------------------------
    @property
    def pieces(self) -> tuple[QuantizedWeight, ...]:
        return self.parts

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def act(self) -> str:
        return self.parts[0].act

    @property
    def activations(self) -> ActivationMode:
        modes = {p.activations for p in self.parts}
        if len(modes) != 1:
            raise ValueError(f"SplitRows: parts differ in activation mode: {sorted(map(str, modes))}")
        return modes.pop()

    @property
    def input_order(self) -> None:
        return None

    @property
    def num_experts(self) -> None:
        return None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def offsets(self) -> list[int]:
        """Each part's first output row, and out_features last."""
        out = [0]
        for p in self.parts:
            out.append(out[-1] + p.out_features)
        return out

    def describe(self) -> str:
        return "split[" + " | ".join(p.describe() for p in self.parts) + "]"

    def __repr__(self) -> str:
        return f"SplitRows({tuple(self.shape)}, {self.describe()}, {self.nbytes} bytes)"

    def use_activations(self, mode: ActivationMode, where: str = "a weight") -> None:
        for i, p in enumerate(self.parts):
            p.use_activations(mode, f"{where} part {i}")

    def map(self, fn: Callable[[QuantizedWeight], QuantizedWeight]) -> "SplitRows":
        """Every part through `fn` (a layout choice, plain())."""
        return SplitRows(tuple(fn(p) for p in self.parts))

    def plain(self) -> "SplitRows":
        return self.map(lambda p: p.plain())

    def ordered_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    # ---- values ----------------------------------------------------------------------------------------
    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts], 0)

    def dense(self) -> torch.Tensor:
        return self.dequantize()

    def joined(self) -> QuantizedWeight:
        """The one widened weight `joining.cat_rows` would have made (for consumers of one weight)."""
        return joining.cat_rows([p.plain() for p in self.parts])

    def native_parts(self) -> list[torch.Tensor]:
        """Every part's eight native parts one after another (csrc `project`: more than eight, a multiple
        of eight, is a split weight; the plain layout says itself as layout 0)."""
        out: list[torch.Tensor] = []
        for p in self.parts:
            out += eight_parts(p)
        return out

    def biases(self, bias: torch.Tensor | None) -> list[torch.Tensor | None]:
        """`bias` [N] cut into each part's slice."""
        if bias is None:
            return [None] * len(self.parts)
        at = self.offsets
        return [bias[at[i]:at[i + 1]] for i in range(len(self.parts))]


def eight_parts(w: QuantizedWeight) -> list[torch.Tensor]:
    """`w.native_parts()` in the eight-part form whatever its layout: [..., order (empty), layout, out_features]."""
    parts = w.native_parts()
    if len(parts) == 8:
        return parts
    empty = torch.empty(0, dtype=torch.long)
    return [*parts[:5], parts[5] if len(parts) == 6 else empty, torch.tensor(w.layout.value.native, dtype=torch.int64),
            torch.tensor(w.out_features, dtype=torch.int64)]


def pieces(value: Any) -> tuple[QuantizedWeight, ...]:
    """The QuantizedWeights `value` holds: itself, a SplitRows' parts, or none (a tensor)."""
    if isinstance(value, QuantizedWeight):
        return (value,)
    return value.parts if isinstance(value, SplitRows) else ()


def is_quantized(value: Any) -> bool:
    """A QuantizedWeight or a SplitRows of them: what a quantized linear method runs."""
    return isinstance(value, (QuantizedWeight, SplitRows))
