"""What each activation row adds to a row-group GEMV: per-call CPU time of the default model's products
(GGUF Q4_1 in affine row groups, its Q8_0 head in row groups) by row count, 1 to 8 rows (a plain decode
step is one; a verification of k guesses k + 1), and the cost of each row past the first.

    python benchmarks/row_groups_rows.py                   # SmolLM2-135M's shapes, one thread
    python benchmarks/row_groups_rows.py --shapes 1536x576 --rows 1,6
    python benchmarks/row_groups_rows.py --tiles 4,0       # tiles of at most 4 rows against the build's own

Timing: the engine's ops as the build this Python imports has them, one thread, the thread's CPU time per
call (robust on a shared machine), row counts alternated batch by batch in one process, medians over
rounds. Weights stream (more than --stream-mb of distinct copies per shape, as a decode step's weights do
not stay in cache). Run it under two checkouts (PYTHONPATH) to compare builds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch

from row_groups_q4_1 import weights as plain_and_grouped

from perfxlm.ops import native

Q = gguf.GGMLQuantizationType
# q|k|v, o, gate|up, down of one layer (x30), the tied head (Q8_0)
SHAPES = ["960x576:q4_1", "576x576:q4_1", "3072x576:q4_1", "576x1536:q4_1", "49152x576:q8_0"]


def weights(qtype: Q, n: int, k: int, copies: int, rng: np.random.Generator) -> list:
    """Random codes of `qtype` in row groups (the grouped halves of row_groups_q4_1's pairs)."""
    return [grouped for _, grouped in plain_and_grouped(qtype, n, k, copies, rng)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="NxK:q4_1|q8_0, comma-separated")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8")
    ap.add_argument("--stream-mb", type=float, default=64.0)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--per-batch", type=int, default=8)
    ap.add_argument("--tiles", default="0", help="row tile caps to alternate (set_row_tile; 0: the build's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ops = native.kernels()
    rows = [int(r) for r in args.rows.split(",")]
    tiles = [int(t) for t in args.tiles.split(",")]
    rng = np.random.default_rng(0)
    for spec in args.shapes.split(","):
        shape, fmt = spec.split(":")
        n, k = (int(v) for v in shape.split("x"))
        qtype = Q.Q4_1 if fmt == "q4_1" else Q.Q8_0
        bits = 4.5 if fmt == "q4_1" else 8.5
        copies = max(2, int(args.stream_mb * 1e6 / (n * k * bits / 8)) + 1)
        ws = weights(qtype, n, k, copies, rng)
        xs = {m: torch.randn(m, k) for m in rows}
        calls = [0]

        def call(m: int) -> None:
            w = ws[calls[0] % copies]
            calls[0] += 1
            ops.linear_q(xs[m], w.codes, w.scales, w.mins, None, None, False, 64, False, True, 64, -1,
                         w.layout.value.native, n)  # fmt: skip

        for m in rows:  # warm
            for _ in range(copies):
                call(m)
        per: dict[tuple[int, int], list[float]] = {(t, m): [] for t in tiles for m in rows}
        for _ in range(args.rounds):
            for m in rows:
                for tile in tiles:
                    ops.set_row_tile(tile)
                    t = time.thread_time()
                    for _ in range(args.per_batch):
                        call(m)
                    per[(tile, m)].append((time.thread_time() - t) / args.per_batch * 1e6)
        ops.set_row_tile(0)
        for tile in tiles:
            med = {m: statistics.median(per[(tile, m)]) for m in rows}
            one = med[rows[0]]
            line = "  ".join(f"{m}:{med[m]:7.1f}" + (f" (+{(med[m] - one) / (m - rows[0]):5.1f}/row)" if m != rows[0] else "")
                             for m in rows)
            label = f"tile {tile}" if tile else "tile -"
            print(f"{shape:>9} {fmt} {label}  us per call  {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
