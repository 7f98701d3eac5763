"""The MTP layer's weights, read from the target's own safetensors checkpoint (the tensors the target
skips): float, in the target's compute dtype. An embedding or head the checkpoint leaves out is the
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
            weights = _read(names)
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


def _read(names: dict[str, str]):
    by_file: dict[str, list[str]] = {}
    for name, path in names.items():
        by_file.setdefault(path, []).append(name)
    for path, wanted in by_file.items():
        with safe_open(path, framework="pt") as f:
            for name in sorted(
                wanted, key=lambda n: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", n)]
            ):
                yield name, f.get_tensor(name)
