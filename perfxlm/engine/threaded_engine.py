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

Failures: what belongs to one request (a bad command for it, a sink that raises, its own sampling
state) ends that request only. Anything else that escapes a thread marks the engine dead
(EngineDeadError): every caller gets the error at once, new requests are refused, and
check_health() raises, so a supervisor can restart the process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from perfxlm.config import EngineConfig
from perfxlm.engine.front_end import EngineFrontEndParts
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.messages import EngineCoreOutput
from perfxlm.engine.request import Request, RequestStatus
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import SamplingParams

logger = logging.getLogger("perfxlm")

# A sink receives each RequestOutput of its request, or an Exception if the engine failed.
Sink = Callable[[RequestOutput | BaseException], None]


class EngineDeadError(RuntimeError):
    """vLLM's name: the engine failed as a whole and serves no more requests; build a new one."""


class ThreadedEngine(EngineFrontEndParts):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()  # guards output_processor, _sinks, _dead and the order of commands
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[list[EngineCoreOutput] | None] = queue.SimpleQueue()
        self._stopped = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._dead: EngineDeadError | None = None
        self.stats = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "num_preemptions": 0, "steps": 0}
        self._core_thread = threading.Thread(target=self._run_thread, args=(self._core_loop,), name="perfxlm-core",
                                             daemon=True)
        self._output_thread = threading.Thread(target=self._run_thread, args=(self._output_loop,),
                                               name="perfxlm-output", daemon=True)
        self._core_thread.start()
        self._output_thread.start()

    # ---- caller side ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, sink: Sink,
                    arrival_time: float | None = None, lora_request: Any = None) -> None:
        """Validate and queue a request (ValueError on bad input, raised in the caller's thread)."""
        self.check_health()
        if request_id in self._sinks:  # refuse before any tokenizing; re-checked under the lock below
            raise ValueError(f"request_id {request_id!r} is already in use.")
        arrival_time = arrival_time if arrival_time is not None else time.time()
        pr = self.input_processor.process(request_id, prompt, params, arrival_time, lora_request)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self._sinks:
                raise ValueError(f"request_id {request_id!r} is already in use.")
            self._sinks[request_id] = sink
            self.output_processor.add_request(request_id, pr, arrival_time)
            self._idle.clear()
            # Under the lock: an abort of an earlier request with this id is queued before this add.
            self._commands.put(("add", pr.request, request_id))

    def abort(self, request_id: str) -> None:
        """End a request now: its sink gets a final output with finish_reason 'abort'; its blocks are
        freed before the next step."""
        with self._lock:
            sink = self._sinks.pop(request_id, None)
            final = self._forget(request_id)
        if sink is not None and final is not None:
            self._deliver(request_id, sink, final)

    def _forget(self, request_id: str) -> RequestOutput | None:
        """Drop a request's front-end state and end its sequences in the core. Holds the lock."""
        state = self.output_processor.states.get(request_id)
        if state is None:
            return None
        child_ids = list(state.child_ids)
        final = self.output_processor.abort(request_id)
        self._commands.put(("finish", child_ids, RequestStatus.FINISHED_ABORTED, None))
        return final

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine failed, was shut down, or lost one of its threads."""
        if self._dead is not None:
            raise self._dead
        if self._stopped.is_set():
            raise EngineDeadError("the engine has been shut down")
        for thread in (self._core_thread, self._output_thread):
            if not thread.is_alive():
                raise EngineDeadError(f"the engine thread {thread.name} has stopped")
        try:
            self.core.check_health()  # worker processes, under tensor parallelism
        except Exception as exc:
            self._die(exc)
            raise self._dead or EngineDeadError(str(exc)) from exc

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> EngineDeadError:
        """Why the engine serves no more requests (a generic error while it still runs)."""
        return self._dead or EngineDeadError("the engine is not running")

    def abort_all(self) -> int:
        """Abort every request in flight (each sink gets its final 'abort' output); how many."""
        with self._lock:
            ids = list(self._sinks)
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is queued or running in the core."""
        return self._idle.wait(timeout)

    def check_invariants(self) -> dict[str, int]:
        """KV pool check, taken by the core thread between steps."""
        self.check_health()
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
        self.core.shutdown()

    # ---- failure handling ----------------------------------------------------------------
    def _run_thread(self, loop: Callable[[], None]) -> None:
        """Every engine thread runs here: however it ends, unless shut down, every caller learns it."""
        try:
            loop()
        except BaseException as exc:
            logger.exception("engine thread %s failed", threading.current_thread().name)
            self._die(exc)
            return
        if not self._stopped.is_set():
            self._die(RuntimeError(f"engine thread {threading.current_thread().name} exited"))

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            if self._dead is not None:
                return
            dead = EngineDeadError(f"the engine failed and stopped serving: {type(exc).__name__}: {exc}")
            dead.__cause__ = exc
            self._dead = dead
            sinks, self._sinks = self._sinks, {}
            for rid in list(self.output_processor.states):
                self.output_processor.abort(rid)
        # Wake the other thread so that it ends too, and whoever waits for idleness.
        self._commands.put(("stop",))
        self._outputs.put(None)
        self._idle.set()
        for rid, sink in sinks.items():
            self._deliver(rid, sink, dead)

    def _deliver(self, request_id: str, sink: Sink, item: RequestOutput | BaseException) -> bool:
        """Hand one item to a sink. A sink that raises (its caller's event loop closed, say) is that
        caller's failure: the request is dropped, and the thread delivering goes on with the others."""
        try:
            sink(item)
            return True
        except Exception:
            logger.warning("the consumer of request %r failed; aborting the request", request_id, exc_info=True)
            with self._lock:
                self._sinks.pop(request_id, None)
                self._forget(request_id)
            return False

    def _fail_request(self, request_id: str, exc: BaseException) -> None:
        """A command for one request failed in the core: end that request only, with the error."""
        logger.warning("request %r failed in the engine core: %s", request_id, exc)
        with self._lock:
            sink = self._sinks.pop(request_id, None)
            self.output_processor.abort(request_id)  # the core holds nothing of it: drop the state only
        if sink is not None:
            self._deliver(request_id, sink, exc)

    # ---- core thread ---------------------------------------------------------------------
    def _apply(self, cmd: tuple) -> bool:
        kind = cmd[0]
        if kind == "add":
            _, request, user_id = cmd
            try:
                self.core.add_request(request)
            except Exception as exc:  # e.g. an id still live in the core: this request's failure only
                self._fail_request(user_id, exc)
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
        while self._dead is None:
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
            # A step that raises is engine-wide (a request's own failures are handled inside the step):
            # the exception ends this loop and marks the engine dead.
            outputs = self.core.step()
            self.stats["steps"] += 1
            self._refresh_stats()
            if outputs:
                self._outputs.put(outputs)

    def _refresh_stats(self) -> None:
        sched = self.core.scheduler
        self.stats.update(num_running=sched.num_running, num_waiting=sched.num_waiting,
                          kv_usage=self.core.kv_cache_manager.usage, num_preemptions=sched.num_preemptions_total)

    # ---- output thread -------------------------------------------------------------------
    def _output_loop(self) -> None:
        while True:
            outputs = self._outputs.get()
            if outputs is None:
                return
            deliveries = []
            with self._lock:
                if self._dead is not None:
                    return
                # A failure here leaves the output state unknown: it is engine-wide (ends the loop).
                results, stopped = self.output_processor.process(outputs)
                for result in results:
                    sink = self._sinks.get(result.request_id)
                    if sink is None:
                        continue
                    if result.finished:
                        del self._sinks[result.request_id]
                    deliveries.append((sink, result))
                for seq_id, stop in stopped:  # under the lock: before any later add of the same id
                    self._commands.put(("finish", [seq_id], RequestStatus.FINISHED_STOPPED, stop))
            for sink, result in deliveries:
                self._deliver(result.request_id, sink, result)
