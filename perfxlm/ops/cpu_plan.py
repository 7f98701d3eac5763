"""Which fast path a bf16 model takes on this CPU: chosen from the CPU's capabilities, each one selectable.

bf16 weights are multiplied with float32 activations on every CPU kind: decode reads each weight once per
step, so the bytes read decide its speed, and widening bf16 to float32 in registers costs nothing next
to the read. What differs between CPU kinds is the layout the weights are kept in and what runs the
products with many rows (prefill, large decode batches):

- `rows` layout (CPUs with AVX512-BF16 or AMX: Sapphire/Emerald/Granite Rapids, Zen 4/5): the plain
  [N, K] bf16 tensor. Few rows go to the native row kernel; more rows round the activations to bf16 and
  run torch's bf16 GEMM on the same tensor (oneDNN: AMX tiles or AVX512-BF16 dot products, 5-10x the
  float32 GEMM rate there). A tied LM head shares the embedding table.
- `panels` layout (AVX-512 without bf16 arithmetic, AVX2): [N/16, K, 16] panels for the native panel
  kernel up to 256 rows (it beats MKL's float32 GEMM there); past that, `panel_gemm` says: the same
  kernel (AVX2 and AVX-512 builds) or panels widened into a reused float32 buffer for MKL (scalar builds).

Every choice can be forced from the environment, so the tests run each path on whatever CPU they meet
(a path the CPU lacks is emulated by torch: correct, slow):
- PERFXLM_BF16_LAYOUT = rows | panels
- PERFXLM_BF16_GEMM = bf16 | float32      many-row products on the rows layout
- PERFXLM_BF16_DOTS = 1 | 0               under gemm=bf16, those rows take perfxlm's own bf16 dot-product
                                          kernel (csrc/bf16_dots.cpp: the same bf16-rounded activations,
                                          vdpbf16ps on the plain rows, each output independent of the
                                          batch) instead of torch's bf16 GEMM. Default 1 on AVX512-BF16
                                          without AMX: the default model's projections, one thread's CPU
                                          time per call, alternating, loaded 2-vCPU Zen 4: 0.4-0.67x
                                          oneDNN's at 16 rows, 0.77-0.87x at 64, 0.82-1.0x at 512, 0.94-0.99x
                                          at 2048 (prefill chunks); the 16-row LM head 0.76-0.89x. 0 with
                                          AMX (its tiles, not measured against) and without AVX512-BF16 (the
                                          kernel is emulated in C++ there: correct, slow)
- PERFXLM_BF16_PANEL_GEMM = kernel | float32   rows past native_max_rows on the panels layout (prefill):
                                          the native panel kernel (6 x 16 register tiles on AVX2, each
                                          column one float32 FMA chain, as at few rows) or widened slabs
                                          under MKL's float32 GEMM. Default kernel on AVX2 builds: the
                                          default model's projections at 512 rows, one thread's CPU time
                                          per call, alternating, loaded 2-vCPU Zen 4 forced to the avx2
                                          tier (MKL_ENABLE_INSTRUCTIONS=AVX2): 1.17-1.30x MKL's, 1.03-1.26x
                                          at 2048. Kernel on AVX-512 builds too (the panels layout there
                                          is AVX-512 without bf16: prefill 512 of the default model's
                                          BF16 file 1.21x MKL's AVX-512 GEMM end to end, Zen 4 forced to
                                          avx512_vnni); float32 on scalar ones (no SIMD tile)
- PERFXLM_NATIVE_MAX_ROWS = N             rows up to which the native kernels run
- PERFXLM_BF16_COMPUTE = float32 | bfloat16   activations of a bfloat16 model (bfloat16: torch's bf16
                                              ops throughout, no native linear kernels)

Quantized weights (perfxlm.quant) at few rows: every SIMD tier (AVX2, AVX-VNNI, AVX512-VNNI) has an int8
dot-product GEMV, which runs where the weight's activations are rounded to int8 blocks of 32 (llama.cpp's
scheme, 2-3x fewer instructions than widening codes to float32); otherwise, and on the scalar build (and
AVX-512 without VNNI), the codes are widened and the activations stay float32. Which weights round their
activations is not the CPU's choice but the format's: the engine's `quant_activations` (auto | int8 |
float32, perfxlm.quant.config: auto rounds GGUF and int4 weights of a bfloat16 model where the build has
int8 dots, keeps int8 and nf4 weight-only, w8a8 always rounds), decided once at load.
- PERFXLM_QUANT_ACTIVATIONS = auto | int8 | float32   stands in for quant_activations left at auto
                                                      (read with the engine's configuration, not here)
- PERFXLM_QUANT_MAX_ROWS = N      rows up to which quantized weights take the GEMV kernels; more rows
                                  dequantize slabs for torch's GEMM (or run the int8 GEMM, below). Default 8
                                  with fast bf16 (AMX's measured crossover 12-16; kept on AVX512-BF16
                                  alone, see detect); 32 without (AVX2, AVX-512 without BF16), where the GEMM is float32 and the int8 GEMV is 2.5x faster at
                                  16 rows, even at 32 (8-bit codes) and 1.3x faster at 64 (4-bit codes)
- PERFXLM_QUANT_BLOCK_MAX_ROWS = N  the same limit for 4-bit codes (int4, Q4_0, Q4_1, Q4_K) and for
                                  weights of more than 4M values (an LM head) with int8 activation
                                  blocks; default 128 without fast bf16, where their int8 block
                                  products beat dequantizing for the float32 GEMM: 4-bit FFN shapes
                                  1.2-1.4x at 64 rows, equal at 256, 0.85-1.1x at 512; the default
                                  model's Q8_0 head 1.7x at 48-64 rows, 1.25x at 128 (its dequantized
                                  slabs leave the cache); 8-bit projections lose past 32 (Zen 3, 2
                                  threads); elsewhere the limit above

- PERFXLM_QUANT_GEMM = int8 | float32   what runs the rows past those limits for weights whose activations
                                  are rounded to int8 blocks: the int8 GEMM (csrc/quant_gemm.cpp:
                                  vpdpbusd on 16-column panels repacked per call; on AVX2 builds
                                  8-column panels, 8-bit codes as int16 pairs without AVX-VNNI) or
                                  torch's float32 GEMM on dequantized slabs. Default int8 on
                                  AVX512-VNNI (AVX512-BF16 too: Zen 4's bf16 GEMM is no AMX, see detect)
                                  and on AVX2 / AVX-VNNI, without AMX: one 512-row
                                  product (2 threads / one thread's CPU time, loaded machine) measured
                                  1.4-4.4x the float32 path on AVX512-VNNI (Q4_0 and Q8_0, the default
                                  model's and a 1B model's shapes), 1.5-1.8x forced to the avx2 tier
                                  (Q4_0); float32 on AVX-512 without VNNI (its float32 GEMM is twice
                                  AVX2's; not measured) and with AMX (its bf16 GEMM)
- PERFXLM_QUANT_GEMM_ROWS = N     under the int8 GEMM, the rows from which int8-block weights it takes
                                  run it, before the GEMV limits above (parallel decode's 16-64 rows;
                                  the fused decode layer follows it too); 0: only past those limits.
                                  Default 16 without fast bf16 (_AUTO_GEMM_ROWS), 0 with it

- PERFXLM_DOT_WIDTH = 256 | 512   the vector width of the int8 block GEMV in AVX512-VNNI builds (the
                                  other builds have only the 256-bit one): zmm tiles, or the AVX2 tiles
                                  with vpdpbusd on ymm (AVX512-VL + VNNI) and the centre of centred codes
                                  folded into the dot products. Default 512. Zen 4 splits each 512-bit
                                  operation in two, yet the 256-bit tiles do not win there clearly (the
                                  default model's decode-step weights, batch 1, streamed from memory, one
                                  thread's CPU time per call, 7 alternating rounds, loaded 2-vCPU Zen 4):
                                  per step 0.95x the zmm time on Q8_0, 1.04x on Q4_0, 1.06x on Q4_K_M;
                                  3-9 % faster on every 576-input matrix and the Q8_0 head, 1.5x slower on
                                  4-bit codes at 1536 inputs (Q4_0 / Q4_K down), cache-resident 4-bit
                                  matrices 0.6-0.9x. Set in the native kernels by `use` / `reset` (they
                                  read the same variable when they load)

- PERFXLM_ROW_INTERLEAVE = 0 | 8    the code layout of Q8_0 / Q4_0 matrices (centred 8- and 4-bit codes, a
                                  float16 scale per 32) whose activations are rounded to int8 blocks:
                                  8 keeps them in row groups (perfxlm/quant/row_groups.py: 8 rows'
                                  blocks together, one vpdpbusd's lanes 8 rows), which the GEMV reads
                                  1.3-2.3x faster per call than the plain rows (the default model's
                                  shapes, one thread, loaded Zen 4; AVX2 build 1.4-2.7x) and the int8
                                  GEMM reads as its panels; 0 keeps rows. Default 8 on the SIMD tiers
                                  (AVX2 and up), 0 on the scalar build (its row-group GEMV is plain C++).
                                  Chosen at load (`perfxlm.quant.layout_choice.choose_layouts`); expert stacks
                                  alike (each expert its own groups: csrc/moe_kernels.cpp's runs of
                                  an expert's rows, the int8 GEMM per expert)

- PERFXLM_ROW_GROUPS_K = all | head | off  which Q4_K / Q5_K / Q6_K matrices (with int8 activation
                                  blocks) take K-quant row groups (perfxlm/quant/row_groups_k.py): "all"
                                  every one (their GEMV at few rows, the int8 GEMM reading the groups
                                  with the plain layout's bits from its first row), "head" the LM head
                                  only (the layout's first use: Q6_K heads 2.2-2.9x per batch-1 call,
                                  loaded Zen 4), "off" keeps rows. Default "all" where row_groups is 8,
                                  else "off"

The instruction-set tier (perfxlm.ops.isa: PERFXLM_ISA=auto | scalar | avx2 | avx_vnni | avx512 |
avx512_vnni | avx512_bf16 | amx) decides the native build and the flags every choice above sees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from perfxlm.ops import isa

LAYOUTS = ("rows", "panels")
GEMMS = ("bf16", "float32")
QUANT_GEMMS = ("int8", "float32")
COMPUTES = ("float32", "bfloat16")
DOT_WIDTHS = ("256", "512")
ROW_INTERLEAVES = ("0", "8")
ROW_GROUPS_K = ("all", "head", "off")
BF16_DOTS = ("0", "1")
PANEL_GEMMS = ("kernel", "float32")
# Measured with 2 threads on the default model's shapes: AMX's bf16 GEMM overtakes the row kernel past
# 4 rows; the panel kernel beats MKL's float32 GEMM up to 256 rows on AVX-512 without bf16.
_AUTO_MAX_ROWS = {("rows", "bf16"): 4, ("rows", "float32"): 64, ("panels", "bf16"): 256, ("panels", "float32"): 256}
# Rows from which int8-block weights run the int8 GEMM instead of the block GEMV, without fast bf16 (one
# thread's CPU time per product, the default model's projections, Q4_0 and Q8_0, loaded Xeon forced to
# the avx2 tier): the GEMM repacks each weight per call, which the GEMV's products overtake below ~16 rows.
_AUTO_GEMM_ROWS = 16


@dataclass(frozen=True)
class CpuPlan:
    layout: str  # how bf16 linear weights are stored
    gemm: str  # what multiplies many rows against rows-layout bf16 weights
    native_max_rows: int  # up to this many rows the native kernel runs
    bf16_compute: str  # activation dtype of a bfloat16 model
    quant_max_rows: int = 8  # up to this many rows quantized weights take the GEMV kernels
    isa: str = "scalar"  # the instruction-set tier the native kernels are built for
    quant_block_max_rows: int = -1  # the same for 4-bit codes and >4M-value weights; -1: quant_max_rows
    quant_gemm: str = "float32"  # past those rows, int8-block weights: the int8 GEMM or the float32 one
    quant_gemm_rows: int = 0  # under the int8 GEMM, int8-block weights it takes run it from this many rows
    # (0: past their GEMV limit above)
    dot_width: int = 256  # the int8 block GEMV's vector width: 512 (zmm tiles) or 256
    row_groups: int = 0  # Q8_0 / Q4_0 matrices with int8 activation blocks in row groups of 8 (0: rows)
    row_groups_k: str = "off"  # K-quant matrices in row groups: "all" | "head" (the LM head only) | "off"
    bf16_dots: bool = False  # under gemm="bf16": csrc/bf16_dots.cpp's kernel instead of torch's bf16 GEMM
    panel_gemm: str = "float32"  # panels layout past native_max_rows: the panel kernel or MKL on widened slabs

    def describe(self) -> str:
        gemm = "bf16 (dots)" if self.gemm == "bf16" and self.bf16_dots else self.gemm
        if self.layout == "panels":
            gemm = f"{gemm} (panels past {self.native_max_rows} rows: {self.panel_gemm})"
        return (f"isa={self.isa} bf16 layout={self.layout} gemm={gemm} native_max_rows={self.native_max_rows} "
                f"activations={self.bf16_compute} quantized: gemv_max_rows={self.quant_max_rows}"
                + ("" if self.quant_block_max_rows < 0 else f" (4-bit and heads: {self.quant_block_max_rows})")
                + f", then the {self.quant_gemm} GEMM"
                + (f" (int8-block weights from {self.quant_gemm_rows} rows)"
                   if self.quant_gemm == "int8" and self.quant_gemm_rows > 0 else "")
                + f", int8 dots {self.dot_width}-bit"
                + (f", row groups of {self.row_groups}" if self.row_groups else ", code rows plain")
                + {"all": ", K-quants in row groups", "head": ", K-quant head in row groups"}.get(self.row_groups_k, ""))


def _choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    value = os.environ.get(name, "auto").strip().lower() or "auto"
    if value == "auto":
        return default
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected auto or one of {', '.join(allowed)}.")
    return value


def detect() -> CpuPlan:
    """The plan for this CPU, with any environment overrides applied."""
    fast_bf16 = isa.has_fast_bf16()
    layout = _choice("PERFXLM_BF16_LAYOUT", LAYOUTS, "rows" if fast_bf16 else "panels")
    gemm = _choice("PERFXLM_BF16_GEMM", GEMMS, "bf16" if fast_bf16 else "float32")
    max_rows = _rows("PERFXLM_NATIVE_MAX_ROWS", _AUTO_MAX_ROWS[(layout, gemm)])
    compute = _choice("PERFXLM_BF16_COMPUTE", COMPUTES, "float32")
    # Measured on the default model's shapes (AMX CPU, 2 threads, Q4 and Q8 codes): the int8-block GEMV
    # beats dequantizing slabs for the bf16 GEMM up to 12-16 rows (equal at 16). 8 keeps short prefill
    # tails (a prefix-cache hit's last tokens) on the GEMM that computed the prompt the first time, so a
    # bf16 model's greedy text does not move with the cache (measured cost at 9-16 rows: under 10 %).
    # Without fast bf16 (AVX2, AVX-512 with or without VNNI) the GEMM path widens the codes into a float32
    # GEMM, which the int8-block products beat further: 16 parallel sequences of the default model on an
    # AVX512-VNNI Xeon (no BF16), 3 alternating rounds: Q8_0 209 -> 316 tok/s with 32 rows, Q4_0 208 ->
    # 334 with 4-bit codes up to 128 rows (AVX2 measured the same way on a Zen 3).
    # Only AMX's bf16 GEMM beats the int8 products on quantized weights: on AVX512-BF16 without AMX (a
    # 2-vCPU Zen 4, one thread per call, alternating, loaded) the int8 GEMM ran the default model's Q4_0
    # and Q8_0 projections 2.3-6.5x faster than dequantized slabs into the bf16 GEMM at 16-64 rows and
    # 1.2-1.8x at 512, so past the GEMV's 8 rows such a CPU takes the int8 GEMM. The 8 stays (not the 32
    # of the CPUs without fast bf16): there a bfloat16 model's prompt chunks and a preempted request's
    # recomputed tail must land on the same kernel as the first prefill did, or its greedy text moves.
    tier = isa.selected()
    quant_rows = _rows("PERFXLM_QUANT_MAX_ROWS", 8 if fast_bf16 else 32)
    block_rows_limit = _rows("PERFXLM_QUANT_BLOCK_MAX_ROWS", -1 if fast_bf16 else 128)
    quant_gemm = _quant_gemm(fast_bf16 and isa.has_amx())
    gemm_rows = _rows("PERFXLM_QUANT_GEMM_ROWS", _AUTO_GEMM_ROWS if quant_gemm == "int8" and not fast_bf16 else 0)
    dots = _choice("PERFXLM_BF16_DOTS", BF16_DOTS, "1" if "avx512_bf16" in isa.visible_flags() and not isa.has_amx() else "0")
    # the panel kernel past 256 rows on every SIMD build (measured against MKL: the docstring's
    # PERFXLM_BF16_PANEL_GEMM); a build without AVX2 has only its scalar loop, which MKL outruns
    flags = isa.visible_flags()
    panel_gemm = _choice("PERFXLM_BF16_PANEL_GEMM", PANEL_GEMMS, "kernel" if "avx2" in flags else "float32")
    return CpuPlan(layout, gemm, max_rows, compute, quant_rows, tier, block_rows_limit, quant_gemm, gemm_rows,
                   _dot_width(), *_row_groups(), bf16_dots=dots == "1", panel_gemm=panel_gemm)


def _row_groups() -> tuple[int, str]:
    """(row_groups, row_groups_k): 8 on the SIMD tiers (AVX2 and up: the row-group GEMV's vpdpbusd /
    vpmaddubsw form), 0 on the scalar build; either forcible on any CPU (the scalar build runs row groups
    in plain C++: correct, slower). K-quants follow it (every matrix) unless PERFXLM_ROW_GROUPS_K says."""
    simd = {"avx2", "fma", "f16c"} <= isa.visible_flags()
    groups = int(_choice("PERFXLM_ROW_INTERLEAVE", ROW_INTERLEAVES, "8" if simd else "0"))
    return groups, _choice("PERFXLM_ROW_GROUPS_K", ROW_GROUPS_K, "all" if groups == 8 else "off")


def _dot_width() -> int:
    """512 where the build has zmm int8 tiles (AVX512-VNNI), 256 on builds without them (AVX2, AVX-VNNI,
    AVX-512 without VNNI). csrc/quant_linear.cpp's default_dot_width applies the same rule."""
    zmm = "avx512_vnni" in isa.visible_flags()
    value = _choice("PERFXLM_DOT_WIDTH", DOT_WIDTHS, "512" if zmm else "256")
    if value == "512" and not zmm:
        raise ValueError(f"PERFXLM_DOT_WIDTH=512 needs AVX512-VNNI; the {isa.selected()} tier lacks it "
                         "(set 256 or auto).")
    return int(value)


def _quant_gemm(amx_bf16: bool) -> str:
    """int8 by default where it was measured faster: AVX512-VNNI (with or without AVX512-BF16), and AVX2
    without AVX-512, all without AMX; forcing int8 on a tier without AVX2 (no GEMM in its build) is an
    error, not a quiet fallback."""
    flags = isa.visible_flags()
    measured = "avx512_vnni" in flags or ("avx2" in flags and "avx512f" not in flags)
    choice = _choice("PERFXLM_QUANT_GEMM", QUANT_GEMMS, "int8" if measured and not amx_bf16 else "float32")
    if choice == "int8" and not {"avx2", "fma"} <= flags:
        raise ValueError(f"PERFXLM_QUANT_GEMM=int8 needs AVX2; the {isa.selected()} tier lacks it "
                         "(set float32 or auto).")
    return choice


def _rows(name: str, default: int) -> int:
    raw = os.environ.get(name, "auto").strip().lower()
    if raw in ("", "auto"):
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected auto or an integer >= 0.") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: expected auto or an integer >= 0.")
    return value


def has_int8_dots() -> bool:
    """Whether the native build has the int8 block-dot GEMV (AVX2, AVX-VNNI, AVX512-VNNI)."""
    from perfxlm.ops import native

    ops = native.kernels()
    return ops is not None and hasattr(ops, "int8_block_dots") and bool(ops.int8_block_dots())


_plan: CpuPlan | None = None


def plan() -> CpuPlan:
    """The plan in force (detected once per process; `use` replaces it)."""
    global _plan
    if _plan is None:
        _plan = detect()
    return _plan


def use(new: CpuPlan | None = None, **changes: object) -> CpuPlan:
    """Put a plan in force: `new`, or the current one with `changes`; returns the previous plan."""
    global _plan
    previous = plan()
    _plan = replace(new or previous, **changes)  # type: ignore[arg-type]
    _set_kernels(_plan)
    return previous


def reset() -> None:
    """Forget the plan in force: the next `plan()` reads the CPU and the environment again."""
    global _plan
    _plan = None
    _set_kernels(None)


def _set_kernels(p: CpuPlan | None) -> None:
    """Put the plan's choices that live in the native kernels there: the int8 GEMV's dot width and
    whether bf16 rows past the row kernel take the bf16 dot-product kernel, read at each product, so they
    hold for every caller (module path, fused layer, experts, LoRA ranges). Loaded kernels are set at once
    (None: back to the environment's rule); kernels not loaded yet start from that rule themselves (csrc
    default_dot_width, default_dots), so they are loaded here only for a plan that departs from it."""
    import torch

    try:
        loaded = hasattr(torch.ops.perfxlm, "set_int8_dot_width")
        width = p.dot_width if p is not None else _dot_width()
        dots = p.bf16_dots if p is not None else _default_dots()
        if not loaded and width == _dot_width() and dots == _default_dots():
            return
    except ValueError:  # a bad PERFXLM_DOT_WIDTH: raised by the plan() that reads it, not here
        return
    from perfxlm.ops import native

    ops = native.kernels()
    if ops is not None and hasattr(ops, "set_int8_dot_width"):
        ops.set_int8_dot_width(width)
    if ops is not None and hasattr(ops, "set_bf16_dots"):
        ops.set_bf16_dots(dots)


def _default_dots() -> bool:
    """The rule csrc/bf16_dots.cpp's default_dots applies from the environment when it loads (a build
    for AVX512-BF16 without AMX, unless PERFXLM_BF16_DOTS says)."""
    return detect().bf16_dots
