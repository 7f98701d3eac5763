"""POST /v1/chat/completions."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from perfxlm.entrypoints.openai.errors import APIError, error_body
from perfxlm.entrypoints.openai.protocol import ChatCompletionRequest
from perfxlm.entrypoints.openai.serving_base import (
    ServerContext, check_model, collect_until_disconnect, generate_one, merge, new_id, now, sse, to_sampling_params,
    usage,
)
from perfxlm.outputs import CompletionOutput, RequestOutput


def _message_dicts(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in req.messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(d.get("content"), list):  # OpenAI content parts: keep the text ones
            parts = d["content"]
            if any(p.get("type") != "text" for p in parts):
                raise APIError(400, "Only text content parts are supported.", "messages")
            d["content"] = "".join(p.get("text", "") for p in parts)
        out.append(d)
    return out


def _logprobs_content(c: CompletionOutput, k: int) -> dict | None:
    if c.logprobs is None:
        return None

    def item(lp) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": max(lp.logprob, -9999.0), "bytes": list(text.encode())}

    content = []
    for tid, entry in zip(c.token_ids, c.logprobs):
        top = sorted(entry.values(), key=lambda lp: -lp.logprob)[:k]
        content.append({**item(entry[tid]), "top_logprobs": [item(lp) for lp in top]})
    return {"content": content}


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools:
        raise APIError(400, "tools are not supported by this server.", "tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice is not supported by this server.", "tool_choice")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise APIError(400, "response_format other than text is not supported.", "response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true.", "top_logprobs")


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request):
    check_model(ctx, req.model)
    _check_unsupported(req)
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise APIError(400, "best_of > n is not supported with stream.", "best_of")
    prompt = await ctx.renderer.render(_message_dicts(req), req.add_generation_prompt, req.chat_template,
                                       req.continue_final_message, req.chat_template_kwargs)
    if req.cache_salt is not None:
        prompt["cache_salt"] = req.cache_salt
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, ctx.max_model_len - len(prompt["prompt_token_ids"]))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = to_sampling_params(req, max_tokens, logprobs)
    request_id = new_id("chatcmpl")
    stream = merge([generate_one(ctx, prompt, params, request_id)])
    if req.stream:
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            first = None
        return StreamingResponse(_stream(ctx, req, request_id, stream, first), media_type="text/event-stream")

    results = await collect_until_disconnect(raw, stream)
    out = results[-1][1]
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs_content(c, req.top_logprobs or 0), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason} for c in out.outputs]
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": now(),
                         "model": ctx.served_model_name, "choices": choices,
                         "usage": usage(len(out.prompt_token_ids or ()), completion_tokens)})


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, request_id: str,
                  stream: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput] | None
                  ) -> AsyncIterator[str]:
    created = now()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.served_model_name}
    started: set[int] = set()
    prompt_tokens = completion_tokens = 0
    try:
        async def items():
            if first is not None:
                yield first
            async for item in stream:
                yield item

        async for _, out in items():
            prompt_tokens = len(out.prompt_token_ids or ())
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                if c.index not in started:
                    started.add(c.index)
                    yield sse({**base, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                                    "logprobs": None, "finish_reason": None}]})
                chunk = {**base, "choices": [{"index": c.index, "delta": {"content": c.text} if c.text else {},
                                              "logprobs": _logprobs_content(c, req.top_logprobs or 0),
                                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    yield sse("[DONE]")
