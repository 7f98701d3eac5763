"""Batch-1 GEMVs of the default model's format (GGUF Q4_1) per call: the plain layout's block GEMV against
affine row groups (CodeLayout.ROWS8_M, csrc/row_groups_m.h), beside Q4_0's plain and row-group GEMVs on
the same shapes (the headroom row groups gave the centred format).

    python benchmarks/row_groups_q4_1.py                          # SmolLM2-135M's shapes and its head
    python benchmarks/row_groups_q4_1.py --shapes 576x576 --threads 2 --modes stream

Timing: the engine's own ops as the build this Python imports has them (int8 activation blocks), one
thread unless --threads; per-call thread CPU time (one thread) or wall time (more), the kernels
alternated batch by batch in one process, medians over rounds. "stream" cycles through more than
--stream-mb of distinct weights per kernel (a decode step's weights do not stay in cache), "resident"
repeats one weight. On a shared machine the wall clock moves: say so with any figure.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from perfxlm.ops import native
from perfxlm.quant.gguf_repack import repack
from perfxlm.quant.weight import ActivationMode

Q = gguf.GGMLQuantizationType
SHAPES = ["576x576", "1536x576", "576x1536", "49152x576"]  # q/o, gate/up, down, the tied head


def weights(qtype: Q, n: int, k: int, copies: int, rng: np.random.Generator) -> list:
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    out = []
    for _ in range(copies):
        raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
        d = rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-3
        raw[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
        if qtype == Q.Q4_1:
            raw[:, 2:4] = (-8 * d).astype(np.float16).view(np.uint8).reshape(-1, 2)
        w = repack(raw, qtype, (n, k))
        w.use_activations(ActivationMode.INT8_NATIVE)
        out.append((w, w.in_row_groups()))
    return out


def times(n: int, k: int, stream_mb: float, rounds: int, per_batch: int, threads: int) -> dict[str, float]:
    ops = native.kernels()
    rng = np.random.default_rng(0)
    copies = max(2, int(stream_mb * 1e6 / (n * k * 20 / 32)) + 1) if stream_mb > 0 else 1
    q41, q40 = weights(Q.Q4_1, n, k, copies, rng), weights(Q.Q4_0, n, k, copies, rng)
    x = torch.randn(1, k)
    big = 1 << 30

    def kernel(ws, grouped):
        calls = [0]

        def call() -> None:
            w, r = ws[calls[0] % copies]
            calls[0] += 1
            if grouped:
                ops.linear_q(x, r.codes, r.scales, r.mins, None, None, False, big, False, True, big, -1,
                             r.layout.value.native, n)  # fmt: skip
            else:
                ops.linear_q(x, w.codes, w.scales, w.mins, None, None, False, big, False, True, big)

        return call

    fns = {"q4_1 plain": kernel(q41, False), "q4_1 rows8_m": kernel(q41, True),
           "q4_0 plain": kernel(q40, False), "q4_0 rows8": kernel(q40, True)}  # fmt: skip
    clock = time.thread_time if threads == 1 else time.perf_counter
    got: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(per_batch):
            fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            t = clock()
            for _ in range(per_batch):
                fn()
            got[name].append((clock() - t) / per_batch)
    return {name: sorted(t)[len(t) // 2] for name, t in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK")
    ap.add_argument("--stream-mb", type=float, default=64.0)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-batch", type=int, default=10, help="calls per timed batch")
    ap.add_argument("--modes", default="stream,resident")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if native.kernels() is None or not hasattr(native.kernels(), "linear_q_rows8_m"):
        raise SystemExit("needs the native kernels with affine row groups")
    torch.set_num_threads(args.threads)
    clock = "thread CPU time" if args.threads == 1 else "wall time"
    print(f"per call, {args.threads} thread(s), {clock}, medians of {args.rounds} rounds (us); ratio: plain / groups")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for mode in args.modes.split(","):
            t = times(n, k, args.stream_mb if mode == "stream" else 0, args.rounds, args.per_batch, args.threads)
            us = {name: v * 1e6 for name, v in t.items()}
            print(f"  {shape:>9} {mode:>8}: q4_1 {us['q4_1 plain']:8.1f} -> {us['q4_1 rows8_m']:8.1f} "
                  f"({t['q4_1 plain'] / t['q4_1 rows8_m']:4.2f}x)   q4_0 {us['q4_0 plain']:8.1f} -> "
                  f"{us['q4_0 rows8']:8.1f} ({t['q4_0 plain'] / t['q4_0 rows8']:4.2f}x)")


if __name__ == "__main__":
    main()
