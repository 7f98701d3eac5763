"""AsyncLLM: vLLM's asynchronous interface. `async for out in engine.generate(prompt, params, id)`.

Cancelling the consuming task (or breaking out of the loop) aborts the request; its KV blocks are
freed before the next engine step.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncGenerator

from perfxlm.config import EngineConfig
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.threaded_engine import ThreadedEngine
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import SamplingParams

_HEALTH_POLL_S = 0.5


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            raise TypeError("pass either an EngineConfig or keyword arguments, not both")
        self.engine = ThreadedEngine(config)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, engine_args: Any = None, **kwargs: Any) -> "AsyncLLM":
        """vLLM's shape: AsyncLLM.from_engine_args(AsyncEngineArgs(model=...)); keyword arguments work too.
        vLLM's arguments with no engine field here are translated, noticed or refused (compat.py)."""
        from perfxlm.compat import split_vllm_kwargs

        if engine_args is not None:
            kwargs = {**engine_args.as_kwargs(), **kwargs}
        for name in ("usage_context", "start_engine_loop", "disable_log_requests", "enable_log_requests"):
            kwargs.pop(name, None)  # vLLM's from_engine_args parameters with nothing to do here
        rest, settings = split_vllm_kwargs(kwargs)
        return cls(EngineConfig(**rest, **settings))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str | None = None,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """`lora_request`: the LoRARequest the request runs with (enable_lora), as in vLLM."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(results.put_nowait, item)

        self.engine.add_request(request_id, prompt, sampling_params, sink, lora_request=lora_request)
        finished = False
        try:
            while not finished:
                if results.empty():
                    item = await self._next(results)
                else:
                    item = results.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled, or the consumer stopped iterating
                self.engine.abort(request_id)

    async def _next(self, results: asyncio.Queue) -> RequestOutput | BaseException:
        """The next item, looking at the engine's health every half second while none comes: a dead
        engine is learnt within a second even if its error never reached this request's sink."""
        # One getter for the whole wait (not wait_for, which cancels a get that may have just taken an item).
        getter = asyncio.ensure_future(results.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=_HEALTH_POLL_S)
                if done:
                    return getter.result()
                self.engine.check_health()
        finally:
            if not getter.done():
                getter.cancel()

    async def abort(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.engine.abort(rid)

    async def check_health(self) -> None:
        """Raise EngineDeadError unless every engine thread is alive and the engine has not failed."""
        self.engine.check_health()

    @property
    def errored(self) -> bool:
        return self.engine.is_dead

    def shutdown(self) -> None:
        self.engine.shutdown()
