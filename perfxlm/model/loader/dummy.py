"""Random weights of the right shapes, for benchmarking sizes we have no checkpoint for."""

from __future__ import annotations

import torch
from torch import nn

from perfxlm.model.layers.norm import GemmaRMSNorm


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int) -> None:
    # drawn where each weight lives: a GPU model's billions of values never pass through the CPU
    gens: dict[torch.device, torch.Generator] = {}
    # Gemma's norms scale by 1 + w: an identity norm stores 0
    gemma_norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, GemmaRMSNorm)}
    for name, param in model.named_parameters():
        if name in gemma_norms:
            param.zero_()
        elif name.endswith("norm.weight") or param.ndim == 1 and "norm" in name:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            gen = gens.get(param.device)
            if gen is None:
                gen = gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            values = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            values.normal_(0.0, 0.02, generator=gen)
            param.copy_(values)
