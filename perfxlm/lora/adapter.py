"""A PEFT LoRA adapter folder, read and checked against the model before any request runs with it.

The folder holds `adapter_config.json` and `adapter_model.safetensors` (or `.bin`) with, per targeted
module, `base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The delta a
module adds is B A x times `lora_alpha / r` (`lora_alpha / sqrt(r)` with rsLoRA), r and alpha per module
where `rank_pattern` / `alpha_pattern` name it, as PEFT computes it. Everything is checked here, so a bad
adapter is the request's ValueError, never a failure inside a step: the rank against `max_lora_rank`,
every module against the model's projections and their shapes (an adapter for another base model),
and the PEFT features this engine does not run (DoRA, trained biases, modules_to_save, embeddings).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from perfxlm.lora.request import LoRARequest
from perfxlm.lora.targets import LoRATargets

_PREFIX = "base_model.model."
_CONFIG = "adapter_config.json"
_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_TENSOR_NAME = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class LoRAPart:
    """One checkpoint module's A and B: the rows [row, row + rows) of its engine projection's output."""

    row: int
    rows: int
    a: torch.Tensor  # [r, in] float32
    b: torch.Tensor  # [rows, r] float32
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: its parts per engine projection, and the key its prefix-cache blocks hash with."""

    request: LoRARequest
    modules: dict[str, list[LoRAPart]]  # engine module name -> parts (one per checkpoint module)
    rank: int

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def cache_key(self) -> str:
        """What separates this adapter's KV blocks from the base model's and every other adapter's."""
        r = self.request
        return f"lora\x1f{r.lora_int_id}\x1f{r.lora_name}\x1f{os.path.abspath(r.lora_path)}"


def read_adapter_config(path: str, max_rank: int) -> dict[str, Any]:
    """The folder's adapter_config.json, refused early (before any tensor is read) where it cannot run."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter folder {path!r} does not exist: lora_path must be a PEFT adapter folder "
                         f"(adapter_config.json and adapter_model.safetensors).")
    config_path = os.path.join(path, _CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter folder {path!r} has no {_CONFIG}: save the adapter with PEFT's "
                         "save_pretrained().")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: cannot read the adapter's config ({exc}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object.")
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{path}: peft_type is {peft_type!r}; only LoRA adapters are supported.")
    refusals = {
        "use_dora": "DoRA adapters are not supported: merge the adapter (merge_and_unload) or train plain LoRA",
        "fan_in_fan_out": "fan_in_fan_out (GPT-2's Conv1D layout) is not supported",
        "layer_replication": "layer_replication is not supported",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported: merge the adapter instead",
        "lora_bias": "trained LoRA biases are not supported",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise ValueError(f"{path}: {why}.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config['bias']!r} (trained biases) is not supported; only bias='none'.")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"{config_path}: rank {r!r} is not a positive integer.")
    if max(ranks) > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {max(ranks)}, more than max_lora_rank ({max_rank}): "
                         f"start the engine with max_lora_rank >= {max(ranks)}.")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for file in _WEIGHT_FILES:
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            continue
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(full)
        return torch.load(full, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter folder {path!r} has no {' or '.join(_WEIGHT_FILES)}.")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches the module name or its trailing part."""
    for key, value in patterns.items():
        if module == key or re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def load_adapter(request: LoRARequest, targets: LoRATargets, max_rank: int) -> LoRAAdapter:
    path = request.lora_path
    config = read_adapter_config(path, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(path).items():
        local = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
        m = _TENSOR_NAME.match(local)
        if m is None:
            raise ValueError(f"{path}: tensor {name!r} is not a LoRA A or B weight of a linear projection "
                             "(embeddings, biases, DoRA magnitudes and saved modules are not supported).")
        pairs.setdefault(m.group("module"), {})[m.group("which")] = tensor
    if not pairs:
        raise ValueError(f"{path}: the adapter holds no LoRA weights.")
    alpha = config.get("lora_alpha", 8)
    rslora = bool(config.get("use_rslora", False))
    modules: dict[str, list[LoRAPart]] = {}
    seen: set[tuple[str, str | None]] = set()
    rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: module {module!r} has lora_{next(iter(ab))} but not its other half.")
        target, shard = targets.resolve(module)
        a, b = ab["A"].to(torch.float32), ab["B"].to(torch.float32)
        row, rows = target.rows(shard)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape != (rows, r):
            raise ValueError(
                f"{path}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but this "
                f"model's projection takes {target.in_features} inputs to {rows} outputs: the adapter was "
                f"trained for another base model (its base_model_name_or_path is "
                f"{config.get('base_model_name_or_path')!r})."
            )
        if r > max_rank:
            raise ValueError(f"LoRA adapter {path!r}: module {module!r} has rank {r}, more than max_lora_rank "
                             f"({max_rank}): start the engine with max_lora_rank >= {r}.")
        if (target.name, shard) in seen:
            raise ValueError(f"{path}: two modules of the adapter land on {target.name} {shard or ''}.")
        seen.add((target.name, shard))
        module_alpha = float(_pattern_value(config.get("alpha_pattern") or {}, module, alpha))
        scale = module_alpha / math.sqrt(r) if rslora else module_alpha / r
        modules.setdefault(target.name, []).append(LoRAPart(row, rows, a.contiguous(), b.contiguous(), scale))
        rank = max(rank, r)
    for parts in modules.values():
        parts.sort(key=lambda p: p.row)
    return LoRAAdapter(request, modules, rank)
