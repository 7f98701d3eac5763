"""What agent frameworks send, through the official openai client, against a server started with a
typical vLLM launch line: response_format, tools with each tool_choice, the reasoning split,
chat_template_kwargs, generation-config defaults and the launch flags themselves."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import ServerProcess

openai = pytest.importorskip("openai")

KEY = "sk-test-key"
NAME = "smol"
TEMPLATE = """{%- if tools %}<|im_start|>system
Tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# a grammar forcing a Hermes-style reply with thinking and one call, so "auto" parsing is tested exactly
FORCED = ('root ::= "<think>\\nhmm\\n</think>\\n\\nSure. <tool_call>\\n{\\"name\\": \\"get_weather\\", '
          '\\"arguments\\": {\\"city\\": \\"Paris\\"}}\\n</tool_call>"')


@pytest.fixture(scope="module")
def server(tmp_path_factory, monkeypatch_module):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    monkeypatch_module.setenv("VLLM_CPU_KVCACHE_SPACE", "0.25")
    s = ServerProcess.__new__(ServerProcess)
    # vLLM's launch line, unchanged (ServerProcess adds --dtype float32 --kv-cache-gib; this one does not)
    _start(s, ["--host", "127.0.0.1", "--served-model-name", NAME, "--dtype", "bfloat16",
               "--max-model-len", "8192", "--max-num-seqs", "64", "--enable-prefix-caching",
               "--chat-template", str(template), "--generation-config", "auto", "--api-key", KEY,
               "--tensor-parallel-size", "1", "--kv-cache-dtype", "auto", "--enable-auto-tool-choice",
               "--tool-call-parser", "hermes", "--disable-log-requests", "--uvicorn-log-level", "info",
               "--gpu-memory-utilization", "0.9", "--enforce-eager", "--swap-space", "4",
               "--reasoning-parser", "qwen3", "--allowed-origins", '["*"]'])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _start(s: ServerProcess, flags: list[str]) -> None:
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import default_model_or_skip
    from tests.server.conftest import free_port

    s.port = free_port()
    s.url = f"http://127.0.0.1:{s.port}"
    cmd = [sys.executable, "-m", "perfxlm.entrypoints.cli", "serve", default_model_or_skip(), "--port", str(s.port),
           *flags]
    s.log_path = f"/tmp/perfxlm-test-server-{s.port}.log"
    s.log = open(s.log_path, "w")
    s.proc = subprocess.Popen(cmd, stdout=s.log, stderr=subprocess.STDOUT, env={**os.environ, "TQDM_DISABLE": "1"})
    deadline = time.time() + 180
    while time.time() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"server exited early: {open(s.log_path).read()[-2000:]}")
        try:
            if httpx.get(s.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)


def _chat(client, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 40)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=NAME, **kw)


def _collect(stream) -> tuple[dict, str | None]:
    """Accumulate a chat stream as clients do: content, reasoning and tool-call pieces."""
    acc = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta.model_dump(exclude_none=True)
        acc["content"] += d.get("content") or ""
        acc["reasoning_content"] += d.get("reasoning_content") or ""
        for call in d.get("tool_calls") or []:
            slot = acc["tool_calls"].setdefault(call["index"], {"name": "", "arguments": ""})
            slot["name"] += call.get("function", {}).get("name") or ""
            slot["arguments"] += call.get("function", {}).get("arguments") or ""
        finish = chunk.choices[0].finish_reason or finish
    return acc, finish


def test_launch_line(server, client):
    assert httpx.get(server.url + "/v1/models").status_code == 401  # --api-key
    assert [m.id for m in client.models.list().data] == [NAME]
    log = open(server.log_path).read()
    assert "--gpu-memory-utilization has no effect on CPU" in log
    assert "0.250 GiB" in log  # VLLM_CPU_KVCACHE_SPACE
    pre = httpx.options(server.url + "/v1/models", headers={"Origin": "http://a.example",
                                                             "Access-Control-Request-Method": "GET"})
    assert pre.headers.get("access-control-allow-origin") == "*"  # '["*"]', vLLM's JSON form


@pytest.mark.parametrize("stream", [False, True])
def test_response_format(client, stream):
    for fmt, check in [({"type": "json_object"}, lambda v: isinstance(v, dict)),
                       ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
                        lambda v: isinstance(v["name"], str) and isinstance(v["age"], int))]:
        msgs = [{"role": "user", "content": "A person as JSON with name and age."}]
        if stream:
            acc, finish = _collect(_chat(client, messages=msgs, response_format=fmt, stream=True, max_tokens=60))
            text = acc["content"]
        else:
            r = _chat(client, messages=msgs, response_format=fmt, max_tokens=60)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", text
        assert check(json.loads(text))


def test_other_spellings_and_errors(client):
    extra = [{"structured_outputs": {"choice": ["Paris", "Rome"]}}, {"guided_choice": ["Paris", "Rome"]},
             {"grammar": 'root ::= "Paris" | "Rome"'}, {"json_schema": {"type": "string", "enum": ["Paris", "Rome"]}}]
    for body in extra:
        text = _chat(client, extra_body=body, max_tokens=8).choices[0].message.content
        assert text.strip('"') in ("Paris", "Rome"), (body, text)
    with pytest.raises(openai.BadRequestError, match="Unsupported type"):
        _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}})
    with pytest.raises(openai.BadRequestError, match="one structured-output"):
        _chat(client, response_format={"type": "json_object"}, extra_body={"guided_regex": "a+"})
    # vLLM's continuous_usage_stats: running usage on every chunk
    chunks = list(_chat(client, max_tokens=3, stream=True,
                        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens >= 1
    # completions take the same fields
    text = client.completions.create(model=NAME, prompt="The year:", max_tokens=6,
                                     extra_body={"guided_regex": "[0-9]{4}"}).choices[0].text
    assert len(text) == 4 and text.isdigit()
    # unknown fields: accepted and ignored as vLLM does, unless they would change the result
    r = _chat(client, max_tokens=2, store=False, metadata={"k": "v"}, extra_body={"cache_prompt": True})
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="logits_processors"):
        _chat(client, extra_body={"logits_processors": ["x"]})


def test_tool_choice_none_required_named(client):
    r = _chat(client, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content
    r = _chat(client, tools=TOOLS, tool_choice="required", max_tokens=60)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = _chat(client, tools=TOOLS, tool_choice=named, max_tokens=40)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    acc, finish = _collect(_chat(client, tools=TOOLS, tool_choice=named, max_tokens=40, stream=True))
    assert finish == "stop" and acc["tool_calls"][0]["name"] == "get_weather" and not acc["content"]
    assert json.loads(acc["tool_calls"][0]["arguments"]) == json.loads(call.function.arguments)  # streamed in pieces
    acc, finish = _collect(_chat(client, tools=TOOLS, tool_choice="required", max_tokens=60, stream=True))
    assert finish == "tool_calls" and acc["tool_calls"][0]["name"] == "get_weather"
    assert isinstance(json.loads(acc["tool_calls"][0]["arguments"])["city"], str)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        _chat(client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_auto_tool_call_and_reasoning(client):
    r = _chat(client, tools=TOOLS, extra_body={"structured_outputs": {"grammar": FORCED}}, max_tokens=120)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls", m
    assert m.content == "Sure." and m.reasoning_content.strip() == "hmm"
    assert m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}
    acc, finish = _collect(_chat(client, tools=TOOLS, extra_body={"structured_outputs": {"grammar": FORCED}},
                                 max_tokens=120, stream=True))
    assert finish == "tool_calls"
    assert acc["reasoning_content"].strip() == "hmm" and acc["content"].strip() == "Sure."
    assert json.loads(acc["tool_calls"][0]["arguments"]) == {"city": "Paris"}


def test_tool_results_and_template_kwargs(client):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"}]
    r = _chat(client, messages=history, tools=TOOLS, max_tokens=8)
    assert r.choices[0].message.content is not None
    base = _chat(client, max_tokens=1).usage.prompt_tokens
    off = _chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > base  # the template saw enable_thinking


def test_auto_needs_the_flags():
    from perfxlm.entrypoints.openai.serving_base import ServerContext
    from perfxlm.entrypoints.openai.serving_chat import _tool_mode
    from perfxlm.entrypoints.openai.errors import APIError
    from perfxlm.entrypoints.openai.protocol import ChatCompletionRequest

    ctx = ServerContext(None, "m", 100, None)
    req = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        _tool_mode(ctx, req)


def test_sdk_parse_with_a_pydantic_model(client):
    """The openai SDK's parse(): a strict schema with $defs, enums and nullable fields, parsed back."""
    from enum import Enum

    from pydantic import BaseModel

    class Color(str, Enum):
        red = "red"
        blue = "blue"

    class Address(BaseModel):
        city: str
        zip: str | None

    class Person(BaseModel):
        name: str
        age: int
        color: Color
        address: Address

    r = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "A person as JSON."}],
                                      response_format=Person, max_tokens=80, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(r.choices[0].message.parsed, Person)
