"""Over HTTP: request chat templates refused by default, cache_salt accepted and validated, long prompts
tokenized off the event loop."""

from __future__ import annotations

import httpx

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_request_chat_template_is_refused_without_the_flag(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "max_tokens": 2, "chat_template": "{{ messages[0].content }}"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"chat_template": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_cache_salt_is_accepted_and_validated(server):
    for path, body in (("/v1/completions", {"prompt": "The sky is"}), ("/v1/chat/completions", {"messages": MESSAGES})):
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "cache_salt": "tenant-a"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(server.url + path, json={**body, "max_tokens": 2, "cache_salt": ""}, timeout=60)
        assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]
    server.wait_idle()


def test_health_answers_while_a_long_prompt_is_tokenized(server):
    import threading
    import time

    long_prompt = "word " * 600_000  # ~3 MB: tokenizing takes a while, in the renderer's threads
    result = {}

    def post():
        result["r"] = httpx.post(server.url + "/tokenize", json={"prompt": long_prompt}, timeout=120)

    t = threading.Thread(target=post)
    t.start()
    worst = 0.0
    while t.is_alive():
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - start)
        time.sleep(0.05)
    t.join()
    assert result["r"].status_code == 200 and result["r"].json()["count"] >= 600_000
    assert worst < 1.0, worst
