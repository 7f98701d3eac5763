"""sentence-transformers' `Dense` modules (a linear layer and an activation, optionally with a residual)
applied to pooled sentence embeddings, after pooling and before normalization, in modules.json's order:
EmbeddingGemma's 768 -> 3072 -> 768 projection, older models' Tanh heads. Each module's folder holds its
config.json and weights (model.safetensors or pytorch_model.bin: linear.weight, linear.bias,
residual.weight), read here once at load. Products run in float32 whatever the model's dtype, as the
pooled states do."""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SENTENCE_EMBEDDING = "sentence_embedding"


def _activation(name: str | None) -> nn.Module:
    """An activation named as sentence-transformers saves it (`torch.nn.modules.activation.Tanh`). Only
    torch's own nn.Module classes, as sentence-transformers accepts without trust_remote_code."""
    if not name:
        return nn.Tanh()  # Dense's default when the config names none
    module_name, _, cls_name = name.rpartition(".")
    if not module_name.startswith("torch."):
        raise ValueError(f"Dense activation_function {name!r} is not one of torch's: only torch.nn activations "
                         "are supported.")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError):
        raise ValueError(f"Dense activation_function {name!r} does not name a torch class.") from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"Dense activation_function {name!r} is not a torch.nn.Module class.")
    return cls()


def _read_weights(folder: str) -> dict[str, torch.Tensor]:
    safetensors = os.path.join(folder, "model.safetensors")
    if os.path.isfile(safetensors):
        from safetensors.torch import load_file

        return load_file(safetensors)
    binary = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ValueError(f"sentence-transformers Dense module {folder!r} has no model.safetensors or pytorch_model.bin.")


@dataclass
class DenseLayer:
    weight: torch.Tensor  # [out, in] float32
    bias: torch.Tensor | None
    activation: nn.Module
    residual: torch.Tensor | None  # [out, in] where in != out; the input itself where they are equal
    use_residual: bool

    @classmethod
    def load(cls, folder: str) -> "DenseLayer":
        config_path = os.path.join(folder, "config.json")
        if not os.path.isfile(config_path):
            raise ValueError(f"sentence-transformers Dense module {folder!r} has no config.json.")
        with open(config_path, encoding="utf-8") as f:
            config: dict[str, Any] = json.load(f)
        for key in ("module_input_name", "module_output_name"):
            if config.get(key) not in (None, SENTENCE_EMBEDDING):
                raise ValueError(f"sentence-transformers Dense module {folder!r} reads or writes "
                                 f"{config[key]!r}: only Dense layers over the sentence embedding are supported.")
        weights = {k: v.to(torch.float32) for k, v in _read_weights(folder).items()}
        n_in, n_out = int(config["in_features"]), int(config["out_features"])
        weight = weights.get("linear.weight")
        if weight is None or tuple(weight.shape) != (n_out, n_in):
            shape = None if weight is None else tuple(weight.shape)
            raise ValueError(f"Dense module {folder!r}: linear.weight is {shape}, its config says ({n_out}, {n_in}).")
        use_residual = bool(config.get("use_residual", False))
        residual = weights.get("residual.weight") if use_residual and n_in != n_out else None
        if use_residual and n_in != n_out and residual is None:
            raise ValueError(f"Dense module {folder!r} uses a projected residual but has no residual.weight.")
        bias = weights.get("linear.bias") if config.get("bias", True) else None
        return cls(weight, bias, _activation(config.get("activation_function")), residual, use_residual)

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(F.linear(x, self.weight, self.bias))
        if self.use_residual:
            out = out + (x if self.residual is None else F.linear(x, self.residual))
        return out


class DenseStack:
    """The Dense modules in order; [rows, hidden] pooled embeddings -> [rows, out_features]."""

    def __init__(self, layers: list[DenseLayer]) -> None:
        self.layers = layers

    @classmethod
    def load(cls, folders: list[str] | tuple[str, ...], hidden_size: int) -> "DenseStack":
        layers = [DenseLayer.load(f) for f in folders]
        width = hidden_size
        for folder, layer in zip(folders, layers):
            if layer.in_features != width:
                raise ValueError(f"Dense module {folder!r} takes {layer.in_features} features, but what precedes "
                                 f"it gives {width}.")
            width = layer.out_features
        return cls(layers)

    @property
    def out_features(self) -> int:
        return self.layers[-1].out_features

    @torch.inference_mode()
    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        x = pooled.to(torch.float32)
        for layer in self.layers:
            x = layer(x)
        return x
