"""Block-quantized FP8 checkpoints (DeepSeek-V3's, transformers' FineGrainedFP8), `quant_method: "fp8"`.

`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [BN, BK]}`. A quantized module stores
- `<module>.weight` float8_e4m3fn [N, K] (or a stack [E, N, K]);
- `<module>.weight_scale_inv` float32 [ceil(N / BN), ceil(K / BK)]: the multiplier of each BN x BK block,
  w[n, k] = fp8[n, k] x scale_inv[n // BN, k // BK] (DeepSeek's own `weight_dequant`; the last row and
  column blocks may be partial).
Modules the config leaves unquantized (`modules_to_not_convert`: the router, the embeddings, the head,
DeepSeek's norms) have no scale_inv and arrive as float tensors.

Kept as its bytes: codes are the e4m3 bytes (the 256-value table `fp8_e4m3_levels` gives their values,
as for compressed-tensors' FP8), and each row gets the scale of its block for every group of G = gcd(BK,
K) columns, G = BK whenever K is whole blocks (every DeepSeek-V3 projection): one float32 per BK weights,
4 / BK bytes per weight (3 % over the bytes themselves at BK = 128) where the blocks' own scales would
cost 4 / (BN x BK); a per-row scale is what the engine's one storage form (and every product over it)
takes. The values are exactly DeepSeek's (one float32 multiply each). Products run the native FP8 kernel
(ops/fp8_linear.py: the bytes decoded in registers) where G is a multiple of 16, else the plain-torch
definition over the 256-level table; nothing is widened at load.
Static activation scales, other fp8 formats and UE8M0-only scale tensors are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from perfxlm.quant.formats.base import CheckpointFormat, TensorInfo, check_tensor, expect, expect_known_fields
from perfxlm.quant.formats.compressed_tensors import fp8_e4m3_levels
from perfxlm.quant.weight import QuantizedWeight

_KNOWN_FIELDS = {
    "quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
    "modules_to_convert", "dequantize", "scale_fmt", "expert_dtype",
}  # fmt: skip
_SCALE_FMTS = ("float", "ue8m0")  # ue8m0: the float32 scales are powers of two (DeepSeek-V3.1); same storage


def _block_size(config: dict[str, Any]) -> tuple[int, int]:
    """weight_block_size as (BN, BK): transformers' default (128, 128) where absent."""
    value = config.get("weight_block_size", [128, 128])
    ok = isinstance(value, (list, tuple)) and len(value) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
    expect(ok, f"quantization_config.weight_block_size={value!r} is not supported; supported: two positive "
           "integers [rows, columns] (DeepSeek-V3: [128, 128]).")  # fmt: skip
    return int(value[0]), int(value[1])


class FP8BlockFormat(CheckpointFormat):
    method = "fp8"
    parts = ("weight", "weight_scale_inv")
    marker = "weight_scale_inv"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        expect_known_fields(config, _KNOWN_FIELDS, self.method)
        fmt = config.get("fmt", "e4m3")
        expect(fmt == "e4m3", f"quantization_config.fmt={fmt!r} is not supported; supported: 'e4m3'.")
        scheme = config.get("activation_scheme", "dynamic")
        expect(scheme == "dynamic", f"quantization_config.activation_scheme={scheme!r} is not supported; "
               "supported: 'dynamic' (activations stay float32 here).")  # fmt: skip
        scale_fmt = config.get("scale_fmt") or "float"
        expect(scale_fmt in _SCALE_FMTS, f"quantization_config.scale_fmt={scale_fmt!r} is not supported; "
               f"supported: {', '.join(_SCALE_FMTS)}.")  # fmt: skip
        expert_dtype = config.get("expert_dtype") or "fp8"
        expect(expert_dtype == "fp8", f"quantization_config.expert_dtype={expert_dtype!r} is not supported; "
               "supported: 'fp8'.")  # fmt: skip
        expect(not config.get("modules_to_convert"), "quantization_config.modules_to_convert is not supported "
               f"(found {config.get('modules_to_convert')!r}); supported: empty (every module with a "
               "weight_scale_inv is quantized).")  # fmt: skip
        self.block_rows, self.block_cols = _block_size(config)

    def is_packed(self, module: str, infos: dict[str, TensorInfo]) -> bool:
        # an fp8 weight without its scale is packed too: `check` then names the missing scale
        weight = infos.get("weight")
        return self.marker in infos or (weight is not None and weight[1] == "F8_E4M3")

    def _grid(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        *lead, n, k = shape
        return (*lead, math.ceil(n / self.block_rows), math.ceil(k / self.block_cols))

    def check(self, module: str, infos: dict[str, TensorInfo]) -> None:
        why = f"fp8 e4m3 weight, float32 weight_scale_inv per {self.block_rows}x{self.block_cols} block"
        info = infos.get("weight")
        shape = tuple(info[0]) if info is not None else ()
        check_tensor(module, "weight", info, shape if len(shape) in (2, 3) else (0, 0), ("F8_E4M3",), why)
        check_tensor(module, "weight_scale_inv", infos.get("weight_scale_inv"), self._grid(shape), ("F32",), why)

    def build(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        weight, scale = tensors["weight"], tensors["weight_scale_inv"].float()
        *lead, n, k = weight.shape
        expect(tuple(scale.shape) == self._grid(tuple(weight.shape)),
               f"checkpoint tensor '{module}.weight_scale_inv' is {list(scale.shape)}; '{module}.weight' "
               f"[{n}, {k}] in {self.block_rows}x{self.block_cols} blocks needs "
               f"{list(self._grid(tuple(weight.shape)))}.")  # fmt: skip
        group = math.gcd(self.block_cols, k)  # every group inside one block column
        per_block = self.block_cols // group
        rows = scale.repeat_interleave(self.block_rows, dim=-2).narrow(-2, 0, n)
        scales = rows.repeat_interleave(per_block, dim=-1).narrow(-1, 0, k // group).contiguous()
        codes = weight.view(torch.uint8).contiguous()
        return QuantizedWeight(codes, scales, None, fp8_e4m3_levels(), 8, group, "float", n, k)

    @property
    def activation_source(self) -> str:
        return "int8"  # 8-bit codes; the 256-level table keeps the products float32 whatever the mode

    def describe(self) -> str:
        return f"fp8 (e4m3 bytes, one float32 scale per {self.block_rows}x{self.block_cols} block)"
