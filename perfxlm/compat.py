"""vLLM constructor arguments that mean something else (or nothing) on a CPU engine: each is taken
with vLLM's meaning where it has one here, accepted with a notice where it only sizes GPU things,
and refused with what to use instead where perfxlm cannot honour it."""

from __future__ import annotations

import logging
import os
from typing import Any

logger = logging.getLogger("perfxlm")

# accepted: no effect on a CPU engine, as in vLLM's own CPU backend (logged once per argument)
_NOTICES = {
    "swap_space": "swap_space has no effect: preempted requests are recomputed, never swapped",
    "cpu_offload_gb": "cpu_offload_gb has no effect: the weights already live in CPU memory",
    "max_seq_len_to_capture": "max_seq_len_to_capture has no effect: no CUDA graphs on CPU",
    "disable_custom_all_reduce": "disable_custom_all_reduce has no effect on CPU",
    "trust_remote_code": "trust_remote_code has no effect: perfxlm runs its own model code, never a model's",
    "fully_sharded_loras": "fully_sharded_loras has no effect: LoRA runs in one process",
}
_SILENT = {"disable_log_stats", "enforce_eager", "compilation_config"}
_TOKENIZER_MODES = {"auto", "hf"}
_noticed: set[str] = set()


def split_vllm_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(kwargs left for the engine, engine settings these arguments translate to). ValueError names
    the arguments perfxlm cannot honour and what to use instead."""
    rest = dict(kwargs)
    settings: dict[str, Any] = {}
    mode = rest.pop("tokenizer_mode", "auto")
    if mode not in _TOKENIZER_MODES:
        raise ValueError(f"tokenizer_mode={mode!r} is not supported: perfxlm loads the Hugging Face fast tokenizer "
                         "(tokenizer.json, or the one in a GGUF file); use 'auto' or 'hf'.")
    # revision and download_dir are engine fields (the hub cache, perfxlm/hub.py)
    for name in ("tokenizer_revision", "code_revision"):
        value = rest.pop(name, None)
        if value not in (None, "main"):
            raise ValueError(f"{name}={value!r} is not supported: the tokenizer and code come from the model's "
                             "revision (revision=...).")
    if "device" in rest:  # checked here (a bad name fails before anything loads), resolved by EngineConfig
        check_device(rest["device"])
    share = rest.pop("gpu_memory_utilization", None)
    if share is not None:  # None: the default (the CLI passes its flag's absence as None)
        settings["gpu_memory_utilization"] = check_gpu_memory_utilization(share)
    task = rest.pop("task", None)
    if task is not None:  # vLLM's older spelling of runner / convert
        from perfxlm.pooling.runner_kind import task_settings

        settings.update(task_settings(task))
    override = rest.pop("override_pooler_config", None)
    if override is not None and rest.get("pooler_config") is None:  # vLLM's older name of pooler_config
        settings["pooler_config"] = override
    lora_dtype = rest.pop("lora_dtype", None)
    if lora_dtype is not None:  # an engine field (checked by lora.config.LoRAConfig); absent: its default
        settings["lora_dtype"] = lora_dtype
    nbytes = rest.pop("kv_cache_memory_bytes", None)
    if nbytes is not None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be a positive integer, got {nbytes!r}.")
        if rest.get("kv_cache_gib") is None:
            settings["kv_cache_gib"] = nbytes / 2**30
    for name in list(rest):
        if name in _NOTICES:
            rest.pop(name)
            if name not in _noticed:
                _noticed.add(name)
                logger.warning("%s.", _NOTICES[name])
        elif name in _SILENT:
            rest.pop(name)
    if rest.get("kv_cache_gib") is None and "kv_cache_gib" not in settings:
        gib = kv_cache_space_env()
        if gib is not None:
            settings["kv_cache_gib"] = gib
    return rest, settings


def kv_cache_space_env() -> float | None:
    """VLLM_CPU_KVCACHE_SPACE: vLLM's CPU KV cache size in GiB (0 or unset: the default size)."""
    space = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if not space:
        return None
    try:
        gib = float(space)
    except ValueError:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must be a number of GiB, got {space!r}.") from None
    return gib if gib > 0 else None


def check_device(device: Any) -> str:
    """vLLM's `device`: "auto", "cpu", "cuda" or "cuda:N" (perfxlm/device.py); the device type it resolves
    to here. ValueError names the choices, or says that torch sees no GPU."""
    from perfxlm.device import resolve_device

    return resolve_device(device).type


def check_gpu_memory_utilization(value: Any) -> float:
    """vLLM's share of the GPU's memory the engine may take (weights, activations and KV cache): in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {value!r}.")
    return float(value)
