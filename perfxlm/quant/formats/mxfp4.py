"""MXFP4 checkpoints (gpt-oss as OpenAI publishes it), `quant_method: "mxfp4"`.

The expert stacks are stored as two tensors each, beside the module's float tensors:
- `<stack>_blocks` uint8 [E, N, K / 32, 16]: E2M1 codes, byte j of a block holding elements 2j (low
  nibble) and 2j + 1 (high);
- `<stack>_scales` uint8 [E, N / ..., K / 32]: one E8M0 exponent per block of 32 (2^(e - 127)).
(`experts.gate_up_proj_blocks` / `_scales`, `experts.down_proj_blocks` / `_scales`: already [E, out, in],
gate and up rows interleaved as the model multiplies them.) Each pair becomes the stack's
QuantizedWeight under the stack's own name (`quant/mxfp4.py`: nibbles reordered, exponents as exact
float32 scales). Everything else (attention, router, embeddings: `modules_to_not_convert`) is float.
"""

from __future__ import annotations

from typing import Any

import torch

from perfxlm.quant import mxfp4
from perfxlm.quant.formats.base import CheckpointFormat, TensorInfo, expect, expect_known_fields
from perfxlm.quant.weight import QuantizedWeight

_KNOWN_FIELDS = {"quant_method", "modules_to_not_convert"}


class MXFP4Format(CheckpointFormat):
    method = "mxfp4"
    parts = ("blocks", "scales")
    marker = "blocks"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        expect_known_fields(config, _KNOWN_FIELDS, self.method)

    def split(self, name: str) -> tuple[str, str]:
        """`...experts.gate_up_proj_blocks` -> (`...experts.gate_up_proj`, "blocks"): the parts hang off
        the stack's name with an underscore, not a dot."""
        stem, _, part = name.rpartition("_")
        return (stem, part) if part in self.parts and stem else (name, "")

    def output_name(self, module: str) -> str:
        return module  # the stack's parameter itself (`experts.gate_up_proj`), not `<module>.weight`

    def check(self, module: str, infos: dict[str, TensorInfo]) -> None:
        blocks, scales = infos.get("blocks"), infos.get("scales")
        why = "mxfp4: uint8 blocks [..., N, K / 32, 16] and uint8 scales [..., N, K / 32]"
        if scales is None:
            raise ValueError(f"checkpoint tensor '{module}_scales' is missing ({why}).")
        b_shape, b_dtype = blocks
        s_shape, s_dtype = scales
        ok = b_dtype == "U8" and s_dtype == "U8" and len(b_shape) in (3, 4) and b_shape[-1] == 16
        if not ok or tuple(s_shape) != tuple(b_shape[:-1]):
            raise ValueError(
                f"checkpoint tensors '{module}_blocks' ({b_dtype} {list(b_shape)}) and '{module}_scales' "
                f"({s_dtype} {list(s_shape)}) do not fit ({why})."
            )

    def build(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        return mxfp4.from_checkpoint(tensors["blocks"], tensors["scales"], module)

    @property
    def activation_source(self) -> str:
        # 4-bit values, as int4's: under auto a bfloat16 model rounds activations to int8 blocks where the
        # kernel looks the E2M1 table up as int8 (llama.cpp's scheme for MXFP4), else float32
        return "int4"

    def describe(self) -> str:
        return "mxfp4 (E2M1 codes, one E8M0 exponent per 32 weights)"
