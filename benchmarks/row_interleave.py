"""Would a row-interleaved code layout speed up batch-1 decode? A standalone micro-benchmark of the
int8-dot GEMV for Q8_0 and Q4_0 weights (row_interleave_proto.cpp, built here with g++ -O3 -march=native,
one thread), in perfxlm's layout and in interleaved ones, on the default model's shapes.

    python benchmarks/row_interleave.py                       # check, then time (stream and resident)
    python benchmarks/row_interleave.py --callgrind           # and instructions per call (valgrind)
    python benchmarks/row_interleave.py --shapes 576x576 --formats q8 --rounds 31
    python benchmarks/row_interleave.py --real-only   # perfxlm's linear_q against its linear_q_rows8

The question (ik_llama.cpp's "_R4" / "_R8" types): perfxlm's batch-1 kernels hold a row's codes together,
so per 64-code chunk and row they spread the row's scales over the int32 lanes (a permute) and convert
and FMA once per row, and per row they add the mins term and reduce 16 lanes to one. Stored with the
blocks of R consecutive rows together ([quad][row][4 bytes] per block of 32, the R rows' float16 scales
first), one vpdpbusd's lanes belong to R different rows: per block one conversion and one FMA with the R
scales as loaded serve R rows, the centre comes off in the integer sums, and the results come out in
lanes. Kernels timed (names as printed):

  plain_vnni_zmm   perfxlm's AVX512-VNNI batch-1 tile (vnni_block_tile, one activation row, four weight
                   rows) after its activation pass, written as csrc/quant_linear.cpp has it
  plain_avx2       perfxlm's AVX2 four-row kernels (block_tile_m1x4 / _q8: vpmaddubsw + vpmaddwd)
  rR_vnni_ymm/zmm  R interleaved rows, vpdpbusd on ymm (AVX512-VL) or zmm; a vector holds W/32/R quads
                   per row (QV), the activations spread to match once per call where QV > 1
  rR_avx2          R interleaved rows with vpmaddubsw + vpmaddwd (4-bit: one vpmaddwd per block)

--real (or --real-only) times the engine's own ops the same way, in the build this Python imports:
linear_q on the plain layout against linear_q_rows8 on the same weights in row groups
(perfxlm/quant/row_groups.py, csrc/row_groups.h: the R = 8 layout, ymm vpdpbusd or vpmaddubsw).

Timing: per-call thread CPU time, the kernels alternated batch by batch in one process, the median over
rounds; "stream" cycles through more than --stream-mb of distinct weights per kernel (a decode step's
weights do not stay in cache), "resident" repeats one weight. The ratio printed is plain time over
interleaved time (above 1: the interleaved layout is faster), for the same ISA (VNNI kernels against
plain_vnni_zmm, AVX2 ones against plain_avx2). On a shared machine the wall clock moves; thread CPU time
and callgrind's instruction counts are the figures to compare.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "row_interleave_proto.cpp")
SHAPES = ["576x576", "192x576", "1536x576", "576x1536"]  # q/o, k/v, gate/up, down of SmolLM2-135M


def build(out_dir: str, flags: list[str], name: str) -> str:
    exe = os.path.join(out_dir, name)
    subprocess.run(["g++", "-O3", *flags, "-std=c++17", "-o", exe, SOURCE], check=True)
    return exe


def run(cmd: list[str]) -> str:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return res.stdout


def baseline(kernel: str) -> str:
    return "plain_avx2" if kernel.endswith("avx2") else "plain_vnni_zmm"


def callgrind_per_call(exe: str, fmt: str, n: str, k: str, kernel: str, calls: int) -> float:
    """Instructions per call: a run of `calls` calls less a run of none (the same setup)."""
    totals = []
    with tempfile.TemporaryDirectory() as d:
        for c in (0, calls):
            out = os.path.join(d, f"cg.{c}")
            subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", exe, "count", fmt, n, k,
                            "0", "1", "1", kernel, str(c)], check=True, capture_output=True)
            with open(out) as f:
                text = f.read()
            totals.append(int(re.search(r"^(?:summary|totals):\s+(\d+)", text, re.M).group(1)))
    return (totals[1] - totals[0]) / calls


def real_times(fmt: str, n: int, k: int, stream_mb: float, rounds: int, per_batch: int) -> tuple[float, float]:
    """perfxlm's own batch-1 calls (the build this Python imports, one thread, int8 blocks), alternated
    batch by batch: linear_q on the plain layout and linear_q_rows8 on row groups (nan where the build has
    none). Per-call thread CPU time, medians over rounds, dispatch included."""
    import time

    import gguf
    import numpy as np
    import torch

    from perfxlm.ops import native
    from perfxlm.quant import row_groups
    from perfxlm.quant.gguf_repack import repack

    torch.set_num_threads(1)
    ops = native.kernels()
    has_rows8 = hasattr(ops, "linear_q_rows8")
    qtype = gguf.GGMLQuantizationType.Q8_0 if fmt == "q8" else gguf.GGMLQuantizationType.Q4_0
    bits = 8 if fmt == "q8" else 4
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(0)
    size = n * k // elems * nbytes
    copies = max(2, int(stream_mb * 1e6 / size) + 1) if stream_mb > 0 else 1
    weights, grouped = [], []
    for _ in range(copies):
        raw = rng.integers(0, 256, size=(n * k // elems, nbytes), dtype=np.uint8)
        raw[:, 0:2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
        w = repack(raw, qtype, (n, k))
        weights.append(w)
        if has_rows8:
            grouped.append(row_groups.pack(w.codes, w.scales, bits))
    x = torch.randn(1, k)
    calls = [0, 0]

    def plain() -> None:
        w = weights[calls[0] % copies]
        calls[0] += 1
        ops.linear_q(x, w.codes, w.scales, w.mins, w.levels, None, False, 1 << 30, False, True, 1 << 30)

    def rows8() -> None:
        c, s = grouped[calls[1] % copies]
        calls[1] += 1
        ops.linear_q_rows8(x, c, s, bits, n, None)

    fns = [plain, rows8] if has_rows8 else [plain]
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        for _ in range(per_batch):
            fn()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.thread_time()
            for _ in range(per_batch):
                fn()
            times[i].append((time.thread_time() - t) / per_batch)
    med = [sorted(t)[len(t) // 2] for t in times]
    return med[0], med[1] if has_rows8 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated NxK")
    ap.add_argument("--formats", default="q8,q4")
    ap.add_argument("--stream-mb", type=float, default=128.0)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--per-batch", type=int, default=20, help="calls per timed batch")
    ap.add_argument("--modes", default="stream,resident")
    ap.add_argument("--callgrind", action="store_true")
    ap.add_argument("--callgrind-calls", type=int, default=10)
    ap.add_argument("--real", action="store_true",
                    help="also time perfxlm's own ops: linear_q (plain layout) against linear_q_rows8 (row groups)")
    ap.add_argument("--real-only", action="store_true", help="only --real (no standalone kernels)")
    args = ap.parse_args()
    if shutil.which("g++") is None:
        raise SystemExit("needs g++")
    out_dir = tempfile.mkdtemp(prefix="row_interleave_")
    exe = build(out_dir, ["-march=native"], "proto_native")
    results: dict[tuple, float] = {}
    for fmt in args.formats.split(",") if not args.real_only else []:
        for shape in args.shapes.split(","):
            n, k = shape.split("x")
            sys.stdout.write(run([exe, "check", fmt, n, k]))
            for mode in args.modes.split(","):
                mb = str(args.stream_mb if mode == "stream" else 0)
                text = run([exe, "time", fmt, n, k, mb, str(args.rounds), str(args.per_batch)])
                sys.stdout.write(text)
                for m in re.finditer(r"^time (\S+) (\S+) (\S+) (\S+) ([\d.]+) us", text, re.M):
                    results[(m[1], m[3], m[4], m[2])] = float(m[5])
    if args.real or args.real_only:
        print("\nperfxlm's ops, one thread, thread CPU time per call incl. dispatch: linear_q (plain) / "
              "linear_q_rows8 (row groups):")
        for fmt in args.formats.split(","):
            for shape in args.shapes.split(","):
                n, k = (int(v) for v in shape.split("x"))
                for mode in args.modes.split(","):
                    t, t8 = real_times(fmt, n, k, args.stream_mb if mode == "stream" else 0, args.rounds, args.per_batch)
                    print(f"  {fmt} {shape:>9} {mode:>8}: {t * 1e6:7.2f} us / {t8 * 1e6:7.2f} us  {t / t8:5.2f}x")
    print("\nplain / interleaved, per call (thread CPU time, medians):")
    for (fmt, shape, mode, kernel), t in results.items():
        if kernel.startswith("plain"):
            continue
        base = results[(fmt, shape, mode, baseline(kernel))]
        print(f"  {fmt} {shape:>9} {mode:>8} {kernel:>13}: {base / t:5.2f}x  ({base:.2f} -> {t:.2f} us)")
    if args.callgrind:
        # valgrind has no AVX-512: the AVX2 kernels, from a build for AVX2 + FMA + F16C
        exe2 = build(out_dir, ["-mavx2", "-mfma", "-mf16c"], "proto_avx2")
        print("\ninstructions per call (callgrind, AVX2 build), plain / interleaved:")
        for fmt in args.formats.split(","):
            for shape in args.shapes.split(","):
                n, k = shape.split("x")
                kernels = ["plain_avx2", "r4_avx2", "r8_avx2"]
                ir = {kern: callgrind_per_call(exe2, fmt, n, k, kern, args.callgrind_calls) for kern in kernels}
                for kern in kernels:
                    ratio = "" if kern.startswith("plain") else f"  {ir[baseline(kern)] / ir[kern]:5.2f}x"
                    print(f"  {fmt} {shape:>9} {kern:>14}: {ir[kern]:10.0f}{ratio}")
    shutil.rmtree(out_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
