"""Tensor parallelism with every rank started from outside (vLLM's distributed_executor_backend=
"external_launcher"): `torchrun --nnodes K --nproc-per-node P script.py`, the script building
`LLM(model, tensor_parallel_size=K*P, distributed_executor_backend="external_launcher")` on every rank.

Each process is one rank: it joins the process group from torchrun's variables (env://: MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE; LOCAL_RANK and LOCAL_WORLD_SIZE pick its cores on its machine with the
same plan as spawned workers, `distributed/topology.py`), loads its shard, and runs the whole engine
(tokenizer, scheduler, KV cache manager) itself. The ranks are given the same prompts in the same order
and schedule the same steps: the scheduler is deterministic given the same requests, the same pool and
the same sampled tokens. The pool is the smallest any rank could hold (`agree_num_blocks`), and after each
step rank 0's ModelRunnerOutput is broadcast and used by every rank, so every rank's scheduler and
outputs are rank 0's, whatever its own sampler drew (`generate` returns the same outputs on every rank).

Collectives: shared memory where every rank sees the same /dev/shm (one machine), else gloo over TCP
(several machines; pick the interface with GLOO_SOCKET_IFNAME). A rank that fails raises in its own
process; the others stop in their next collective after PERFXLM_COLLECTIVE_TIMEOUT seconds (or gloo's
timeout), so torchrun's own fault handling ends the job.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

from perfxlm.executor.base import Executor

logger = logging.getLogger("perfxlm")

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _shared_memory_everywhere(rank: int) -> bool:
    """Whether every rank sees the same /dev/shm: rank 0 creates a file there, the others look for it."""
    import torch
    import torch.distributed as dist

    path = [f"/dev/shm/perfxlm-probe-{os.getpid()}-{os.urandom(6).hex()}" if rank == 0 else None]
    if rank == 0 and os.path.isdir("/dev/shm"):
        open(path[0], "w").close()
    dist.broadcast_object_list(path, src=0)
    ok = torch.tensor([1 if os.path.exists(path[0]) else 0], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    dist.barrier()
    if rank == 0:
        try:
            os.unlink(path[0])
        except OSError:
            pass
    return bool(ok.item())


class ExternalLauncherExecutor(Executor):
    def __init__(self, config: Any) -> None:
        import torch.distributed as dist

        from perfxlm.distributed.comm import collective_timeout, make_communicator
        from perfxlm.distributed.parallel_state import TPGroup
        from perfxlm.distributed.topology import bind_current_process, plan_rank_cpus
        from perfxlm.model.loader import load_model

        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise ValueError(f"distributed_executor_backend='external_launcher' needs the process started by torchrun "
                             f"(or with its variables set): {', '.join(missing)} not set.")
        self.config = config
        self.rank, self.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if self.world_size != config.tensor_parallel_size:
            raise ValueError(f"torchrun started {self.world_size} processes but tensor_parallel_size is "
                             f"{config.tensor_parallel_size}: they must be equal under external_launcher.")
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.cpus = plan_rank_cpus(local_size)[local_rank]
        self.threads = bind_current_process(self.cpus)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group("gloo", init_method="env://", rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=max(30.0, collective_timeout())))
        kind = os.environ.get("PERFXLM_ALLREDUCE", "shm")
        if kind == "shm" and not _shared_memory_everywhere(self.rank):
            kind = "gloo"  # ranks on several machines
        self.comm = make_communicator(self.rank, self.world_size, kind)
        self.model = load_model(config, tp=TPGroup(self.rank, self.world_size, self.comm))
        # speculative decoding: rank 0 alone proposes (a draft model loads there only), every rank verifies
        # its drafts, so the ranks' schedulers stay identical
        self.proposes_drafts = self.rank == 0
        self._runner: Any = None  # not `runner`: the engine core would call it directly, skipping the broadcast
        logger.info("external launcher: rank %d of %d, %s collectives, cores %s", self.rank, self.world_size,
                    self.comm.name, self.cpus or "all")

    # ---- executor interface ----------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int, spec: Any) -> int:
        """Of all ranks together, as with spawned workers."""
        import torch
        import torch.distributed as dist

        from perfxlm.worker.model_runner import ModelRunner

        mine = torch.tensor([ModelRunner.kv_bytes_per_block(self.model, block_size, spec)], dtype=torch.int64)
        dist.all_reduce(mine)
        return int(mine.item())

    def agree_num_blocks(self, num_blocks: int) -> int:
        """Every rank's scheduler needs the same pool: the smallest one any rank planned (their memory differs)."""
        import torch
        import torch.distributed as dist

        n = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MIN)
        return int(n.item())

    def head_dim(self) -> int | None:
        from perfxlm.model.layers.attention import common_head_dim

        return common_head_dim(self.model)

    def initialize_cache(self, num_blocks: int) -> None:
        from perfxlm.worker.model_runner import ModelRunner

        c = self.config
        self._runner = ModelRunner(self.model, num_blocks, c.resolved.block_size, c.resolved.kv_cache_spec)
        self.comm.barrier()

    def execute(self, so: Any) -> Any:
        import torch.distributed as dist

        out = self._runner.execute(so)
        box = [out if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)  # every rank goes on with rank 0's tokens
        return box[0]

    def agree_draft_tokens(self, drafts: dict[str, list[int]]) -> dict[str, list[int]]:
        import torch.distributed as dist

        box = [drafts if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def check_health(self) -> None:
        pass  # a lost rank shows as a collective that times out, raised in the step

    def shutdown(self) -> None:
        import torch.distributed as dist

        if self.comm is not None:
            self.comm.close()
            self.comm = None
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_group = False

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} started by an external launcher ({self.comm.name} collectives)"
