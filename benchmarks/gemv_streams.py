"""Batch-1 GEMV read rate from DRAM, per read pattern (csrc/read_streams.h): the row-group kernels (Q8_0 /
Q4_0 `rows8`, Q4_1 `rows8_m`, K-quants `rows8_k`) and the bf16 panel kernel (`bf16p`,
linear_bf16_packed: the AVX2 tier's bf16 layout), each thread reading its share as one sequential stream
(streams=1) or as its two halves side by side (streams=2: two far-apart streams; Q8_0 / Q4_0 and the
panels interleave them a block / a k step at a time, the Q4_1 and K-quant groups a group at a time).

Each call reads weights from DRAM, as a decode step does: the weight cycles through enough distinct copies
(--stream-mb, several times the L3) that none is cache-resident when it comes round again. Wall clock per
call (the product runs on every thread) and the process's CPU time per call over the threads (the steadier
figure on a shared machine: time the threads were off the CPU is not counted, time stalled on memory is),
the two orders alternating round by round in one process, medians; GB/s = the weight's bytes / time per
call. Say "loaded" with any figure taken while others run.

    python benchmarks/gemv_streams.py                       # native tier, 1 and 2 threads
    python benchmarks/gemv_streams.py --isa avx2 --threads 2
    python benchmarks/gemv_streams.py --types q4_k q6_k --shapes qkv1b gate_up1b down1b
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isa", default=None, help="force a kernel tier (PERFXLM_ISA), e.g. avx2")
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0", "q4_1", "q4_k", "bf16p"])
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="default: the default model's for 32-blocks, Llama-3.2-1B's for all")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2], help="0: each kernel's default")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--stream-mb", type=int, default=160)
    args = ap.parse_args()
    if args.isa:
        os.environ["PERFXLM_ISA"] = args.isa  # read when the kernels load, below

    import gguf
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import row_groups_linear
    from row_groups_linear import SHAPES, weight

    from perfxlm.ops import native
    from perfxlm.ops.linear import pack_bf16, run_linear_q
    from perfxlm.quant.layouts import CodeLayout

    Q = gguf.GGMLQuantizationType
    types = {"q8_0": (Q.Q8_0, CodeLayout.ROWS8), "q4_0": (Q.Q4_0, CodeLayout.ROWS8),
             "q4_1": (Q.Q4_1, CodeLayout.ROWS8_M), "q4_k": (Q.Q4_K, CodeLayout.ROWS8_K),
             "q6_k": (Q.Q6_K, CodeLayout.ROWS8_K), "bf16p": (None, None)}
    row_groups_linear.F16_AT.setdefault(Q.Q4_1, (0, 2))  # Q4_1's d and m: finite float16
    ops = native.kernels()
    print(f"tier {ops.compiled_isa()}  (wall clock: label loaded / quiet by the machine's state)")
    for t in args.types:
        qtype, layout = types[t]
        k_quant = layout is CodeLayout.ROWS8_K
        shapes = args.shapes or (["qkv1b", "gate_up1b", "down1b"] if k_quant else
                                 ["qkv", "gate_up", "down", "qkv1b", "gate_up1b", "down1b"])
        for name in shapes:
            n, k = SHAPES[name]
            if k_quant and k % 256:
                continue
            if qtype is None:  # bf16 panels
                def make(seed):
                    g = torch.Generator().manual_seed(seed)
                    return pack_bf16(torch.randn(n, k, generator=g).bfloat16())

                def call(w):
                    return ops.linear_bf16_packed(x, w, n, None)

                per = n * k * 2
            else:
                def make(seed):
                    return weight(qtype, n, k, seed).in_layout(layout)

                def call(w):
                    return run_linear_q(ops, x, w, None, False, True, False)

                per = make(0).nbytes
            copies = max(2, int(args.stream_mb * 2**20 // per))
            ws = [make(s) for s in range(copies)]
            x = torch.randn(1, k)
            for threads in args.threads:
                torch.set_num_threads(threads)
                times: dict[int, list[float]] = {s: [] for s in args.streams}
                cpu: dict[int, list[float]] = {s: [] for s in args.streams}
                ref = None
                for r in range(args.rounds + 1):
                    order = args.streams if r % 2 else list(reversed(args.streams))
                    for s in order:
                        ops.set_gemv_streams(s)
                        out = call(ws[0])
                        if ref is None:
                            ref = out
                        elif not torch.equal(out, ref):
                            first = args.streams[0]
                            raise SystemExit(f"{t} {name}: streams={s} differs from streams={first}")
                        t0, c0 = time.perf_counter(), time.process_time()
                        for w in ws:
                            call(w)
                        if r:
                            times[s].append((time.perf_counter() - t0) / copies)
                            cpu[s].append((time.process_time() - c0) / copies / threads)
                cells = "  ".join(f"streams={s} {per / statistics.median(times[s]) / 1e9:5.1f} GB/s wall "
                                  f"{per / statistics.median(cpu[s]) / 1e9:5.1f} per CPU"
                                  for s in args.streams)
                print(f"{t} {name:9s} {n}x{k} ({per / 2**20:.1f} MiB x {copies}) threads={threads}: {cells}",
                      flush=True)
    ops.set_gemv_streams(0)  # each kernel's default again


if __name__ == "__main__":
    main()
