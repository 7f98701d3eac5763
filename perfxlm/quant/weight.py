"""`QuantizedWeight`: one affine form every quantized weight format maps onto without loss.

A weight matrix [N, K] (or a stack of expert matrices [E, N, K]) is stored as
- `codes`, uint8: bits=8: [N, K], one code u (0..255) per weight; bits=4: [N, K // 2], GGUF Q4_0's
  nibble layout: within each 32-element block b of a row, byte j (j < 16) of the block's 16 bytes holds
  element 32b + j in its low nibble and element 32b + 16 + j in its high nibble; bits=5: [N, 5 K // 8],
  each row the 4-bit layout of the low four bits (K // 2 bytes) followed by a plane of the fifth bits
  (K // 8 bytes, a 32-block's four bytes read as one little-endian word, its bits in the order
  `code_layout.PLANE_BIT` gives, which AVX2 unpacks with shifts), u = low + 16 x fifth (0..31); bits=6: [N, 3 K // 4],
  the 5-bit layout followed by a second plane of sixth bits (K // 8 bytes, in the fifth plane's order),
  u = low + 16 x fifth + 32 x sixth (0..63): GGUF Q6_K's values, read by the 4- and 5-bit kernels plus one
  more plane's unpack;
- `scales`, `mins`: both float32 or both float16, [N, K // group], contiguous; or GGUF K-quants'
  two-level form (`perfxlm.quant.super_scales`): bytes [N, K // group + 2 K // 256], a small integer per
  group then a float16 factor per 256 weights; or, for a level table (MXFP4), power-of-two bytes
  (torch.float8_e8m0fnu [N, K // group], 2^(byte - 127)); `mins` None for centred
  codes (Q4_0, Q8_0, symmetric int4 / int8, NF4), whose min is implied: -8 x scale for 4-bit codes,
  -128 x scale for 8-bit ones, 0 with a level table. Not storing it is what lets a 4-bit decode stream
  4.5 bits per weight instead of 5;
- `levels`: None, or float32 [2 ** bits]: a table of values the codes index (NF4's 16 NormalFloat
  levels; the 256 values of FP8 e4m3 bytes, a pre-quantized checkpoint's FP8 weights kept as they are);
- `input_order`: None, or int64 [K] ([E, K] for a stack): the codes' columns are the weight's input channels in this order
  (GPTQ's act-order: groups are contiguous runs of that order), so a product takes x[..., input_order].

The value of the weight in codes column k is `scales[n, k // group] * u + mins[n, k // group]`, or with
levels `scales[...] * levels[u] + mins[...]`, computed in float32 as a multiply then an add (two
roundings); centred codes: `scales[...] * (u - centre)` (or `* levels[u]`), one rounding; `dequantize()` gives that matrix, `dense()` the weight as the model sees it (the columns put
back where `input_order` says).
`act` says how the activations meet it: "float" (weight-only: activations stay float32), "int8" (W8A8:
activations quantized per token at run time, one scale per row) or "int8_block" (W8A8 with one scale
per token per block of 32 activations, llama.cpp's Q8 activations: far fewer small activations lost
beside an outlier channel); see `perfxlm.quant.reference` for both rules. A weight-only weight may
still have its activations rounded to int8 blocks at run time, as llama.cpp does for all its formats:
`activations` (an `ActivationMode`, put on it at load from the engine's `quant_activations`) says so.

Stacks carry a leading expert dimension on codes, scales and mins; `w[e]` is one expert's weight.

`layout` (a `perfxlm.quant.layouts.CodeLayout`) says how codes and scales sit in memory: PLAIN as above,
or ROWS8 / ROWS8_M / ROWS8_K (row groups: perfxlm/quant/row_groups.py, row_groups_k.py) for the int8-dot GEMVs,
chosen at load. `plain()` gives
the same weight in the plain layout; methods that take only that layout say so (ValueError) rather than
read row groups as rows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from perfxlm.quant import super_scales
from perfxlm.quant.layouts import CodeLayout, members
from perfxlm.quant.code_layout import (  # noqa: F401  (the layout's names, as callers import them from here)
    BLOCK4, pack_codes, pack_fives, pack_nibbles, pack_sixes, unpack_fives, unpack_nibbles, unpack_sixes)

ACTS = ("float", "int8", "int8_block")
ACT_BLOCK = 32  # activations per scale under act="int8_block"
BITS = (4, 5, 6, 8)  # code widths
EXPONENT = torch.float8_e8m0fnu  # scales held as power-of-two bytes (MXFP4's E8M0), 2^(byte - 127)


class ActivationMode(enum.Enum):
    """What a product with a quantized weight does to its float32 activations (the engine's
    `quant_activations`, resolved once per model by `perfxlm.quant.config.resolve_activations`)."""

    FLOAT = "float32"  # kept float32: weight-only, exact to float summation order
    # int8 blocks of 32 where the native block GEMV takes the weight (an int8-dot build, a layout it has:
    # llama.cpp's scheme, faster than widening codes), float32 elsewhere: never slower than FLOAT
    INT8_NATIVE = "int8_native"
    # int8 blocks of 32 on every path: the kernel's, else rounded in torch the same way (W8A8's blocks)
    INT8 = "int8"

    def __str__(self) -> str:
        return self.value


def _format_activations(act: str, mode: ActivationMode) -> ActivationMode:
    """The mode a weight of format `act` runs under when `mode` is asked: W8A8 with blocks always rounds
    them; W8A8 per token quantizes whole rows itself, so no blocks on top."""
    if act == "int8_block":
        return ActivationMode.INT8
    if act == "int8":
        return ActivationMode.FLOAT
    return mode


def _pick(mins: torch.Tensor | None, fn: Any) -> torch.Tensor | None:
    """fn(mins) for stored mins; centred codes (None) stay centred."""
    return None if mins is None else fn(mins)


def same_levels(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal level tables (FP8's has NaN entries, for codes no weight uses)."""
    return a is b or (a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all()))


@dataclass(eq=False)
class QuantizedWeight:
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    levels: torch.Tensor | None
    bits: int
    group: int
    act: str
    out_features: int
    in_features: int
    # Not part of the stored format either: whether products round the activations to int8 blocks, put
    # here at load (`use_activations`); a W8A8 weight's own `act` decides for it.
    activations: ActivationMode = ActivationMode.FLOAT
    # Input channel of each codes column (GPTQ act-order), or None: the columns are the inputs in order.
    input_order: torch.Tensor | None = None
    # How codes and scales are arranged (layouts.py): PLAIN as the module docstring says, or row groups.
    layout: CodeLayout = CodeLayout.PLAIN

    def __post_init__(self) -> None:
        if self.layout is not CodeLayout.PLAIN:
            return self._check_layout()
        n, k, g = self.out_features, self.in_features, self.group
        if self.bits not in BITS:
            raise ValueError(f"QuantizedWeight: bits={self.bits}; supported: {', '.join(map(str, BITS))}.")
        if self.act not in ACTS:
            raise ValueError(f"QuantizedWeight: act={self.act!r}; supported: {', '.join(ACTS)}.")
        if g < 1 or k % g:
            raise ValueError(f"QuantizedWeight: group {g} does not divide in_features {k}.")
        if self.bits != 8 and (k % BLOCK4 or g % self.min_group):
            raise ValueError(
                f"QuantizedWeight: {self.bits}-bit codes need in_features ({k}) multiples of {BLOCK4} and group "
                f"({g}) multiples of {self.min_group}."
            )
        lead = tuple(self.codes.shape[:-2])
        if len(lead) > 1:
            raise ValueError(f"QuantizedWeight: codes {tuple(self.codes.shape)}: expected 2 or 3 dims")
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (*lead, n, k * self.bits // 8):
            raise ValueError(
                f"QuantizedWeight: codes {self.codes.dtype} {tuple(self.codes.shape)}, expected uint8 "
                f"{(*lead, n, k * self.bits // 8)}."
            )
        if super_scales.is_super(self.scales) or super_scales.is_super(self.mins):
            self._check_super(lead)
            return self._finish()
        want = (*lead, n, k // g)
        for name in ("scales", "mins"):
            t = getattr(self, name)
            if t is None and name == "mins":
                continue
            ok = tuple(t.shape) == want and t.dtype in (torch.float32, torch.float16, EXPONENT) and t.is_contiguous()
            if not ok:
                raise ValueError(
                    f"QuantizedWeight: {name} {t.dtype} {tuple(t.shape)}, expected contiguous float32 or "
                    f"float16 {want} (or {EXPONENT} scales of a level table)."
                )
        if self.scales.dtype == EXPONENT and (self.mins is not None or self.levels is None or self.bits != 4):
            raise ValueError(f"QuantizedWeight: {EXPONENT} scales take centred 4-bit codes into a level table (MXFP4).")
        if self.mins is not None and self.scales.dtype != self.mins.dtype:
            raise ValueError("QuantizedWeight: scales and mins must share one dtype.")
        lv = self.levels
        if lv is not None and self.bits in (5, 6):
            raise ValueError(f"QuantizedWeight: {self.bits}-bit codes take no level table (affine codes only).")
        if lv is not None and (lv.dtype != torch.float32 or tuple(lv.shape) != (1 << self.bits,)):
            raise ValueError(f"QuantizedWeight: levels must be float32 [{1 << self.bits}] for {self.bits}-bit codes.")
        order = self.input_order
        if order is not None and (order.dtype != torch.int64 or tuple(order.shape) != (*lead, k)):
            raise ValueError(f"QuantizedWeight: input_order must be int64 {[*lead, k]} (in_features).")
        if self.act != "float" and (self.bits != 8 or self.levels is not None):
            raise ValueError("QuantizedWeight: int8 activations need 8-bit affine codes (no levels).")
        if self.act == "int8_block" and k % ACT_BLOCK:
            raise ValueError(f"QuantizedWeight: int8 activation blocks need in_features ({k}) a multiple of {ACT_BLOCK}.")
        self._finish()

    def _finish(self) -> None:
        if not self.codes.is_contiguous():
            self.codes = self.codes.contiguous()
        self.activations = _format_activations(self.act, self.activations)

    def _check_layout(self) -> None:
        """A non-plain layout: the weight it was packed from must be one the layout takes (checked by
        in_layout), codes and scales must have the layout's shapes, and the layout must hold the rest
        (`Layout.holds`: scales dtype, bits, in_features)."""
        want = self.layout.value.shapes(self)
        got = (tuple(self.codes.shape), tuple(self.scales.shape))
        mins = None if self.mins is None else tuple(self.mins.shape)
        if (self.codes.dtype != torch.uint8 or got != want or not self.layout.value.holds(self)
                or mins != self.layout.value.mins_shape(self) or self.levels is not None
                or self.input_order is not None or self.act != "float"):  # fmt: skip
            raise ValueError(f"QuantizedWeight: {self.layout} layout wants uint8 codes and scales {want} in its "
                             f"form ({self.bits}-bit codes, {self.scales.dtype} scales), mins "
                             f"{self.layout.value.mins_shape(self)}, no table or input order; got {got}, mins {mins}.")
        self._finish()
        if self.activations is ActivationMode.FLOAT:
            raise ValueError(f"QuantizedWeight: the {self.layout} layout's products round activations to int8 "
                             "blocks; a weight whose activations stay float32 keeps the plain layout.")

    def _plain_only(self, what: str) -> None:
        """ValueError for a method that reads the plain layout, called on another."""
        if self.layout is not CodeLayout.PLAIN:
            raise ValueError(f"QuantizedWeight.{what} reads the plain layout; this weight is in {self.layout}: "
                             "call plain() first.")

    # ---- layouts -------------------------------------------------------------------------------------
    def in_layout(self, layout: CodeLayout) -> "QuantizedWeight":
        """The same weight with its codes and scales in `layout` (bytes moved only; self if already)."""
        if layout is self.layout:
            return self
        w = self.plain()
        if not layout.value.takes(w):
            raise ValueError(f"the {layout} layout does not take {w!r}")
        codes, scales = layout.value.pack(w)
        return w._like(codes, scales, layout.value.pack_mins(w), layout=layout, out_features=w.out_features)

    def in_row_groups(self) -> "QuantizedWeight":
        """In row groups of 8: ROWS8 for centred codes, ROWS8_M for affine ones (Q4_1)."""
        w = self.plain()
        return self.in_layout(next((m for m in members(CodeLayout.ROWS8) if m.value.takes(w)), CodeLayout.ROWS8))

    def plain(self) -> "QuantizedWeight":
        """The same weight in the plain layout (self where it is)."""
        if self.layout is CodeLayout.PLAIN:
            return self
        codes, scales, mins = self.layout.value.unpack(self)
        return self._like(codes, scales, mins, layout=CodeLayout.PLAIN, out_features=self.out_features)

    def _check_super(self, lead: tuple[int, ...]) -> None:
        """Two-level (K-quant) scales: bytes of the one row layout, affine codes, float activations."""
        k, g = self.in_features, self.group
        if k % super_scales.SUPER_BLOCK or super_scales.SUPER_BLOCK % g:
            raise ValueError(f"QuantizedWeight: two-level scales need in_features ({k}) a multiple of "
                             f"{super_scales.SUPER_BLOCK} and a group ({g}) dividing it.")
        want = (*lead, self.out_features, super_scales.row_bytes(k, g))
        for name, dtypes in (("scales", super_scales.BYTE_DTYPES), ("mins", (torch.uint8,))):
            t = getattr(self, name)
            if t is None and name == "mins":
                continue
            if tuple(t.shape) != want or t.dtype not in dtypes or not t.is_contiguous():
                raise ValueError(f"QuantizedWeight: two-level {name} {t.dtype} {tuple(t.shape)}, expected "
                                 f"contiguous {' or '.join(map(str, dtypes))} {want}.")
        if self.levels is not None or self.input_order is not None or self.act != "float":
            raise ValueError("QuantizedWeight: two-level scales take affine codes, in order, float activations.")

    def use_activations(self, mode: ActivationMode, where: str = "a weight") -> None:
        """Take the model's activation mode (a W8A8 weight keeps the rounding its format names).
        ValueError where int8 blocks of 32 do not fit the input size (`where` names the weight)."""
        mode = _format_activations(self.act, mode)
        if mode is ActivationMode.FLOAT and self.layout is not CodeLayout.PLAIN:
            raise ValueError(f"{where}: float32 activations on a {self.layout} weight (its products round them "
                             "to int8 blocks): take plain() first.")
        if mode is ActivationMode.INT8:
            self.check_activation_blocks(self.in_features, where)
        self.activations = mode

    @staticmethod
    def check_activation_blocks(in_features: int, where: str) -> None:
        """ValueError unless int8 activation blocks of 32 divide `in_features` (of weight `where`)."""
        if in_features % ACT_BLOCK:
            raise ValueError(
                f"quant_activations='int8' rounds activations in blocks of {ACT_BLOCK}, which do not divide "
                f"the input size {in_features} of {where}; supported for this model: "
                "quant_activations='auto' or 'float32'."
            )

    # ---- centred codes -------------------------------------------------------------------------------
    @property
    def min_group(self) -> int:
        """The smallest group the code width takes: whole 32-blocks for 4- and 5-bit codes; 6-bit codes
        (Q6_K's) a half block, each half of a 32-block being one nibble half the kernels unpack; 8-bit 1."""
        return {4: BLOCK4, 5: BLOCK4, 6: BLOCK4 // 2}.get(self.bits, 1)

    @property
    def centred(self) -> bool:
        """Whether the mins are implied (-centre x scale) rather than stored."""
        return self.mins is None

    @property
    def centre(self) -> int:
        """The code a centred weight's zero sits at: 8 (4-bit), 16 (5-bit), 128 (8-bit), 0 with a level
        table."""
        return 0 if self.levels is not None else 1 << (self.bits - 1)

    @property
    def exponent_scales(self) -> bool:
        """Whether the scales are one power-of-two byte per group (MXFP4's E8M0, `quant/mxfp4.py`)."""
        return self.scales.dtype == EXPONENT

    @property
    def two_level(self) -> bool:
        """Whether the scales are GGUF K-quants' two-level bytes (`super_scales`), not floats (in the plain
        layout: K-quant row groups hold other bytes, the layout's params)."""
        return self.layout is CodeLayout.PLAIN and super_scales.is_super(self.scales)

    @property
    def kquant(self) -> bool:
        """Whether this is a K-quant weight (two-level scales, plain or in K-quant row groups): under ggml's
        activation rule its int8 activations are q8_K, a scale per 256 (perfxlm.quant.act_blocks)."""
        return self.two_level or self.layout is CodeLayout.ROWS8_K

    @property
    def groups(self) -> int:
        return self.in_features // self.group

    def float_scales(self) -> torch.Tensor:
        """The scales as float32 [..., N, K // group]."""
        self._plain_only("float_scales")
        if self.two_level:
            return super_scales.expand(self.scales, self.groups)
        return self.scales.float()

    def full_mins(self) -> torch.Tensor:
        """The mins as float32, stored or implied."""
        self._plain_only("full_mins")
        if self.mins is not None:
            return super_scales.expand(self.mins, self.groups).neg_() if self.two_level else self.mins.float()
        return self.float_scales() * float(-self.centre)

    def flat(self) -> "QuantizedWeight":
        """The same values with one float32 scale (and min) per group: two-level scales multiplied out,
        exponent bytes widened (what the paths that do not read them take); any other weight as it is."""
        if self.exponent_scales:
            return self._like(self.codes, self.float_scales(), None)
        if not self.two_level:
            return self
        return self._like(self.codes, self.float_scales(), None if self.mins is None else self.full_mins())

    def with_mins(self) -> "QuantizedWeight":
        """The same values with the mins stored (float32 scales too where -centre x scale leaves float16)."""
        self._plain_only("with_mins")
        if self.two_level or self.exponent_scales:
            return self.flat().with_mins()
        if self.mins is not None:
            return self
        mins = self.scales * float(-self.centre)
        if not torch.isfinite(mins).all() and torch.isfinite(self.scales).all():
            return self._like(self.codes, self.scales.float(), self.full_mins())
        return self._like(self.codes, self.scales, mins)

    # ---- shape ---------------------------------------------------------------------------------------
    def native_parts(self) -> list[torch.Tensor]:
        """The tensors the native products take (csrc `project`, `moe_experts`): [codes, scales, mins
        (empty: centred codes), levels (empty: none), act_int8 (0-dim bool)], and an act-order weight's
        `input_order` sixth (int64 [K], [E, K] for a stack): the product takes x's columns in that order."""
        empty = torch.empty(0)
        parts = [self.codes, self.scales, self.mins if self.mins is not None else empty,
                 self.levels if self.levels is not None else empty, torch.tensor(self.act == "int8")]
        if self.layout is not CodeLayout.PLAIN:  # [..., order (empty: none), layout, out_features]
            order = empty.long() if self.input_order is None else self.input_order
            return [*parts, order, torch.tensor(self.layout.value.native, dtype=torch.int64),
                    torch.tensor(self.out_features, dtype=torch.int64)]
        return parts if self.input_order is None else [*parts, self.input_order]

    def ordered_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] with its columns in the codes' order: x[..., input_order] (GPTQ act-order), else x
        itself. The one place a torch-side product meets an input order (csrc `project` is the native
        one); a matrix's only, a stack's experts each take their own (`w[e]`)."""
        if self.input_order is None:
            return x
        if self.input_order.dim() != 1:
            raise ValueError("a stack's experts each have their own input order: take one (w[e]) first")
        return x.index_select(-1, self.input_order)

    @property
    def kernel_levels(self) -> bool:
        """Whether the native kernels take this weight's codes: affine codes, or a 16-level table on
        4-bit codes (a 256-level table, FP8 bytes, runs the plain-torch product)."""
        return self.levels is None or self.bits == 4

    @property
    def num_experts(self) -> int | None:
        # codes: [(E,) N, bytes] plain; [(E,) groups, blocks, bytes] in a row-group layout
        matrix_dims = 2 if self.layout is CodeLayout.PLAIN else 3
        return self.codes.shape[0] if self.codes.dim() == matrix_dims + 1 else None

    @property
    def shape(self) -> torch.Size:
        lead = () if self.num_experts is None else (self.num_experts,)
        return torch.Size((*lead, self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype `dequantize` returns."""
        return torch.float32

    @property
    def nbytes(self) -> int:
        extra = 0 if self.levels is None else self.levels.numel() * 4
        extra += 0 if self.input_order is None else self.input_order.numel() * 8
        stored = (self.codes, self.scales) if self.mins is None else (self.codes, self.scales, self.mins)
        return sum(t.numel() * t.element_size() for t in stored) + extra

    def describe(self) -> str:
        fmt = f"u{self.bits}" if self.levels is None else ("nf4" if self.bits == 4 else "fp8")
        if self.levels is not None and self.bits == 4 and float(self.levels[7]) == 12.0:
            fmt = "mxfp4"  # E2M1 doubled (quant/mxfp4.py): its positive half ends at 12, NF4's at 1
        if self.centred and self.levels is None:
            fmt = f"s{self.bits}"  # signed: centred codes
        if self.input_order is not None:
            fmt += " act-order"
        group = "channel" if self.group == self.in_features else f"g{self.group}"
        act = {"float": "", "int8": " a8", "int8_block": " a8/32"}[self.act]
        if self.act == "float" and self.activations is not ActivationMode.FLOAT:
            act = " a8/32" if self.activations is ActivationMode.INT8 else " a8/32 where native"
        scales = str(self.scales.dtype).removeprefix('torch.')
        if self.two_level:
            scales += f" x float16/{super_scales.SUPER_BLOCK}"
        layout = "" if self.layout is CodeLayout.PLAIN else f" {self.layout}"
        return f"{fmt} {group} {scales}{act}{layout}"

    def __repr__(self) -> str:
        return f"QuantizedWeight({tuple(self.shape)}, {self.describe()}, {self.nbytes} bytes)"

    def _like(
        self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, **changes: Any
    ) -> "QuantizedWeight":
        rows = codes.shape[-2] if self.layout is CodeLayout.PLAIN else self.out_features  # groups: not rows
        fields = dict(levels=self.levels, bits=self.bits, group=self.group, act=self.act,
                      out_features=rows, in_features=self.in_features,
                      activations=self.activations,
                      input_order=self.input_order, layout=self.layout)  # fmt: skip
        fields.update(changes)
        return QuantizedWeight(codes, scales.contiguous(), None if mins is None else mins.contiguous(), **fields)

    # ---- values --------------------------------------------------------------------------------------
    def unpacked_codes(self) -> torch.Tensor:
        """One uint8 code per weight, [..., N, K]."""
        self._plain_only("unpacked_codes")
        if self.bits == 4:
            return unpack_nibbles(self.codes)
        if self.bits == 6:
            return unpack_sixes(self.codes)
        return unpack_fives(self.codes) if self.bits == 5 else self.codes

    def dequantize(self) -> torch.Tensor:
        """float32 [..., N, K]: scales * u (or levels[u]) + mins, the reference every kernel is held to."""
        if self.layout is not CodeLayout.PLAIN:
            return self.plain().dequantize()
        if self.two_level:
            return self.flat().dequantize()
        u = self.unpacked_codes()
        lead = u.shape[:-1]
        if self.levels is not None:  # int32 indices: a third of the time of int64 ones (measured)
            values = self.levels.index_select(0, u.reshape(-1).int()).view(u.shape)
        else:
            values = u.float()
        values = values.view(*lead, -1, self.group)
        if self.mins is None:
            if self.levels is None:
                values.sub_(float(self.centre))
            values.mul_(self.scales.float().unsqueeze(-1))
        else:
            values.mul_(self.scales.float().unsqueeze(-1)).add_(self.mins.float().unsqueeze(-1))
        return values.view(*lead, self.in_features)

    def dense(self) -> torch.Tensor:
        """float32 [..., N, K]: the weight as the model multiplies by it (`dequantize()` with its columns
        put back in input order where `input_order` is set)."""
        values = self.dequantize()
        if self.input_order is None:
            return values
        index = self.input_order.unsqueeze(-2).expand_as(values)
        return torch.empty_like(values).scatter_(-1, index, values)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` dequantized, float32 [*ids.shape, K]: a table lookup that never widens the table."""
        flat = ids.reshape(-1)
        return self.index_rows(flat).dequantize().view(*ids.shape, self.in_features)

    # ---- rows ----------------------------------------------------------------------------------------
    def __getitem__(self, expert: int) -> "QuantizedWeight":
        if self.num_experts is None:
            raise TypeError("only a stack of expert weights can be indexed")
        order = None if self.input_order is None else self.input_order[expert]
        # (a stack in row groups: the expert's groups, a matrix in the same layout)
        return self._like(self.codes[expert], self.scales[expert], _pick(self.mins, lambda m: m[expert]),
                          input_order=order)

    def narrow_rows(self, start: int, length: int) -> "QuantizedWeight":
        """Output rows [start, start + length) (views where the storage allows; row groups: whole groups,
        the last one may end at out_features)."""
        if self.layout is not CodeLayout.PLAIN:
            return self.layout.value.narrow_rows(self, start, length)
        dim = self.codes.dim() - 2
        return self._like(
            self.codes.narrow(dim, start, length), self.scales.narrow(dim, start, length),
            _pick(self.mins, lambda m: m.narrow(dim, start, length)),
        )  # fmt: skip

    def narrow_columns(self, start: int, length: int) -> "QuantizedWeight":
        """Input columns [start, start + length): whole groups only (a tensor-parallel rank's share of a
        row-parallel weight). Codes move as bytes: a 4-bit group (a multiple of 32 values, GGUF's nibble
        order within each 32) is whole bytes."""
        self._plain_only("narrow_columns")
        if self.input_order is not None:
            raise ValueError("act-order weights (input_order) cannot be split by input columns")
        if start % self.group or length % self.group:
            raise ValueError(f"columns [{start}, {start + length}) of a weight with groups of {self.group} inputs: "
                             "a split must fall on group boundaries")
        if self.two_level:  # whole super-blocks keep the form; a finer cut takes the float scales
            if start % super_scales.SUPER_BLOCK or length % super_scales.SUPER_BLOCK:
                return self.flat().narrow_columns(start, length)
            cut = lambda t: super_scales.narrow(t, self.groups, self.group, start, length)  # noqa: E731
            codes = self._column_codes(start, length)
            return self._like(codes, cut(self.scales), _pick(self.mins, cut), in_features=length)
        codes = self._column_codes(start, length)
        g0, gn = start // self.group, length // self.group
        return self._like(
            codes.contiguous(), self.scales.narrow(-1, g0, gn),
            _pick(self.mins, lambda m: m.narrow(-1, g0, gn)), in_features=length,
        )  # fmt: skip

    def _column_codes(self, start: int, length: int) -> torch.Tensor:
        """The codes of input columns [start, start + length) (whole 32-blocks), contiguous."""
        if self.bits in (5, 6):  # nibbles then one or two bit planes: each narrowed (whole 32-blocks in all)
            k = self.in_features
            parts = [self.codes[..., : k // 2].narrow(-1, start // 2, length // 2)]
            for p in range(self.bits - 4):
                at = k // 2 + p * (k // 8)
                parts.append(self.codes[..., at : at + k // 8].narrow(-1, start // 8, length // 8))
            return torch.cat(parts, dim=-1)
        return self.codes.narrow(-1, start * self.bits // 8, length * self.bits // 8).contiguous()

    def zero_rows(self, rows: int) -> "QuantizedWeight":
        """`rows` rows of this form whose values are all zero (scales and mins 0): padding."""
        self._plain_only("zero_rows")
        lead = tuple(self.codes.shape[:-2])
        codes = torch.zeros((*lead, rows, self.codes.shape[-1]), dtype=torch.uint8)
        scales = torch.zeros((*lead, rows, self.scales.shape[-1]), dtype=self.scales.dtype)
        return self._like(codes, scales, None if self.mins is None else torch.zeros_like(scales))

    def index_rows(self, index: torch.Tensor) -> "QuantizedWeight":
        """Output rows in the order `index` gives (a permutation, or a gather for lookups); from row
        groups the rows are gathered straight into a plain weight (an embedding lookup reads only them)."""
        if self.layout is not CodeLayout.PLAIN:
            return self.layout.value.index_rows(self, index)
        dim = self.codes.dim() - 2
        return self._like(
            self.codes.index_select(dim, index), self.scales.index_select(dim, index),
            _pick(self.mins, lambda m: m.index_select(dim, index)),
        )  # fmt: skip

    # ---- promotion -----------------------------------------------------------------------------------
    def widened(self, bits: int = 8) -> "QuantizedWeight":
        """The same values with `bits`-bit codes (8, or 5 from 4)."""
        if self.bits == bits:
            return self
        self._plain_only("widened")
        if self.two_level:
            return self.flat().widened(bits)
        if bits < self.bits or bits not in BITS or (bits != 8 and self.levels is not None):
            raise ValueError(f"{self.bits}-bit codes cannot be widened to {bits} bits")
        u = self.unpacked_codes().contiguous()
        if self.centred and self.levels is None:  # u - 8 == (u + 120) - 128: still centred
            u.add_((1 << (bits - 1)) - self.centre)
        return self._like(pack_codes(u, bits), self.scales, self.mins, bits=bits)

    def regrouped(self, group: int) -> "QuantizedWeight":
        """The same values with a smaller group that divides this one (scales and mins repeated)."""
        if group == self.group:
            return self
        self._plain_only("regrouped")
        if self.two_level:
            return self.flat().regrouped(group)
        if self.group % group:
            raise ValueError(f"group {group} does not divide {self.group}")
        r = self.group // group
        w = self if group % self.min_group == 0 else self.widened()
        dim = w.scales.dim() - 1
        return w._like(
            w.codes, w.scales.repeat_interleave(r, dim=dim),
            _pick(w.mins, lambda m: m.repeat_interleave(r, dim=dim)), group=group,
        )  # fmt: skip

    def with_scale_dtype(self, dtype: torch.dtype) -> "QuantizedWeight":
        if self.scales.dtype == dtype:
            return self
        self._plain_only("with_scale_dtype")
        if self.two_level or self.exponent_scales:
            return self.flat().with_scale_dtype(dtype)
        if dtype != torch.float32:
            raise ValueError("scales are only ever widened (float16 -> float32)")
        return self._like(self.codes, self.scales.float(), _pick(self.mins, torch.Tensor.float))
