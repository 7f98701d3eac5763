"""What completions and chat share: request fields -> SamplingParams, running a request against
the engine while watching the client, usage, and SSE framing."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, TypeVar

import logging

from fastapi import Request

from perfxlm.engine.async_engine import AsyncLLM
from perfxlm.engine.threaded_engine import EngineDeadError
from perfxlm.entrypoints.openai.errors import APIError, ClientDisconnected
from perfxlm.entrypoints.openai.off_loop import run_off_loop
from perfxlm.entrypoints.openai.protocol import REFUSED_FIELDS, SamplingFields
from perfxlm.outputs import RequestOutput
from perfxlm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams


logger = logging.getLogger("perfxlm.server")
T = TypeVar("T")


@dataclass
class ServerContext:
    engine: AsyncLLM
    served_model_name: str
    max_model_len: int
    metrics: Any  # ServerMetrics
    renderer: Any = None  # ChatRenderer: templates and tokenization off the event loop
    enable_auto_tool_choice: bool = False
    tool_parser: Any = None  # tool_parsers.ToolParser (--tool-call-parser)
    reasoning_parser: Any = None  # reasoning_parsers.ReasoningParser (--reasoning-parser)
    reasoning_token_ids: tuple[int, int] | None = None  # (<think>, </think>) when each is one token
    # sampling defaults of the model's generation_config.json (--generation-config auto), used where a
    # request leaves a field unset
    default_sampling: dict = field(default_factory=dict)
    adapters: Any = None  # serving_lora.ServedAdapters: LoRA adapters by name (--enable-lora)
    responses: Any = None  # responses_store.ResponseStore: /v1/responses kept for GET and previous_response_id


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_logged_extra_fields: set[str] = set()


def check_extra_fields(req: Any) -> None:
    """vLLM's rule for fields the server does not know: accepted, logged once per name, ignored; those
    that would change the result (REFUSED_FIELDS) are a 400 saying what to use instead."""
    extra = getattr(req, "model_extra", None) or {}
    for name in sorted(extra):
        if name in REFUSED_FIELDS:
            raise APIError(400, f"Unsupported field {name}: {REFUSED_FIELDS[name]}.", name)
    new = sorted(set(extra) - _logged_extra_fields)
    if new:
        _logged_extra_fields.update(new)
        logger.warning("The following fields were present in the request but ignored: %s", ", ".join(new))


def check_model(ctx: ServerContext, model: str | None) -> Any:
    """The LoRARequest the request's `model` names (an adapter's name), None for the base model."""
    if model is None or model == ctx.served_model_name:
        return None
    lora = ctx.adapters.get(model) if ctx.adapters is not None else None
    if lora is None:
        raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
    return lora


_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "disable_fallback", "disable_any_whitespace",
                    "disable_additional_properties", "whitespace_pattern", "structural_tag"}


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's constraint from whichever spelling it used; 400 when it uses two or a bad one."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            schema = rf.get("schema")  # llama-server's {"type": "json_object", "schema": {...}}
            found.append(("response_format", {"json": schema} if schema else {"json_object": True}))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if spec is None and isinstance(rf.get("schema"), dict):
                spec = {"schema": rf["schema"]}  # llama-server also takes the schema beside the type
            if not isinstance(spec, dict):
                raise APIError(400, "response_format.json_schema must be an object with a schema.", "response_format")
            schema = spec.get("schema", spec.get("json_schema"))
            if schema is None:
                raise APIError(400, "response_format.json_schema.schema is missing.", "response_format")
            found.append(("response_format", {"json": schema}))
        elif kind == "structural_tag":
            raise APIError(400, "response_format type structural_tag is not supported; use json_schema.",
                           "response_format")
        elif kind not in (None, "text"):
            raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}.",
                           "response_format")
    if req.structured_outputs is not None:
        unknown = sorted(set(req.structured_outputs) - _STRUCTURED_KEYS)
        if unknown:
            raise APIError(400, f"Unsupported field(s) in structured_outputs: {', '.join(unknown)}.",
                           "structured_outputs")
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append((name, {key: value}))
    if not found:
        return None
    if len(found) > 1:
        raise APIError(400, f"Give one structured-output constraint; got {', '.join(n for n, _ in found)}.",
                       found[1][0])
    name, fields = found[0]
    if name.startswith("guided_") and req.guided_whitespace_pattern is not None:
        fields["whitespace_pattern"] = req.guided_whitespace_pattern
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(400, str(exc), name) from None


def to_sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None, defaults: dict | None = None,
) -> SamplingParams:
    # Upper bounds that depend on the engine (n, best_of, logprobs) are checked where the request enters
    # it; its ValueError becomes a 400 in generate_one.
    logit_bias = None
    if req.logit_bias:
        try:
            logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings).", "logit_bias") from None
    defaults = defaults or {}

    def pick(name: str, fallback: float) -> float:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    try:
        return SamplingParams(
            n=req.n,
            best_of=req.best_of,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", -1),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
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
            structured_outputs=structured_outputs if structured_outputs is not None else structured_outputs_of(req),
        )
    except ValueError as exc:
        raise APIError(400, str(exc), _param_of(str(exc))) from None


# what a beam search cannot honour: with use_beam_search these must be unset or at their neutral value
_NOT_WITH_BEAMS = ("best_of", "stop", "stop_token_ids", "min_tokens", "logit_bias", "allowed_token_ids", "bad_words",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "top_p", "top_k", "min_p", "seed",
                   "truncate_prompt_tokens", "response_format", "structured_outputs", "guided_json", "guided_regex",
                   "guided_choice", "guided_grammar", "json_schema", "grammar")
_NEUTRAL = {"repetition_penalty": 1.0, "top_p": 1.0, "top_k": -1}


def to_beam_search_params(req: SamplingFields, max_tokens: int, defaults: dict | None = None) -> BeamSearchParams:
    """vLLM's use_beam_search: n beams, the request's ignore_eos, temperature (the model's default, else
    1.0, as vLLM), length_penalty and include_stop_str_in_output; a field it would ignore is a 400."""
    for name in _NOT_WITH_BEAMS:
        value = getattr(req, name)
        if value not in (None, [], {}, 0, _NEUTRAL.get(name)):
            raise APIError(400, f"{name} is not supported with use_beam_search.", name)
    temperature = req.temperature if req.temperature is not None else (defaults or {}).get("temperature", 1.0)
    try:
        return BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                temperature=temperature, length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output)
    except ValueError as exc:
        raise beam_search_error(exc) from None


def beam_search_error(exc: ValueError) -> APIError:
    """A 400 in the request's words: the beam width is its n."""
    message = str(exc)
    if message.startswith("beam_width"):
        return APIError(400, "n (the beam width)" + message[len("beam_width"):], "n")
    return APIError(400, message, _param_of(message))


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0].strip(".:")
    if word.startswith("structured_outputs."):
        return "structured_outputs"
    return word if word.isidentifier() and word.islower() else None


async def compile_structured_outputs(ctx: ServerContext, params: SamplingParams) -> None:
    """Compile the request's grammar on the renderer's threads (a large schema takes milliseconds to
    seconds): the engine then finds it compiled and the event loop never waits on it."""
    if params.structured_outputs is None or ctx.renderer is None:
        return
    processor = ctx.engine.engine.input_processor
    try:
        params._grammar = await ctx.renderer.off_loop(processor.compile_structured_outputs, params)
    except ValueError as exc:
        raise APIError(400, str(exc), _param_of(str(exc))) from None


async def generate_one(ctx: ServerContext, prompt: Any, params: SamplingParams, request_id: str,
                       lora_request: Any = None) -> AsyncIterator[RequestOutput]:
    """AsyncLLM.generate with the engine's ValueErrors turned into 400s and server metrics kept."""
    if lora_request is not None:
        # an adapter the engine's cache dropped (more adapters than --max-cpu-loras) is read from disk
        # here, off the event loop; adding the request then finds it loaded
        try:
            await run_off_loop(ctx.engine.engine.loras.get, lora_request)
        except ValueError as exc:
            raise APIError(400, str(exc), "model") from None
    stream = ctx.engine.generate(prompt, params, request_id, lora_request=lora_request)
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


async def beam_search_one(ctx: ServerContext, prompt: Any, params: BeamSearchParams, request_id: str,
                          logprobs: int | None, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
    """AsyncLLM.beam_search with generate_one's error handling: bad input a 400, a dead engine a 503."""
    stream = ctx.engine.beam_search(prompt, request_id, params, lora_request, logprobs=logprobs)
    try:
        try:
            out = await stream.__anext__()
        except ValueError as exc:
            raise beam_search_error(exc) from None
        yield out
    except EngineDeadError as exc:
        raise engine_dead_error(exc) from None
    finally:
        await stream.aclose()


def engine_dead_error(exc: BaseException) -> APIError:
    return APIError(503, f"The engine has failed and serves no more requests: {exc}", code="engine_dead")


async def prepended(first: Any, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`first` (already awaited, to turn an early error into a status code before streaming) then the rest."""
    if first is not None:
        yield first
    async for item in stream:
        yield item


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


_DISCONNECT_POLL_S = 0.2


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts what it runs in the engine) if the client goes away
    first: then ClientDisconnected. Nothing else watches the connection while a handler awaits, so a
    client that gave up would otherwise keep its request generating to the end."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                raise ClientDisconnected()
        return task.result()
    finally:
        if not task.done():  # the client left, or this handler itself was cancelled
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def first_until_disconnect(request: Request, stream: AsyncIterator[Any]) -> Any:
    """A streaming request's first item (None if there is none), awaited before the response starts so
    that bad input is a status code; the stream is closed if the client goes away meanwhile. A beam
    search yields only when it ends: without this an abandoned one would run to its last token."""
    try:
        async def first() -> Any:
            return await anext(stream, None)

        return await until_disconnect(request, first())
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise


async def collect_until_disconnect(request: Request, stream: AsyncIterator[tuple[int, RequestOutput]]
                                   ) -> list[tuple[int, RequestOutput]]:
    """Run a non-streaming request, but stop (and so abort it) if the client goes away."""

    async def consume() -> list[tuple[int, RequestOutput]]:
        return [item async for item in stream]

    try:
        return await until_disconnect(request, consume())
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise


# Characters that JSON leaves raw but that line readers built on str.splitlines (httpx's
# aiter_lines among them) take for line ends; escaped so a sampled token can never cut an event.
_LINE_BREAKING = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_json(data: dict) -> str:
    """One JSON document for an SSE ``data:`` line: UTF-8 kept, every line-breaking character escaped."""
    return json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKING)


def sse(data: dict | str) -> str:
    payload = data if isinstance(data, str) else sse_json(data)
    return f"data: {payload}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def now() -> int:
    return int(time.time())
