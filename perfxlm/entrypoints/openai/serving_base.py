"""What completions and chat share: request fields -> SamplingParams, running a request against
the engine while watching the client, usage, and SSE framing."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request

from perfxlm.engine.async_engine import AsyncLLM
from perfxlm.engine.threaded_engine import EngineDeadError
from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.protocol import SamplingFields
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ServerContext:
    engine: AsyncLLM
    served_model_name: str
    max_model_len: int
    metrics: Any  # ServerMetrics
    renderer: Any = None  # ChatRenderer: templates and tokenization off the event loop


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None and model != ctx.served_model_name:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")


def to_sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
) -> SamplingParams:
    # Upper bounds that depend on the engine (n, best_of, logprobs) are checked where the request enters
    # it; its ValueError becomes a 400 in generate_one.
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings).", "logit_bias") from None
    try:
        return SamplingParams(
            n=req.n,
            best_of=req.best_of,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logit_bias=logit_bias,
            allowed_token_ids=req.allowed_token_ids,
            bad_words=req.bad_words,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            output_kind=RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), _param_of(str(exc))) from None


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0].strip(".:")
    return word if word.isidentifier() and word.islower() else None


async def generate_one(ctx: ServerContext, prompt: Any, params: SamplingParams, request_id: str
                       ) -> AsyncIterator[RequestOutput]:
    """AsyncLLM.generate with the engine's ValueErrors turned into 400s and server metrics kept."""
    stream = ctx.engine.generate(prompt, params, request_id)
    try:
        try:
            first = await stream.__anext__()
        except ValueError as exc:
            raise APIError(400, str(exc), _param_of(str(exc))) from None
        ctx.metrics.on_output(first)
        yield first
        async for out in stream:
            ctx.metrics.on_output(out)
            yield out
    except EngineDeadError as exc:  # new requests get a 503; open streams end with this error
        raise engine_dead_error(exc) from None
    finally:
        ctx.metrics.forget(request_id)  # an aborted stream never sees its final output
        await stream.aclose()  # closing the engine stream aborts the request if it is still running


def engine_dead_error(exc: BaseException) -> APIError:
    return APIError(503, f"The engine has failed and serves no more requests: {exc}", code="engine_dead")


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' streams as their outputs arrive, tagged with the prompt index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # surface to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def collect_until_disconnect(request: Request, stream: AsyncIterator[tuple[int, RequestOutput]]
                                   ) -> list[tuple[int, RequestOutput]]:
    """Run a non-streaming request, but stop (and so abort it) if the client goes away."""
    results: list[tuple[int, RequestOutput]] = []

    async def consume() -> None:
        async for item in stream:
            results.append(item)

    task = asyncio.create_task(consume())
    while not task.done():
        await asyncio.wait({task}, timeout=0.2)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()  # type: ignore[attr-defined]
            raise asyncio.CancelledError("client disconnected")
    task.result()
    return results


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())
