"""POST /v1/responses through the official openai client (client.responses.create), against a server with
a Hermes tool parser, the qwen3 reasoning parser and a store of three responses."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import ServerProcess
from tests.server.test_agent_compat import FORCED, TEMPLATE

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("tpl") / "chat.jinja"
    template.write_text(TEMPLATE)
    s = ServerProcess("--chat-template", str(template), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--reasoning-parser", "qwen3", "--max-stored-responses", "3")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _events(stream) -> list:
    return list(stream)


def test_text_response_equals_chat_and_is_stored(client, server):
    kwargs = dict(model=MODEL, instructions="Answer briefly.", input="Name a fruit.", max_output_tokens=9,
                  temperature=0)
    r = client.responses.create(**kwargs)
    chat = client.chat.completions.create(model=MODEL, max_tokens=9, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert [item.type for item in r.output] == ["message"]
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.instructions == "Answer briefly." and r.store is True
    again = client.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == r.output_text

    events = _events(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if r.status == "completed" else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text
    server.wait_idle()


def test_items_input_and_previous_response_id(client, server):
    first = client.responses.create(model=MODEL, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Say a color."}]}], max_output_tokens=6,
        temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And another?",
                                     max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "Say a color."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == chat.usage.prompt_tokens > first.usage.input_tokens
    server.wait_idle()


def test_reasoning_and_function_call_items(client, server):
    body = {"structured_outputs": {"grammar": FORCED}}
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                max_output_tokens=120, temperature=0, extra_body=body)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text.strip() == "hmm"
    assert r.output_text.strip() == "Sure."
    call = r.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.usage.output_tokens_details.reasoning_tokens > 0

    events = _events(client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
                                             max_output_tokens=120, temperature=0, extra_body=body, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta").strip() == "hmm"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1, 2]

    # the call's result as the next turn's input, after the stored turn
    follow = client.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=5, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output[-1].type in ("message", "function_call")
    server.wait_idle()


def test_named_tool_choice_gives_one_call(client, server):
    r = client.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS, max_output_tokens=40,
                                temperature=0, tool_choice={"type": "function", "name": "get_weather"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    events = _events(client.responses.create(model=MODEL, input="Weather in Rome?", tools=TOOLS,
                                             max_output_tokens=40, temperature=0, stream=True,
                                             tool_choice={"type": "function", "name": "get_weather"}))
    streamed = [i for i in events[-1].response.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    server.wait_idle()


def test_store_is_bounded_and_optional(client, server):
    ids = [client.responses.create(model=MODEL, input=f"Count {i}", max_output_tokens=2, temperature=0).id
           for i in range(4)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the least recently used of four, with room for three
    assert client.responses.retrieve(ids[3]).id == ids[3]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="x", previous_response_id=ids[0], max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(ids[3])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[3])
    server.wait_idle()


def test_truncation_auto_drops_the_oldest_turns(client, server):
    items = [{"role": "user", "content": "word " * 2300},  # past the server's 2048-token context alone
             {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Say hi."}]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=items, max_output_tokens=4)
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=4, temperature=0, truncation="auto")
    fits = client.responses.create(model=MODEL, input=items[1:], max_output_tokens=4, temperature=0)
    assert r.output_text == fits.output_text and r.usage.input_tokens == fits.usage.input_tokens
    assert r.truncation == "auto"
    with pytest.raises(openai.BadRequestError) as err:  # nothing left to drop
        client.responses.create(model=MODEL, input=items[0]["content"], max_output_tokens=4, truncation="auto")
    assert err.value.body["param"] == "input"
    server.wait_idle()


@pytest.mark.parametrize("body,param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": 5}, "input"),
])
def test_bad_input_is_400(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": MODEL, "max_output_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert httpx.get(server.url + "/v1/responses/resp_missing", timeout=10).status_code == 404
    server.wait_idle()
