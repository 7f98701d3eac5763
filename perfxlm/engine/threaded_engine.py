"""The engine running in the background, for servers and embedders.

    caller threads / event loop         core thread                 output thread
    ---------------------------         -----------                 -------------
    add_request: tokenize, validate  →  commands → EngineCore.step → EngineCoreOutputs
                                                                   → OutputProcessor: detokenize,
    per-request sink  ←──────────────────────────────────────────────  stop strings, RequestOutput
    abort(request_id) → commands (applied before the next step)

The core thread owns the scheduler, KV cache and model; the output thread owns nothing but the
output processor (under a lock shared with abort). Detokenizing one step's tokens overlaps the
next forward pass: torch releases the GIL inside its ops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from perfxlm.config import EngineConfig
from perfxlm.engine.engine_core import EngineFrontEndParts
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.messages import EngineCoreOutput
from perfxlm.engine.request import Request, RequestStatus
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import SamplingParams

logger = logging.getLogger("perfxlm")

# A sink receives each RequestOutput of its request, or an Exception if the engine failed.
Sink = Callable[[RequestOutput | BaseException], None]


class EngineDeadError(RuntimeError):
    pass


class ThreadedEngine(EngineFrontEndParts):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()  # guards output_processor and _sinks
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[list[EngineCoreOutput] | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self.stats = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_preemptions": 0, "steps": 0}
        self._core_thread = threading.Thread(target=self._core_loop, name="perfxlm-core", daemon=True)
        self._output_thread = threading.Thread(target=self._output_loop, name="perfxlm-output", daemon=True)
        self._core_thread.start()
        self._output_thread.start()

    # ---- caller side ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, sink: Sink,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request (ValueError on bad input, raised in the caller's thread)."""
        if self._stopped.is_set():
            raise EngineDeadError("the engine has been shut down")
        arrival_time = arrival_time if arrival_time is not None else time.time()
        pr = self.input_processor.process(request_id, prompt, params, arrival_time)
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            self._sinks[request_id] = sink
            self.output_processor.add_request(request_id, pr, arrival_time)
        self._idle.clear()
        self._commands.put(("add", pr.request))

    def abort(self, request_id: str) -> None:
        """End a request now: its sink gets a final output with finish_reason 'abort'; its blocks are
        freed before the next step."""
        with self._lock:
            state = self.output_processor.states.get(request_id)
            sink = self._sinks.pop(request_id, None)
            if state is None:
                return
            child_ids = list(state.child_ids)
            final = self.output_processor.abort(request_id)
        self._commands.put(("finish", child_ids, RequestStatus.FINISHED_ABORTED, None))
        if sink is not None and final is not None:
            sink(final)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running in the core."""
        return self._idle.wait(timeout)

    def check_invariants(self) -> dict[str, int]:
        """KV pool check, taken by the core thread between steps."""
        done = threading.Event()
        box: dict[str, Any] = {}
        self._commands.put(("call", lambda: box.update(result=self.core.check_invariants()), done, box))
        if not done.wait(30):
            raise TimeoutError("engine core did not answer")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._commands.put(("stop",))
        self._core_thread.join(timeout=30)
        self._outputs.put(None)
        self._output_thread.join(timeout=30)
        with self._lock:
            ids = list(self._sinks)
        for rid in ids:
            self.abort(rid)

    # ---- core thread ---------------------------------------------------------------------
    def _apply(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            request: Request = cmd[1]
            self.core.add_request(request)
        elif kind == "finish":
            self.core.finish_requests(cmd[1], cmd[2], cmd[3])
        elif kind == "call":
            _, fn, done, box = cmd
            try:
                fn()
            except BaseException as exc:  # report to the caller, keep serving
                box["error"] = exc
            done.set()
        elif kind == "stop":
            return False
        return True

    def _core_loop(self) -> None:
        while True:
            busy = self.core.has_unfinished_requests()
            if not busy:
                self._refresh_stats()
                self._idle.set()
            try:
                cmd = self._commands.get(block=not busy)
                if not self._apply(cmd):
                    return
                while True:  # drain whatever else arrived
                    if not self._apply(self._commands.get_nowait()):
                        return
            except queue.Empty:
                pass
            if not self.core.has_unfinished_requests():
                continue
            self._idle.clear()
            try:
                outputs = self.core.step()
            except Exception as exc:  # a failed step must not kill the server: fail its requests
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            self.stats["steps"] += 1
            self._refresh_stats()
            if outputs:
                self._outputs.put(outputs)

    def _refresh_stats(self) -> None:
        sched = self.core.scheduler
        self.stats.update(num_running=sched.num_running, num_waiting=sched.num_waiting,
                          kv_usage=self.core.kv_cache_manager.usage, num_preemptions=sched.num_preemptions_total)

    def _fail_all(self, exc: Exception) -> None:
        sched = self.core.scheduler
        ids = [r.request_id for r in list(sched.running) + list(sched.waiting)]
        sched.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            for rid in list(self.output_processor.states):
                self.output_processor.abort(rid)
        for sink in sinks.values():
            sink(exc)

    # ---- output thread -------------------------------------------------------------------
    def _output_loop(self) -> None:
        while True:
            outputs = self._outputs.get()
            if outputs is None:
                return
            deliveries = []
            with self._lock:
                try:
                    results, stopped = self.output_processor.process(outputs)
                except Exception as exc:
                    logger.exception("output processing failed")
                    continue
                for result in results:
                    sink = self._sinks.get(result.request_id)
                    if sink is None:
                        continue
                    if result.finished:
                        del self._sinks[result.request_id]
                    deliveries.append((sink, result))
            for seq_id, stop in stopped:
                self._commands.put(("finish", [seq_id], RequestStatus.FINISHED_STOPPED, stop))
            for sink, result in deliveries:
                sink(result)
