"""A sampled token may hold characters that str.splitlines-based readers (httpx's aiter_lines) take
for line ends; every SSE event must still arrive as one parseable ``data:`` line."""

import json

import pytest

from perfxlm.entrypoints.openai.serving_base import sse, sse_json

LINE_BREAKERS = ["\x85", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\r", "\n"]


@pytest.mark.parametrize("ch", LINE_BREAKERS)
def test_event_stays_one_line_for_any_splitlines_break(ch):
    body = {"choices": [{"text": f"a{ch}b é 中"}]}
    event = sse(body)
    lines = [line for line in event.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:]) == body
    assert "é 中" in event  # UTF-8 is kept, only line breakers are escaped


def test_sse_json_round_trips():
    body = {"type": "response.output_text.delta", "delta": "x\u2028y\x85z"}
    text = sse_json(body)
    assert len(text.splitlines()) == 1 and json.loads(text) == body
