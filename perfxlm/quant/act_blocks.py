"""Which arithmetic rounds activations to int8 blocks of 32 (csrc/act_blocks.h): the one setting that the
native kernels (block GEMVs, row groups, int8 GEMM) and their torch references
(perfxlm.quant.reference.fake_quantize_blocks) share.

    ggml   (default) what a GGUF file's q8_0 / q8_1 activation blocks hold, as ggml's x86
           quantize_row_q8_0 / q8_1 computes them: each value times 127 / max |x|, rounded half to even,
           clamped to +-127, and the block's scale max |x| / 127 rounded to fp16 (a block whose fp16 scale
           is 0 is zero). llama.cpp multiplies these fp16 scales, so a GGUF model's products are its own.
           K-quant weights (two-level scales: GGUF Q4_K / Q5_K / Q6_K, int4's super-block form) take
           ggml's q8_K activations instead, as llama.cpp gives them: one float32 scale per 256 values
           (127 / max |x| and its reciprocal, no fp16 rounding), each block of 32 rounded with it.
    fine   ggml's blocks of 32 for every weight, K-quants too (the default before q8_K: a scale per 32
           values is closer to float, but not llama.cpp's products).
    float  the scale max |x| / 127 in float32, each value divided by it, for every weight (perfxlm's rule
           before ggml's).

PERFXLM_ACT_BLOCKS=ggml|fine|float picks it for a process (read when the kernels load); set_mode changes it
at run time (tests, measurements). The two differ by the fp16 rounding of each scale (at most 2^-11
relative) and, rarely, by one step of a value that lands on a rounding boundary.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator

ENV = "PERFXLM_ACT_BLOCKS"
MODES = ("float", "ggml", "fine")  # index = the kernels' perfxlm_act::Arith
DEFAULT = "ggml"
_state: dict[str, str] = {}
_appliers: list[Callable[[int], object]] = []


def _check(name: str) -> str:
    if name not in MODES:
        raise ValueError(f"{ENV}={name!r}: expected one of {', '.join(MODES)}.")
    return name


def mode() -> str:
    """The arithmetic in force: set_mode's, else the environment's, else the default."""
    try:
        return _state["mode"]
    except KeyError:
        _state["mode"] = _check(os.environ.get(ENV, "").strip() or DEFAULT)
        return _state["mode"]


def index(name: str | None = None) -> int:
    return MODES.index(_check(name or mode()))


def super_blocks(kquant: bool) -> bool:
    """Whether activations for a weight round as q8_K (one scale per 256 values): K-quant weights under
    ggml's rule."""
    return kquant and mode() == "ggml"


def set_mode(name: str) -> str:
    """Use `name` from now on, in the kernels (if loaded) and the references; returns the previous one."""
    previous = mode()
    _state["mode"] = _check(name)
    for apply in _appliers:
        apply(index())
    return previous


@contextmanager
def using(name: str) -> Iterator[str]:
    """`name` for the body of a with-statement (tests, measurements), then the mode before."""
    previous = set_mode(name)
    try:
        yield name
    finally:
        set_mode(previous)


def applied_by(apply: Callable[[int], object]) -> None:
    """The loaded kernels' setter (perfxlm.ops.native registers it at load): set_mode calls it with the
    mode's index, so this module needs no import of the kernels."""
    _appliers.append(apply)
    apply(index())
