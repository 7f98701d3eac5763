"""use_beam_search over /v1/completions and /v1/chat/completions (vLLM's extra parameter)."""

import httpx
import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_one_beam_without_eos_is_greedy(client, server):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=7, temperature=0)
    greedy = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    beam = client.completions.create(**kwargs, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in beam.choices] == [greedy] and beam.usage.completion_tokens == 7
    server.wait_idle()


def test_beams_are_ranked_and_distinct(client, server):
    r = client.completions.create(model=MODEL, prompt=["1, 2, 3,", "Paris is"], max_tokens=5, n=3, temperature=0,
                                  logprobs=2, extra_body={"use_beam_search": True, "length_penalty": 0.0})
    assert [c.index for c in r.choices] == list(range(6))
    for first in (0, 3):
        beams = r.choices[first:first + 3]
        assert len({c.text for c in beams}) == 3
        sums = [sum(c.logprobs.token_logprobs) for c in beams]  # length_penalty 0: ranked by the sum itself
        assert sums == sorted(sums, reverse=True)
        assert all(len(top) <= 3 for c in beams for top in c.logprobs.top_logprobs)  # the chosen one and 2 more
    again = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, n=3, temperature=0,
                                      extra_body={"use_beam_search": True, "length_penalty": 0.0})
    assert [c.text for c in again.choices] == [c.text for c in r.choices[:3]]

    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2, temperature=0,
                                          extra_body={"use_beam_search": True})
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
    assert chat.choices[0].message.content != chat.choices[1].message.content
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, n=2, temperature=0,
                                              stream=True, extra_body={"use_beam_search": True})
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in chat.choices]
    server.wait_idle()


@pytest.mark.parametrize("body,param,words", [
    ({"n": 0}, "n", "n (the beam width) must be an integer >= 1"),
    ({"n": 11}, "n", "max_logprobs"),
    ({"n": 10**6}, "n", "n (the beam width) must be at most"),
    ({"n": 2, "stop": ["."]}, "stop", "not supported with use_beam_search"),
    ({"n": 2, "response_format": {"type": "json_object"}}, "response_format", "not supported with use_beam_search"),
    ({"n": 2, "max_tokens": 4000}, None, "max_model_len"),
])
def test_bad_beam_requests_are_400(server, body, param, words):
    payload = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "use_beam_search": True, **body}
    r = httpx.post(server.url + "/v1/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param
    ok = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200
    server.wait_idle()
