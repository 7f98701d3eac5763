"""Many-row products of quantized weights: the int8 GEMM (csrc/quant_gemm.cpp) against the paths it
replaces (activations rounded to int8 blocks, weights dequantized in slabs for torch's float32 GEMM; and
at 16-128 rows, parallel decode's, the block GEMV of csrc/quant_linear.cpp), and
torch's own int8 GEMM (`_int_mm`, oneDNN) on plain int8 matrices of the same shape, which has no per-block
scales and so only bounds what an integer GEMM can do here. The default model's and a Llama-3.2-1B's
projections, Q4_0 and Q8_0 codes (fp16 scales per 32, centred), the paths alternating call by call.

    python benchmarks/quant_gemm.py --rows 512 --threads 2 --rounds 5
    PERFXLM_ISA=avx2 python benchmarks/quant_gemm.py --rows 16,32,64,128 --shapes "135M qkv,135M gate_up,135M down"
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from perfxlm.ops import native

SHAPES = {  # name: (N, K)
    "135M qkv": (960, 576),
    "135M gate_up": (3072, 576),
    "135M down": (576, 1536),
    "1B qkv": (3072, 2048),
    "1B gate_up": (16384, 2048),
    "1B down": (2048, 8192),
}


def centred_weight(n: int, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n + k + bits)
    codes = torch.randint(0, 256, (n, k * bits // 8), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half()
    return codes, scales


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512", help="comma-separated row counts")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="calls of each path, alternating; medians reported")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of " + ", ".join(SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.kernels()
    if ops is None or not ops.quant_block_gemm_max_code():
        raise SystemExit("this build of the kernels has no int8 GEMM (it needs AVX2)")
    top = int(ops.quant_block_gemm_max_code())
    print(f"isa={ops.compiled_isa()} threads={args.threads} rounds={args.rounds} (medians, ms)")
    for rows in (int(r) for r in args.rows.split(",")):
        for bits in (4, 8) if top >= 255 else (4,):  # 8-bit codes where the GEMM runs them at full rate
            for name in args.shapes.split(","):
                n, k = SHAPES[name]
                codes, scales = centred_weight(n, k, bits)
                x = torch.randn(rows, k)
                xq = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
                wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
                paths = {  # max_rows 0: past the GEMV, the int8 blocks dequantized for the float32 GEMM
                    "float32": lambda: ops.linear_q(x, codes, scales, None, None, None, False, 0, False, True, 0),
                    "int8 gemm": lambda: ops.quant_block_gemm(x, codes, scales, None, None, None),
                    "gemv": lambda: ops.linear_q(x, codes, scales, None, None, None, False, rows, False, True, rows),
                    "_int_mm": lambda: torch._int_mm(xq, wq.t()),
                }
                times: dict[str, list[float]] = {p: [] for p in paths}
                for fn in paths.values():
                    fn()  # warm: buffers, caches
                for _ in range(args.rounds):
                    for p, fn in paths.items():
                        times[p].append(timed(fn))
                med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
                print(f"Q{bits}_0 {name:13s} rows={rows:4d}  float32 {med['float32']:8.2f}  int8 gemm "
                      f"{med['int8 gemm']:8.2f} ({med['float32'] / med['int8 gemm']:4.2f}x)  block gemv {med['gemv']:8.2f} "
                      f"({med['gemv'] / med['int8 gemm']:4.2f}x)  _int_mm {med['_int_mm']:8.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
