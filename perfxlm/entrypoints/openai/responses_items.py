"""The Responses API's shapes against the chat path's: input items -> chat messages, its flat function
tools -> chat tools, and a finished turn (reasoning, text, tool calls) -> output items and back into the
messages a later turn (previous_response_id) continues from. Plain data, no engine and no HTTP."""

from __future__ import annotations

import uuid
from typing import Any

from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.tool_parsers import ToolCall

_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of content parts.", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}: only text content parts are supported (input_text, output_text), "
                                f"got {kind!r}.", "input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: str | list[Any]) -> list[dict]:
    """Chat messages for a request's `input`: a string is one user message; items are messages
    (role + content), function_call and function_call_output; reasoning items are dropped, as the chat
    templates drop earlier turns' thinking."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}.",
                               "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text_of(item.get("content", ""), where)})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, arguments, call_id)):
                raise APIError(400, f"{where}: a function_call needs string name, arguments and call_id.", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # parallel calls of one turn stay in one message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise APIError(400, f"{where}: a function_call_output needs a string call_id.", "input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported; use message, function_call, "
                                "function_call_output or reasoning.", "input")
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict] | None:
    """The Responses API's flat function tools ({"type": "function", "name", "parameters"}) as chat tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools[{i}] must be a function tool {{\"type\": \"function\", \"name\": ...}}; "
                                f"built-in tools ({kind!r}) are not supported.", "tools")
        function = {"name": tool["name"]}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """"auto" / "none" / "required" stay; {"type": "function", "name": N} becomes the chat form."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def structured_format(text: dict | None) -> dict | None:
    """`text.format` as the chat path's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object such as {\"type\": \"json_schema\", ...}.", "text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "text.format.schema must be a JSON schema object.", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt["schema"]}}
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}.",
                   "text")


def reasoning_item(text: str, status: str = "completed", rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(text: str, status: str = "completed", mid: str | None = None) -> dict:
    return {"type": "message", "id": mid or item_id("msg"), "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(call: ToolCall, status: str = "completed", fid: str | None = None) -> dict:
    return {"type": "function_call", "id": fid or item_id("fc"), "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def output_items(reasoning: str | None, content: str | None, calls: list[ToolCall], status: str) -> list[dict]:
    items = []
    if reasoning:
        items.append(reasoning_item(reasoning, status))
    if content or not calls:
        items.append(message_item(content or "", status))
    items.extend(function_call_item(call, status) for call in calls)
    return items


def turn_messages(output: list[dict]) -> list[dict]:
    """A response's output as the chat messages a later turn sees (the thinking left out)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message]

