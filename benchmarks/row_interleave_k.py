"""Row groups for K-quants (csrc/row_groups_k.h): perfxlm's batch-1 GEMV on Q4_K / Q5_K / Q6_K weights in the
plain layout (linear_q, int8 blocks) against linear_q_rows8_k on the same weights in row groups, one
thread, in the build this Python imports. The K-quant companion of row_interleave.py --real.

    python benchmarks/row_interleave_k.py                          # the default shapes, stream and resident
    python benchmarks/row_interleave_k.py --cases q6_k:49152x2048 --modes stream --rounds 9
    python benchmarks/row_interleave_k.py --rows 4                 # 4 activation rows per call

Default shapes (K-quant rows are whole super-blocks of 256: a 576-wide row, the default model's, is
stored by llama.cpp in a fallback type, so its shapes with K = 576 do not occur): Q4_K at the default
model's down projection (576x1536), 1536x768, and a 2B model's q/o, gate/up, down (2048x2048,
6144x2048, 2048x6144); Q5_K at 2048x2048; Q6_K at LM heads: 49152x768 (the default model's vocabulary),
49152x2048 (Qwen3-MoE-like) and 151936x2048 (Qwen's vocabulary).

Timing: per-call thread CPU time, the two ops alternated batch by batch in one process, medians over
rounds, activation rounding and dispatch included; "stream" cycles through more than --stream-mb of
distinct weights per op (a decode step's weights do not stay in cache; a weight larger than that is one
copy), "resident" repeats one weight. The ratio is plain time over row-group time (above 1: row groups
are faster). On a shared machine the wall clock moves; compare ratios from the same process.
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch

from perfxlm.ops import native
from perfxlm.quant import QuantizedWeight, row_groups_k
from perfxlm.quant.gguf_repack import repack

Q = gguf.GGMLQuantizationType
QTYPES = {"q4_k": Q.Q4_K, "q5_k": Q.Q5_K, "q6_k": Q.Q6_K}
_F16_AT = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
CASES = ["q4_k:576x1536", "q4_k:1536x768", "q4_k:2048x2048", "q4_k:6144x2048", "q4_k:2048x6144",
         "q5_k:2048x2048", "q6_k:49152x768", "q6_k:49152x2048", "q6_k:151936x2048"]  # fmt: skip
CHUNK_ROWS = 8192  # rows repacked and packed at a time: the repack's temporaries stay small


def weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> tuple[QuantizedWeight, tuple[torch.Tensor, torch.Tensor]]:
    """A random GGUF weight as the engine loads it, and its row groups (built CHUNK_ROWS rows at a time)."""
    qtype = QTYPES[fmt]
    elems, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    plain, grouped = [], []
    for r0 in range(0, n, CHUNK_ROWS):
        rows = min(CHUNK_ROWS, n - r0)
        raw = rng.integers(0, 256, size=(rows * k // elems, nbytes), dtype=np.uint8)
        for at in _F16_AT[qtype]:
            raw[:, at : at + 2] = (rng.uniform(0.5, 1.5, raw.shape[0]) * 1e-3).astype(np.float16).view(np.uint8).reshape(-1, 2)
        w = repack(raw, qtype, (rows, k))
        plain.append(w)
        grouped.append(row_groups_k.pack(w))
    cat = lambda ts: torch.cat(ts).contiguous()  # noqa: E731
    w = QuantizedWeight(cat([p.codes for p in plain]), cat([p.scales for p in plain]),
                        None if plain[0].mins is None else cat([p.mins for p in plain]), None, plain[0].bits,
                        plain[0].group, "float", n, k)  # fmt: skip
    return w, (cat([g[0] for g in grouped]), cat([g[1] for g in grouped]))


def times(fmt: str, n: int, k: int, m: int, stream_mb: float, rounds: int, per_batch: int) -> tuple[float, float]:
    ops = native.kernels()
    rng = np.random.default_rng(0)
    bits = row_groups_k.FORMATS[fmt]
    size = n * k * {4: 4.625, 5: 5.625, 6: 6.5625}[bits] / 8
    copies = max(2, int(stream_mb * 1e6 / size) + 1) if stream_mb > 0 and size < stream_mb * 1e6 else 1
    made = [weight(fmt, n, k, rng) for _ in range(copies)]
    x = torch.randn(m, k)
    calls = [0, 0]

    def plain() -> None:
        w = made[calls[0] % copies][0]
        calls[0] += 1
        ops.linear_q(x, w.codes, w.scales, w.mins, None, None, False, 1 << 30, False, True, 1 << 30)

    def rows8() -> None:
        c, p = made[calls[1] % copies][1]
        calls[1] += 1
        ops.linear_q_rows8_k(x, c, p, bits, n, None)

    fns = [plain, rows8]
    out: list[list[float]] = [[], []]
    for fn in fns:
        for _ in range(max(1, per_batch // 4)):
            fn()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t = time.thread_time()
            for _ in range(per_batch):
                fn()
            out[i].append((time.thread_time() - t) / per_batch)
    med = [sorted(t)[len(t) // 2] for t in out]
    return med[0], med[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated fmt:NxK (fmt q4_k, q5_k or q6_k)")
    ap.add_argument("--modes", default="stream,resident")
    ap.add_argument("--stream-mb", type=float, default=128.0)
    ap.add_argument("--rows", type=int, default=1, help="activation rows per call")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-batch", type=int, default=0, help="calls per timed batch (0: about 10 ms of work)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = native.kernels()
    if ops is None or not hasattr(ops, "linear_q_rows8_k"):
        raise SystemExit("this build has no linear_q_rows8_k")
    print(f"isa {ops.compiled_isa()}, one thread, {args.rows} activation row(s); thread CPU time per call, "
          "linear_q (plain) / linear_q_rows8_k (row groups):")
    for case in args.cases.split(","):
        fmt, shape = case.split(":")
        n, k = (int(v) for v in shape.split("x"))
        per = args.per_batch or max(1, int(3e8 / (n * k)))  # ~3e8 weights per batch: some 10 ms
        for mode in args.modes.split(","):
            t, t8 = times(fmt, n, k, args.rows, args.stream_mb if mode == "stream" else 0, args.rounds, per)
            print(f"  {fmt} {shape:>11} {mode:>8}: {t * 1e6:9.1f} us / {t8 * 1e6:9.1f} us  {t / t8:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
