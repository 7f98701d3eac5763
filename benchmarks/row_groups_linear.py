"""Per-call CPU time of the engine's quantized product (`run_linear_q`, the module path's call) with the
weights in the plain layout and in row groups (CodeLayout.ROWS8), on the default model's shapes.

One thread, thread CPU time per call (a loaded machine's wall clock says little), the two layouts
alternating call by call, medians over rounds; at 1-8 rows the weights cycle through enough distinct
copies (--stream-mb) that each call streams them from memory, as a decode step does.

    python benchmarks/row_groups_linear.py --rows 1 4 8 16 512
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
from perfxlm.quant.weight import ActivationMode

# SmolLM2-135M: q|k|v, o, gate|up, down, the tied head
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
TYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def weight(qtype, n, k, seed):
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    raw[:, 0:2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-2).astype(np.float16).view(np.uint8).reshape(-1, 2)
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
            per = n * k * (1 if t == "q8_0" else 0.5)
            for rows in args.rows:
                copies = max(1, int(args.stream_mb * 2**20 // per)) if rows <= 8 else 1
                plain = [weight(TYPES[t], n, k, seed) for seed in range(copies)]
                grouped = [w.in_row_groups() for w in plain]
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
