"""Many-row products of quantized weights: the int8 GEMM (csrc/quant_gemm.cpp) against the paths it
replaces (activations rounded to int8 blocks, weights dequantized in slabs for torch's float32 GEMM; and
at 16-128 rows, parallel decode's, the block GEMV of csrc/quant_linear.cpp), and
torch's own int8 GEMM (`_int_mm`, oneDNN) on plain int8 matrices of the same shape, which has no per-block
scales and so only bounds what an integer GEMM can do here. The default model's and a Llama-3.2-1B's
projections, Q4_0 and Q8_0 codes (fp16 scales per 32, centred) and Q6_K codes (a signed byte scale per 16
and a float16 factor per 256, which both the GEMM and the float32 path read as stored), the paths
alternating call by call. `--clock cpu` reports the process's CPU time per call (with --threads 1:
the one thread's), which a loaded machine disturbs less than wall time.

    python benchmarks/quant_gemm.py --rows 512 --threads 2 --rounds 5
    PERFXLM_ISA=avx2 python benchmarks/quant_gemm.py --rows 16,32,64,128 --shapes "135M qkv,135M gate_up,135M down"
    python benchmarks/quant_gemm.py --formats Q6_K --shapes "1B o,1B up,1B down" --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from perfxlm.ops import native
from perfxlm.quant import super_scales

SHAPES = {  # name: (N, K)
    "135M qkv": (960, 576),
    "135M gate_up": (3072, 576),
    "135M down": (576, 1536),
    "1B qkv": (3072, 2048),
    "1B gate_up": (16384, 2048),
    "1B down": (2048, 8192),
    "1B o": (2048, 2048),  # also q; the 2048 x 2048 of the 1B
    "1B v": (512, 2048),  # Q4_K_M's attn_v (Q6_K in half the layers)
    "1B up": (8192, 2048),  # gate or up alone
    "1B head": (128256, 2048),
}
FORMATS = ("Q4_0", "Q8_0", "Q6_K")


def centred_weight(n: int, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k + bits)
    codes = torch.randint(0, 256, (n, k * bits // 8), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
    return codes, scales


def q6_k_weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 6-bit codes (any bytes are valid) with Q6_K's two-level scales: signed bytes per 16, float16 per 256."""
    g = torch.Generator().manual_seed(n + k + 6)
    codes = torch.randint(0, 256, (n, k * 3 // 4), generator=g, dtype=torch.uint8)
    sub = torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8)
    factors = (torch.rand(n, k // super_scales.SUPER_BLOCK, generator=g) * 1e-4 + 1e-5).half()
    return codes, super_scales.join(sub, factors)


def timed(fn, clock=time.perf_counter) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512", help="comma-separated row counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="calls of each path, alternating; medians reported")
    ap.add_argument("--shapes", default="135M qkv,135M gate_up,135M down,1B qkv,1B gate_up,1B down",
                    help="comma-separated names of " + ", ".join(SHAPES))
    ap.add_argument("--formats", default="Q4_0,Q8_0", help="comma-separated, of " + ", ".join(FORMATS))
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall time, or the process's CPU time")
    ap.add_argument("--paths", default="float32,int8 gemm,gemv,_int_mm",
                    help="comma-separated paths to time besides float32 and int8 gemm (gemv, _int_mm, bf16)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    ops = native.kernels()
    if ops is None or not ops.quant_block_gemm_max_code():
        raise SystemExit("this build of the kernels has no int8 GEMM (it needs AVX2)")
    top = int(ops.quant_block_gemm_max_code())
    print(f"isa={ops.compiled_isa()} threads={args.threads} rounds={args.rounds} (medians, ms of {args.clock} time)")
    tops = {"Q4_0": 15, "Q8_0": 255, "Q6_K": 63}
    for rows in (int(r) for r in args.rows.split(",")):
        for fmt in (f for f in args.formats.split(",") if tops[f] <= top):  # where the GEMM runs them at full rate
            for name in args.shapes.split(","):
                n, k = SHAPES[name]
                if fmt == "Q6_K":
                    codes, scales = q6_k_weight(n, k)
                else:
                    codes, scales = centred_weight(n, k, 4 if fmt == "Q4_0" else 8)
                x = torch.randn(rows, k)
                xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
                wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
                paths = {  # max_rows 0: past the GEMV, the int8 blocks dequantized for the float32 GEMM
                    "float32": lambda: ops.linear_q(x, codes, scales, None, None, None, False, 0, False, True, 0),
                    "int8 gemm": lambda: ops.quant_block_gemm(x, codes, scales, None, None, None),
                    "gemv": lambda: ops.linear_q(x, codes, scales, None, None, None, False, rows, False, True, rows),
                    "_int_mm": lambda: torch._int_mm(xq, wq.t()),
                    # the same slabs dequantized to bf16 for torch's bf16 GEMM (the plan's on CPUs with fast bf16)
                    "bf16": lambda: ops.linear_q(x, codes, scales, None, None, None, False, 0, True, True, 0),
                }
                wanted = {"float32", "int8 gemm", *args.paths.split(",")}
                paths = {p: fn for p, fn in paths.items() if p in wanted}
                times: dict[str, list[float]] = {p: [] for p in paths}
                for fn in paths.values():
                    fn()  # warm: buffers, caches
                for _ in range(args.rounds):
                    for p, fn in paths.items():
                        times[p].append(timed(fn, clock))
                med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
                med.setdefault("gemv", float("nan"))
                med.setdefault("_int_mm", float("nan"))
                print(f"{fmt} {name:13s} rows={rows:4d}  float32 {med['float32']:8.2f}  int8 gemm "
                      f"{med['int8 gemm']:8.2f} ({med['float32'] / med['int8 gemm']:4.2f}x)  block gemv {med['gemv']:8.2f} "
                      f"({med['gemv'] / med['int8 gemm']:4.2f}x)  _int_mm {med['_int_mm']:8.2f}"
                      + (f"  bf16 {med['bf16']:8.2f} ({med['bf16'] / med['int8 gemm']:4.2f}x)" if "bf16" in med else ""),
                      flush=True)


if __name__ == "__main__":
    main()
