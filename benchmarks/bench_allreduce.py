"""All-reduce latency between tensor-parallel ranks on one machine: the shared-memory path against gloo.

    python benchmarks/bench_allreduce.py [--world-size 2] [--sizes 8K,32K,128K,512K,1M] [--iters 500]

Each rank is a spawned process pinned to its own core (one thread), as the engine's workers are. Sizes
are bytes of float32; the time is the median over `iters` calls after a warm-up, read on rank 0, the
all-gather of the logits beside it. Prints a Markdown table (and JSON with --output-json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1], 1)
    return int(float(text.rstrip("KM")) * mult)


def _rank(rank: int, world: int, init: str, sizes: list[int], iters: int, cpus, queue) -> None:
    import torch
    import torch.distributed as dist

    from perfxlm.distributed.comm import GlooCommunicator, init_process_group, make_communicator
    from perfxlm.distributed.topology import bind_current_process

    bind_current_process(cpus)
    torch.set_num_threads(1)
    init_process_group(rank, world, init)
    comms = {"shm": make_communicator(rank, world, "shm"), "gloo": GlooCommunicator()}
    results = []
    for size in sizes:
        x = torch.randn(size // 4)
        row = {"bytes": size}
        for name, comm in comms.items():
            if name == "shm" and comm.name != "shm":
                continue
            for op in ("all_reduce", "all_gather"):
                fn = getattr(comm, op)
                times = []
                for i in range(iters + 20):
                    y = x.clone()
                    t = time.perf_counter()
                    fn(y)
                    times.append(time.perf_counter() - t)
                row[f"{name}_{op}_us"] = statistics.median(times[20:]) * 1e6
        results.append(row)
        if rank == 0:
            # check: the shared-memory sum equals gloo's
            a, b = x.clone(), x.clone()
            comms["shm"].all_reduce(a), comms["gloo"].all_reduce(b)
            row["max_abs_diff"] = float((a - b).abs().max())
        else:
            a, b = x.clone(), x.clone()
            comms["shm"].all_reduce(a), comms["gloo"].all_reduce(b)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default="8K,32K,128K,512K,1M")
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    import multiprocessing as mp

    from perfxlm.distributed.comm import shm_native
    from perfxlm.distributed.topology import plan_rank_cpus

    shm_native()  # build once before the ranks start
    sizes = [_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/rendezvous"
        cpus = plan_rank_cpus(args.world_size)
        procs = [ctx.Process(target=_rank, args=(r, args.world_size, init, sizes, args.iters, cpus[r], queue))
                 for r in range(args.world_size)]
        for proc in procs:
            proc.start()
        try:
            results = queue.get(timeout=600)
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
    print(f"{args.world_size} ranks, one core each ({', '.join(map(str, cpus))}); median µs per call")
    print("| size | shm all-reduce | gloo all-reduce | gloo / shm | shm all-gather | gloo all-gather |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in results:
        kb = row["bytes"] / 1024
        shm = row.get("shm_all_reduce_us", float("nan"))
        print(f"| {kb:g} KB | {shm:.1f} | {row['gloo_all_reduce_us']:.1f} | {row['gloo_all_reduce_us'] / shm:.1f}x | "
              f"{row.get('shm_all_gather_us', float('nan')):.1f} | {row['gloo_all_gather_us']:.1f} |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"world_size": args.world_size, "cpus": cpus, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
