"""The CPU's instruction-set tier: which build of the native kernels runs, detected from the CPU's flags,
forcible with PERFXLM_ISA (read when the kernels are first loaded in a process) so every tier's kernels
can be run and tested on any CPU that has at least that tier.

Tiers, lowest first (each needs the flags of the ones below it, as llama.cpp's per-variant CPU builds):

    scalar        portable loops (x86-64-v2)
    avx2          AVX2 + FMA + F16C (x86-64-v3): Zen 2/3, Haswell to Comet Lake, most client cores
    avx_vnni      avx2 with int8 dot products on ymm (vpdpbusd): Alder Lake and later client cores
    avx512        AVX-512 F/BW/VL/DQ (x86-64-v4): Skylake-SP
    avx512_vnni   with int8 dot products on zmm: Cascade Lake, Ice Lake
    avx512_bf16   with bf16 dot products: Cooper Lake, Zen 4/5
    amx           with AMX tiles: Sapphire / Emerald / Granite Rapids

`auto` builds with -march=native (every feature of this CPU, tuned for it) and is named after the
highest tier the CPU has. A forced tier builds with that tier's flags only, and the CPU plan (bf16
layout, int8 activations, GEMV/GEMM crossovers) sees only that tier's flags, so the engine behaves as it
would on such a CPU. torch's own kernels follow ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA, which must be
set before torch starts (benchmarks/compare_llamacpp.py --isa does both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

ENV = "PERFXLM_ISA"


@lru_cache(maxsize=1)
def raw_cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class Tier:
    name: str
    cflags: tuple[str, ...]  # compiler flags of a build for this tier
    needs: frozenset[str]  # /proc/cpuinfo flags the tier executes (its own and the lower tiers')


def _tiers() -> tuple[Tier, ...]:
    v3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
    v4 = v3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
    return (
        Tier("scalar", ("-march=x86-64-v2",), frozenset()),
        Tier("avx2", ("-march=x86-64-v3",), v3),
        Tier("avx_vnni", ("-march=x86-64-v3", "-mavxvnni"), v3 | {"avx_vnni"}),
        Tier("avx512", ("-march=x86-64-v4",), v4),
        Tier("avx512_vnni", ("-march=x86-64-v4", "-mavx512vnni"), v4 | {"avx512_vnni"}),
        Tier("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"), v4 | {"avx512_vnni", "avx512_bf16"}),
        Tier("amx", ("-march=sapphirerapids",), v4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}),
    )


TIERS = _tiers()
NAMES = tuple(t.name for t in TIERS)
_BY_NAME = {t.name: t for t in TIERS}
# Flags that a tier's build and plan must not see unless the tier has them.
_TIER_FLAGS = frozenset().union(*(t.needs for t in TIERS))


# One tier per distinct kernel path: what the tests build besides the CPU's own tier.
DISTINCT_PATHS = ("scalar", "avx2", "avx_vnni", "avx512_vnni")


def supported(flags: frozenset[str] | None = None) -> list[str]:
    """The tiers this CPU can run, lowest first."""
    flags = raw_cpu_flags() if flags is None else flags
    return [t.name for t in TIERS if t.needs <= flags]


def detect(flags: frozenset[str] | None = None) -> str:
    """The highest tier the CPU has. AVX-VNNI sits beside AVX-512 rather than below it: a CPU with
    both (Sapphire Rapids) is named by its AVX-512 tier."""
    return supported(flags)[-1]


@lru_cache(maxsize=None)
def _check(name: str) -> str:
    if name not in _BY_NAME:
        raise ValueError(f"{ENV}={name!r}: expected auto or one of {', '.join(NAMES)}.")
    missing = _BY_NAME[name].needs - raw_cpu_flags()
    if missing:
        raise ValueError(
            f"{ENV}={name}: this CPU lacks {', '.join(sorted(missing))}, so a build for that tier cannot "
            f"run here; this CPU runs {', '.join(supported())}."
        )
    return name


def requested() -> str:
    """'auto', or the forced tier (validated against this CPU)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    return value if value == "auto" else _check(value)


def selected() -> str:
    """The tier in force: the forced one, else the CPU's highest."""
    value = requested()
    return detect() if value == "auto" else value


def compile_flags() -> list[str]:
    """-march flags of the native build. PERFXLM_NATIVE_MARCH (a raw -march value) still wins, for
    builds no tier names."""
    raw = os.environ.get("PERFXLM_NATIVE_MARCH")
    if raw:
        return [f"-march={raw}"]
    value = requested()
    return ["-march=native"] if value == "auto" else list(_BY_NAME[value].cflags)


def has_fast_bf16() -> bool:
    """Whether the CPU (as the plan may use it) computes bf16 natively: AVX512-BF16 or AMX."""
    return bool(visible_flags() & {"avx512_bf16", "amx_bf16"})


def has_amx() -> bool:
    """Whether the CPU (as the plan may use it) has AMX tiles, whose bf16 GEMM outruns int8 products on
    quantized weights dequantized in slabs; AVX512-BF16 alone (Zen 4/5) does not."""
    return bool(visible_flags() & {"amx_bf16", "amx_int8"})


def visible_flags() -> frozenset[str]:
    """The CPU's flags as the plan may use them: a forced tier hides the tier flags above it."""
    flags = raw_cpu_flags()
    value = requested()
    if value == "auto":
        return flags
    return (flags - _TIER_FLAGS) | _BY_NAME[value].needs
