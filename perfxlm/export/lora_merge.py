"""`perfxlm export onnx --lora PATH`: one PEFT adapter merged into the exported weights, W + scale * B A,
so a runtime with no adapter support (ONNX Runtime, onnxruntime-genai: the ort and standard flavors) runs
the adapted model. The adapter is read and checked by the engine's own reader (`lora/adapter.py`: the
modules placed on the fused projections by the model's checkpoint tables, ranks, alphas, rsLoRA, the
PEFT features refused by name), and the delta is computed as peft's merge computes it ((B @ A) * scale
added to W), so the merged graph is peft's `merge_and_unload()` model.

Only float matrices take a merge: a quantized weight's codes (`--quantization`, a GGUF file's blocks)
cannot hold W + delta without being quantized again, which would not be the adapter's model; such an
export is refused naming the projection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from perfxlm.lora.adapter import load_adapter
from perfxlm.lora.request import LoRARequest
from perfxlm.lora.targets import LoRATargets

_ANY_RANK = 1 << 30  # the export has no slots to size: any rank merges


def merge_adapter(model: nn.Module, path: str, stored: torch.dtype | None) -> list[str]:
    """Add the adapter at `path` into `model`'s projections in place; the projections merged, in order.
    `stored`: the dtype the export writes float matrices in (a bf16-held matrix the engine holds in
    float32 is merged, and then held, in float32, so its merged values are not rounded to bf16)."""
    adapter = load_adapter(LoRARequest("export", 1, path), LoRATargets.of(model), _ANY_RANK)
    modules = dict(model.named_modules())
    for name, parts in adapter.modules.items():
        module = modules[name]
        w = module.weight
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            describe = w.describe() if hasattr(w, "describe") else type(w).__name__
            raise ValueError(f"--lora: {name} is {describe}, whose codes cannot take the adapter's delta "
                             "without quantizing again: export the float checkpoint with --lora and no "
                             "--quantization (or merge the adapter into the checkpoint before quantizing).")
        if tuple(w.shape) != (module.out_features, module.in_features):
            raise ValueError(f"--lora: {name}'s weight is held as {tuple(w.shape)}, not [out, in].")
        merged = w.detach().float().clone()
        for part in parts:  # peft's get_delta_weight: (B @ A) * scaling, added to the weight
            merged[part.row : part.row + part.rows] += (part.b @ part.a) * part.scale
        keep = w.dtype if w.dtype != torch.bfloat16 or stored != torch.float32 else torch.float32
        module.weight = nn.Parameter(merged.to(keep), requires_grad=False)
    return list(adapter.modules)


def describe_merge(path: str, merged: list[str]) -> dict[str, Any]:
    """What the manifest records of a merged adapter."""
    import os

    return {"path": os.path.abspath(path), "modules": merged}
