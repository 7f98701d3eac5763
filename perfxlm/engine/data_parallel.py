"""Data parallelism: M engine replicas, each a whole EngineCore (model, KV cache, scheduler) in its own
spawned process pinned to its own cores (one NUMA node each where the machine has enough: the same plan
as tensor-parallel ranks, `distributed/topology.py`), behind one front end.

`DataParallelCore` stands where `EngineCore` stands in the front ends (LLMEngine, ThreadedEngine): the
front end still tokenizes, validates and detokenizes in its own process, once for all replicas. Each
new request goes to the replica with the fewest requests in flight (ties: the lowest index); aborts and
stop strings go to the replica that holds the request. Replicas step on their own, as fast as their
cores allow, and send each step's EngineCoreOutputs back with their scheduler and KV-cache counts;
`step()` returns whatever arrived (waiting a few ms at most, so new commands are applied promptly).

Messages: `engine/replica_messages.py`'s dataclasses and the supervision module's Ready / Failed / Stop.
Replicas are started, watched and stopped by `distributed/supervision.py`'s `Supervisor`, as
tensor-parallel workers are, each pinned to the cores the resolved config planned for it
(`ResolvedConfig.process_cpus`) and running the engine's CPU plan (`ResolvedConfig.cpu_plan`), not one it
detects itself.

Faults: a replica that dies or fails is noticed at once (its pipe and process sentinel are watched while
stepping, and `check_health` looks at every process), and one that sends nothing for
PERFXLM_STEP_TIMEOUT seconds while it holds requests (default: no limit) counts as hung. Either marks
the whole engine dead (`WorkerDiedError`; the threaded engine turns it into EngineDeadError, `/health`
503, open streams end with the error) and every replica is stopped: a server with a lost replica is
restarted as a whole by its supervisor. `shutdown` (also run when the core is collected, and at exit)
stops the replicas, then terminates and kills what remains, like the tensor-parallel workers.
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import replace
from typing import Any

from perfxlm.distributed.supervision import Channel, Ready, Stop, Supervisor, WorkerDiedError, encode
from perfxlm.engine.engine_core import EngineCore
from perfxlm.engine.replica_messages import (
    AddRequest, CheckInvariants, FinishRequests, InvariantCounts, StepOutputs,
)  # fmt: skip
from perfxlm.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger("perfxlm")

__all__ = ["DataParallelCore", "WorkerDiedError"]

SEP = "\x1e"  # sibling ids of n > 1 requests are "{id}\x1e{i}" (InputProcessor)
_POLL_S = 0.005  # longest wait in step() before the front end applies newly queued commands


def _base(request_id: str) -> str:
    return request_id.split(SEP, 1)[0]


def _stats(core: Any) -> dict[str, int]:
    s, kv = core.scheduler, core.kv_cache_manager
    return {"num_running": s.num_running, "num_waiting": s.num_waiting,
            "num_preemptions_total": s.num_preemptions_total, "num_blocks": kv.num_blocks,
            "num_free_blocks": kv.num_free_blocks, "prefix_queries": kv.prefix_queries,
            "prefix_hits": kv.prefix_hits, "spec_num_drafts": s.spec_stats.num_drafts,
            "spec_num_draft_tokens": s.spec_stats.num_draft_tokens,
            "spec_num_accepted_tokens": s.spec_stats.num_accepted_tokens}  # fmt: skip


def replica_body(channel: Channel, index: int, config: Any, cpus: list[int] | None) -> None:
    """One replica: a whole EngineCore, stepping while it holds requests, applying commands between steps."""
    core = None
    try:
        from perfxlm.distributed.topology import bind_current_process
        from perfxlm.engine.messages import EngineCoreOutput
        from perfxlm.ops import cpu_plan

        threads = bind_current_process(cpus)
        cpu_plan.use(config.resolved.cpu_plan)  # the engine's decisions (layout, GEMM, ISA tier), not this process's
        core = EngineCore(config)  # a default KV pool takes its share of memory (resolved.data_parallel_size)
        channel.send(Ready({"num_kv_blocks": core.num_kv_blocks, "max_model_len": core.resolved.max_model_len,
                            "kv_bytes_per_block": core.kv_bytes_per_block, "pid": os.getpid(), "cpus": cpus,
                            "threads": threads, "stats": _stats(core),
                            "cpu_plan": cpu_plan.plan().describe()}))  # fmt: skip
        generation: dict[str, int] = {}  # base request id -> generation of the front end's add
        failed: list[Any] = []  # outputs of requests that could not be added
        ended: set[str] = set()  # base ids whose sequences may all have ended since the last report

        def apply(msg: Any) -> bool:
            if isinstance(msg, AddRequest):  # the request pickled on its own: one that cannot be rebuilt fails alone
                generation[_base(msg.request_id)] = msg.generation
                try:
                    core.add_request(pickle.loads(msg.blob))
                except Exception as exc:
                    failed.append(EngineCoreOutput(msg.request_id, [], "abort", error=f"{type(exc).__name__}: {exc}"))
                    ended.add(_base(msg.request_id))
            elif isinstance(msg, FinishRequests):
                core.finish_requests(msg.request_ids, msg.status, msg.stop_reason)
                ended.update(_base(r) for r in msg.request_ids)
            elif isinstance(msg, CheckInvariants):
                channel.send(InvariantCounts(core.check_invariants()))
            elif isinstance(msg, Stop):
                return False
            else:
                raise TypeError(f"unexpected message {type(msg).__name__}")
            return True

        while True:
            if not core.has_unfinished_requests() and not ended:
                if not apply(channel.recv()):  # idle: sleep until a command comes
                    break
            running = True
            while running and channel.poll():
                running = apply(channel.recv())
            if not running:
                break
            outputs = core.step() if core.has_unfinished_requests() else []
            if failed:
                outputs, failed[:] = failed + outputs, []
            ended.update(_base(o.request_id) for o in outputs if o.finish_reason is not None)
            done = []
            if ended:
                live = {_base(r) for r in core.scheduler.requests}
                done = [(b, generation.pop(b)) for b in ended if b not in live and b in generation]
                ended.clear()
            if outputs or done:
                channel.send(StepOutputs(outputs, done, _stats(core)))
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                pass


class _SchedulerView:
    """What the front ends read of a scheduler, summed over the replicas; requests go to the router."""

    def __init__(self, dp: "DataParallelCore") -> None:
        self._dp = dp

    def add_request(self, request: Any) -> None:
        self._dp.add_request(request)

    def finish_requests(self, request_ids: list[str], status: Any, stop_reason: str | None = None) -> None:
        self._dp.finish_requests(request_ids, status, stop_reason)

    def has_unfinished_requests(self) -> bool:
        return self._dp.has_unfinished_requests()

    @property
    def num_running(self) -> int:
        return self._dp.total("num_running")

    @property
    def num_waiting(self) -> int:
        return self._dp.total("num_waiting")

    @property
    def num_preemptions_total(self) -> int:
        return self._dp.total("num_preemptions_total")

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding's counters over the replicas (acceptance per position stays per replica)."""
        return SpecDecodeStats(self._dp.total("spec_num_drafts"), self._dp.total("spec_num_draft_tokens"),
                               self._dp.total("spec_num_accepted_tokens"))


class _KVView:
    """The KV-cache counts of all replicas together (their pools are separate)."""

    def __init__(self, dp: "DataParallelCore") -> None:
        self._dp = dp

    @property
    def num_blocks(self) -> int:
        return self._dp.total("num_blocks")

    @property
    def num_free_blocks(self) -> int:
        return self._dp.total("num_free_blocks")

    @property
    def usage(self) -> float:
        total = self.num_blocks
        return 1.0 - self.num_free_blocks / total if total else 0.0

    @property
    def prefix_queries(self) -> int:
        return self._dp.total("prefix_queries")

    @property
    def prefix_hits(self) -> int:
        return self._dp.total("prefix_hits")

    def check_invariants(self) -> dict[str, int]:
        return self._dp.check_invariants()


class DataParallelCore:
    """M EngineCore replicas in spawned processes, used by the front ends as one EngineCore."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.size = m = config.data_parallel_size
        self.step_timeout = float(os.environ.get("PERFXLM_STEP_TIMEOUT", "0")) or None
        self.inflight = [0] * m  # requests routed to each replica and not yet ended there
        self._owner: dict[str, tuple[int, int]] = {}  # base request id -> (replica, generation)
        self._generation = 0
        self._stats: list[dict[str, int]] = [{} for _ in range(m)]
        self._last_heard = [time.monotonic()] * m
        self._outputs: list[Any] = []  # arrived while waiting for something else (invariants)
        self._replies: dict[tuple[int, type], Any] = {}
        self.model = self.runner = None  # the model lives in the replicas
        self.scheduler = _SchedulerView(self)
        self.kv_cache_manager = _KVView(self)
        self.rank_cpus = list(config.resolved.process_cpus)
        self.replicas = Supervisor("data-parallel replica", "perfxlm-dp", replica_body,
                                   [(i, config, self.rank_cpus[i]) for i in range(m)])  # fmt: skip
        self.procs = self.replicas.procs
        try:
            self.infos = [self._recv_kind(i, Ready).info for i in range(m)]
        except BaseException:
            self.shutdown()
            raise
        for i, info in enumerate(self.infos):
            self._stats[i] = info["stats"]
        # The front end validates prompts against one replica's limits: they are all built alike.
        self.num_kv_blocks = min(i["num_kv_blocks"] for i in self.infos)
        self.kv_bytes_per_block = self.infos[0]["kv_bytes_per_block"]
        self.resolved = replace(config.resolved, max_model_len=min(i["max_model_len"] for i in self.infos))
        logger.info("data parallel: %d replicas, cores %s", m,
                    " | ".join(str(i["cpus"] or "all") for i in self.infos))

    # ---- EngineCore's interface ---------------------------------------------------------
    def add_request(self, request: Any) -> None:
        self._check()
        base = _base(request.request_id)
        if base in self._owner:
            raise ValueError(f"request_id {base!r} is already in use.")
        r = min(range(self.size), key=lambda i: (self.inflight[i], i))
        self._generation += 1
        try:
            blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
            payload = encode(AddRequest(blob, self._generation, request.request_id))
        except Exception as exc:  # e.g. a compiled grammar: an engine object that cannot cross processes
            raise ValueError(f"request {base!r} cannot be sent to a data-parallel replica: {exc} (it would run "
                             "with data_parallel_size 1).") from None
        if not self.inflight[r]:
            self._last_heard[r] = time.monotonic()  # an idle replica owes nothing until now
        self.replicas.send_bytes(r, payload)
        self._owner[base] = (r, self._generation)
        self.inflight[r] += 1

    def finish_requests(self, request_ids: list[str], status: Any, stop_reason: str | None = None) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self._owner.get(_base(rid))
            if owner is not None:
                by_replica.setdefault(owner[0], []).append(rid)
        for r, ids in by_replica.items():
            self.replicas.send(r, FinishRequests(ids, status, stop_reason))

    def has_unfinished_requests(self) -> bool:
        return bool(self._owner) or bool(self._outputs)

    def step(self) -> list[Any]:
        """The outputs that replicas sent since the last call (waits up to a few ms for some)."""
        if not self._outputs:
            self._pump(_POLL_S)
        out, self._outputs = self._outputs, []
        return out

    def check_health(self) -> None:
        self.replicas.check_health()

    def check_invariants(self) -> dict[str, int]:
        """Every replica's KV pool checked (by the replica, between its steps); the counts summed."""
        self.replicas.broadcast(CheckInvariants())
        total: dict[str, int] = {}
        for i in range(self.size):
            for k, v in self._recv_kind(i, InvariantCounts).counts.items():
                total[k] = total.get(k, 0) + v
        return total

    def shutdown(self) -> None:
        self.replicas.shutdown()

    def describe(self) -> str:
        return f"{self.size} data-parallel replica processes"

    # ---- per replica --------------------------------------------------------------------
    def total(self, key: str) -> int:
        return sum(s.get(key, 0) for s in self._stats)

    def replica_stats(self) -> list[dict[str, int]]:
        """Per replica: its scheduler and KV counts (as of its last message) and requests in flight."""
        return [{**s, "inflight": n, "pid": p.pid} for s, n, p in zip(self._stats, self.inflight, self.procs)]

    # ---- messages -----------------------------------------------------------------------
    def _check(self) -> None:
        self.replicas.check()

    def _recv_kind(self, r: int, kind: type) -> Any:
        """Wait for replica r's next `kind` message, handling what else arrives meanwhile."""
        while (r, kind) not in self._replies:
            self._pump(1.0)
        return self._replies.pop((r, kind))

    def _pump(self, timeout: float) -> None:
        got = self.replicas.receive(timeout)
        now = time.monotonic()
        for i, msg in got:
            self._last_heard[i] = now
            self._handle(i, msg)
        if self.step_timeout is not None:
            for i in range(self.size):
                if self.inflight[i] and now - self._last_heard[i] > self.step_timeout:
                    self.replicas.fail(f"data-parallel replica {i} sent nothing for {self.step_timeout} s")

    def _handle(self, i: int, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            self._stats[i] = msg.stats
            for o in msg.outputs:  # an aborted request's last outputs may still come: not the new owner's
                owner = self._owner.get(_base(o.request_id))
                if owner is not None and owner[0] == i:
                    self._outputs.append(o)
            for base, gen in msg.done:
                if self._owner.get(base) == (i, gen):
                    del self._owner[base]
                    self.inflight[i] -= 1
        else:
            self._replies[(i, type(msg))] = msg
