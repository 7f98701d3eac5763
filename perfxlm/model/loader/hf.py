"""Hugging Face safetensors checkpoints, single-file or sharded with an index."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch
from safetensors import safe_open


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(
            f"No *.safetensors weights in {folder!r}. Convert the checkpoint to safetensors, "
            "or use load_format='dummy' for random weights."
        )
    return [os.path.join(folder, n) for n in names]


def iter_safetensors_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    # safe_open memory-maps the file; each tensor is read once, straight into its parameter.
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
