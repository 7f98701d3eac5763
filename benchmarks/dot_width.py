"""The int8 block GEMV at batch 1 on 512-bit (zmm) against 256-bit (ymm) tiles, in one process: the
default model's (SmolLM2-135M) decode-step weights in each GGUF file's formats, each width in turn,
alternating step by step, medians.

    python benchmarks/dot_width.py --threads 1 --files q8_0,q4_0,q4_k_m --rounds 15
    python benchmarks/dot_width.py --threads 2 --resident

`streamed`: a whole decode step's distinct weights (30 layers' q/k/v/o/gate/up/down and the head: 60-150
MB, past the caches), called in order as a step calls them; `--resident`: one weight of each kind called
repeatedly (it stays in L2). Each call is timed in the calling thread's CPU time (with 1 thread: what the
call cost, however loaded the machine) and in wall time (with 2 threads, what the split cost too). Needs an
AVX512-VNNI build (the only one with both widths).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from perfxlm.ops import native

LAYERS = 30
# per layer: (kind, N, K, GGUF type) as each file holds the default model (its Q4_K_M file keeps the
# 576-wide matrices Q5_0, v Q8_0, and down alternating Q6_K / Q4_K; every file's head is Q8_0)
FILES = {
    "q8_0": lambda i: [("q", 576, 576, "Q8_0"), ("k", 192, 576, "Q8_0"), ("v", 192, 576, "Q8_0"),
                       ("o", 576, 576, "Q8_0"), ("gate", 1536, 576, "Q8_0"), ("up", 1536, 576, "Q8_0"),
                       ("down", 576, 1536, "Q8_0")],
    "q4_0": lambda i: [("q", 576, 576, "Q4_0"), ("k", 192, 576, "Q4_0"), ("v", 192, 576, "Q4_0"),
                       ("o", 576, 576, "Q4_0"), ("gate", 1536, 576, "Q4_0"), ("up", 1536, 576, "Q4_0"),
                       ("down", 576, 1536, "Q4_0")],
    "q4_k_m": lambda i: [("q", 576, 576, "Q5_0"), ("k", 192, 576, "Q5_0"), ("v", 192, 576, "Q8_0"),
                         ("o", 576, 576, "Q5_0"), ("gate", 1536, 576, "Q5_0"), ("up", 1536, 576, "Q5_0"),
                         ("down", 576, 1536, "Q6_K" if i % 2 == 0 else "Q4_K")],
}
HEAD = ("head", 49152, 576, "Q8_0")


def k_weight(n: int, k: int, qtype_name: str, seed: int):
    """Random GGUF blocks (finite float16 factors) repacked as the engine holds them."""
    import gguf
    import numpy as np

    from perfxlm.quant.gguf_repack import repack

    q = gguf.GGMLQuantizationType[qtype_name]
    elems, nbytes = gguf.GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
    Q = gguf.GGMLQuantizationType
    for at in {Q.Q6_K: (208,), Q.Q5_0: (0,), Q.Q8_0: (0,)}.get(q, (0, 2)):
        raw[:, at : at + 2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return repack(raw, q, (n, k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--files", default="q8_0,q4_0,q4_k_m")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--resident", action="store_true", help="one weight per kind, called repeatedly")
    ap.add_argument("--modes", default="512,256",
                    help="comma list of 512, 256, 256-nofold (256-bit tiles adding centred codes' mins per row)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ops = native.kernels()
    if ops is None or not hasattr(ops, "set_int8_dot_width"):
        raise SystemExit("no native kernels with a dot-width choice here")
    widths = args.modes.split(",")  # the modes, named as given

    def put(mode: str) -> None:
        width = int(mode.split("-")[0])
        if ops.set_int8_dot_width(width) != width:
            raise SystemExit(f"this build has no {width}-bit int8 tiles")
        ops.set_int8_centre_fold("nofold" not in mode)

    for mode in widths:
        put(mode)
    for name in args.files.split(","):
        layers = 1 if args.resident else LAYERS
        step = [(kind, fmt, k_weight(n, k, fmt, seed=100 * i + j))
                for i in range(layers) for j, (kind, n, k, fmt) in enumerate(FILES[name](i))]
        step.append((HEAD[0], HEAD[3], k_weight(*HEAD[1:], seed=7)))
        xs = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)) for k in (576, 1536)}
        mb = sum(w.nbytes for _, _, w in step) / 1e6
        repeat = 20 if args.resident else 1
        cpu: dict = defaultdict(list)  # (width, kind, fmt) -> CPU seconds per call, every call
        wall: dict = defaultdict(list)
        step_cpu: dict = defaultdict(list)  # width -> a round's step total
        step_wall: dict = defaultdict(list)
        outs = {}
        for r in range(args.rounds + 2):
            for width in widths if r % 2 == 0 else widths[::-1]:
                put(width)
                sc = sw = 0.0
                for kind, fmt, w in step:
                    x = xs[w.in_features]
                    c0, t0 = time.thread_time(), time.perf_counter()
                    for _ in range(repeat):
                        y = ops.linear_q(x, w.codes, w.scales, w.mins, w.levels, None, False, 8, False, True)
                    c1, t1 = time.thread_time(), time.perf_counter()
                    if r >= 2:  # two warm-up rounds
                        cpu[width, kind, fmt].append((c1 - c0) / repeat)
                        wall[width, kind, fmt].append((t1 - t0) / repeat)
                        sc += (c1 - c0) / repeat
                        sw += (t1 - t0) / repeat
                    outs[width, kind, fmt] = y
                if r >= 2:
                    step_cpu[width].append(sc)
                    step_wall[width].append(sw)
        print(f"{name}: {len(step)} weights, {mb:.1f} MB, {'resident' if args.resident else 'streamed'}, "
              f"{args.threads} thread(s), {args.rounds} rounds, medians")
        kinds = list(dict.fromkeys((kind, fmt) for kind, fmt, _ in step))
        counts = defaultdict(int)
        for kind, fmt, _ in step:
            counts[kind, fmt] += 1
        for label, table, steps in (("cpu", cpu, step_cpu), ("wall", wall, step_wall)):
            meds = [statistics.median(steps[width]) for width in widths]
            print(f"  {label} per step: " + "  ".join(f"{w}: {m * 1e3:7.3f} ms" for w, m in zip(widths, meds))
                  + "  | vs " + widths[0] + ": " + " ".join(f"{m / meds[0]:.3f}" for m in meds[1:]))
            for kind, fmt in kinds:
                meds = [statistics.median(table[width, kind, fmt]) * 1e6 for width in widths]
                print(f"    {kind:5s} {fmt:5s} x{counts[kind, fmt]:3d}: " + "  ".join(f"{w}: {m:8.2f} us" for w, m in zip(widths, meds))
                      + "  | " + " ".join(f"{m / meds[0]:.3f}" for m in meds[1:]))
        for other in widths[1:]:  # every mode computes the same products (to float rounding)
            err = max(float((outs[widths[0], k, f] - outs[other, k, f]).abs().max()
                            / outs[widths[0], k, f].abs().max().clamp_min(1e-30)) for k, f in kinds)
            print(f"  largest difference {other} vs {widths[0]}, relative to the output's largest: {err:.2e}")


if __name__ == "__main__":
    main()
