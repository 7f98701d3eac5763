"""The Responses API's shapes against the chat path's, and the bounded store, without a server."""

import pytest

from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.responses_items import (
    chat_tool_choice, chat_tools, input_messages, output_items, structured_format, turn_messages,
)
from perfxlm.entrypoints.openai.responses_store import ResponseStore, StoredResponse
from perfxlm.entrypoints.openai.tool_parsers import ToolCall


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Oslo and Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("items,words", [
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "only text content parts"),
    ([{"role": "robot", "content": "x"}], "role must be"),
    ([{"type": "function_call", "name": "w"}], "needs string name, arguments and call_id"),
    ([{"type": "function_call_output", "output": "x"}], "needs a string call_id"),
    ([{"type": "file_search_call"}], "is not supported"),
    (["text"], "must be an object"),
])
def test_bad_items_are_400(items, words):
    with pytest.raises(APIError) as err:
        input_messages(items)
    assert err.value.status == 400 and words in err.value.message and err.value.param == "input"


def test_tools_choice_and_format():
    flat = [{"type": "function", "name": "w", "description": "d", "parameters": {"type": "object"}, "strict": True}]
    assert chat_tools(flat) == [{"type": "function", "function": {"name": "w", "description": "d",
                                                                  "parameters": {"type": "object"}, "strict": True}}]
    assert chat_tools(None) is None
    with pytest.raises(APIError, match="built-in tools"):
        chat_tools([{"type": "web_search"}])
    assert chat_tool_choice({"type": "function", "name": "w"}) == {"type": "function", "function": {"name": "w"}}
    assert chat_tool_choice("required") == "required"
    assert structured_format(None) is None and structured_format({"format": {"type": "text"}}) is None
    assert structured_format({"format": {"type": "json_object"}}) == {"type": "json_object"}
    schema = {"type": "object"}
    assert structured_format({"format": {"type": "json_schema", "name": "n", "schema": schema}}) == {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    for bad in ({"format": {"type": "json_schema"}}, {"format": {"type": "yaml"}}, {"format": "json"}):
        with pytest.raises(APIError):
            structured_format(bad)


def test_output_items_and_the_turn_they_leave():
    call = ToolCall("w", '{"city": "Oslo"}', id="call_1")
    items = output_items("think", "Sure.", [call], "completed")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[2]["call_id"] == "call_1" and items[2]["arguments"] == '{"city": "Oslo"}'
    assert [i["type"] for i in output_items(None, None, [], "incomplete")] == ["message"]
    assert turn_messages(items) == [{"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]}]


def test_store_drops_the_least_recently_used():
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put(rid, StoredResponse({"id": rid}, []))
    assert store.get("a") is not None  # a is now the most recent
    store.put("c", StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    assert store.delete("a") and not store.delete("a")
    none = ResponseStore(0)
    none.put("x", StoredResponse({}, []))
    assert none.get("x") is None
    with pytest.raises(ValueError, match="max_stored_responses"):
        ResponseStore(-1)
