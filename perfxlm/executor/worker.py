"""One tensor-parallel rank: a spawned process pinned to its cores, holding its shard of the model and
its share of the KV cache, running every step the engine sends.

Its messages are `executor/worker_messages.py`'s; it runs inside `distributed/supervision.py`'s
`child_main`, which reports a failure as `Failed` before the process exits, exits when the engine's
process goes away and ignores Ctrl-C, which the engine handles.
"""

from __future__ import annotations

import os
from typing import Any

from perfxlm.distributed.supervision import Channel, Ready, Stats, StatsQuery, Stop
from perfxlm.executor.worker_messages import CacheReady, InitCache, Step, StepOutput


def worker_body(channel: Channel, rank: int, world_size: int, config: Any, init_method: str,
                cpus: list[int] | None) -> None:  # fmt: skip
    comm = None
    try:
        import torch

        from perfxlm.distributed.comm import init_process_group, make_communicator
        from perfxlm.distributed.parallel_state import TPGroup
        from perfxlm.distributed.topology import bind_current_process
        from perfxlm.executor.delta import DeltaDecoder
        from perfxlm.model.fused_decode import fused_decode_steps
        from perfxlm.model.layers.attention import Attention, common_head_dim
        from perfxlm.model.loader import load_model
        from perfxlm.ops import cpu_plan
        from perfxlm.worker.model_runner import ModelRunner

        threads = bind_current_process(cpus)
        resolved = config.resolved
        cpu_plan.use(resolved.cpu_plan)  # the engine's decisions (layout, GEMM, ISA tier), not this process's own
        if config.seed is not None:
            torch.manual_seed(config.seed)
        init_process_group(rank, world_size, init_method)
        comm = make_communicator(rank, world_size)
        model = load_model(config, tp=TPGroup(rank, world_size, comm))  # the parallel layers hold this rank's shard
        attn = next(m for m in model.modules() if isinstance(m, Attention))
        channel.send(Ready({
            "kv_bytes_per_block": ModelRunner.kv_bytes_per_block(model, resolved.block_size, resolved.kv_cache_spec),
            "comm": comm.name, "threads": threads, "cpus": cpus, "pid": os.getpid(),
            "heads": attn.num_heads, "kv_heads": attn.num_kv_heads, "head_dim": common_head_dim(model),
            "cpu_plan": cpu_plan.plan().describe(),
        }))  # fmt: skip
        msg = channel.recv()
        if not isinstance(msg, InitCache):
            return
        runner = ModelRunner(model, msg.num_blocks, resolved.block_size, resolved.kv_cache_spec)
        comm.barrier()
        channel.send(CacheReady())
        decoder = DeltaDecoder()
        while True:
            msg = channel.recv()
            if isinstance(msg, Step):
                out = runner.execute(decoder.decode(msg.delta))
                if rank == 0:
                    channel.send(StepOutput(out))
            elif isinstance(msg, StatsQuery):
                channel.send(Stats({"fused_decode_steps": fused_decode_steps(model)}))
            elif isinstance(msg, Stop):
                break
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
    finally:
        if comm is not None:
            comm.close()
