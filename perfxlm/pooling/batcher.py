"""The pooling engine behind a server: callers (the HTTP handlers' threads) submit checked inputs; one
thread runs whatever has arrived as one list, so concurrent small requests share batches. A failure
while running a merged list is retried request by request, so only the request that fails gets the error."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any

from perfxlm.pooling.engine import PoolingEngine, PoolingInput


class PoolingBatcher:
    def __init__(self, engine: PoolingEngine) -> None:
        self.engine = engine
        self._queue: queue.Queue[tuple[list[PoolingInput], Future] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="perfxlm-pooling", daemon=True)
        self._thread.start()

    def submit(self, inputs: list[PoolingInput]) -> Future:
        future: Future = Future()
        self._queue.put((inputs, future))
        return future

    def alive(self) -> bool:
        return self._thread.is_alive()

    def num_waiting(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            items = [item]
            while True:  # everything queued meanwhile joins this run
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                items.append(more)
            self._run(items)

    def _run(self, items: list[tuple[list[PoolingInput], Future]]) -> None:
        merged = [x for inputs, _ in items for x in inputs]
        try:
            outs = self.engine.run(merged)
        except Exception:  # noqa: BLE001 - find whose input fails, fail only that request
            for inputs, future in items:
                _settle(future, lambda inputs=inputs: self.engine.run(inputs))
            return
        at = 0
        for inputs, future in items:
            future.set_result(outs[at : at + len(inputs)])
            at += len(inputs)

    def shutdown(self) -> None:
        self._queue.put(None)


def _settle(future: Future, compute: Any) -> None:
    try:
        future.set_result(compute())
    except BaseException as exc:  # noqa: BLE001 - delivered to the caller
        future.set_exception(exc)
