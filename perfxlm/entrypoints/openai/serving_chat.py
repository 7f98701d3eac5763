"""POST /v1/chat/completions."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from perfxlm.entrypoints.openai.errors import APIError, error_body
from perfxlm.entrypoints.openai.protocol import ChatCompletionRequest
from perfxlm.entrypoints.openai.serving_base import (
    ServerContext, beam_search_one, check_extra_fields, check_model, collect_until_disconnect, compile_structured_outputs,
    first_until_disconnect, generate_one, merge, prepended, new_id, now, sse, structured_outputs_of,
    to_beam_search_params, to_sampling_params, usage,
)
from perfxlm.entrypoints.openai.tool_parsers import ToolCall, parse_required, required_schema
from perfxlm.outputs import CompletionOutput, RequestOutput
from perfxlm.sampling_params import StructuredOutputsParams


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
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true.", "top_logprobs")


def _tool_mode(ctx: ServerContext, req: ChatCompletionRequest) -> tuple[str, dict | None]:
    """("none" | "auto" | "required" | "named", the named tool) after checking tools and tool_choice."""
    tools = req.tools or []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}.",
                           "tools")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type", "function") == "function" else None
        if not isinstance(name, str):
            raise APIError(400, 'tool_choice must be "none", "auto", "required" or '
                                '{"type": "function", "function": {"name": ...}}.', "tool_choice")
        tool = next((t for t in tools if t["function"]["name"] == name), None)
        if tool is None:
            raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools.", "tool_choice")
        return "named", tool
    if choice not in ("none", "auto", "required"):
        raise APIError(400, f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}.',
                       "tool_choice")
    if choice != "none" and not tools:
        raise APIError(400, f'tool_choice "{choice}" needs tools.', "tool_choice")
    if choice == "auto" and (not ctx.enable_auto_tool_choice or ctx.tool_parser is None):
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                       "tool_choice" if req.tool_choice is not None else "tools")
    return choice, None


def _tool_constraint(mode: str, tool: dict | None, req: ChatCompletionRequest) -> StructuredOutputsParams | None:
    if mode == "named":
        schema = tool["function"].get("parameters") or {"type": "object", "properties": {}}
        return StructuredOutputsParams(json=schema)
    if mode == "required":
        return StructuredOutputsParams(json=required_schema(req.tools, req.parallel_tool_calls is not False))
    return None


class _ChoiceParser:
    """Turns one choice's text into reasoning, content and tool calls, whole or piece by piece."""

    def __init__(self, ctx: ServerContext, mode: str, tool: dict | None, parallel: bool,
                 opened: bool | None = None) -> None:
        self.reasoning = ctx.reasoning_parser
        self.opened = opened  # the prompt ends inside <think>
        self.tools = ctx.tool_parser if mode == "auto" else None
        self.mode, self.tool, self.parallel = mode, tool, parallel
        self.text = ""
        self.call_id: str | None = None  # named tool choice: the call whose arguments are streaming
        self.sent_reasoning = 0
        self.sent_content = 0

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, final, self.opened)

    def finish(self, text: str, finish_reason: str | None) -> tuple[str | None, str | None, list[ToolCall]]:
        reasoning, content = self.split(text, True)
        calls: list[ToolCall] = []
        if self.mode == "named":
            if finish_reason == "stop":
                try:  # the grammar made it valid JSON: send it compact, as OpenAI does
                    arguments = json.dumps(json.loads(content), ensure_ascii=False)
                except ValueError:
                    arguments = content
                calls = [ToolCall(self.tool["function"]["name"], arguments)]
                content = ""
        elif self.mode == "required":
            if finish_reason == "stop":
                try:
                    calls = parse_required(content)
                    content = ""
                except (ValueError, KeyError, TypeError):
                    calls = []
        elif self.tools is not None:
            content, calls = self.tools.parse(content)
        if not self.parallel and len(calls) > 1:
            calls = calls[:1]
        return reasoning, (content or None), calls

    def stream(self, delta: str) -> tuple[str, str]:
        """New (reasoning, content) text to send for this piece of output, before the end."""
        self.text += delta
        reasoning, content = self.split(self.text, False)
        if self.mode == "required":
            content = ""  # the constrained output is the calls, sent at the end
        elif self.tools is not None:
            content = content[: self.tools.stream_split(content)]
        return self._unsent(reasoning, content)

    def stream_end(self, delta: str, finish_reason: str | None) -> tuple[str, str, list[ToolCall]]:
        """The last piece: what is left to send of reasoning and content, and the calls."""
        self.text += delta
        _, _, calls = self.finish(self.text, finish_reason)
        reasoning, content = self.split(self.text, True)
        if calls and self.mode != "named":  # the content before the calls, as it streamed (auto)
            content = self.tools.content_before_calls(content) if self.tools is not None else ""
        new_r, new_c = self._unsent(reasoning, content)
        return new_r, new_c, calls

    def _unsent(self, reasoning: str | None, content: str) -> tuple[str, str]:
        new_r = (reasoning or "")[self.sent_reasoning:]
        new_c = content[self.sent_content:]
        self.sent_reasoning += len(new_r)
        self.sent_content += len(new_c)
        return new_r, new_c


def _named_call_piece(parser: "_ChoiceParser", tool: dict, arguments: str) -> dict:
    """One streamed piece of a named call: the first carries its id and name, the rest only arguments."""
    if parser.call_id is None:
        parser.call_id = ToolCall(tool["function"]["name"], "").id
        return {"index": 0, "id": parser.call_id, "type": "function",
                "function": {"name": tool["function"]["name"], "arguments": arguments}}
    return {"index": 0, "function": {"arguments": arguments}}


def _finish_reason(reason: str | None, mode: str, calls: list[ToolCall]) -> str | None:
    # vLLM and OpenAI: a model-chosen call ends with "tool_calls"; a forced named function with "stop"
    if calls and reason == "stop" and mode in ("auto", "required"):
        return "tool_calls"
    return reason


def _assistant_args_to_dicts(messages: list[dict]) -> list[dict]:
    """Templates (Qwen, Hermes, Llama) expect a past call's arguments as a mapping, clients send JSON text."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            f = call.get("function") if isinstance(call, dict) else None
            if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                try:
                    f["arguments"] = json.loads(f["arguments"])
                except json.JSONDecodeError:
                    pass
    return messages


def _thinking_end(ctx: ServerContext, prompt_ids: list[int]) -> int | None:
    """Under --reasoning-parser the structured output constrains the answer, not the thinking (as vLLM):
    the end-of-thinking token, unless the prompt already closed the thinking (enable_thinking=False) or the
    vocabulary has no single such token (the constraint then holds from the first token)."""
    ids = ctx.reasoning_token_ids
    if ids is None:
        return None
    start, end = ids
    last_end = max((i for i, t in enumerate(prompt_ids) if t == end), default=-1)
    last_start = max((i for i, t in enumerate(prompt_ids) if t == start), default=-1)
    return None if last_end > last_start else end


async def create_chat_completion(ctx: ServerContext, req: ChatCompletionRequest, raw: Request):
    check_extra_fields(req)
    lora = check_model(ctx, req.model)
    _check_unsupported(req)
    if req.stream and req.best_of is not None and req.best_of > req.n:
        raise APIError(400, "best_of > n is not supported with stream.", "best_of")
    mode, tool = _tool_mode(ctx, req)
    constraint = _tool_constraint(mode, tool, req)
    if constraint is not None and structured_outputs_of(req) is not None:
        raise APIError(400, f'tool_choice "{mode}" constrains the output already; drop the structured-output '
                            "field.", "tool_choice")
    tools = req.tools if mode != "none" and req.tools else None
    prompt = await ctx.renderer.render(_assistant_args_to_dicts(_message_dicts(req)), req.add_generation_prompt,
                                       req.chat_template, req.continue_final_message, req.chat_template_kwargs,
                                       tools=tools)
    if req.cache_salt is not None:
        prompt["cache_salt"] = req.cache_salt
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens is None:
        max_tokens = max(1, ctx.max_model_len - len(prompt["prompt_token_ids"]))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    request_id = new_id("chatcmpl")
    if req.use_beam_search:
        if constraint is not None:
            raise APIError(400, f'tool_choice "{mode}" is not supported with use_beam_search.', "tool_choice")
        beams = to_beam_search_params(req, max_tokens, ctx.default_sampling)
        stream = merge([beam_search_one(ctx, prompt, beams, request_id, logprobs, lora)])
    else:
        params = to_sampling_params(req, max_tokens, logprobs, structured_outputs=constraint,
                                    defaults=ctx.default_sampling)
        if params.structured_outputs is not None and ctx.reasoning_parser is not None:
            params._grammar_start_token = _thinking_end(ctx, prompt["prompt_token_ids"])
        await compile_structured_outputs(ctx, params)
        stream = merge([generate_one(ctx, prompt, params, request_id, lora)])
    parallel = req.parallel_tool_calls is not False
    # a template that opens <think> itself (Qwen3 thinking-only, DeepSeek-R1): the output starts in reasoning
    opened = True if (prompt.get("prompt") or "").rstrip().endswith("<think>") else None
    if req.stream:
        # bad input surfaces as a 400 before the stream starts
        first = await first_until_disconnect(raw, stream)
        return StreamingResponse(_stream(ctx, req, request_id, stream, first, mode, tool, parallel, opened),
                                 media_type="text/event-stream")

    results = await collect_until_disconnect(raw, stream)
    out = results[-1][1]
    choices = []
    for c in out.outputs:
        reasoning, content, calls = _ChoiceParser(ctx, mode, tool, parallel, opened).finish(c.text, c.finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if ctx.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        message["tool_calls"] = [call.to_dict() for call in calls]
        choices.append({"index": c.index, "message": message,
                        "logprobs": _logprobs_content(c, req.top_logprobs or 0),
                        "finish_reason": _finish_reason(c.finish_reason, mode, calls), "stop_reason": c.stop_reason})
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return JSONResponse({"id": request_id, "object": "chat.completion", "created": now(),
                         "model": req.model or ctx.served_model_name, "choices": choices,
                         "usage": usage(len(out.prompt_token_ids or ()), completion_tokens)})


async def _stream(ctx: ServerContext, req: ChatCompletionRequest, request_id: str,
                  stream: AsyncIterator[tuple[int, RequestOutput]], first: tuple[int, RequestOutput] | None,
                  mode: str, tool: dict | None, parallel: bool, opened: bool | None = None) -> AsyncIterator[str]:
    created = now()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": req.model or ctx.served_model_name}
    parsers: dict[int, _ChoiceParser] = {}
    prompt_tokens = completion_tokens = 0

    def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        body = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason, **({"stop_reason": stop_reason}
                                                                        if finish_reason else {})}]}
        if include_usage:
            body["usage"] = usage(prompt_tokens, completion_tokens) if continuous else None
        return sse(body)

    try:
        async for _, out in prepended(first, stream):
            prompt_tokens = len(out.prompt_token_ids or ())
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                parser = parsers.get(c.index)
                if parser is None:
                    parser = parsers[c.index] = _ChoiceParser(ctx, mode, tool, parallel, opened)
                    yield chunk(c.index, {"role": "assistant", "content": ""})
                finished = c.finish_reason is not None
                calls: list[ToolCall] = []
                if finished:
                    new_r, new_c, calls = parser.stream_end(c.text, c.finish_reason)
                else:
                    new_r, new_c = parser.stream(c.text)
                delta: dict[str, Any] = {}
                if new_r:
                    delta["reasoning_content"] = new_r
                if new_c and mode == "named" and (not finished or calls or parser.call_id is not None):
                    delta["tool_calls"] = [_named_call_piece(parser, tool, new_c)]  # the arguments, as they come
                elif new_c:
                    delta["content"] = new_c
                lps = _logprobs_content(c, req.top_logprobs or 0)
                if not finished:
                    if delta or lps is not None:
                        yield chunk(c.index, delta, lps)
                    continue
                if delta or lps is not None:
                    yield chunk(c.index, delta, lps)
                if calls and mode != "named":
                    yield chunk(c.index, {"tool_calls": [{"index": i, **call.to_dict()} for i, call in enumerate(calls)]})
                yield chunk(c.index, {}, None, _finish_reason(c.finish_reason, mode, calls), c.stop_reason)
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.param, exc.code))
    yield sse("[DONE]")
