"""GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), `quant_method: "gptq"`.

Per quantized module, for a weight W [N, K] with `bits` b (4 or 8; 32 / b values per int32 word) and
`group_size` G (-1: one group per row):
- `qweight` int32 [K b / 32, N]: packed along the inputs: word r of column n holds inputs
  r * 32 / b + j, j = 0 .. 32 / b - 1, value j in bits [b j, b (j + 1)) (lowest bits first);
- `qzeros` int32 [K / G, N b / 32]: zero points, packed the same way along the outputs;
- `scales` float16 [K / G, N];
- `g_idx` int32 [K] (optional): the group of each input channel; with `desc_act` (act-order) the
  groups are runs of a permutation of the inputs, not of the inputs in order.
W[n, k] = scales[g, n] * (q[k, n] - z[g, n]), g = g_idx[k]. `checkpoint_format` "gptq" (the default:
AutoGPTQ's v1) stores z - 1 in qzeros (a symmetric checkpoint's 8 as 7); "gptq_v2" stores z.
Act-order becomes the QuantizedWeight's `input_order`: the codes' columns sorted by group, so groups are
contiguous and the products gather x's columns in that order first (one index_select per product).
"""

from __future__ import annotations

from typing import Any

import torch

from perfxlm.quant.formats.base import (
    CheckpointFormat, TensorInfo, act_order, affine_weight, check_tensor, expect, field, unpack_int32,
)  # fmt: skip
from perfxlm.quant.weight import QuantizedWeight

BITS = (4, 8)
_FLOATS = ("F16", "BF16", "F32")
_ZERO_OFFSET = {"gptq": 1, "gptq_v1": 1, "gptq_v2": 0}


class GPTQFormat(CheckpointFormat):
    method = "gptq"
    parts = ("qweight", "qzeros", "scales", "g_idx")
    marker = "qweight"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        bits = field(config, "bits", "w_bit")
        expect(bits in BITS, f"quantization_config.bits={bits!r} for gptq is not supported; supported: 4, 8.")
        group = field(config, "group_size", default=-1)
        expect(
            isinstance(group, int) and not isinstance(group, bool) and (group == -1 or group >= 1),
            f"quantization_config.group_size={group!r} for gptq: expected a positive integer or -1.",
        )
        fmt = str(field(config, "checkpoint_format", default="gptq")).lower()
        expect(fmt in _ZERO_OFFSET, f"quantization_config.checkpoint_format={fmt!r} for gptq is not supported; "
               f"supported: {', '.join(_ZERO_OFFSET)}.")  # fmt: skip
        self.bits, self.group, self.zero_offset = bits, group, _ZERO_OFFSET[fmt]
        self.desc_act = bool(field(config, "desc_act", default=False))
        self.sym = bool(field(config, "sym", default=True))

    def _shapes(self, infos: dict[str, TensorInfo]) -> tuple[int, int, int]:
        words, n = infos["qweight"][0]
        k = words * 32 // self.bits
        groups = 1 if self.group == -1 else k // self.group
        return n, k, max(groups, 1)

    def check(self, module: str, infos: dict[str, TensorInfo]) -> None:
        why = f"gptq, bits={self.bits}, group_size={self.group}"
        shape = infos["qweight"][0]
        check_tensor(module, "qweight", infos["qweight"], shape if len(shape) == 2 else (0, 0), ("I32",), why)
        n, k, groups = self._shapes(infos)
        if self.group != -1 and k % self.group:
            raise ValueError(
                f"checkpoint tensor '{module}.qweight' holds {k} inputs at {self.bits} bits, which "
                f"group_size={self.group} does not divide ({why})."
            )
        expect(n * self.bits % 32 == 0, f"checkpoint tensor '{module}.qweight': {n} outputs cannot pack "
               f"zero points at {self.bits} bits ({why}).")  # fmt: skip
        check_tensor(module, "scales", infos.get("scales"), (groups, n), _FLOATS, why)
        check_tensor(module, "qzeros", infos.get("qzeros"), (groups, n * self.bits // 32), ("I32",), why)
        if "g_idx" in infos:
            check_tensor(module, "g_idx", infos["g_idx"], (k,), ("I32", "I64"), why)

    def build(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        qweight = tensors["qweight"]
        groups = tensors["scales"].shape[0]
        codes = unpack_int32(qweight.t().contiguous(), self.bits)  # [N, K]
        zeros = unpack_int32(tensors["qzeros"], self.bits).t().to(torch.int32) + self.zero_offset  # [N, groups]
        scales = tensors["scales"].t()
        order = None
        if "g_idx" in tensors:
            order = act_order(module, tensors["g_idx"], groups, codes.shape[1], "g_idx")
            if order is not None:
                codes = codes.index_select(1, order)
        return affine_weight(module, codes, scales, zeros, self.bits, input_order=order)

    @property
    def activation_source(self) -> str:
        return "int4" if self.bits == 4 else "int8"

    def describe(self) -> str:
        group = "per channel" if self.group == -1 else f"group {self.group}"
        return f"gptq ({self.bits}-bit, {group}{', act-order' if self.desc_act else ''})"
