"""vLLM's `speculative_config`: which proposer, how many tokens it guesses, and its options.

Accepted as vLLM spells it (a dict, or JSON text from the command line):

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"model": PATH, "num_speculative_tokens": 4}               (method "draft_model")
    {"method": "mtp", "num_speculative_tokens": 2}              (the checkpoint's MTP layer; "deepseek_mtp")

Every check here runs when the engine's configuration is built, before any weights are read; the draft
model's checks (`check_draft_against_target`) read only its config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 16
# vLLM's default n-gram length when neither bound is given
_DEFAULT_LOOKUP = 5
_KEYS = {
    "method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
    "disable_by_batch_size", "quantization", "draft_tensor_parallel_size", "revision", "max_model_len",
}  # fmt: skip
# vLLM's other names for the same methods
_ALIASES = {"[ngram]": "ngram", "draft": "draft_model", "deepseek_mtp": "mtp"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of METHODS
    num_speculative_tokens: int  # drafts per step and request, 1..MAX_SPECULATIVE_TOKENS
    prompt_lookup_min: int = 0  # ngram: shortest suffix n-gram matched
    prompt_lookup_max: int = 0  # ngram: longest, tried first
    model: str | None = None  # draft_model: the draft's checkpoint folder or GGUF file
    quantization: Any = None  # draft_model: how its weights are stored (the engine's `quantization` values)
    # speculation pauses on steps with more running requests than this (None: the engine's measured default)
    disable_by_batch_size: int | None = None

    @staticmethod
    def parse(value: Any) -> "SpeculativeConfig | None":
        """A dict, JSON text, a SpeculativeConfig or None -> a validated SpeculativeConfig (or None).
        ValueError names the value and what is allowed."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r}: {exc}.") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or JSON object), got {type(value).__name__}.")
        unknown = sorted(set(value) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                             f"{', '.join(sorted(_KEYS))}.")
        method = value.get("method")
        model = value.get("model")
        if method is None:
            if model is None:
                raise ValueError("speculative_config needs a 'method' (one of ngram, draft_model, mtp) or a draft "
                                 "'model'.")
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        method = _ALIASES.get(method, method)
        if method not in METHODS:
            raise ValueError(f"speculative_config: method {value.get('method')!r} is not supported; use one of "
                             f"{', '.join(METHODS)}.")
        k = _int(value, "num_speculative_tokens", None)
        if k is None:
            raise ValueError("speculative_config: num_speculative_tokens is required (1 to "
                             f"{MAX_SPECULATIVE_TOKENS}).")
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {k}.")
        tp = _int(value, "draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(f"speculative_config: draft_tensor_parallel_size must be 1 (the draft runs whole in "
                             f"the engine's process, whatever the target's tensor_parallel_size), got {tp}.")
        disable = _int(value, "disable_by_batch_size", None)
        if disable is not None and disable < 1:
            raise ValueError(f"speculative_config: disable_by_batch_size must be >= 1, got {disable}.")
        if method == "ngram":
            lo, hi = _int(value, "prompt_lookup_min", None), _int(value, "prompt_lookup_max", None)
            if lo is None and hi is None:
                lo = hi = _DEFAULT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo < 1 or hi < 1:
                raise ValueError(f"speculative_config: prompt_lookup_min and prompt_lookup_max must be >= 1, got "
                                 f"{lo} and {hi}.")
            if lo > hi:
                raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                                 f"({hi}).")
            return SpeculativeConfig("ngram", k, lo, hi, disable_by_batch_size=disable)
        if method == "mtp":
            return SpeculativeConfig("mtp", k, disable_by_batch_size=disable)
        if not isinstance(model, str) or not model or model in ("ngram", "[ngram]"):
            raise ValueError(f"speculative_config: method 'draft_model' needs 'model', the draft's folder or "
                             f".gguf file, got {model!r}.")
        return SpeculativeConfig("draft_model", k, model=model, quantization=value.get("quantization"),
                                 disable_by_batch_size=disable)


def _int(value: dict, key: str, default: int | None) -> int | None:
    v = value.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"speculative_config: {key} must be an integer, got {v!r}.")
    return v


def approx_num_params(hf_config: Any) -> int:
    """Weights of a decoder from its config alone (embeddings, attention, MLP), to compare two models'
    sizes before either is loaded."""
    text = getattr(hf_config, "text_config", None) or hf_config
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    layers = int(getattr(text, "num_hidden_layers", 0) or 0)
    inter = int(getattr(text, "intermediate_size", 0) or 4 * hidden)
    vocab = int(getattr(text, "vocab_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 1) or 1)
    kv_heads = int(getattr(text, "num_key_value_heads", heads) or heads)
    head_dim = int(getattr(text, "head_dim", 0) or hidden // heads)
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    experts = int(getattr(text, "num_local_experts", 0) or getattr(text, "num_experts", 0) or 1)
    return vocab * hidden + layers * (attn + 3 * hidden * inter * experts)


def check_draft_against_target(draft_config: Any, target_config: Any, draft_path: str) -> None:
    """The draft must speak the target's vocabulary and be smaller than it (else speculation only costs).
    ValueError naming both values."""
    dv = getattr(getattr(draft_config, "text_config", None) or draft_config, "vocab_size", None)
    tv = getattr(getattr(target_config, "text_config", None) or target_config, "vocab_size", None)
    if dv != tv:
        raise ValueError(f"speculative_config: the draft model {draft_path!r} has a vocabulary of {dv} tokens, the "
                         f"target {tv}; a draft must share the target's tokenizer and vocabulary.")
    dp, tp = approx_num_params(draft_config), approx_num_params(target_config)
    if dp > tp:
        raise ValueError(f"speculative_config: the draft model {draft_path!r} (~{dp / 1e6:.1f}M weights) is larger "
                         f"than the target (~{tp / 1e6:.1f}M); use a smaller draft.")


# the families whose checkpoints' multi-token-prediction layers the `mtp` method loads
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM",)


def check_mtp_target(hf_config: Any, model_path: str, load_format: str, tensor_parallel_size: int,
                     backend: Any) -> None:
    """`mtp` needs a safetensors checkpoint of a family whose MTP layers this engine builds, with at least
    one (`num_nextn_predict_layers`), and the target whole in the engine's process (the layer reads its
    hidden states). ValueError naming what to change, from the config alone."""
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    if arch not in MTP_ARCHITECTURES:
        raise ValueError(f"speculative_config: method 'mtp' needs a model with multi-token-prediction layers "
                         f"({', '.join(MTP_ARCHITECTURES)}); this one is {arch}. Use 'ngram' or a draft 'model'.")
    n = getattr(hf_config, "num_nextn_predict_layers", None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"speculative_config: method 'mtp' needs a checkpoint with multi-token-prediction "
                         f"layers, but its config has num_nextn_predict_layers={n!r} (>= 1 needed). Use 'ngram' "
                         "or a draft 'model'.")
    packed = getattr(hf_config, "quantization_config", None)
    method = (packed.get("quant_method") if isinstance(packed, dict) else getattr(packed, "quant_method", packed)) \
        if packed else None  # fmt: skip
    if method not in (None, "fp8"):
        raise ValueError(f"speculative_config: method 'mtp' reads the MTP layer's float or fp8-block weights; this "
                         f"checkpoint is stored quantized ({method!r}). Use a float (bf16 / fp16 / fp32) or "
                         "DeepSeek's fp8 checkpoint, or 'ngram'.")
    if load_format != "safetensors":
        raise ValueError(f"speculative_config: method 'mtp' loads the MTP layer from a safetensors checkpoint; "
                         f"load_format {load_format!r} is not supported with it.")
    if tensor_parallel_size != 1 or backend == "external_launcher":
        raise ValueError(f"speculative_config: method 'mtp' runs the MTP layer on the target's hidden states in "
                         f"the engine's process: tensor_parallel_size must be 1 (got {tensor_parallel_size}) "
                         "and distributed_executor_backend not 'external_launcher'.")
    from perfxlm.spec_decode.mtp_loading import mtp_tensor_files

    if not mtp_tensor_files(model_path, hf_config):  # names only: the files' headers
        raise ValueError(f"speculative_config: method 'mtp': the checkpoint {model_path!r} has "
                         f"num_nextn_predict_layers={n} but no tensors of its MTP layer "
                         f"(model.layers.{hf_config.num_hidden_layers}.*).")
