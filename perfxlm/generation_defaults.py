"""Sampling defaults from a model's generation_config.json, applied as vLLM does by default
(`--generation-config auto`): a request (or `LLM.get_default_sampling_params()`) that leaves a field
unset gets the model's value. `vllm` turns this off (vLLM's own defaults); a folder path reads that
folder's generation_config.json instead."""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("perfxlm")

# generation_config.json key -> SamplingParams field
_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(model: str | None, generation_config: str | None = "auto") -> dict:
    if generation_config in (None, "vllm", "none"):
        return {}
    if generation_config == "auto":
        folder = model if model and os.path.isdir(model) else None
    elif os.path.isdir(generation_config):
        folder = generation_config
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                         f"got {generation_config!r}.")
    if folder is None:  # a GGUF file carries no generation_config.json
        return {}
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if generation_config != "auto":
            raise ValueError(f"No generation_config.json in {folder!r}.")
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    out = {}
    for key, name in _KEYS.items():
        value = data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name in ("top_k", "max_tokens") else float(value)
    if out:
        logger.info("Sampling defaults from the model's generation_config.json: %s (--generation-config vllm "
                    "turns them off)", out)
    return out
