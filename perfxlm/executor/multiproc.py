"""Tensor parallelism over N spawned worker processes (see `executor/__init__.py`, `executor/worker.py`).

Faults: while it waits for a step's result, the engine also watches every worker's process sentinel and
pipe, so a worker that dies is noticed at once, and one that hangs within the collective timeout
(PERFXLM_COLLECTIVE_TIMEOUT, default 10 s: the other ranks stop waiting for it in their next all-reduce
and report). PERFXLM_STEP_TIMEOUT (seconds, default none) bounds a whole step as a last resort. After a
failure every worker is killed and every later call raises `WorkerDiedError`; the threaded engine turns
that into EngineDeadError (`/health` 503, open streams end with the error). `shutdown` (also run when
the executor is collected, and by multiprocessing at exit for its daemon workers) stops the workers,
then terminates and kills what remains.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import tempfile
import time
import types
import weakref
from multiprocessing.connection import wait
from typing import Any

from perfxlm.distributed.topology import plan_rank_cpus
from perfxlm.executor.base import Executor
from perfxlm.executor.delta import DeltaEncoder
from perfxlm.executor.worker import worker_main
from perfxlm.model.loader import check_tensor_parallel, packed_checkpoint
from perfxlm.model.registry import resolve_model_class

logger = logging.getLogger("perfxlm")


@contextlib.contextmanager
def _without_main_module():
    """Spawned workers need nothing from the caller's script: hide it while they start, so that they do
    not run it again (a script calling LLM(..., tensor_parallel_size=2) needs no __main__ guard)."""
    real = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = real


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker died, hung or failed: the model is gone."""


def _stop_workers(procs: list[Any], conns: list[Any], tmpdir: str) -> None:
    for conn in conns:
        try:
            conn.send_bytes(pickle.dumps(("stop",)))
        except Exception:
            pass
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)
    for conn in conns:
        conn.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


class MultiprocExecutor(Executor):
    def __init__(self, config: Any) -> None:
        # what every rank would refuse, refused here before any process starts (a ValueError, not a worker's)
        check_tensor_parallel(resolve_model_class(config.hf_config), packed_checkpoint(config.model, config.load_format))
        self.config = config
        self.world_size = n = config.tensor_parallel_size
        self.encoder = DeltaEncoder()
        self._dead: str | None = None
        self._pending: dict[int, Any] = {}
        self.step_timeout = float(os.environ.get("PERFXLM_STEP_TIMEOUT", "0")) or None
        ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="perfxlm-tp-")
        init_method = f"file://{self._tmpdir}/rendezvous"
        self.rank_cpus = plan_rank_cpus(n)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns, self._tmpdir)
        for rank in range(n):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(
                target=worker_main, name=f"perfxlm-tp{rank}", daemon=True,
                args=(rank, n, config, child, init_method, self.rank_cpus[rank], os.getpid()),
            )  # fmt: skip
            with _without_main_module():
                p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        try:
            self.infos = [self._recv(r, "ready", timeout=None) for r in range(n)]
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
        for conn in self.conns:
            conn.send(("init_cache", num_blocks))
        for r in range(self.world_size):
            self._recv(r, "ok", timeout=None)

    def execute(self, so: Any) -> Any:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        payload = pickle.dumps(("step", self.encoder.encode(so)), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
        except OSError as exc:
            self._fail(f"sending a step to the workers failed: {exc}")
        return self._recv(0, "out", timeout=self.step_timeout)

    def check_health(self) -> None:
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                self._fail(f"tensor-parallel worker rank {rank} (pid {p.pid}) died with exit code {p.exitcode}")

    def shutdown(self) -> None:
        self._finalizer()

    def describe(self) -> str:
        return f"{self.world_size} tensor-parallel worker processes ({self.infos[0]['comm']} collectives)"

    # ---- receiving -------------------------------------------------------------------------
    def _recv(self, rank: int, expect: str, timeout: float | None) -> Any:
        """The next message of `rank`, watching every worker meanwhile: a message from another rank can
        only be an error, and a sentinel means a process ended."""
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        if rank in self._pending:
            return self._pending.pop(rank)
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        conns = {id(c): r for r, c in enumerate(self.conns)}
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait_for = 1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic()))
            ready = wait(list(self.conns) + list(sentinels), timeout=wait_for)
            for obj in ready:  # pipes first: a worker that failed said why before it exited
                if id(obj) not in conns:
                    continue
                r = conns[id(obj)]
                try:
                    msg = pickle.loads(obj.recv_bytes())
                except (EOFError, OSError):
                    continue  # closed: its sentinel tells the rest
                if msg[0] == "error":
                    self._fail(msg[1])
                if msg[0] != expect:
                    self._fail(f"unexpected message {msg[0]!r} from tensor-parallel rank {r}")
                if r == rank:
                    return msg[1]
                self._pending[r] = msg[1]  # set-up: the ranks answer in any order
            for obj in ready:
                if obj in sentinels:
                    r = sentinels[obj]
                    p = self.procs[r]
                    p.join(0.1)
                    self._fail(f"tensor-parallel worker rank {r} (pid {p.pid}) died with exit code {p.exitcode}")
            if deadline is not None and time.monotonic() >= deadline:
                self._fail(f"tensor-parallel rank {rank} did not answer within {timeout} s")

    def _fail(self, why: str) -> None:
        if self._dead is None:
            self._dead = why
            logger.error("tensor parallel: %s", why)
            for p in self.procs:  # the others wait in a collective for the lost rank: no graceful stop
                if p.is_alive():
                    p.kill()
            self.shutdown()
        raise WorkerDiedError(self._dead)
