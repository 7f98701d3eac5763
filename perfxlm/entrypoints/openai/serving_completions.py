"""POST /v1/completions."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from perfxlm.entrypoints.openai.errors import APIError, error_body
from perfxlm.entrypoints.openai.protocol import CompletionRequest
from perfxlm.entrypoints.openai.serving_base import (
    ServerContext, beam_search_one, check_extra_fields, check_model, collect_until_disconnect, compile_structured_outputs,
    first_until_disconnect, generate_one, merge, prepended, new_id, now, sse, to_beam_search_params, to_sampling_params,
    usage,
)
from perfxlm.outputs import CompletionOutput, RequestOutput


def _prompts(req: CompletionRequest) -> list[Any]:
    prompts = _raw_prompts(req)
    if req.cache_salt is None:
        return prompts
    return [{"prompt": p, "cache_salt": req.cache_salt} if isinstance(p, str) else {**p, "cache_salt": req.cache_salt}
            for p in prompts]


async def _tokenized(ctx: ServerContext, prompt: Any) -> dict:
    """Text prompts tokenized in the renderer's threads: a long prompt must not hold up the event loop."""
    if isinstance(prompt, str):
        prompt = {"prompt": prompt}
    if "prompt_token_ids" not in prompt:
        prompt = {**prompt, "prompt_token_ids": await ctx.renderer.encode(prompt["prompt"])}
    return prompt


def _raw_prompts(req: CompletionRequest) -> list[Any]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty.", "prompt")
    if isinstance(p[0], int):
        return [{"prompt_token_ids": p}]
    if isinstance(p[0], list):
        return [{"prompt_token_ids": ids} for ids in p]
    return list(p)


def _logprobs_block(c: CompletionOutput, tokenizer: Any, text_offset0: int) -> dict | None:
    if c.logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset0
    for tid, entry in zip(c.token_ids, c.logprobs):
        chosen = entry[tid]
        text = chosen.decoded_token if chosen.decoded_token is not None else str(tid)
        tokens.append(text)
        token_logprobs.append(chosen.logprob)
        top.append({(lp.decoded_token if lp.decoded_token is not None else str(t)): lp.logprob
                    for t, lp in entry.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


async def create_completion(ctx: ServerContext, req: CompletionRequest, raw: Request):
    check_extra_fields(req)
    lora = check_model(ctx, req.model)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported.", "suffix")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported.", "echo")
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise APIError(400, "best_of > n is not supported with stream.", "best_of")
    # tokenized here, in the renderer's threads: a long prompt must not hold up the event loop
    prompts = [await _tokenized(ctx, p) for p in _prompts(req)]
    max_tokens = 16 if req.max_tokens is None else req.max_tokens
    request_id = new_id("cmpl")
    if req.use_beam_search:
        if req.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs is not supported with use_beam_search.", "prompt_logprobs")
        beams = to_beam_search_params(req, max_tokens, ctx.default_sampling)
        streams = [beam_search_one(ctx, p, beams, f"{request_id}-{i}", req.logprobs, lora)
                   for i, p in enumerate(prompts)]
    else:
        params = to_sampling_params(req, max_tokens, req.logprobs, req.prompt_logprobs, defaults=ctx.default_sampling)
        await compile_structured_outputs(ctx, params)
        streams = [generate_one(ctx, p, params, f"{request_id}-{i}", lora) for i, p in enumerate(prompts)]
    tokenizer = ctx.engine.tokenizer
    n = req.n

    if req.stream:
        merged = merge(streams)
        # bad input surfaces as a 400 before the stream starts
        first = await first_until_disconnect(raw, merged)
        return StreamingResponse(_stream(ctx, req, request_id, merged, first, n, tokenizer),
                                 media_type="text/event-stream")

    results = await collect_until_disconnect(raw, merge(streams))
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, out in sorted(results, key=lambda r: r[0]):
        prompt_tokens += len(out.prompt_token_ids or ())
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            text = ((out.prompt or "") + c.text) if req.echo else c.text
            choices.append({"index": i * n + c.index, "text": text,
                            "logprobs": _logprobs_block(c, tokenizer, 0), "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason, "prompt_logprobs": _prompt_lps(out)})
    return JSONResponse({"id": request_id, "object": "text_completion", "created": now(),
                         "model": req.model or ctx.served_model_name, "choices": choices,
                         "usage": usage(prompt_tokens, completion_tokens)})


def _prompt_lps(out: RequestOutput) -> list | None:
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in e.items()} for e in out.prompt_logprobs]


async def _stream(ctx: ServerContext, req: CompletionRequest, request_id: str,
                  merged: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput] | None,
                  n: int, tokenizer: Any) -> AsyncIterator[str]:
    created = now()
    prompt_tokens: dict[int, int] = {}
    completion_tokens = 0
    echoed: set[tuple[int, int]] = set()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        async for i, out in prepended(first, merged):
            prompt_tokens[i] = len(out.prompt_token_ids or ())
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = c.text
                if req.echo and (i, c.index) not in echoed:
                    echoed.add((i, c.index))
                    text = (out.prompt or "") + text
                chunk = {"id": request_id, "object": "text_completion", "created": created,
                         "model": req.model or ctx.served_model_name,
                         "choices": [{"index": i * n + c.index, "text": text,
                                      "logprobs": _logprobs_block(c, tokenizer, 0),
                                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                if include_usage:  # continuous_usage_stats: the running totals on every chunk (vLLM)
                    chunk["usage"] = (usage(sum(prompt_tokens.values()), completion_tokens)
                                      if req.stream_options.continuous_usage_stats else None)
                yield sse(chunk)
        if include_usage:
            yield sse({"id": request_id, "object": "text_completion", "created": created,
                       "model": req.model or ctx.served_model_name, "choices": [],
                       "usage": usage(sum(prompt_tokens.values()), completion_tokens)})
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    yield sse("[DONE]")
