"""The real server driven by the official openai client."""

import openai
import pytest

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_non_stream_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert "Paris" in r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5 and r.usage.total_tokens == 13


def test_streamed_text_equals_non_streamed_greedy(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 24

    messages = [{"role": "user", "content": "Name a fruit."}]
    chat_full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == chat_full.choices[0].message.content and streamed


def test_chat_usage_and_finish(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                       max_completion_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens > 5 and r.usage.completion_tokens >= 1


def test_n2_and_seed_reproducibility(client):
    kwargs = dict(model=MODEL, prompt="My favourite animal is", max_tokens=10, temperature=1.0, seed=7, n=2)
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert len(a.choices) == 2 and [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens == 20
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=5, seed=3)
    assert len(chat.choices) == 2


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    text = base.choices[0].text
    word = text.split()[1]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                  stop=[word])
    assert r.choices[0].text == text[: text.index(word)] and r.choices[0].finish_reason == "stop"


def test_logprobs_completions_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    # Greedy: the chosen token is the most likely one.
    assert all(t.logprob == max(x.logprob for x in t.top_logprobs) for t in content)


def test_echo_and_token_prompts(client):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Hello there")
    r = client.completions.create(model=MODEL, prompt=[[504, 3458], [1, 2, 3]], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]


def test_tokenize_detokenize_version(server):
    import httpx

    t = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert t["count"] == len(t["tokens"]) == 2
    d = httpx.post(server.url + "/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "Hello world"
    assert "version" in httpx.get(server.url + "/version").json()
    assert httpx.get(server.url + "/").text.count("perfxlm") >= 1
