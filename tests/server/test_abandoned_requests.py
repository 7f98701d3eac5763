"""Request shapes the fuzz test found leaving state behind: each must answer (or be aborted when its
client leaves) and the server must go idle with every KV block free."""

import httpx
import pytest

_CHAT = [{"role": "user", "content": "Tell me a long story."}]


@pytest.mark.parametrize(
    "path,body,status",
    [
        # an empty regex constrains to the empty string: the request ends at once
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "guided_regex": ""}, 200),
        ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 3, "structured_outputs": {"json": {}}}, 200),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 3, "guided_grammar": "", "stream": True}, 400),
    ],
)
def test_empty_constraints_answer_and_hold_nothing(server, path, body, status):
    """These hung forever (the grammar compile raised StopIteration on its thread), each counted in
    flight for good after its client left."""
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    server.wait_idle(timeout=10)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [True, False])
def test_abandoned_beam_search_is_aborted(server, path, stream):
    """A streaming request's handler awaits its first output before answering, and a beam search gives
    its only output at the end: a client that left meanwhile kept the whole search running."""
    body = {"max_tokens": 1500, "n": 2, "use_beam_search": True, "ignore_eos": True, "stream": stream,
            **({"prompt": "Story:"} if path == "/v1/completions" else {"messages": _CHAT})}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + path, json=body, timeout=1.5)
    server.wait_idle(timeout=10)
