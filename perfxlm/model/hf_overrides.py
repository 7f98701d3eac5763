"""vLLM's `hf_overrides`: attributes laid over a checkpoint's config.json after it is read (a dict of
values, or a function config -> config), e.g. {"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true} to serve a causal LM as a
reranker. Applied once, where the engine config resolves the model's config, so the runner choice, the
model class and the loader all see the same values."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping


def parse_hf_overrides(value: Any) -> dict[str, Any] | Callable[[Any], Any] | None:
    """None, a mapping, JSON text of one (the command line's), or a callable; ValueError otherwise."""
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"hf_overrides is not valid JSON: {exc}.") from None
    if not isinstance(value, Mapping):
        raise ValueError(
            f"hf_overrides must be a dict of config.json attributes (or a function of the config), "
            f"got {type(value).__name__}."
        )
    bad = [k for k in value if not isinstance(k, str) or not k.isidentifier()]
    if bad:
        raise ValueError(f"hf_overrides: keys must be config attribute names, got {bad[0]!r}.")
    return dict(value)


def apply_hf_overrides(hf_config: Any, overrides: Any) -> Any:
    """The config with the overrides laid over it (the same object for a dict; a function's return)."""
    overrides = parse_hf_overrides(overrides)
    if overrides is None:
        return hf_config
    if callable(overrides):
        updated = overrides(hf_config)
        if updated is None:
            raise ValueError("hf_overrides: the function must return the (updated) config, it returned None.")
        return updated
    for key, value in overrides.items():
        setattr(hf_config, key, value)
    return hf_config


def overridden_architectures(architectures: list[str], overrides: Any) -> list[str]:
    """config.json's architectures as a dict of overrides changes them (before the config object is built:
    the runner is chosen from the file; a function of the config is applied to the loaded one there)."""
    overrides = parse_hf_overrides(overrides)
    if isinstance(overrides, dict) and overrides.get("architectures") is not None:
        archs = overrides["architectures"]
        if isinstance(archs, str) or not all(isinstance(a, str) for a in archs):
            raise ValueError(f"hf_overrides: architectures must be a list of class names, got {archs!r}.")
        return list(archs)
    return architectures
