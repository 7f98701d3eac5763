"""AWQ checkpoints (AutoAWQ's GEMM layout), `quant_method: "awq"`, `version: "gemm"`.

Per quantized module, for a weight W [N, K] in groups of G inputs (`group_size` / `q_group_size`), 4 bits:
- `qweight` int32 [K, N / 8]: packed along the outputs, 8 per word: word c of input row k holds outputs
  8 c + AWQ_ORDER[j] in bits [4 j, 4 j + 4) for j = 0 .. 7, with AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
  (the interleave AutoAWQ's GEMM kernel reads);
- `qzeros` int32 [K / G, N / 8]: zero points, packed the same way;
- `scales` float16 [K / G, N].
W[n, k] = scales[k / G, n] * (q[k, n] - z[k / G, n]) (no offset on the zeros, unlike GPTQ's v1).
The GEMV / Marlin / exllama layouts pack differently and are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from perfxlm.quant.formats.base import (
    CheckpointFormat, TensorInfo, affine_weight, check_tensor, expect, field, unpack_int32,
)  # fmt: skip
from perfxlm.quant.weight import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output column (within 8) of nibble j
# nibble holding output column i within 8: the inverse permutation of AWQ_ORDER
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(i) for i in range(8))
_FLOATS = ("F16", "BF16", "F32")


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's order -> uint8 [R, 8 C], output columns in order."""
    nibbles = unpack_int32(packed, 4).view(packed.shape[0], -1, 8)
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


class AWQFormat(CheckpointFormat):
    method = "awq"
    parts = ("qweight", "qzeros", "scales")
    marker = "qweight"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        bits = field(config, "bits", "w_bit")
        expect(bits == 4, f"quantization_config.bits={bits!r} for awq is not supported; supported: 4.")
        group = field(config, "group_size", "q_group_size", default=128)
        expect(
            isinstance(group, int) and not isinstance(group, bool) and (group == -1 or group >= 1),
            f"quantization_config.group_size={group!r} for awq: expected a positive integer or -1.",
        )
        version = str(field(config, "version", default="gemm")).lower()
        expect(version == "gemm", f"quantization_config.version={version!r} for awq is not supported; "
               "supported: 'gemm' (AutoAWQ's default layout).")  # fmt: skip
        zero_point = field(config, "zero_point", default=True)
        expect(zero_point is True, f"quantization_config.zero_point={zero_point!r} for awq is not supported; "
               "supported: true (GEMM checkpoints store zero points).")  # fmt: skip
        self.group = group

    def check(self, module: str, infos: dict[str, TensorInfo]) -> None:
        why = f"awq gemm, bits=4, group_size={self.group}"
        shape = tuple(infos["qweight"][0])
        check_tensor(module, "qweight", infos["qweight"], shape if len(shape) == 2 else (0, 0), ("I32",), why)
        k, n = shape[0], shape[1] * 8
        if self.group != -1 and k % self.group:
            raise ValueError(
                f"checkpoint tensor '{module}.qweight' holds {k} inputs, which group_size={self.group} "
                f"does not divide ({why})."
            )
        groups = 1 if self.group == -1 else k // self.group
        check_tensor(module, "scales", infos.get("scales"), (groups, n), _FLOATS, why)
        check_tensor(module, "qzeros", infos.get("qzeros"), (groups, n // 8), ("I32",), why)

    def build(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        codes = unpack_awq(tensors["qweight"]).t()  # [N, K]
        zeros = unpack_awq(tensors["qzeros"]).t()  # [N, groups]
        return affine_weight(module, codes.contiguous(), tensors["scales"].t(), zeros, 4)

    @property
    def activation_source(self) -> str:
        return "int4"

    def describe(self) -> str:
        return f"awq (4-bit gemm, {'per channel' if self.group == -1 else f'group {self.group}'})"
