"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request becomes chat messages (instructions, the stored turns of previous_response_id, its input
items), renders through the chat template, runs as one chat choice, and its text is split by the same
reasoning and tool parsers (`_ChoiceParser`) into reasoning, message and function_call output items.
Streaming sends OpenAI's events in order: response.created, response.in_progress, then per item
output_item.added, content_part.added, the deltas, their .done events, output_item.done, and last
response.completed (response.incomplete when max_output_tokens cut it)."""

from __future__ import annotations

import itertools
import time
from types import SimpleNamespace
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.protocol import ResponsesRequest
from perfxlm.entrypoints.openai.responses_items import (
    chat_tool_choice, chat_tools, function_call_item, input_messages, item_id, message_item, output_items,
    output_text_part, reasoning_item, structured_format, turn_messages,
)
from perfxlm.entrypoints.openai.responses_store import StoredResponse
from perfxlm.entrypoints.openai.serving_base import (
    ServerContext, check_extra_fields, check_model, collect_until_disconnect, compile_structured_outputs,
    first_until_disconnect, generate_one, merge, prepended, sse_json, to_sampling_params,
)
from perfxlm.entrypoints.openai.serving_chat import (
    _assistant_args_to_dicts, _ChoiceParser, _thinking_end, _tool_constraint, _tool_mode,
)
from perfxlm.entrypoints.openai.tool_parsers import ToolCall
from perfxlm.outputs import RequestOutput


def _check(ctx: ServerContext, req: ResponsesRequest) -> Any:
    """The request's LoRA adapter (None: the base model), after refusing what the endpoint cannot do."""
    check_extra_fields(req)
    lora = check_model(ctx, req.model)
    if req.background:
        raise APIError(400, "background responses are not supported; drop background or set it to false.",
                       "background")
    if req.n != 1:
        raise APIError(400, "n is not a Responses API field; a response has one output.", "n")
    if req.use_beam_search:
        raise APIError(400, "use_beam_search is not supported on /v1/responses; use /v1/completions.",
                       "use_beam_search")
    if req.text is not None and structured_format(req.text) is not None and req.response_format is not None:
        raise APIError(400, "Give text.format or response_format, not both.", "text")
    return lora


def _history(ctx: ServerContext, req: ResponsesRequest) -> list[dict]:
    if req.previous_response_id is None:
        return []
    stored = ctx.responses.get(req.previous_response_id) if ctx.responses is not None else None
    if stored is None:
        raise APIError(400, f"Previous response with id {req.previous_response_id!r} not found (responses are "
                            "kept only with store=true, and the oldest are dropped past --max-stored-responses).",
                       "previous_response_id", "previous_response_not_found")
    return [dict(m) for m in stored.messages]


def _usage(out: RequestOutput, reasoning_tokens: int) -> dict:
    prompt = len(out.prompt_token_ids or ())
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens or 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


class _Turn:
    """One request's settings, kept to build the Response object and to store the turn."""

    def __init__(self, ctx: ServerContext, req: ResponsesRequest, conversation: list[dict]) -> None:
        self.ctx, self.req, self.conversation = ctx, req, conversation
        self.id = item_id("resp")
        self.created = int(time.time())

    def response(self, status: str, output: list[dict], usage: dict | None) -> dict:
        req = self.req
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.ctx.served_model_name, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": req.store,
            "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"), "tools": req.tools or [],
            "top_p": req.top_p, "truncation": req.truncation or "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    def remember(self, body: dict) -> None:
        if self.req.store and self.ctx.responses is not None:
            self.ctx.responses.put(self.id, StoredResponse(body, self.conversation + turn_messages(body["output"])))


async def create_response(ctx: ServerContext, req: ResponsesRequest, raw: Request):
    lora = _check(ctx, req)
    history = _history(ctx, req)
    conversation = history + input_messages(req.input)  # instructions are not carried to later turns (OpenAI)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    tools = chat_tools(req.tools)
    shape = SimpleNamespace(tools=tools, tool_choice=chat_tool_choice(req.tool_choice),
                            parallel_tool_calls=req.parallel_tool_calls)
    mode, tool = _tool_mode(ctx, shape)
    constraint = _tool_constraint(mode, tool, shape)
    fmt = structured_format(req.text)
    if fmt is not None:
        if constraint is not None:
            raise APIError(400, f'tool_choice "{mode}" constrains the output already; drop text.format.', "text")
        req.response_format = fmt
    max_tokens = req.max_output_tokens if req.max_output_tokens is not None else req.max_tokens
    prompt = await _render(ctx, req, system, conversation, tools if mode != "none" else None, max_tokens or 1)
    if max_tokens is None:
        max_tokens = max(1, ctx.max_model_len - len(prompt["prompt_token_ids"]))
    params = to_sampling_params(req, max_tokens, None, structured_outputs=constraint, defaults=ctx.default_sampling)
    if params.structured_outputs is not None and ctx.reasoning_parser is not None:
        params._grammar_start_token = _thinking_end(ctx, prompt["prompt_token_ids"])
    await compile_structured_outputs(ctx, params)
    turn = _Turn(ctx, req, conversation)
    stream = merge([generate_one(ctx, prompt, params, turn.id, lora)])
    opened = True if (prompt.get("prompt") or "").rstrip().endswith("<think>") else None
    parser = _ChoiceParser(ctx, mode, tool, req.parallel_tool_calls is not False, opened)
    if req.stream:
        # bad input surfaces as a 400 before the stream starts
        first = await first_until_disconnect(raw, stream)
        return StreamingResponse(_stream(turn, parser, stream, first), media_type="text/event-stream")

    results = await collect_until_disconnect(raw, stream)
    out = results[-1][1]
    choice = out.outputs[0]
    reasoning, content, calls = parser.finish(choice.text, choice.finish_reason)
    status = _status(choice.finish_reason)
    body = turn.response(status, output_items(reasoning, content, calls, _item_status(status)),
                         _usage(out, await _count_tokens(ctx, reasoning)))
    turn.remember(body)
    return JSONResponse(body)


def _status(finish_reason: str | None) -> str:
    """A response's status from its choice's finish: cut by max_output_tokens, aborted, or done."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"  # items have no "cancelled"


async def _render(ctx: ServerContext, req: ResponsesRequest, system: list[dict], conversation: list[dict],
                  tools: list[dict] | None, min_new_tokens: int) -> dict:
    """The prompt through the chat template; with truncation="auto", the oldest turns dropped until it
    and min_new_tokens fit max_model_len."""
    kept = list(conversation)
    while True:
        prompt = await ctx.renderer.render(_assistant_args_to_dicts(system + [dict(m) for m in kept]), True,
                                           req.chat_template, False, req.chat_template_kwargs, tools=tools)
        if req.truncation != "auto" or len(prompt["prompt_token_ids"]) + min_new_tokens <= ctx.max_model_len:
            return prompt
        kept = _drop_oldest_turn(kept)
        if not kept:
            raise APIError(400, f"The instructions and the last input item alone exceed max_model_len "
                                f"({ctx.max_model_len} tokens) with max_output_tokens; shorten them.", "input")


def _drop_oldest_turn(messages: list[dict]) -> list[dict]:
    """truncation="auto" (OpenAI: drop items from the start of the conversation until it fits): the oldest
    message goes, with the tool results that answered it, and the last message always stays (empty when
    only it was left, which is then refused)."""
    if len(messages) <= 1:
        return []
    rest = messages[1:]
    while len(rest) > 1 and rest[0]["role"] == "tool":
        rest = rest[1:]
    return rest


async def _count_tokens(ctx: ServerContext, text: str | None) -> int:
    if not text or ctx.renderer is None:
        return 0
    return len(await ctx.renderer.encode(text, add_special_tokens=False))


def get_response(ctx: ServerContext, response_id: str) -> JSONResponse:
    stored = ctx.responses.get(response_id) if ctx.responses is not None else None
    if stored is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", "response_id", "not_found")
    return JSONResponse(stored.response)


def delete_response(ctx: ServerContext, response_id: str) -> JSONResponse:
    if ctx.responses is None or not ctx.responses.delete(response_id):
        raise APIError(404, f"Response with id {response_id!r} not found.", "response_id", "not_found")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


class _Events:
    """OpenAI's streaming events for one response, numbered, with the items they open and close."""

    def __init__(self, turn: _Turn) -> None:
        self.turn = turn
        self.seq = itertools.count()
        self.output: list[dict] = []  # items done so far
        self.open: dict | None = None  # the reasoning or message item receiving text
        self.text = ""

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(self.seq), **fields}
        return f"event: {kind}\ndata: {sse_json(body)}\n\n"

    def start(self) -> list[str]:
        shell = self.turn.response("in_progress", [], None)
        return [self.event("response.created", response=shell), self.event("response.in_progress", response=shell)]

    def text_piece(self, kind: str, delta: str) -> list[str]:
        """New text for a reasoning item (kind "reasoning") or the message ("message"), opening it first."""
        if not delta:
            return []
        events = []
        if self.open is not None and self.open["type"] != kind:
            events += self.close_open("completed")
        if self.open is None:
            self.open = (reasoning_item("", "in_progress") if kind == "reasoning"
                         else message_item("", "in_progress"))
            self.open["content"] = []
            self.text = ""
            index = len(self.output)
            events.append(self.event("response.output_item.added", output_index=index, item=self.open))
            events.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                                     content_index=0, part=self._part("")))
        self.text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=self.open["id"], output_index=len(self.output), content_index=0,
                                 delta=delta, **extra))
        return events

    def _part(self, text: str) -> dict:
        if self.open["type"] == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return output_text_part(text)

    def close_open(self, status: str) -> list[str]:
        if self.open is None:
            return []
        item, index = self.open, len(self.output)
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        events = [self.event(done, item_id=item["id"], output_index=index, content_index=0, text=self.text, **extra),
                  self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                             part=self._part(self.text))]
        final = (reasoning_item(self.text, status, item["id"]) if item["type"] == "reasoning"
                 else message_item(self.text, status, item["id"]))
        events.append(self.event("response.output_item.done", output_index=index, item=final))
        self.output.append(final)
        self.open = None
        return events

    def call(self, call: ToolCall, status: str) -> list[str]:
        index = len(self.output)
        item = function_call_item(call, "in_progress")
        events = [self.event("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
                  self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=call.arguments),
                  self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=call.name, arguments=call.arguments)]
        final = {**item, "status": status}
        events.append(self.event("response.output_item.done", output_index=index, item=final))
        self.output.append(final)
        return events


async def _stream(turn: _Turn, parser: _ChoiceParser, stream: AsyncIterator[tuple[int, RequestOutput]],
                  first: tuple[int, RequestOutput] | None) -> AsyncIterator[str]:
    events = _Events(turn)
    for e in events.start():
        yield e
    held = ""  # a named tool's arguments: sent as the call at the end, or as text if it never became one
    try:
        async for _, out in prepended(first, stream):
            choice = out.outputs[0]
            if choice.finish_reason is None:
                new_r, new_c = parser.stream(choice.text)
                calls: list[ToolCall] = []
            else:
                new_r, new_c, calls = parser.stream_end(choice.text, choice.finish_reason)
            for e in events.text_piece("reasoning", new_r):
                yield e
            if parser.mode == "named":
                held += new_c
                new_c = "" if calls or choice.finish_reason is None else held
            for e in events.text_piece("message", new_c):
                yield e
            if choice.finish_reason is None:
                continue
            status = _status(choice.finish_reason)
            has_message = any(i["type"] == "message" for i in events.output + [events.open or {"type": None}])
            if not calls and not has_message:
                for e in events.close_open(_item_status(status)) + _empty_message(events):
                    yield e
            for e in events.close_open(_item_status(status)):
                yield e
            for call in calls:
                for e in events.call(call, _item_status(status)):
                    yield e
            reasoning = "".join(p["text"] for i in events.output if i["type"] == "reasoning" for p in i["content"])
            body = turn.response(status, events.output,
                                 _usage(out, await _count_tokens(turn.ctx, reasoning)))
            turn.remember(body)
            yield events.event("response.completed" if status == "completed" else "response.incomplete",
                               response=body)
    except APIError as exc:
        yield events.event("error", code=exc.code or str(exc.status), message=exc.message, param=exc.param)


def _empty_message(events: _Events) -> list[str]:
    """A turn with no text and no call still answers with one (empty) message, as the non-streamed form."""
    events.open = message_item("", "in_progress")
    events.open["content"] = []
    events.text = ""
    index = len(events.output)
    return [events.event("response.output_item.added", output_index=index, item=events.open),
            events.event("response.content_part.added", item_id=events.open["id"], output_index=index,
                         content_index=0, part=output_text_part(""))]
