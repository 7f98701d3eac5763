"""The model as the exporter holds it while writing it out: loaded as the engine loads it with the export's
dtype, but only read, never run, and no wider than its checkpoint where widening is exact.

- Never run (`get_model(runs=False)`): no huge-page arena (a second copy of each weight while it moves,
  and a tied table's original kept until its last owner moved) and no bf16 panel layout (a tied head's own
  packed copy of the table). The values are the same; the graph is written from them as [N, K].
- A bf16 checkpoint the engine holds in float32 (dtype auto on a CPU without fast bf16, or float32): its
  matrices are held in bf16 and widened block by block as they are written (decoder.WidenedBf16). bf16 ->
  float32 is exact, so the graph's float32 weights are the engine's, bit for bit, from half the memory.
  Only where every floating tensor of the checkpoint is bf16 and nothing is quantized at load (a quantizer
  reads the float32 model the engine would hold).

On a 1B-shaped Llama (2.30 GiB bf16 checkpoint) the export's peak fell from 1.57x the checkpoint (bf16) and
2.6x (auto: float32 here) to the figures README's export section gives.
"""

from __future__ import annotations

from typing import Any

import torch

BF16 = "BF16"


def checkpoint_all_bf16(folder: str) -> bool:
    """Whether every floating tensor of a safetensors folder is bf16 (read from the file headers)."""
    from safetensors import safe_open

    from perfxlm.model.loader.hf import safetensors_files

    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype.startswith(("F", "BF")) and dtype != BF16:  # F64, F32, F16, F8_*: not exact in bf16
                    return False
    return True


def held_dtype(config: Any) -> torch.dtype:
    """The dtype the exporter holds float matrices in: the engine's, or bf16 where that is a bf16
    checkpoint's exact values widened."""
    r = config.resolved
    if (r.weight_dtype == torch.float32 and r.compute_dtype == torch.float32 and r.quantized_source is None
            and r.load_format == "safetensors" and r.device.type == "cpu" and checkpoint_all_bf16(r.model)):
        return torch.bfloat16
    return r.weight_dtype


def load_for_export(config: Any) -> tuple[torch.nn.Module, torch.dtype]:
    """(the model as held for export, the dtype its float matrices are to be stored in: the engine's)."""
    from perfxlm.model.loader import get_model

    r = config.resolved
    return get_model(
        r.model, config.hf_config, r.compute_dtype, r.load_format, r.seed, held_dtype(config),
        quantization=r.quant_config, activations=r.quant_activations, device=r.device, runs=False,
    ), r.weight_dtype  # fmt: skip
