"""Batch-1 decode tok/s of one GGUF file with its Q8_0 / Q4_0 matrices in the plain layout and in row
groups (PERFXLM_ROW_INTERLEAVE=0 / 8), both engines in one process, alternating round by round; medians.

Decode time is a request of `--new` tokens less the same request with one (its prefill and first token),
so the figure is the steady decode rate. Wall clock and process CPU time both: on a loaded machine the
CPU time (over the threads) is the steadier figure.

    python benchmarks/row_groups_decode.py --gguf ~/.cache/perfxlm/compare/<file>.q8_0.gguf
    python benchmarks/row_groups_decode.py --gguf <file with a K-quant head> --knob head_k

`--knob head_k` compares the K-quant head's layouts alone (PERFXLM_ROW_GROUPS_K=off / head, row groups on),
`--knob all_k` every K-quant matrix's (PERFXLM_ROW_GROUPS_K=off / all, row groups on).
`--knob streams` one engine, the order threads walk their row groups in (set_gemv_streams 1 / 2:
one sequential stream, or two far-apart halves side by side) switched round by round in the one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from perfxlm import LLM, SamplingParams
from perfxlm.ops import cpu_plan, native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--knob", choices=("interleave", "head_k", "all_k", "streams"), default="interleave")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    values = (1, 2) if args.knob == "streams" else (0, 8)
    if args.knob == "streams":
        llm = LLM(args.gguf, kv_cache_gib=0.25, enable_prefix_caching=False)
        engines = {1: llm, 2: llm}
        print(cpu_plan.plan().describe(), flush=True)
    for value in () if args.knob == "streams" else values:
        os.environ["PERFXLM_ROW_INTERLEAVE"] = str(value if args.knob == "interleave" else 8)
        if args.knob != "interleave":
            os.environ["PERFXLM_ROW_GROUPS_K"] = (args.knob[:-2] if value else "off")
        cpu_plan.reset()
        engines[value] = LLM(args.gguf, kv_cache_gib=0.25, enable_prefix_caching=False)
        print(value, cpu_plan.plan().describe(), flush=True)
    prompt = {"prompt_token_ids": [100 + (i * 37) % 5000 for i in range(args.prompt)]}
    full = SamplingParams(temperature=0, max_tokens=args.new + 1, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    wall = {v: [] for v in values}
    cpu = {v: [] for v in values}
    for r in range(args.rounds + 1):
        for value in (values if r % 2 else values[::-1]):
            llm = engines[value]
            if args.knob == "streams":
                native.kernels().set_gemv_streams(value)
            times = []
            for params in (full, first):
                w0, c0 = time.perf_counter(), time.process_time()
                llm.generate([prompt], params, use_tqdm=False)
                times.append((time.perf_counter() - w0, time.process_time() - c0))
            if r:  # the first round warms up
                wall[value].append(args.new / (times[0][0] - times[1][0]))
                cpu[value].append(args.new / (times[0][1] - times[1][1]))
    for value in values:
        name = (f"PERFXLM_ROW_INTERLEAVE={value}" if args.knob == "interleave"
                else f"row group streams {value}" if args.knob == "streams"
                else f"PERFXLM_ROW_GROUPS_K={args.knob[:-2] if value else 'off'}")
        print(f"{name}: decode {statistics.median(wall[value]):.1f} tok/s wall (loaded), "
              f"{statistics.median(cpu[value]):.1f} tok/s per CPU-second", flush=True)
    a, b = values
    print(f"ratio {b}/{a}: wall {statistics.median(wall[b]) / statistics.median(wall[a]):.3f}, "
          f"CPU {statistics.median(cpu[b]) / statistics.median(cpu[a]):.3f}")


if __name__ == "__main__":
    main()
