"""compressed-tensors checkpoints (llm-compressor's), `quant_method: "compressed-tensors"`.

The config's `config_groups` give each group of modules (by `targets`: a class name such as "Linear",
or "re:<regex>" on the module name) a scheme: `weights` (num_bits, type int / float, symmetric, strategy
channel / group / tensor, group_size, actorder) and `input_activations`; a group's `format` (else the
config's) says how its tensors are stored. Three are kept packed here:
- "pack-quantized" (W4A16 / W8A16): `weight_packed` int32 [N, K b / 32], the signed value q + 2^(b-1)
  packed along the inputs lowest bits first (value j of word c is element c * 32 / b + j); `weight_scale`
  [N, K / G] (one column per row for channel); asymmetric: `weight_zero_point` int32 packed the same
  way but along the outputs ([N b / 32, K / G]); `weight_shape` [2]; with actorder, `weight_g_idx` [K].
  W = scale * (q - zp).
- "int-quantized" (W8A8 int8): `weight` int8 [N, K], `weight_scale` [N, 1] (or one per tensor), an
  asymmetric checkpoint's `weight_zero_point`; input activations dynamic per token (one absmax / 127
  scale per row at run time, the engine's W8A8 per-token rule) or none (weight-only).
- "float-quantized" (FP8 e4m3): `weight` float8_e4m3fn [N, K], `weight_scale` [N, 1] (or one per
  tensor): kept as its bytes with a 256-value table (QuantizedWeight.levels) times the scale; dynamic fp8
  activations are kept float32 (the CPU has no fp8 arithmetic; float32 is the more exact of the two).
Static activation scales (`input_scale`), KV cache schemes, sparsity and transforms are refused by name.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from perfxlm.quant.formats.base import (
    CheckpointFormat, TensorInfo, act_order, affine_weight, check_tensor, expect, unpack_int32,
)  # fmt: skip
from perfxlm.quant.weight import QuantizedWeight

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
_FLOATS = ("F16", "BF16", "F32")
_STRATEGIES = ("channel", "group", "tensor")
_STATIC_PARTS = ("input_scale", "input_zero_point", "weight_global_scale", "input_global_scale")


@functools.cache
def fp8_e4m3_levels() -> torch.Tensor:
    """float32 [256]: the value of each float8_e4m3fn byte (one table, shared by every weight)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _per_row(t: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """A scale or zero point as [n, groups]: one per tensor repeated, else as stored."""
    return t.reshape(1, 1).expand(n, groups) if t.numel() == 1 else t.reshape(n, groups)


class _Scheme:
    """One config group, checked: how its modules' weights are stored and what their activations do."""

    def __init__(self, name: str, group: dict[str, Any], default_format: str | None) -> None:
        where = f"quantization_config.config_groups.{name}"
        self.targets = list(group.get("targets") or [])
        self.format = group.get("format") or default_format
        expect(self.format in FORMATS, f"{where}.format={self.format!r} is not supported; supported: "
               f"{', '.join(FORMATS)}.")  # fmt: skip
        w = group.get("weights") or {}
        self.bits, self.type = w.get("num_bits"), w.get("type", "int")
        self.symmetric = bool(w.get("symmetric", True))
        self.strategy = w.get("strategy", "tensor")
        self.group_size = w.get("group_size")
        expect(self.strategy in _STRATEGIES, f"{where}.weights.strategy={self.strategy!r} is not supported; "
               f"supported: {', '.join(_STRATEGIES)}.")  # fmt: skip
        if self.strategy == "group":
            gs = self.group_size
            expect(isinstance(gs, int) and not isinstance(gs, bool) and gs >= 1,
                   f"{where}.weights.group_size={gs!r}: expected a positive integer with strategy 'group'.")
        if self.format == "pack-quantized":
            expect(self.type == "int" and self.bits in (4, 8), f"{where}.weights: num_bits={self.bits!r} type="
                   f"{self.type!r} with pack-quantized is not supported; supported: int, 4 or 8 bits.")
        elif self.format == "int-quantized":
            expect(self.type == "int" and self.bits == 8, f"{where}.weights: num_bits={self.bits!r} type="
                   f"{self.type!r} with int-quantized is not supported; supported: int, 8 bits.")
        else:
            expect(self.type == "float" and self.bits == 8 and self.symmetric,
                   f"{where}.weights: num_bits={self.bits!r} type={self.type!r} with float-quantized is not "
                   "supported; supported: float, 8 bits (e4m3), symmetric.")  # fmt: skip
        if self.format != "pack-quantized":
            expect(self.strategy != "group", f"{where}.weights.strategy='group' with {self.format} is not "
                   "supported; supported: channel or tensor.")  # fmt: skip
        self.act = "float"
        a = group.get("input_activations")
        if a is not None:
            expect(bool(a.get("dynamic")), f"{where}.input_activations: static activation scales are not "
                   "supported; supported: dynamic (per token) or none.")  # fmt: skip
            if self.format == "int-quantized":
                ok = a.get("type", "int") == "int" and a.get("num_bits") == 8 and a.get("strategy") == "token"
                expect(ok and a.get("symmetric", True), f"{where}.input_activations={a!r} is not supported; "
                       "supported with int8 weights: int, 8 bits, symmetric, dynamic per token.")  # fmt: skip
                self.act = "int8"
            elif self.format == "float-quantized":
                expect(a.get("type") == "float", f"{where}.input_activations={a!r} is not supported; "
                       "supported with fp8 weights: dynamic fp8 (kept float32 here) or none.")  # fmt: skip
            else:
                raise ValueError(f"{where}.input_activations={a!r} with pack-quantized weights is not "
                                 "supported; supported: none (weight-only).")  # fmt: skip

    def matches(self, module: str) -> bool:
        for t in self.targets:
            if t.startswith("re:"):
                if re.match(t[3:], module):
                    return True
            elif t in ("Linear", "nn.Linear", "torch.nn.Linear") or module == t or module.endswith("." + t):
                return True
        return False


class CompressedTensorsFormat(CheckpointFormat):
    method = "compressed-tensors"
    parts = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "weight",
             *_STATIC_PARTS)  # fmt: skip
    marker = "weight_scale"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        status = config.get("quantization_status", "compressed")
        expect(status == "compressed", f"quantization_config.quantization_status={status!r} is not supported; "
               "supported: 'compressed' (the packed form llm-compressor saves).")  # fmt: skip
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            expect(not config.get(key), f"quantization_config.{key} is not supported (found {config.get(key)!r}); "
                   "supported: empty.")  # fmt: skip
        groups = config.get("config_groups") or {}
        expect(isinstance(groups, dict) and len(groups) > 0,
               "quantization_config.config_groups: expected at least one group for compressed-tensors.")
        self.schemes = [_Scheme(name, g, config.get("format")) for name, g in groups.items()]

    def scheme(self, module: str) -> _Scheme:
        for s in self.schemes:
            if s.matches(module):
                return s
        raise ValueError(
            f"checkpoint module {module!r} has packed weights that no quantization_config.config_groups "
            "target names."
        )

    def check(self, module: str, infos: dict[str, TensorInfo]) -> None:
        s = self.scheme(module)
        why = f"compressed-tensors {s.format}, {s.bits}-bit {s.strategy}"
        for part in _STATIC_PARTS:
            expect(part not in infos, f"checkpoint tensor '{module}.{part}': static or global scales are not "
                   "supported; supported: dynamic activations, per-channel / group weight scales.")  # fmt: skip
        if s.format == "pack-quantized":
            info = infos.get("weight_packed")
            shape = tuple(info[0]) if info is not None else ()
            check_tensor(module, "weight_packed", info, shape if len(shape) == 2 else (0, 0), ("I32",), why)
            n, k = shape[0], shape[1] * 32 // s.bits
        else:
            info = infos.get("weight")
            shape = tuple(info[0]) if info is not None else ()
            dtype = "I8" if s.format == "int-quantized" else "F8_E4M3"
            check_tensor(module, "weight", info, shape if len(shape) == 2 else (0, 0), (dtype,), why)
            n, k = shape
        groups = self._groups(module, s, k)
        scale_shape = tuple(infos["weight_scale"][0])
        ok = scale_shape == (n, groups) or (s.strategy == "tensor" and scale_shape in ((1,), (), (1, 1)))
        check_tensor(module, "weight_scale", infos["weight_scale"], scale_shape if ok else (n, groups), _FLOATS, why)
        if not s.symmetric:
            zp_shape = (n * s.bits // 32, groups) if s.format == "pack-quantized" else scale_shape
            dtypes = ("I32",) if s.format == "pack-quantized" else ("I8", "I32")
            check_tensor(module, "weight_zero_point", infos.get("weight_zero_point"), zp_shape, dtypes, why)
        if "weight_g_idx" in infos:
            check_tensor(module, "weight_g_idx", infos["weight_g_idx"], (k,), ("I32", "I64"), why)

    def _groups(self, module: str, s: _Scheme, k: int) -> int:
        if s.strategy != "group":
            return 1
        if k % s.group_size:
            raise ValueError(
                f"checkpoint module {module!r} has {k} inputs, which the scheme's group_size={s.group_size} "
                "does not divide."
            )
        return k // s.group_size

    def build(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        s = self.scheme(module)
        scale = tensors["weight_scale"]
        if s.format == "pack-quantized":
            packed = tensors["weight_packed"]
            n, k = packed.shape[0], packed.shape[1] * 32 // s.bits
            if "weight_shape" in tensors:
                stored = tuple(int(v) for v in tensors["weight_shape"].tolist())
                expect(stored == (n, k), f"checkpoint tensor '{module}.weight_shape' is {list(stored)}; "
                       f"'{module}.weight_packed' holds [{n}, {k}] at {s.bits} bits.")  # fmt: skip
            codes = unpack_int32(packed, s.bits)  # q + 2^(b-1)
            scale = _per_row(scale, n, self._groups(module, s, k))
            if s.symmetric:
                zeros = torch.full(scale.shape, 1 << (s.bits - 1), dtype=torch.int32)
            else:  # zp + 2^(b-1), packed along the outputs
                zeros = unpack_int32(tensors["weight_zero_point"].t().contiguous(), s.bits)[:, :n].t()
            order = None
            if "weight_g_idx" in tensors:
                order = act_order(module, tensors["weight_g_idx"], scale.shape[1], k, "weight_g_idx")
                if order is not None:
                    codes = codes.index_select(1, order)
            return affine_weight(module, codes, scale, zeros, s.bits, input_order=order)
        weight = tensors["weight"]
        n, k = weight.shape
        scale = _per_row(scale, n, 1)
        if s.format == "int-quantized":
            codes = weight.view(torch.uint8) ^ 0x80  # q + 128
            zp = tensors.get("weight_zero_point")
            zeros = 128 + (_per_row(zp, n, 1).to(torch.int32) if zp is not None else torch.zeros(n, 1, dtype=torch.int32))
            return affine_weight(module, codes, scale, zeros, 8, act=s.act)
        codes = weight.view(torch.uint8).contiguous()
        s32 = scale.float().contiguous()
        return QuantizedWeight(codes, s32, torch.zeros_like(s32), fp8_e4m3_levels(), 8, k, "float", n, k)

    @property
    def activation_source(self) -> str:
        first = self.schemes[0]
        if first.act == "int8":
            return "w8a8"
        return "int4" if first.format == "pack-quantized" and first.bits == 4 else "int8"

    def describe(self) -> str:
        parts = []
        for s in self.schemes:
            group = f"group {s.group_size}" if s.strategy == "group" else f"per {s.strategy}"
            act = ", int8 activations per token" if s.act == "int8" else ""
            parts.append(f"{s.format} {s.bits}-bit {s.type} {group}{act}")
        return f"compressed-tensors ({'; '.join(parts)})"
