"""Which runner serves a model (vLLM's `runner`): "generate" (the scheduler, KV cache and sampler) or
"pooling" (this package). Decided before the model loads, from its config.json's architectures, so an
encoder asked to generate fails with what to use instead."""

from __future__ import annotations

import json
import os
from typing import Any

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify", "reward")
# vLLM's older `task` argument -> (runner, convert)
TASKS = {
    "auto": ("auto", "auto"),
    "generate": ("generate", "auto"),
    "embed": ("pooling", "embed"),
    "embedding": ("pooling", "embed"),
    "classify": ("pooling", "classify"),
    "score": ("pooling", "auto"),
    "reward": ("pooling", "reward"),
}


def task_settings(task: str) -> dict[str, str]:
    """vLLM's `task=` as the runner and convert it stands for."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}.")
    runner, convert = TASKS[task]
    return {"runner": runner, "convert": convert}


def _architectures(model: str | None, revision: str | None, download_dir: str | None,
                   hf_overrides: Any = None) -> list[str]:
    from perfxlm.model.hf_overrides import overridden_architectures

    if model is None:
        return overridden_architectures([], hf_overrides)  # the default model: a causal LM
    from perfxlm.hub import resolve_model

    path = resolve_model(model, revision, download_dir)
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.isfile(config):
        # a GGUF file (decoders only), or a folder the loader will refuse with its own message
        return overridden_architectures([], hf_overrides)
    if callable(hf_overrides):  # a function of the config: what it makes of the loaded one
        from perfxlm.model.hf_overrides import apply_hf_overrides
        from perfxlm.model.loader import load_hf_config

        return list(getattr(apply_hf_overrides(load_hf_config(path), hf_overrides), "architectures", None) or [])
    with open(config, encoding="utf-8") as f:
        return overridden_architectures(list(json.load(f).get("architectures") or []), hf_overrides)


def select_runner(config: Any) -> str:
    """"generate" or "pooling" for this EngineConfig; ValueError for a runner the model cannot serve."""
    from perfxlm.model.registry import POOLING_ONLY

    runner, convert = config.runner, config.convert
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}.")
    archs = _architectures(config.model, config.revision, config.download_dir, config.hf_overrides)
    encoder = next((a for a in archs if a in POOLING_ONLY), None)
    if convert in ("embed", "classify", "reward"):
        if runner == "generate":
            raise ValueError(f"convert={convert!r} makes a pooling model: use runner='pooling' (or 'auto').")
        runner = "pooling"
    if runner == "auto":
        return "pooling" if encoder else "generate"
    if runner == "generate" and encoder:
        raise ValueError(f"{encoder} is an encoder with no language-model head: it cannot generate. Load it with "
                         "runner='pooling' (embed, classify, score).")
    return runner
