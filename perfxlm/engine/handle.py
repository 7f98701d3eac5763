"""A plain synchronous handle per request, for embedding the engine in other programs.

    engine = Engine(model=...)                      # starts the background engine
    handle = engine.start_request(prompt, params)
    update = handle.queue.get()                     # blocks: new tokens, new text, status
    final = handle.sync()                           # waits for the end -> RequestOutput
    handle.stop()                                   # abort
    handle.release()                                # stop if needed, forget the request
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from perfxlm.config import EngineConfig
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.threaded_engine import ThreadedEngine
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import RequestOutputKind, SamplingParams


_HEALTH_POLL_S = 0.5


@dataclass(slots=True)
class GeneratedUpdate:
    new_token_ids: list[int]  # of the first completion (index 0)
    new_text: str
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None  # everything so far (cumulative); None if the engine failed before any
    error: BaseException | None = None  # the last update of a request the engine failed (finished, "abort")


class RequestHandle:
    def __init__(self, engine: ThreadedEngine, request_id: str) -> None:
        self.engine = engine
        self.request_id = request_id
        self.queue: queue.Queue[GeneratedUpdate] = queue.Queue()
        self._done = threading.Event()
        self._final: RequestOutput | None = None
        self._error: BaseException | None = None
        self._last: RequestOutput | None = None
        self._sent_tokens = 0
        self._sent_chars = 0

    def _sink(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            # Through the queue too: a caller blocked in queue.get() must wake up and learn it.
            self._error = item
            self.queue.put(GeneratedUpdate([], "", True, "abort", self._last, error=item))
            self._done.set()
            return
        self._last = item
        first = item.outputs[0] if item.outputs else None
        tokens = first.token_ids[self._sent_tokens :] if first else []
        text = first.text[self._sent_chars :] if first else ""
        if first:
            self._sent_tokens, self._sent_chars = len(first.token_ids), len(first.text)
        self.queue.put(GeneratedUpdate(tokens, text, item.finished, first.finish_reason if first else None, item))
        if item.finished:
            self._final = item
            self._done.set()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def sync(self, timeout: float | None = None) -> RequestOutput:
        deadline = None if timeout is None else time.monotonic() + timeout
        # Wait in short slices, looking at the engine's health between them: a dead engine is learnt
        # within a second even if its error never reached this handle.
        while not self._done.wait(_HEALTH_POLL_S if deadline is None else
                                  max(0.0, min(_HEALTH_POLL_S, deadline - time.monotonic()))):
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"request {self.request_id!r} did not finish within {timeout} s")
            self.engine.check_health()
        if self._error is not None:
            raise self._error
        assert self._final is not None
        return self._final

    def stop(self) -> None:
        self.engine.abort(self.request_id)

    def release(self) -> None:
        if not self._done.is_set():
            self.stop()


class Engine:
    """The background engine with per-request handles (DashInfer-style)."""

    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        self.engine = ThreadedEngine(config if config is not None else EngineConfig(**kwargs))
        self._ids = itertools.count()

    def start_request(self, prompt: PromptType, params: SamplingParams | None = None,
                      request_id: str | None = None) -> RequestHandle:
        params = (params or SamplingParams()).clone()
        params.output_kind = RequestOutputKind.CUMULATIVE  # the handle computes the deltas itself
        request_id = request_id if request_id is not None else f"handle-{next(self._ids)}"
        handle = RequestHandle(self.engine, request_id)
        self.engine.add_request(request_id, prompt, params, handle._sink)
        return handle

    def shutdown(self) -> None:
        self.engine.shutdown()
