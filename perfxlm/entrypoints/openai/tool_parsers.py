"""Tool calls in model output, in the formats of the supported families (vLLM's --tool-call-parser names):

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Qwen2.5, Qwen3,
  Hermes); text outside the blocks is content;
- llama3_json: the whole output is `{"name": ..., "parameters": {...}}` (calls separated by ";"),
  optionally after `<|python_tag|>` (Llama 3.1+);
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the v11 tokenizer's
  `[TOOL_CALLS]name[ARGS]{...}`; text before the marker is content.

A parser turns the final text into (content, calls). Streaming holds text back from the moment it
may be a call (a marker, or a prefix of one at the end of what has arrived): content streams as it
comes, and the calls are sent whole once the output ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(obj: object, args_keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[object] | None:
    """Consecutive JSON values separated by whitespace, ';' or ','; None if anything else is there."""
    decoder = json.JSONDecoder()
    out, i, n = [], 0, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n;,":
            i += 1
        if i >= n:
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(value)
    return out


class ToolParser:
    markers: tuple[str, ...] = ()
    starts_output_only = False  # the call must be the whole output (llama3_json)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def content_before_calls(self, text: str) -> str:
        """The text before the first call, as it was (what streaming shows as content when calls follow)."""
        if self.starts_output_only:
            return ""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return text[: min(found)] if found else text

    def stream_split(self, text: str) -> int:
        """How many leading characters of the text so far are certainly content (safe to stream)."""
        if self.starts_output_only:
            stripped = text.lstrip()
            if not stripped:
                return 0
            for m in self.markers:
                if stripped.startswith(m) or m.startswith(stripped):
                    return 0
            return len(text)
        cut = len(text)
        for m in self.markers:
            i = text.find(m)
            if i >= 0:
                cut = min(cut, i)
        if cut < len(text):
            return cut
        # hold back a tail that could be the start of a marker
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return cut


class HermesToolParser(ToolParser):
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            values = _json_values(body)
            if not values:
                return text, []
            for v in values:
                call = _call_of(v)
                if call is None:
                    return text, []
                calls.append(call)
        content = text[: text.index("<tool_call>")].strip()
        return (content or None), calls


class Llama3JsonToolParser(ToolParser):
    markers = ("<|python_tag|>", "{")
    starts_output_only = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        values = _json_values(body)
        calls = [_call_of(v) for v in values] if values else []
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls


class MistralToolParser(ToolParser):
    markers = ("[TOOL_CALLS]",)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "[TOOL_CALLS]" not in text:
            return text, []
        content, _, rest = text.partition("[TOOL_CALLS]")
        calls: list[ToolCall] = []
        for part in rest.split("[TOOL_CALLS]"):
            part = part.strip()
            if "[ARGS]" in part:  # v11: name[ARGS]{...}
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args)
                if not values or len(values) != 1:
                    return text, []
                call = _call_of({"name": name.strip(), "arguments": values[0]})
                if call is None:
                    return text, []
                calls.append(call)
                continue
            values = _json_values(part)
            if values is None:
                return text, []
            for v in values:
                for item in (v if isinstance(v, list) else [v]):
                    call = _call_of(item)
                    if call is None:
                        return text, []
                    calls.append(call)
        if not calls:
            return text, []
        return (content.strip() or None), calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"Unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}.") from None


# ---- tool_choice "required" and named: constrained decoding -------------------------------------
def required_schema(tools: list[dict], parallel: bool) -> dict:
    """vLLM's form: a JSON array of {"name", "parameters"} objects, one alternative per tool."""
    items = []
    for t in tools:
        f = t["function"]
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [f["name"]]},
                                     "parameters": f.get("parameters") or {"type": "object", "properties": {}}},
                      "required": ["name", "parameters"]})
    schema: dict = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str) -> list[ToolCall]:
    values = json.loads(text)
    return [ToolCall(v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False)) for v in values]
