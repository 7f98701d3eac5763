"""Activation statistics for activation-aware quantization (`"calibration"` in `quantization=`).

A weight's error reaches the output multiplied by its input channel's activation, so the squared error
that matters is weighted by each input channel's mean square activation (llama.cpp's importance matrix,
AWQ's observation). These statistics come from a few hundred tokens of text run through the model
before the real load:
1. the checkpoint is loaded once as int8 per output channel (close to the float model, within 0.4 %
   perplexity, at a quarter of float32's memory: the float model never exists whole, as in the normal
   load);
2. the calibration tokens run through it in windows, forward pre-hooks on every projection that will be
   quantized summing x^2 per input channel (`ChannelStats`);
3. that model is freed, and the real load quantizes each weight with its statistics
   (`QuantizedLoader`, keyed by qualified weight name: "model.layers.0.self_attn.qkv_proj.weight").
The fused weights share one input (q, k, v; gate, up), so one statistic serves each. MoE experts get
their input's statistics for gate|up; their down projections (per-expert inputs) stay calibration-free.

The text is a file the user names, or a few KB of plain English shipped with the package
(`"calibration": "default"`), tokenized with the model's own tokenizer.
"""

from __future__ import annotations

import gc
import logging
import os
from importlib import resources
from typing import Any, Callable, Iterator

import torch
from torch import nn
from tqdm import tqdm

logger = logging.getLogger("perfxlm")

DEFAULT = "default"  # the text shipped with the package
DEFAULT_TOKENS = 512
WINDOW = 512  # tokens per forward pass
MIN_TOKENS = 16
CALIBRATION_WEIGHTS = {"method": "int8"}  # how the calibration model is loaded (see the module docstring)


def calibration_text(source: str) -> str:
    """The calibration text: the built-in one for "default", else the UTF-8 file `source`."""
    if source == DEFAULT:
        return resources.files("perfxlm.quant").joinpath("calibration.txt").read_text(encoding="utf-8")
    if not os.path.isfile(source):
        raise ValueError(
            f"quantization calibration={source!r}: no such file. Supported: the path of a UTF-8 text file "
            f"(a few hundred tokens of text like the model's use), {DEFAULT!r} (a built-in English text), "
            "or null (no calibration)."
        )
    try:
        with open(source, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"quantization calibration={source!r} is not UTF-8 text: {e}") from None


def calibration_ids(text: str, model_path: str, tokens: int) -> list[int]:
    """The first `tokens` token ids of `text` under the model's tokenizer (BOS where it adds one)."""
    from perfxlm.tokenizer import get_tokenizer

    try:
        tokenizer = get_tokenizer(model_path)
    except ValueError as e:
        raise ValueError(
            f"quantization calibration tokenizes its text with the tokenizer stored with the model "
            f"({model_path!r}), which could not be loaded; supported: a model folder with its tokenizer "
            f"files or a GGUF file, or calibration false. ({e})"
        ) from None
    ids = list(tokenizer.encode(text))[:tokens]
    if len(ids) < MIN_TOKENS:
        raise ValueError(
            f"quantization calibration text has {len(ids)} tokens; supported: at least {MIN_TOKENS} "
            f"(a few hundred, e.g. {DEFAULT_TOKENS}, give stable statistics)."
        )
    return ids


class ChannelStats:
    """Forward pre-hooks summing x^2 per input channel at each named module (`targets`: hook name ->
    module); `mean_squares()` gives float32 [in_features] per name."""

    def __init__(self, targets: dict[str, nn.Module]) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.handles = [m.register_forward_pre_hook(self._hook(name)) for name, m in targets.items()]

    def _hook(self, name: str):
        def record(_module: nn.Module, args: tuple) -> None:
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            sq = x.square().sum(dim=0)
            if name in self.sums:
                self.sums[name] += sq
            else:
                self.sums[name] = sq
            self.rows[name] = self.rows.get(name, 0) + x.shape[0]

        return record

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def mean_squares(self) -> dict[str, torch.Tensor]:
        return {name: s / self.rows[name] for name, s in self.sums.items()}


def hook_targets(model: nn.Module) -> dict[str, nn.Module]:
    """Weight name (as `perfxlm.quant.loading.quantizable` names it) -> the module whose input feeds it."""
    from perfxlm.quant.loading import quantizable

    out: dict[str, nn.Module] = {}
    for name, module, param, _ in quantizable(model):
        if param in ("weight", "gate_up_proj"):  # an MoE's down_proj sees per-expert inputs: not hooked
            out[f"{name}.{param}"] = module
    return out


def _windows(ids: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def run_tokens(model: nn.Module, ids: list[int], window: int = WINDOW) -> None:
    """Prefill `ids` through `model` in windows of `window` tokens, each from position 0, one KV cache
    reused (progress shown with tqdm)."""
    from perfxlm.model.forward_context import AttentionMetadata, PrefillSeq, set_forward_context
    from perfxlm.worker.model_runner import ModelRunner

    block = 16
    blocks = -(-window // block)
    ModelRunner(model, num_blocks=blocks, block_size=block, dtype=torch.float32)
    chunks = list(_windows(ids, window))
    for chunk in tqdm(chunks, desc="Calibrating", unit="window", leave=False):
        n = len(chunk)
        prefill = PrefillSeq(0, n, 0, torch.arange(blocks))
        meta = AttentionMetadata(torch.arange(n), 0, None, None, None, [prefill])
        with torch.inference_mode(), set_forward_context(meta):
            model(torch.tensor(chunk), torch.arange(n))


def collect(
    load_model: Callable[[Any], nn.Module], hf_config: Any, ids: list[int], weights: Any = CALIBRATION_WEIGHTS
) -> dict[str, torch.Tensor]:
    """Mean square activation per input channel of every weight `quantization=` will quantize, from the
    calibration tokens `ids` run through the checkpoint as `load_model(weights)` loads it (`weights`: a
    `quantization=` value: int8 per channel by default; "none" loads it float). The loader is passed in:
    the model loader calls this module while loading, so this module never imports the loader."""
    max_positions = getattr(hf_config, "max_position_embeddings", None) or WINDOW
    model = load_model(weights)
    stats = ChannelStats(hook_targets(model))
    try:
        run_tokens(model, ids, min(WINDOW, max_positions))
    finally:
        stats.remove()
    del model
    gc.collect()
    result = stats.mean_squares()
    logger.info("Calibration: %d tokens, statistics for %d weights.", len(ids), len(result))
    return result


def importance(
    config: Any, model_path: str, hf_config: Any, load_model: Callable[[Any], nn.Module]
) -> dict[str, torch.Tensor]:
    """The activation statistics a `QuantizationConfig` asks for (its `calibration`), before any weight
    of the model is read; {} where it asks for none or, unless the user named the text, where the
    built-in calibration text cannot be used with this model."""
    if config is None or config.calibration is None:
        return {}
    try:
        ids = calibration_ids(calibration_text(config.calibration), model_path, config.calibration_tokens)
    except ValueError as e:
        if config.calibration_explicit:
            raise
        logger.warning("quantization=%r: calibration-free, as the built-in calibration text cannot be "
                       "used here (%s).", config.method, e)
        return {}
    return collect(load_model, hf_config, ids)
