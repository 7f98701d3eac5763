"""Architecture name (config.json `architectures`) -> model class."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS = {
    "LlamaForCausalLM": ("perfxlm.model.models.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config: Any) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(
        f"Model architectures {archs} are not supported. Supported: {', '.join(supported_architectures())}."
    )
