"""A pre-quantized checkpoint folder as the weight stream `load_weights` takes.

`PackedCheckpoint.open(folder)` reads config.json's `quantization_config` (None without one), picks the
format object by `quant_method`, reads every safetensors header (shapes and dtypes, no data) and checks
each packed module's parts: all before the model is built. `stream(weights)` then passes plain tensors
through and holds a packed module's parts until the last arrives (they are adjacent in practice: a file
lists its tensors sorted by name), then yields (`<module>.weight`, QuantizedWeight).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from perfxlm.quant.formats.awq import AWQFormat
from perfxlm.quant.formats.base import CheckpointFormat, TensorInfo
from perfxlm.quant.formats.compressed_tensors import CompressedTensorsFormat
from perfxlm.quant.formats.fp8_blocks import FP8BlockFormat
from perfxlm.quant.formats.gptq import GPTQFormat
from perfxlm.quant.formats.mxfp4 import MXFP4Format

FORMATS: dict[str, type[CheckpointFormat]] = {
    f.method: f for f in (AWQFormat, GPTQFormat, CompressedTensorsFormat, MXFP4Format, FP8BlockFormat)
}
# vLLM's names for the same checkpoints (`quantization=` may name the method; the kernels are ours)
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}


def canonical_method(name: str) -> str:
    name = name.strip().lower()
    return ALIASES.get(name, name)


def quantization_config_of(folder: str) -> dict[str, Any] | None:
    """config.json's quantization_config (None where there is none, or for a GGUF file)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{path}: quantization_config must be an object, got {type(q).__name__}.")
    return q


def format_for(config: dict[str, Any]) -> CheckpointFormat:
    """The format object for a quantization_config; ValueError naming an unknown quant_method."""
    method = config.get("quant_method")
    name = canonical_method(method) if isinstance(method, str) else method
    if name not in FORMATS:
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported; supported: "
            f"{', '.join(FORMATS)} (or a float checkpoint, quantized at load with quantization=)."
        )
    return FORMATS[name](config)


def _headers(files: Iterable[str]) -> dict[str, TensorInfo]:
    from safetensors import safe_open

    infos: dict[str, TensorInfo] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                piece = f.get_slice(name)
                infos[name] = (tuple(piece.get_shape()), piece.get_dtype())
    return infos


@dataclass
class PackedCheckpoint:
    format: CheckpointFormat
    modules: dict[str, set[str]]  # packed module -> the parts its files hold

    @staticmethod
    def open(folder: str, files: Callable[[str], list[str]]) -> "PackedCheckpoint | None":
        """None for a checkpoint without quantization_config; ValueError for one this engine cannot keep
        packed (unknown method or field, a tensor that disagrees with the config). `files(folder)`: its
        safetensors files (the model loader's rule, passed down)."""
        config = quantization_config_of(folder)
        if config is None:
            return None
        fmt = format_for(config)
        by_module: dict[str, dict[str, TensorInfo]] = {}
        for name, info in _headers(files(folder)).items():
            module, part = fmt.split(name)
            if part in fmt.parts:
                by_module.setdefault(module, {})[part] = info
        modules = {}
        for module, infos in by_module.items():
            if fmt.is_packed(module, infos):
                fmt.check(module, infos)
                modules[module] = set(infos)
        if not modules:
            raise ValueError(
                f"{folder!r}: config.json names quant_method {fmt.method!r}, but no tensor is packed as "
                f"{fmt.method} stores weights (no '*.{fmt.marker}' tensor)."
            )
        return PackedCheckpoint(fmt, modules)

    def stream(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, Any]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            module, part = self.format.split(name)
            want = self.modules.get(module)
            if want is None or part not in want:
                yield name, tensor
                continue
            got = pending.setdefault(module, {})
            got[part] = tensor
            if len(got) == len(want):
                del pending[module]
                yield self.format.output_name(module), self.format.build(module, got)
        if pending:
            module, got = next(iter(pending.items()))
            missing = sorted(self.modules[module] - set(got))
            raise ValueError(f"checkpoint ended before {module!r} was complete: missing {missing}.")
