"""AsyncLLM: vLLM's asynchronous interface. `async for out in engine.generate(prompt, params, id)`.

Cancelling the consuming task (or breaking out of the loop) aborts the request; its KV blocks are
freed before the next engine step.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, AsyncGenerator

from perfxlm.beam_search import BeamSearch, to_request_output
from perfxlm.config import EngineConfig
from perfxlm.engine.input_processor import PromptType
from perfxlm.engine.threaded_engine import ThreadedEngine
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import BeamSearchParams, SamplingParams

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

    async def beam_search(
        self, prompt: PromptType, request_id: str, params: BeamSearchParams, lora_request: Any = None,
        logprobs: int | None = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's asynchronous beam search: one finished RequestOutput whose completions are the beam_width
        best beams, generated tokens only (rules in perfxlm/beam_search.py). Each step runs the live beams
        as concurrent one-token requests; cancelling the consumer aborts them. logprobs: how many candidates
        of each token's row to keep (besides the chosen one); None drops the rows."""
        processor = self.engine.input_processor
        processor.lora_adapter(lora_request)  # an adapter the engine cannot run fails before the first step
        text, token_ids = processor.tokenize_prompt(prompt)
        processor.check_beam_search(params, [token_ids])
        search = BeamSearch([token_ids], params, processor.eos_token_ids())
        step = 0
        while beams := search.pending():
            ids = [f"{request_id}-beam{step}-{i}" for i in range(len(beams))]
            outs = await _all([self._final({"prompt_token_ids": b.tokens}, search.step_params, rid, lora_request)
                               for b, rid in zip(beams, ids)])
            search.advance([o.outputs[0].logprobs[0] if o.outputs[0].logprobs else None for o in outs])
            step += 1
        yield to_request_output(request_id, text, token_ids, search.results()[0], params, self.tokenizer, logprobs)

    async def _final(self, prompt: PromptType, params: SamplingParams, request_id: str,
                     lora_request: Any = None) -> RequestOutput:
        out = None
        async for out in self.generate(prompt, params, request_id, lora_request=lora_request):
            pass
        return out

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

    @property
    def dead_error(self) -> BaseException:
        """vLLM's name: the error a caller gets once the engine has failed."""
        return self.engine.dead_error

    def shutdown(self) -> None:
        self.engine.shutdown()


async def _all(coros: list) -> list:
    """Every result, in order; the first failure cancels (so aborts) the others before it is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
