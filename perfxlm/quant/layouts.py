"""How a `QuantizedWeight` arranges its `codes` and `scales` in memory (`CodeLayout`), each layout one
object that says its shapes, which weights it takes, and how to move a weight's bytes in and out of it.

- PLAIN: row by row, as `perfxlm.quant.weight` describes (what every loader and quantizer produces, and
  what every transform of a weight reads: fusing rows, splits, widening, export).
- ROWS8: row groups (`perfxlm.quant.row_groups`, csrc/row_groups.h): 8 rows' blocks together for the
  int8-dot GEMV, chosen once at load by the CPU plan (`row_groups`) for the weights it takes.
- ROWS8_M: row groups of affine 4-bit codes (GGUF Q4_1: a float16 scale and min per 32), `mins` in the
  same groups as the scales (`perfxlm.quant.row_groups.pack_params`); the plan's ROWS8 stands for it on
  such weights (`members`).
- ROWS8_K: K-quant row groups (`perfxlm.quant.row_groups_k`, csrc/row_groups_k.h): Q4_K / Q5_K / Q6_K
  matrices, the params bytes held in `scales` (uint8 [groups, K / 256, P]), `mins` None. Their GEMV reads
  it at few rows and the int8 GEMM builds its panels from it (the plain layout's bits) at many; the plan's
  `row_groups_k` says which weights take it (every K-quant matrix, or the LM head only).

A layout is a performance choice, never a format: `QuantizedWeight.plain()` gives the same values in the
PLAIN layout, bytes moved only. The native kernels are told the layout explicitly (`native` below: the
`layout` argument of linear_q / quant_block_gemm, the seventh native part), never from shapes.

Adding a layout (say K-quant row groups): one more `CodeLayout` member whose value is a `Layout` object
(its `takes`, `shapes`, `pack`, `unpack`, a new `native` number) and the kernels that read it, reached
where csrc dispatches on that number; the weight's methods, the loader's choice and the tests go through
the member.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from perfxlm.quant import row_groups, row_groups_k

if TYPE_CHECKING:
    from perfxlm.quant.weight import QuantizedWeight


@dataclass(frozen=True)
class Layout:
    """The plain layout: the base every other layout derives from (its methods are the identity)."""

    name: str
    native: int  # the number csrc's kernels take for it (0: plain)

    def takes(self, w: "QuantizedWeight") -> bool:
        return True

    def shapes(self, w: "QuantizedWeight") -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The (codes, scales) shapes `w` must have in this layout; None: the plain rules
        (`QuantizedWeight.__post_init__`)."""
        return None

    def pack(self, w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor]:
        """Plain `w`'s (codes, scales) in this layout."""
        return w.codes, w.scales

    def unpack(self, w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """`w`'s (codes, scales, mins), held in this layout, in the plain one."""
        return w.codes, w.scales, w.mins

    def pack_mins(self, w: "QuantizedWeight") -> torch.Tensor | None:
        """Plain `w`'s mins in this layout (None: the layout holds no mins)."""
        return None

    def mins_shape(self, w: "QuantizedWeight") -> tuple[int, ...] | None:
        """The mins' shape `w` must have in this layout (None: no mins)."""
        return None

    def holds(self, w: "QuantizedWeight") -> bool:
        """Whether `w`'s fields past the shapes (scales dtype, bits, in_features) fit this layout's form;
        QuantizedWeight's check asks it for every layout past PLAIN (uint8 codes, the mins' shape
        (`mins_shape`), no table or input order, it checks itself)."""
        return True

    def narrow_rows(self, w: "QuantizedWeight", start: int, length: int) -> "QuantizedWeight":
        """Output rows [start, start + length) of `w` held in this layout (the plain layout's own rule is
        `QuantizedWeight.narrow_rows`'s; a grouped layout cuts whole groups)."""
        raise NotImplementedError

    def index_rows(self, w: "QuantizedWeight", index: torch.Tensor) -> "QuantizedWeight":
        """Rows `index` of `w` held in this layout, as a plain weight (a lookup reads only them)."""
        raise NotImplementedError


@dataclass(frozen=True)
class GroupsOf8(Layout):
    """What the row-group layouts share: codes and scales lead with groups of 8 output rows, the last
    group padded past out_features."""

    def narrow_rows(self, w: "QuantizedWeight", start: int, length: int) -> "QuantizedWeight":
        end, n, rows = start + length, w.out_features, 8
        if start % rows or (end % rows and end != n) or not 0 <= start <= end <= n:
            raise ValueError(f"rows [{start}, {end}) of a row-group weight: whole groups of {rows} only "
                             "(call plain() first)")
        g0, g1 = start // rows, -(-end // rows)
        dim = w.codes.dim() - 3  # a stack's groups follow its expert dimension
        cut = lambda t: t.narrow(dim, g0, g1 - g0)  # noqa: E731
        return w._like(cut(w.codes), cut(w.scales), None if w.mins is None else cut(w.mins), out_features=length)


@dataclass(frozen=True)
class RowGroups(GroupsOf8):
    """Row groups of 8 (row_groups.py): matrices, and expert stacks (each expert its own groups, after a
    leading expert dimension: `w[e]` is a matrix in row groups)."""

    def takes(self, w: "QuantizedWeight") -> bool:
        return row_groups.takes(w)

    def shapes(self, w: "QuantizedWeight") -> tuple[tuple[int, ...], tuple[int, ...]]:
        groups, blocks = -(-w.out_features // row_groups.ROWS), w.in_features // row_groups.BLOCK
        per = row_groups.ROWS * (row_groups.BLOCK if w.bits == 8 else row_groups.BLOCK // 2)
        lead = tuple(w.codes.shape[:1]) if w.codes.dim() == 4 else ()  # a stack's experts
        return (*lead, groups, blocks, per), (*lead, groups, blocks, row_groups.ROWS)

    def pack(self, w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor]:
        return row_groups.pack(w.codes, w.scales, w.bits)

    def unpack(self, w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return (*row_groups.unpack(w.codes, w.scales, w.bits, w.out_features), None)

    def holds(self, w: "QuantizedWeight") -> bool:
        return w.scales.dtype == torch.float16 and w.bits in (4, 8)

    def index_rows(self, w: "QuantizedWeight", index: torch.Tensor) -> "QuantizedWeight":
        """The rows gathered straight out of the groups into a plain weight (a matrix's: a lookup table)."""
        if w.codes.dim() != 3:
            raise ValueError("index_rows of a stack in row groups: call plain() first")
        groups, blocks, per = w.codes.shape
        g, r = torch.div(index, 8, rounding_mode="floor"), index % 8
        # [G, block, quad, row, 4 bytes] -> per index its row's [block, quad, 4]: the plain row's bytes
        codes = w.codes.view(groups, blocks, per // 32, 8, 4)[g, :, :, r].reshape(len(index), blocks * per // 8)
        return w._like(codes, w.scales[g, :, r], None, layout=CodeLayout.PLAIN, out_features=len(index))


@dataclass(frozen=True)
class RowGroupsK(GroupsOf8):
    """K-quant row groups of 8 (row_groups_k.py): Q4_K, Q5_K, Q6_K matrices; the params bytes in `scales`."""

    def takes(self, w: "QuantizedWeight") -> bool:
        return row_groups_k.takes(w) is not None

    def shapes(self, w: "QuantizedWeight") -> tuple[tuple[int, ...], tuple[int, ...]]:
        groups = -(-w.out_features // row_groups_k.ROWS)
        codes = (groups, w.in_features // row_groups_k.BLOCK, row_groups_k.ROWS * row_groups_k.CODE_BYTES.get(w.bits, 0))
        return codes, (groups, w.in_features // row_groups_k.SB, row_groups_k.PARAM_BYTES.get(w.bits, 0))

    def pack(self, w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor]:
        return row_groups_k.pack(w)

    def unpack(self, w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return row_groups_k.unpack(w.codes, w.scales, row_groups_k.FORMAT_OF_BITS[w.bits], w.out_features)

    def holds(self, w: "QuantizedWeight") -> bool:
        return (w.scales.dtype == torch.uint8 and w.bits in row_groups_k.FORMAT_OF_BITS
                and w.group == (16 if w.bits == 6 else 32) and w.in_features % row_groups_k.SB == 0)  # fmt: skip

    def index_rows(self, w: "QuantizedWeight", index: torch.Tensor) -> "QuantizedWeight":
        """Only the groups the rows are in, unpacked, then the rows taken from them."""
        groups, at = torch.unique(torch.div(index, 8, rounding_mode="floor"), return_inverse=True)
        some = w._like(w.codes.index_select(0, groups), w.scales.index_select(0, groups), None,
                       out_features=len(groups) * 8)
        return some.plain().index_rows(at * 8 + index % 8)


@dataclass(frozen=True)
class RowGroupsAffine(RowGroups):
    """Row groups of affine 4-bit codes (GGUF Q4_1): codes and scales as ROWS8's 4-bit ones, the float16
    mins [G, K / 32, 8] beside the scales (row_groups.py, csrc/row_groups_m.h); matrices only."""

    def takes(self, w: "QuantizedWeight") -> bool:
        return row_groups.takes_affine(w)

    def pack_mins(self, w: "QuantizedWeight") -> torch.Tensor:
        return row_groups.pack_params(w.mins)

    def mins_shape(self, w: "QuantizedWeight") -> tuple[int, ...]:
        return self.shapes(w)[1]

    def unpack(self, w: "QuantizedWeight") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        codes, scales = row_groups.unpack(w.codes, w.scales, w.bits, w.out_features)
        return codes, scales, row_groups.unpack_params(w.mins, w.out_features)

    def holds(self, w: "QuantizedWeight") -> bool:
        return w.scales.dtype == torch.float16 and w.mins is not None and w.mins.dtype == torch.float16 and w.bits == 4

    def index_rows(self, w: "QuantizedWeight", index: torch.Tensor) -> "QuantizedWeight":
        plain = RowGroups.index_rows(self, w, index)
        g, r = torch.div(index, 8, rounding_mode="floor"), index % 8
        return plain._like(plain.codes, plain.scales, w.mins[g, :, r])


class CodeLayout(enum.Enum):
    PLAIN = Layout("plain", 0)
    ROWS8 = RowGroups("rows8", 1)
    ROWS8_K = RowGroupsK("rows8_k", 2)
    ROWS8_M = RowGroupsAffine("rows8_m", 3)

    def __str__(self) -> str:
        return self.value.name


def named(name: str) -> CodeLayout:
    """The layout called `name` (its value's name)."""
    for layout in CodeLayout:
        if layout.value.name == name:
            return layout
    raise ValueError(f"no code layout {name!r}; known: {', '.join(str(x) for x in CodeLayout)}")


def members(layout: CodeLayout) -> tuple[CodeLayout, ...]:
    """The layouts `layout` stands for where a plan names it: row groups of 8 (ROWS8) are ROWS8 for centred
    codes and ROWS8_M for affine ones (one switch, PERFXLM_ROW_INTERLEAVE, for both); any other itself."""
    return (CodeLayout.ROWS8, CodeLayout.ROWS8_M) if layout is CodeLayout.ROWS8 else (layout,)


def for_plan(row_groups: int) -> CodeLayout:
    """The layout the CPU plan's `row_groups` (0 | 8) asks for."""
    return CodeLayout.ROWS8 if row_groups == 8 else CodeLayout.PLAIN


def all_for_plan(row_groups: int, row_groups_k: str) -> tuple[CodeLayout, ...]:
    """The layouts the CPU plan gives every quantized matrix, the first that takes a weight winning (they
    take disjoint formats): `row_groups`' (Q8_0 / Q4_0), and ROWS8_K where `row_groups_k` is "all"."""
    return (for_plan(row_groups), *((CodeLayout.ROWS8_K,) if row_groups_k == "all" else ()))


def few_rows_for_plan(row_groups_k: str) -> CodeLayout:
    """The layout the CPU plan's `row_groups_k` ("all" | "head" | "off") gives weights that take few rows
    (the LM head): ROWS8_K unless "off", else PLAIN."""
    return CodeLayout.PLAIN if row_groups_k == "off" else CodeLayout.ROWS8_K

