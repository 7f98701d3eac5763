"""The runner's adapter slots and the per-step batch that applies every row's adapter at once.

Punica's idea (SGMV/BGMV: one launch for a batch whose rows use different adapters) done with two dense
products per projection instead of one product pair per adapter: the adapters in the slots are packed
side by side, each projection's A as [R, in] (every slot's ranks, slot after slot) and B^T as [R, out]
(each part's B at its output columns, zero elsewhere: q, k and v of a fused projection are blocks of
one matrix). A step computes h = x A^T for all rows and all slots, multiplies it by a [rows, R] mask that
holds the adapter's scale where the column belongs to the row's slot and 0 elsewhere, and adds h B^T to
the base output. A row without an adapter, or another slot's columns, contribute exact zeros, so a row's
result is its own adapter's, whatever else shares the step; the mask is built once per step and column
layout, shared by the projections whose columns mean the same. The cost is R = sum of the slots' ranks
columns per projection whether a row uses one adapter or none: at max_loras 4 and rank 16, 64 extra
columns against the projection's thousands. A step whose rows all use one adapter takes only that
slot's columns (a view), so batch-1 decode with an adapter pays for its own rank alone.

The fused decode layer does not take the dense products: its kernel (csrc/lora_kernels.cpp) groups the
rows by slot and reads only each used slot's A and the part of each B row its module covers, from one
block per layer (pack.py, `fused_operands`) that holds each slot's weights of the layer contiguously and
without the zeros beside a fused projection's parts; the slots no row uses cost nothing.

A and B are stored in the LoRA dtype (LoRAConfig.dtype; "auto": float32 beside float32 base weights, so
a float32 engine matches peft exactly, bfloat16 beside bf16 ones, as vLLM keeps adapters in the model's
dtype, int8 beside quantized ones: codes with a scale per packed row): decode with adapters is bound by
reading them. Products always sum in float32 on the fused path; the module path widens the stored
values to the activations' dtype (int8: keeps the codes' values beside them), so both paths use the
same adapter values.

Slots (max_loras) are filled on demand and the least recently used one not needed by the step is given
up; the scheduler never puts more distinct adapters than max_loras in one step. Filling a slot repacks
every projection (copies the slots' weights, a few MB), so it happens only when the step's adapters are
not all already in a slot.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from perfxlm.lora.adapter import LoRAAdapter
from perfxlm.lora.layers import LoRALinear
from perfxlm.lora.pack import pack_layer


@dataclass(frozen=True)
class ColumnLayout:
    """What the packed columns of a projection are: each column's slot and scale, and each slot's span."""

    col_slot: torch.Tensor  # [R] int64
    col_scale: torch.Tensor  # [R], the activations' dtype
    spans: dict[int, tuple[int, int]]  # slot -> [start, end) of its columns


@dataclass(frozen=True)
class PackedLoRA:
    a: torch.Tensor  # [R, in], the LoRA dtype
    # B^T [R, out], the right operand of h B^T as a plain row-major matrix: one slot's columns are a
    # contiguous block of rows, and the GEMM never takes a transposed operand (torch's CPU GEMM ran the
    # [rows, R] x [out, R]^T product of a 1-row step up to 1000x slower than this layout, measured)
    bt: torch.Tensor
    layout: ColumnLayout
    # the fused kernel's view: A and B^T as stored (int8 storage: codes + 128 as uint8, `a` and `bt`
    # then hold their values for the module path), each column's scale (float32, int8's row scales
    # folded in) and [slot, n0, n1) (int32 [R, 3]), the output columns its B row covers (one part of a
    # fused projection)
    kernel_a: torch.Tensor
    kernel_bt: torch.Tensor
    kernel_scale: torch.Tensor
    kernel_cols: torch.Tensor


# From this many rows a step whose rows use several adapters takes each adapter's own rows and columns
# (`LoRABatch._add_grouped`) instead of the masked product over every slot's columns: a prefill of 16
# prompts over 4 rank-16 adapters then does a quarter of the masked product's multiply-adds. Below it (a
# few decode rows on the module path) the masked product's two operations cost less than a product pair
# per slot. PERFXLM_LORA_GROUPED_ROWS sets another bound (0: always grouped; a large number: never).
_GROUPED_ROWS = 64
_RUN_ROWS = 8  # a run of one slot's rows this long takes its products on views in place; shorter: gathered


def grouped_rows() -> int:
    env = os.environ.get("PERFXLM_LORA_GROUPED_ROWS", "")
    return max(0, int(env)) if env.strip() else _GROUPED_ROWS


# Below this many multiply-adds an adapter product runs on the calling thread. The products are small
# (rank columns), and a parallel region's fork and join cost more than such work: on a loaded 2-core
# machine, [1, 576] x [576, 48] then x [48, 3072] took a median 11 us on one thread and, on two, 10 us or
# 24 ms depending on whether the other thread was descheduled (set_num_threads itself costs 0.3 us).
_SERIAL_MACS = 1 << 21


class LoRABatch:
    """One step's adapters: each token row's slot (-1: none). `add` is what a LoRALinear calls."""

    def __init__(self, row_slot: torch.Tensor, single_slot: int | None,
                 kernel_operands: "KernelOperands | None" = None) -> None:
        self.row_slot = row_slot  # [rows] int64
        self.single_slot = single_slot  # the one slot every row uses, if so
        self._masks: dict[int, torch.Tensor] = {}  # id(layout) -> [rows, R] mask, for this step
        self._row_slot32 = row_slot.to(torch.int32)
        self._kernel_operands = kernel_operands if kernel_operands is not None else KernelOperands()
        self._groups: list[tuple[int, slice | torch.Tensor]] | None = None  # _slot_rows(), once per step

    @staticmethod
    def targets(module: Any) -> bool:
        """Whether an adapter of any step can add products to this module (a LoRA wrapper)."""
        return isinstance(module, LoRALinear)

    def operands(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(A [R, in], B^T [R, out], scale: [R] or a [rows, R] mask) of this step for one LoRALinear, or
        None when no adapter of the step targets it. The fused decode layer takes these too."""
        packed: PackedLoRA | None = getattr(layer, "packed", None)
        if packed is None:  # not a LoRA wrapper, or no adapter in the slots targets this projection
            return None
        layout = packed.layout
        if self.single_slot is not None:
            span = layout.spans.get(self.single_slot)
            if span is None:
                return None
            s, e = span
            return packed.a[s:e], packed.bt[s:e], layout.col_scale[s:e]
        scale = self._masks.get(id(layout))
        if scale is None:
            scale = (layout.col_slot == self.row_slot[:, None]) * layout.col_scale
            self._masks[id(layout)] = scale
        return packed.a, packed.bt, scale

    def fused_operands(self, projections: Sequence[Any]) -> list[torch.Tensor]:
        """The fused decode layer's `lora` list for one layer's projections (csrc/lora_kernels.h): the rows'
        slots and the layer's adapter block (pack.py), or [] where no adapter in the slots targets the
        layer. Only the rows' slots change from step to step: the block is kept until the next repack."""
        block = self._kernel_operands.of(projections)
        return [self._row_slot32, block] if block.numel() else []

    def add(self, layer: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.single_slot is None and x.shape[0] >= grouped_rows():
            packed: PackedLoRA | None = getattr(layer, "packed", None)
            if packed is not None:
                self._add_grouped(packed, x, out)
            return out
        ops = self.operands(layer)
        if ops is None:
            return out
        a, bt, scale = ops
        _add_product(x, a, bt, scale, out)
        return out

    def _add_grouped(self, packed: PackedLoRA, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each slot's rows' x A^T * scale B^T over that slot's columns only (see _GROUPED_ROWS)."""
        layout = packed.layout
        for slot, rows in self._slot_rows():
            span = layout.spans.get(slot)
            if span is None:  # this adapter has no part on this projection
                continue
            s, e = span
            a, bt, scale = packed.a[s:e], packed.bt[s:e], layout.col_scale[s:e]
            if isinstance(rows, slice):  # one run of rows: views, added in place
                _add_product(x[rows], a, bt, scale, out[rows])
            else:
                part = _add_product(x.index_select(0, rows), a, bt, scale, None)
                out.index_add_(0, rows, part)

    def _slot_rows(self) -> list[tuple[int, slice | torch.Tensor]]:
        """The used slots' rows as the grouped product takes them: each run of one slot's rows at least
        _RUN_ROWS long (a prompt's tokens) as a slice, viewed in place; a slot's rows in shorter runs (decode
        rows beside a prefill) gathered together."""
        if self._groups is None:
            slots = self.row_slot.numpy()
            self._groups = []
            short: dict[int, list[np.ndarray]] = {}
            bounds = np.flatnonzero(np.diff(slots)) + 1
            for start, end in zip([0, *bounds.tolist()], [*bounds.tolist(), slots.size]):
                slot = int(slots[start])
                if slot < 0:
                    continue
                if end - start >= _RUN_ROWS:
                    self._groups.append((slot, slice(start, end)))
                else:
                    short.setdefault(slot, []).append(np.arange(start, end))
            for slot, idx in short.items():
                self._groups.append((slot, torch.from_numpy(np.concatenate(idx))))
        return self._groups


class KernelOperands:
    """Each layer's adapter block for the fused kernel (pack.py), as the slots hold them now: built at a
    layer's first step after a repack (a copy of the layer's adapters, laid out in the order the kernel
    reads them), so a decode step passes one tensor per layer and the kernel parses no column tables. A
    repack replaces the whole object: no step can see a block of adapters that have left the slots."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[Sequence[Any], torch.Tensor]] = {}  # id(projections) -> block

    def of(self, projections: Sequence[Any]) -> torch.Tensor:
        hit = self._blocks.get(id(projections))
        if hit is not None and hit[0] is projections:
            return hit[1]
        ops: list[Any] = []
        for m in projections:
            packed: PackedLoRA | None = getattr(m, "packed", None)
            ops.append(None if packed is None else (packed.kernel_a, packed.kernel_bt, packed.kernel_scale,
                                                    packed.kernel_cols))
        block = pack_layer(ops)
        self._blocks[id(projections)] = (projections, block)
        return block


@dataclass
class _Slot:
    adapter: LoRAAdapter
    last_used: int = 0


@dataclass
class LoRASlots:
    """The runner's `max_loras` adapter slots over the model's LoRALinear wrappers."""

    wrappers: Sequence[Any]  # layers.LoRALinear
    max_loras: int
    dtype: torch.dtype  # the activations'
    storage_dtype: torch.dtype | None = None  # A's and B's (LoRAConfig.dtype resolved); None: `dtype`
    slots: dict[int, _Slot] = field(default_factory=dict)  # slot index -> adapter
    step: int = 0
    num_repacks: int = 0  # how often the slots' contents changed (tests, metrics)
    # the fused kernel's per-layer operand lists for the slots' current contents (replaced at each repack)
    kernel_operands: KernelOperands = field(default_factory=KernelOperands)

    def batch(self, adapters: Sequence[LoRAAdapter | None], rows: Sequence[int]) -> LoRABatch | None:
        """The step's LoRABatch for requests using `adapters` over `rows` token rows each (the runner's
        order), or None when no request has one."""
        if all(a is None for a in adapters):
            return None
        self.step += 1
        slot_of = self._assign({a.cache_key: a for a in adapters if a is not None})
        per_request = np.fromiter((-1 if a is None else slot_of[a.cache_key] for a in adapters), np.int64,
                                  count=len(adapters))
        used = set(per_request.tolist())
        single = used.pop() if len(used) == 1 else None
        return LoRABatch(torch.from_numpy(np.repeat(per_request, np.asarray(rows, dtype=np.int64))), single,
                         self.kernel_operands)

    def _assign(self, needed: dict[str, LoRAAdapter]) -> dict[str, int]:
        if len(needed) > self.max_loras:
            raise RuntimeError(f"{len(needed)} adapters in one step, more than max_loras ({self.max_loras})")
        slot_of: dict[str, int] = {}
        for index, slot in self.slots.items():
            key = slot.adapter.cache_key
            if needed.get(key) is slot.adapter:
                slot_of[key] = index
                slot.last_used = self.step
        missing = [a for k, a in needed.items() if k not in slot_of]
        if missing:
            free = [i for i in range(self.max_loras) if i not in self.slots]
            # least recently used first, among the slots this step does not need
            evictable = sorted((s.last_used, i) for i, s in self.slots.items() if i not in slot_of.values())
            free += [i for _, i in evictable]
            for adapter, index in zip(missing, free):
                self.slots[index] = _Slot(adapter, self.step)
                slot_of[adapter.cache_key] = index
            self._repack()
        return slot_of

    def _repack(self) -> None:
        """Every wrapped projection's packed A and B for the adapters now in the slots."""
        self.num_repacks += 1
        self.kernel_operands = KernelOperands()
        layouts: dict[tuple, ColumnLayout] = {}
        for wrapper in self.wrappers:
            a_parts, b_blocks, col_slot, col_scale, col_out, spans = [], [], [], [], [], {}
            column = 0
            for index in sorted(self.slots):
                start = column
                for part in self.slots[index].adapter.modules.get(wrapper.name, ()):
                    a_parts.append(part.a)
                    b_blocks.append((part, column))
                    col_slot += [index] * part.rank
                    col_scale += [part.scale] * part.rank
                    col_out += [(index, part.row, part.row + part.rows)] * part.rank
                    column += part.rank
                if column > start:
                    spans[index] = (start, column)
            if not a_parts:
                wrapper.packed = None
                continue
            storage = self.storage_dtype or self.dtype
            a = torch.cat(a_parts)
            bt = torch.zeros(column, wrapper.out_features)
            for part, col in b_blocks:
                bt[col : col + part.rank, part.row : part.row + part.rows] = part.b.T
            kernel_scale = torch.tensor(col_scale, dtype=torch.float32)
            if storage == torch.int8:
                (a, kernel_a, a_scale), (bt, kernel_bt, b_scale) = _int8_rows(a), _int8_rows(bt)
                kernel_scale = kernel_scale * a_scale * b_scale
                a, bt = a.to(self.dtype), bt.to(self.dtype)
            else:
                a = kernel_a = a.to(storage).contiguous()
                bt = kernel_bt = bt.to(storage).contiguous()
            key = (tuple(col_slot), tuple(col_scale))
            layout = layouts.get(key)
            if layout is None:
                layout = layouts[key] = ColumnLayout(torch.tensor(col_slot, dtype=torch.int64),
                                                     torch.tensor(col_scale, dtype=self.dtype), spans)
            wrapper.packed = PackedLoRA(a, bt, layout, kernel_a, kernel_bt, kernel_scale,
                                        torch.tensor(col_out, dtype=torch.int32))


def _add_product(x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor, scale: torch.Tensor,
                 out: torch.Tensor | None) -> torch.Tensor:
    """out += (x A^T * scale) B^T in place (None: the product alone); small products on one thread."""
    if a.dtype != x.dtype:  # bf16 adapters beside float32 activations: the fused kernel's values
        a, bt = a.to(x.dtype), bt.to(x.dtype)
    threads = torch.get_num_threads()
    serial = threads > 1 and x.shape[0] * a.shape[0] * (a.shape[1] + bt.shape[1]) < _SERIAL_MACS
    if serial:
        torch.set_num_threads(1)
    try:
        h = (x @ a.T).mul_(scale)
        return h @ bt if out is None else out.addmm_(h, bt)
    finally:
        if serial:
            torch.set_num_threads(threads)


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 rows as int8 codes with one absmax scale per row: (the values the codes stand for, the
    codes + 128 as uint8, the scales)."""
    scale = w.abs().amax(dim=1).clamp_min(1e-30) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127)
    return q * scale[:, None], (q + 128).to(torch.uint8).contiguous(), scale


class NoAdapters:
    """The runner's slots when the engine runs without LoRA: no step has an adapter."""

    num_repacks = 0

    def batch(self, adapters: Sequence[Any], rows: Sequence[int]) -> None:
        return None
