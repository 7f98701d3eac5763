"""The seam for pre-quantized checkpoints: one `CheckpointFormat` object per `quant_method`.

A Hugging Face folder whose config.json has a `quantization_config` stores some weights packed: a
module's `.weight` is replaced by a few tensors (AWQ's qweight / qzeros / scales, GPTQ's with g_idx,
compressed-tensors' weight_packed / weight_scale ...). A format object
- reads the config's `quantization_config` (`__init__`: ValueError naming the field it refuses),
- says which tensor names are its parts (`parts`, `marker`),
- checks one module's parts from the safetensors headers alone (`check`: ValueError naming the tensor
  whose shape or dtype disagrees with the config), so a bad checkpoint fails before the model is built,
- builds one `QuantizedWeight` from them (`build`) by moving bits: codes are unpacked from their int32
  words and repacked into the engine's layout; scales stay as stored, and mins are scale x zero point,
  exact in float32 (a float16 / bfloat16 scale times an integer of at most 8 bits); nothing is widened
  to float weights.
`PackedCheckpoint` (loading.py of this package) scans the headers, runs the checks, and turns the
safetensors stream into the stream the model's `load_weights` already takes: each module's parts
become one (`<module>.weight`, QuantizedWeight) pair, which the quantized-weight sink keeps as it keeps
a GGUF file's blocks. Adding a format: a subclass here with those four members, registered by its
`quant_method` in `perfxlm.quant.formats.FORMATS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from perfxlm.quant.weight import BLOCK4, QuantizedWeight, pack_nibbles

# (shape, safetensors dtype name) of one tensor, as its file's header gives it
TensorInfo = tuple[tuple[int, ...], str]

GROUP8 = 16  # 8-bit codes: the native kernels take groups that are multiples of 16 (or one per row)


class CheckpointFormat(ABC):
    method: ClassVar[str]  # the config's quant_method
    # the tensor-name suffixes a packed module may have; `marker`: the one every packed module has
    parts: ClassVar[tuple[str, ...]]
    marker: ClassVar[str]

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def split(self, name: str) -> tuple[str, str]:
        """A checkpoint tensor name -> (the packed weight it may belong to, its part): `<module>.<part>`."""
        module, _, part = name.rpartition(".")
        return module, part

    def output_name(self, module: str) -> str:
        """The name the built weight goes by in the stream the model loads."""
        return f"{module}.weight"

    def is_packed(self, module: str, infos: dict[str, TensorInfo]) -> bool:
        """Whether `module`'s tensors (suffix -> info) are a packed weight of this format."""
        return self.marker in infos

    @abstractmethod
    def check(self, module: str, infos: dict[str, TensorInfo]) -> None:
        """ValueError naming the tensor whose shape or dtype disagrees with the config."""

    @abstractmethod
    def build(self, module: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The module's packed tensors -> its weight, [out_features, in_features]."""

    @property
    @abstractmethod
    def activation_source(self) -> str:
        """The engine method (perfxlm.quant.config.METHODS) whose default activation handling these
        weights take under quant_activations='auto' (int4 for 4-bit codes, w8a8 for W8A8, ...)."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the load log."""


def field(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present in `config` (formats spell some fields two ways)."""
    for name in names:
        if name in config:
            return config[name]
    return default


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def expect_known_fields(config: dict[str, Any], known: set[str], method: str) -> None:
    """A ValueError naming the quantization_config fields of `method` this format does not read."""
    unknown = sorted(set(config) - known)
    expect(not unknown, f"quantization_config field(s) {', '.join(unknown)} for {method} are not supported; "
           f"supported: {', '.join(sorted(known))}.")  # fmt: skip


def check_tensor(module: str, part: str, info: TensorInfo | None, shape: tuple[int, ...], dtypes: tuple[str, ...],
                 why: str) -> None:  # fmt: skip
    """ValueError unless tensor `<module>.<part>` exists with `shape` and one of `dtypes`."""
    name = f"{module}.{part}"
    if info is None:
        raise ValueError(f"checkpoint tensor {name!r} is missing ({why}).")
    got_shape, got_dtype = info
    if tuple(got_shape) != tuple(shape) or got_dtype not in dtypes:
        raise ValueError(
            f"checkpoint tensor {name!r} is {got_dtype} {list(got_shape)}; the quantization_config "
            f"({why}) needs {'/'.join(dtypes)} {list(shape)}."
        )


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., C] -> uint8 [..., C * 32 / bits]: value j of word c is bits [bits j, bits (j + 1))
    of it, element c * 32 / bits + j (the little-endian packing GPTQ and compressed-tensors use)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return values.to(torch.uint8).reshape(*packed.shape[:-1], -1)


def _fits_float16(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) and torch.equal(t.half().float(), t) for t in tensors)


def affine_weight(
    module: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, *,
    act: str = "float", input_order: torch.Tensor | None = None,
) -> QuantizedWeight:  # fmt: skip
    """w[n, k] = scales[n, g] * (codes[n, k] - zeros[n, g]), g = k // (K / groups), as a QuantizedWeight:
    codes uint8 [N, K] (0 .. 2^bits - 1), scales [N, groups] (any float dtype), zeros [N, groups] (the
    code whose value is 0). mins = -scales x zeros is exact in float32 for scales of at most 16 significant
    bits; float16 is kept where both fit it exactly, as the checkpoint's scales usually are. 4-bit codes
    whose groups are not whole 32-value blocks (group 16) are kept as 8-bit codes: the same values.
    A symmetric checkpoint (every zero point the middle code, 2^(bits - 1)) keeps no mins: its codes are
    centred (Q4_0 / Q8_0's form, w = scale x (u - centre)), so a decode step streams no min per group
    and the kernels take the implied one; the values are the same, each exact in float32."""
    n, k = codes.shape
    groups = scales.shape[-1]
    group = k // groups
    if groups < 1 or k % groups:
        raise ValueError(f"{module}: {groups} scale groups do not divide the {k} inputs.")
    if group != k and group % GROUP8:
        raise ValueError(
            f"{module}: group size {group} is not supported; supported: multiples of {GROUP8} "
            f"(4-bit codes: of {BLOCK4} stay 4-bit) or one group per row (-1)."
        )
    s = scales.float().contiguous()
    four = bits == 4 and k % BLOCK4 == 0 and group % BLOCK4 == 0
    stored = 4 if four else 8
    if act == "float" and bool((zeros == 1 << (bits - 1)).all()):  # symmetric: centred codes, no mins
        if not four and bits == 4:  # 4-bit values held as 8-bit codes: u - 8 == (u + 120) - 128
            codes = codes + 120
        if _fits_float16(s):
            s = s.half()
        packed = pack_nibbles(codes) if four else codes.contiguous()
        return QuantizedWeight(packed, s, None, None, stored, group, act, n, k, input_order=input_order)
    m = (s * zeros.float()).neg_()
    if _fits_float16(s, m):
        s, m = s.half(), m.half()
    packed = pack_nibbles(codes) if four else codes.contiguous()
    return QuantizedWeight(packed, s, m.contiguous(), None, stored, group, act, n, k, input_order=input_order)


def act_order(module: str, g_idx: torch.Tensor, groups: int, k: int, name: str) -> torch.Tensor | None:
    """GPTQ's g_idx [K] (the group of each input channel) -> the input order that makes every group one
    contiguous run (None where it already is: no act-order). ValueError unless every group holds K /
    groups channels, the layout act-order quantization produces."""
    g_idx = g_idx.to(torch.int64)
    group = k // groups
    natural = torch.arange(k, dtype=torch.int64) // group
    if torch.equal(g_idx, natural):
        return None
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], natural):
        raise ValueError(
            f"checkpoint tensor '{module}.{name}': the group of each input channel must put {group} "
            f"channels in each of the {groups} groups (act-order); got group sizes "
            f"{torch.bincount(g_idx.clamp(min=0), minlength=groups).tolist()[:8]}..."
        )
    return order
