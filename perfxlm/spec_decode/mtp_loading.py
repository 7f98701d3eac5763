"""The MTP layer's weights, read from the target's own safetensors checkpoint (the tensors the target
skips): float, in the target's compute dtype (fp8 blocks, DeepSeek-V3's own format, dequantized). An embedding or head the checkpoint leaves out is the
target's."""

from __future__ import annotations

import re
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from perfxlm.model.loader import bind_linear_methods, linear_plan
from perfxlm.model.loader.hf import safetensors_files
from perfxlm.model.models.deepseek_mtp import DeepseekMTP
from perfxlm.model.models.deepseek_v2 import halves_rope_rows, mtp_layer_of


def load_mtp(target_config: Any, target: nn.Module) -> tuple[DeepseekMTP, nn.Module, nn.Module]:
    """(the first MTP layer, the embedding it reads, the head it predicts through)."""
    hf = target_config.hf_config
    dtype = target_config.resolved.compute_dtype
    prefix = f"model.layers.{hf.num_hidden_layers}."
    names = mtp_tensor_files(target_config.resolved.model, hf)  # checked non-empty with the config
    own_embed = prefix + "embed_tokens.weight" in names
    own_head = prefix + "shared_head.head.weight" in names
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.no_grad():
            mtp = DeepseekMTP(hf, own_embed, own_head, target.make_router)
            qc = getattr(hf, "quantization_config", None) or {}
            block = qc.get("weight_block_size") if isinstance(qc, dict) else None
            weights = _read(names, tuple(block) if block else None)
            if target.rope_interleaved(hf):
                weights = halves_rope_rows(weights, hf)
            mtp.load_weights(weights)
    finally:
        torch.set_default_dtype(old)
    bind_linear_methods(mtp, linear_plan(dtype, dtype, None))
    layer = mtp.layer
    embed = layer.embed_tokens if own_embed else target.model.embed_tokens
    head = layer.shared_head.head if own_head else target.lm_head
    return mtp.eval(), embed, head


def mtp_tensor_files(model_path: str, hf_config: Any) -> dict[str, str]:
    """The first MTP layer's tensor names in a safetensors checkpoint -> the file holding each (read from
    the files' headers, no tensor data)."""
    names: dict[str, str] = {}
    for path in safetensors_files(model_path):
        with safe_open(path, framework="pt") as f:
            names.update((n, path) for n in f.keys() if mtp_layer_of(n, hf_config) == 0)  # noqa: SIM118
    return names


def _read(names: dict[str, str], block: tuple[int, int] | None):
    """The layer's tensors as floats: fp8-block weights (DeepSeek-V3's own checkpoints, `block` their
    weight_block_size) dequantized as DeepSeek's `weight_dequant` does, w = fp8 x scale_inv per block."""
    scales = {n.removesuffix("_scale_inv") for n in names if n.endswith(".weight_scale_inv")}
    for path, wanted in _by_file(names).items():
        with safe_open(path, framework="pt") as f:
            for name in wanted:
                if name.endswith(".weight_scale_inv"):
                    continue
                tensor = f.get_tensor(name)
                if name in scales:
                    if block is None:
                        raise ValueError(f"{name}: fp8 blocks, but the config names no weight_block_size.")
                    with safe_open(names[name + "_scale_inv"], framework="pt") as g:
                        tensor = _dequantize_blocks(tensor, g.get_tensor(name + "_scale_inv"), *block)
                yield name, tensor


def _by_file(names: dict[str, str]) -> dict[str, list[str]]:
    by_file: dict[str, list[str]] = {}
    for name in sorted(names, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)]):
        by_file.setdefault(names[name], []).append(name)
    return by_file


def _dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    n, k = q.shape
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * full
