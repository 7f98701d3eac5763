"""Speed of each KV cache dtype, same run: decode at a long context and many parallel sequences.

Runs `perfxlm bench latency` once per (workload, kv_cache_dtype) per round, rounds interleaved so that
drift on a shared machine hits every dtype alike, and reports medians with the ratio to the `auto`
(model dtype) cache. Workloads (issue targets): batch-1 decode after a 4k-token prompt, and 64 parallel
sequences of 512 in / 128 out.

    python benchmarks/kv_cache_speed.py                       # embedded model
    python benchmarks/kv_cache_speed.py --model model.Q4_0.gguf --rounds 3 --output-json kv.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

WORKLOADS = {
    # name: (batch, input, output, the figure reported, its unit)
    "decode-4k": (1, 4096, 32, "median_decode_step_ms", "ms / decode step"),
    "p64-512-128": (64, 512, 128, "median_throughput_tok_s", "generated tok/s end to end"),
}


def run_once(model: str | None, kv: str, spec: tuple, threads: int, extra: list[str]) -> float:
    batch, inp, out, key, _ = spec
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lat.json"
        cmd = [sys.executable, "-m", "perfxlm", "bench", "latency", "--batch-size", str(batch), "--input-len",
               str(inp), "--output-len", str(out), "--num-iters", "1", "--num-iters-warmup", "1",
               "--kv-cache-dtype", kv, "--threads", str(threads), "--quiet", "--output-json", str(path),
               *extra]
        if model:
            cmd += ["--model", model]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        return json.loads(path.read_text())[key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded model")
    ap.add_argument("--kv", default="auto,int8,fp8", help="comma-separated kv_cache_dtype values")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"any of {', '.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench-arg", action="append", default=[], help="passed to `perfxlm bench latency`")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    kvs = [k.strip() for k in a.kv.split(",") if k.strip()]
    names = [w.strip() for w in a.workloads.split(",") if w.strip()]
    raw = {w: {k: [] for k in kvs} for w in names}
    for rnd in range(a.rounds):
        for i, w in enumerate(names):
            order = kvs if (rnd + i) % 2 == 0 else kvs[::-1]
            for kv in order:
                raw[w][kv].append(run_once(a.model, kv, WORKLOADS[w], a.threads, a.bench_arg))
                print(f"round {rnd + 1} {w} {kv}: {raw[w][kv][-1]:.2f}", flush=True)
    print(f"\n| workload | {' | '.join(kvs)} |\n|---|{'---:|' * len(kvs)}")
    summary = {}
    for w in names:
        med = {kv: statistics.median(v) for kv, v in raw[w].items()}
        base = med[kvs[0]]
        cells = [f"{med[kv]:.2f} ({med[kv] / base:.2f}x)" for kv in kvs]
        print(f"| {w}, {WORKLOADS[w][4]} | {' | '.join(cells)} |")
        summary[w] = med
    print(f"\nmedians of {a.rounds} rounds; ratios against {kvs[0]} (for ms, lower is faster)")
    if a.output_json:
        result = {"summary": summary, "raw": raw, "model": a.model}
        Path(a.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
