"""Tensor parallelism over N spawned worker processes (see `executor/__init__.py`, `executor/worker.py`).

Faults: while it waits for a step's result, the engine also watches every worker's process sentinel and
pipe, so a worker that dies is noticed at once, and one that hangs within the collective timeout
(PERFXLM_COLLECTIVE_TIMEOUT, default 10 s: the other ranks stop waiting for it in their next all-reduce
and report). PERFXLM_STEP_TIMEOUT (seconds, default none) bounds a whole step as a last resort. After a
failure every worker is killed and every later call raises `WorkerDiedError`; the threaded engine turns
that into EngineDeadError (`/health` 503, open streams end with the error). `shutdown` (also run when
the executor is collected, and by multiprocessing at exit for its daemon workers) stops the workers,
then terminates and kills what remains. Starting, watching and stopping the workers is
`distributed/supervision.py`'s `Supervisor`, shared with data-parallel replicas.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from perfxlm.distributed.supervision import Ready, Stats, StatsQuery, Supervisor, WorkerDiedError
from perfxlm.executor.base import Executor
from perfxlm.executor.delta import DeltaEncoder
from perfxlm.executor.worker import worker_body
from perfxlm.executor.worker_messages import CacheReady, InitCache, Step, StepOutput
from perfxlm.model.loader import check_tensor_parallel, packed_checkpoint
from perfxlm.model.registry import resolve_model_class

logger = logging.getLogger("perfxlm")

__all__ = ["MultiprocExecutor", "WorkerDiedError"]


class MultiprocExecutor(Executor):
    def __init__(self, config: Any) -> None:
        # what every rank would refuse, refused here before any process starts (a ValueError, not a worker's)
        check_tensor_parallel(resolve_model_class(config.hf_config), packed_checkpoint(config.model, config.load_format))
        self.config = config
        self.world_size = n = config.tensor_parallel_size
        self.encoder = DeltaEncoder()
        self.step_timeout = float(os.environ.get("PERFXLM_STEP_TIMEOUT", "0")) or None
        tmpdir = tempfile.mkdtemp(prefix="perfxlm-tp-")
        init_method = f"file://{tmpdir}/rendezvous"
        self.rank_cpus = list(config.resolved.process_cpus)  # planned once, in EngineConfig.resolve
        self.workers = Supervisor(
            "tensor-parallel worker rank", "perfxlm-tp", worker_body,
            [(rank, n, config, init_method, self.rank_cpus[rank]) for rank in range(n)], scratch=tmpdir,
        )  # fmt: skip
        self.procs = self.workers.procs
        try:
            self.infos = [self.workers.expect(r, Ready, timeout=None).info for r in range(n)]
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallel: %d ranks, %s collectives, cores %s",
            n, self.infos[0]["comm"], " | ".join(str(i["cpus"] or "all") for i in self.infos),
        )  # fmt: skip

    # ---- executor interface ----------------------------------------------------------------
    def kv_bytes_per_block(self, block_size: int, spec: Any) -> int:
        """Of all ranks together: the pool's size in bytes means the same as with one process."""
        return sum(i["kv_bytes_per_block"] for i in self.infos)

    def head_dim(self) -> int | None:
        return self.infos[0]["head_dim"]

    def initialize_cache(self, num_blocks: int) -> None:
        self.workers.broadcast(InitCache(num_blocks))
        for r in range(self.world_size):
            self.workers.expect(r, CacheReady, timeout=None)

    def execute(self, so: Any) -> Any:
        self.workers.broadcast(Step(self.encoder.encode(so)))
        return self.workers.expect(0, StepOutput, timeout=self.step_timeout).output

    def stats(self) -> list[dict[str, int]]:
        """Each rank's counters (`Stats`), asked between steps."""
        self.workers.broadcast(StatsQuery())
        return [self.workers.expect(r, Stats, timeout=None).values for r in range(self.world_size)]

    def check_health(self) -> None:
        self.workers.check_health()

    def shutdown(self) -> None:
        self.workers.shutdown()

    def describe(self) -> str:
        return f"{self.world_size} tensor-parallel worker processes ({self.infos[0]['comm']} collectives)"
