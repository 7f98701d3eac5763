"""Per-call CPU time of the engine's quantized product (`run_linear_q`, the module path's call) with the
weights in the plain layout and in row groups (CodeLayout.ROWS8; K-quants: ROWS8_K), on the default model's
shapes (and `head2048`, the 49152 x 2048 Q6_K head of a Qwen3-MoE-shaped file, for the K-quants).

One thread, thread CPU time per call (a loaded machine's wall clock says little), the two layouts
alternating call by call, medians over rounds; at 1-8 rows the weights cycle through enough distinct
copies (--stream-mb) that each call streams them from memory, as a decode step does.

    python benchmarks/row_groups_linear.py --rows 1 4 8 16 512
    python benchmarks/row_groups_linear.py --types q6_k --shapes head2048 --rows 1 4 64
    python benchmarks/row_groups_linear.py --types q4_k q6_k --shapes down qkv1b down1b --rows 1 8 16 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch

from perfxlm.ops import cpu_plan, native
from perfxlm.ops.linear import run_linear_q
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.layouts import CodeLayout
from perfxlm.quant.weight import ActivationMode

# SmolLM2-135M: q|k|v, o, gate|up, down, the tied head
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576),
          "head2048": (49152, 2048),
          # Llama-3.2-1B's q|k|v, gate|up and down (K-quants need inputs in whole 256s)
          "qkv1b": (3072, 2048), "gate_up1b": (16384, 2048), "down1b": (2048, 8192)}
Q = gguf.GGMLQuantizationType
TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
F16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # the blocks' float16 factors (d, dmin)
BITS = {"q8_0": 8, "q4_0": 4.5, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5}


def weight(qtype, n, k, seed):
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    for at in F16_AT.get(qtype, (0,)):
        raw[:, at : at + 2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
    w = repack(raw, qtype, (n, k))
    w.use_activations(ActivationMode.INT8_NATIVE)
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--stream-mb", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = native.kernels()
    print(cpu_plan.plan().describe())
    for t in args.types:
        for name in args.shapes:
            n, k = SHAPES[name]
            per = n * k * BITS[t] / 8
            layout = CodeLayout.ROWS8_K if t.endswith("_k") else CodeLayout.ROWS8
            for rows in args.rows:
                copies = max(1, int(args.stream_mb * 2**20 // per)) if rows <= 8 else 1
                plain = [weight(TYPES[t], n, k, seed) for seed in range(copies)]
                grouped = [w.in_layout(layout) for w in plain]
                x = torch.randn(rows, k)
                times = {"plain": [], "rows8": []}
                for r in range(args.rounds + 2):
                    for label, ws in (("plain", plain), ("rows8", grouped)) if r % 2 else (("rows8", grouped), ("plain", plain)):
                        calls = max(1, min(copies, 64)) if rows <= 8 else 1
                        t0 = time.thread_time_ns()
                        for i in range(calls):
                            run_linear_q(ops, x, ws[(r * calls + i) % copies], None, False, True, False)
                        if r >= 2:
                            times[label].append((time.thread_time_ns() - t0) / calls / 1e3)
                p, g = statistics.median(times["plain"]), statistics.median(times["rows8"])
                print(f"{t} {name:8s} {n}x{k} rows={rows:4d}: plain {p:9.1f} us  rows8 {g:9.1f} us  "
                      f"-> {p / g:.2f}x", flush=True)


if __name__ == "__main__":
    main()
