"""The quantized-weight products alone, on the default model's shapes: time per call and the weight bytes
streamed per second, for the int8 block kernel and (past one row) the dequantize-and-GEMM path beside it.

    python benchmarks/quant_gemv.py --rows 1,64,512 --threads 2
    python benchmarks/quant_gemv.py --rows 1 --shapes "1b qkv q4_k,1b gate_up q4_k,1b down q6_k"
    PERFXLM_ISA=avx2 python benchmarks/quant_gemv.py --rows 1 --threads 1 --shapes "q q5_0,kv q5_0,gate q5_0,down q6_k"

The int4 shapes time `quantization="int4"`'s two-level form (rows of whole 256s) beside its float16
scales and mins. The GGUF K-quant shapes (a Llama-3.2-1B-shaped Q4_K_M file's) time the weight as held (two-level scales:
a byte per group, float16 per 256) beside the same values with one float32 scale and min per group (the
form they were held in before), one after the other in one run.

Two builds compare by running this from each checkout in turn (alternating, several times: a shared
machine's single runs move by 20 % or more); the native kernels are built per checkout.
"""

from __future__ import annotations

import argparse
import time

import torch

from perfxlm.ops import cpu_plan, native
from perfxlm.quant import quantizers, two_level

SHAPES = {  # name: (N, K, bits), the default model's (SmolLM2-135M) projections and its head
    "qkv q4": (960, 576, 4),
    "gate_up q4": (3072, 576, 4),
    "down q4": (576, 1536, 4),
    "qkv q8": (960, 576, 8),
    "gate_up q8": (3072, 576, 8),
    "down q8": (576, 1536, 8),
    "head q8": (49152, 576, 8),
    # the default model's Q4_K_M file: its 576-wide matrices fall back to Q5_0 (Q8_0 where Q6_K was meant),
    # the down projection (1536 inputs, whole 256s) is Q4_K or Q6_K
    "q q5_0": (576, 576, "Q5_0"),
    "kv q5_0": (192, 576, "Q5_0"),
    "gate q5_0": (1536, 576, "Q5_0"),
    "v q8_0": (192, 576, "Q8_0"),
    "down q4_k": (576, 1536, "Q4_K"),
    "down q6_k": (576, 1536, "Q6_K"),
    "1b qkv q4_k": (3072, 2048, "Q4_K"),
    "1b gate_up q4_k": (16384, 2048, "Q4_K"),
    "1b down q6_k": (2048, 8192, "Q6_K"),
    # int4 (quantization="int4") on rows of whole 256s: its two-level form beside its float16 form
    "down int4": (576, 1536, "int4"),
    "1b qkv int4": (3072, 2048, "int4"),
}


def k_weight(n: int, k: int, qtype_name: str):
    """Random GGUF blocks (finite float16 factors) repacked as the engine holds them."""
    import gguf
    import numpy as np

    from perfxlm.quant.gguf_repack import repack

    q = gguf.GGMLQuantizationType[qtype_name]
    elems, nbytes = gguf.GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    Q = gguf.GGMLQuantizationType
    for at in {Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q8_0: (0,)}.get(q, (0, 2)):
        raw[:, at : at + 2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return repack(raw, q, (n, k))


def median_seconds(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,64,512", help="activation rows per call (comma list)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.kernels()
    if ops is None:
        raise SystemExit("no native kernels in this environment (a compiler is needed): nothing to time")
    print(f"CPU plan: {cpu_plan.plan().describe()}; int8 block dots: {bool(ops.int8_block_dots())}")
    has_rows4 = any(a.name == "block_max_rows" for a in torch.ops.perfxlm.linear_q.default._schema.arguments)
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            n, k, bits = SHAPES[name]
            if bits == "int4":
                w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
                forms = [("two-level", two_level.quantize_int4(w, 32)),
                         ("float16", quantizers.quantize_int4_search(w, 32))]  # fmt: skip
            elif isinstance(bits, str):
                qw = k_weight(n, k, bits)
                forms = [("held", qw)] + ([("f32 scale+min", qw.flat().with_mins())] if qw.two_level else [])
            else:
                w = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
                qw = quantizers.quantize_symmetric_int4(w, 32) if bits == 4 else quantizers.quantize_symmetric_int8(w, 32)
                forms = [("", qw)]
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1))
            for label, qw in forms:
                time_form(ops, f"{name} {label}".strip(), qw, x, rows, has_rows4)


def time_form(ops, name: str, qw, x: torch.Tensor, rows: int, has_rows4: bool) -> None:
    n, k = qw.out_features, qw.in_features

    def call(limit: int) -> torch.Tensor:
        extra = (limit,) if has_rows4 else ()  # an older build has no 4-bit row limit
        return ops.linear_q(x, qw.codes, qw.scales, qw.mins, qw.levels, None, False, limit, False, True,
                            *extra)  # fmt: skip

    reps = max(5, min(200, int(2e8 / (rows * n * k))))
    block = median_seconds(lambda: call(1 << 30), reps)
    line = (f"{name:21s} rows {rows:4d}: block {block * 1e6:9.1f} us {qw.nbytes / block / 1e9:6.2f} GB/s "
            f"({qw.nbytes * 8 / (n * k):.2f} bits/weight)")
    if rows > 1:
        gemm = median_seconds(lambda: call(0), reps)
        line += f" | dequantize + GEMM {gemm * 1e6:9.1f} us (block {gemm / block:.2f}x)"
    print(line, flush=True)


if __name__ == "__main__":
    main()
