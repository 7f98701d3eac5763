"""Block-FP8 products (DeepSeek-V3's checkpoints): the native kernel over the e4m3 bytes
(csrc/fp8_linear.cpp) against the plain-torch definition it replaced (the whole matrix dequantized through
the 256-level table per call, then torch's GEMM), and against a bf16 weight of the same shape (the
engine's own bf16 row kernel / GEMM), at DeepSeek-V3's shapes and a few row counts. Alternating rounds,
medians; not a test (timings on a shared machine are noise: take them on a quiet one).

    python benchmarks/fp8_linear.py --threads 2
    python benchmarks/fp8_linear.py --rows 1,4,64,512 --rounds 5 --output-json fp8.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from perfxlm.ops import native
from perfxlm.ops.linear import linear
from perfxlm.quant.formats.compressed_tensors import fp8_e4m3_levels
from perfxlm.quant.reference import reference_linear
from perfxlm.quant.weight import QuantizedWeight

# (name, out_features, in_features): DeepSeek-V3's q_a_proj, q_b_proj, o_proj and one expert's gate+up
SHAPES = [("q_a", 1536, 7168), ("q_b", 24576, 1536), ("o_proj", 7168, 16384), ("expert gate_up", 4096, 7168)]


def fp8_weight(n: int, k: int) -> QuantizedWeight:
    w = torch.randn(n, k) * 0.02
    scale = w.abs().amax() / 448.0
    codes = (w / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = torch.full((n, k // 128), float(scale))
    return QuantizedWeight(codes, scales, None, fp8_e4m3_levels(), 8, 128, "float", n, k)


def timed(fn, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,256", help="activation rows per product (1: a decode step)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES))
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ops = native.kernels()
    if ops is None:
        raise SystemExit("the native kernels are not built on this machine")
    results = {}
    for name, n, k in [s for s in SHAPES if s[0] in a.shapes.split(",")]:
        w = fp8_weight(n, k)
        bf16 = w.dequantize().bfloat16()
        for rows in map(int, a.rows.split(",")):
            x = torch.randn(rows, k)
            fns = {"kernel": lambda: ops.linear_fp8(x, w.codes, w.scales, w.group, None),
                   "torch": lambda: reference_linear(x, w), "bf16": lambda: linear(x, bf16)}  # fmt: skip
            times: dict[str, list[float]] = {f: [] for f in fns}
            for f in fns.values():
                f()
            for rnd in range(a.rounds):
                for f in list(fns)[:: 1 if rnd % 2 == 0 else -1]:
                    times[f].append(timed(fns[f], a.repeats))
            med = {f: statistics.median(t) for f, t in times.items()}
            err = (fns["kernel"]() - fns["torch"]()).abs().max().item()
            print(f"{name:>15} {n}x{k}, {rows:4d} rows: kernel {med['kernel']:8.3f} ms, torch {med['torch']:8.3f} ms "
                  f"({med['torch'] / med['kernel']:.1f}x), bf16 weight {med['bf16']:8.3f} ms; max |diff| {err:.1e}")
            results[f"{name}/{rows}"] = med
    if a.output_json:
        Path(a.output_json).write_text(json.dumps({"config": vars(a), "ms": results}, indent=2))


if __name__ == "__main__":
    main()
