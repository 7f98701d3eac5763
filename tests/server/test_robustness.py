"""Bad input, disconnects, overload, auth, CORS, body limits and shutdown, against real server processes."""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess


def post(server, path, body, **kw):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=data, headers={"Content-Type": "application/json",
                                                                 **kw.pop("headers", {})}, timeout=60, **kw)


@pytest.mark.parametrize(
    "body,param",
    [
        ("{not json", None),
        ({"prompt": 123}, "prompt"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "temperature": -0.5}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "logits_processors": ["x"]}, "logits_processors"),  # unknown fields pass; this would change results
        ({"prompt": "x", "logprobs": 50}, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": [10**7]}, None),
        ('{"prompt": "a\\ud800b"}', None),  # a lone surrogate: valid JSON, not encodable text
    ],
)
def test_bad_completion_requests_get_400_and_small_body(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    if param:
        assert err["param"] == param, err
    assert len(r.content) < 1000


def test_chat_validation(server):
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}).status_code == 400
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_tokenize_validation(server):
    """Found by the fuzz test: these two reached the handler and came back 500."""
    assert post(server, "/tokenize", {"messages": []}).status_code == 400
    assert post(server, "/tokenize", '{"prompt": "x\\udfff"}').status_code == 400
    assert post(server, "/tokenize", {"prompt": "héllo"}).json()["count"] >= 2


def test_unknown_model_is_404(server):
    r = post(server, "/v1/completions", {"model": "gpt-9", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_too_long_prompt_states_both_numbers_and_does_not_echo(server):
    prompt = "hello " * 3000
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "2048" in msg and "3001 tokens" in msg and len(r.content) < 1000
    server.wait_idle()


def test_stream_disconnect_after_first_chunk_frees_everything(server):
    for _ in range(3):
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"prompt": "Tell me a long story", "max_tokens": 1000, "stream": True,
                                "ignore_eos": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
    server.wait_idle(timeout=10)


def test_dropped_non_streaming_request_is_aborted(server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "Story:", "max_tokens": 1500, "ignore_eos": True},
                   timeout=1.0)
    server.wait_idle(timeout=10)


_LOAD_SCRIPT = """
import asyncio, sys, httpx
async def main():
    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(*(c.post(sys.argv[1] + "/v1/completions",
                                      json={"prompt": f"Story {i}:", "max_tokens": 60, "ignore_eos": True})
                               for i in range(24)))
asyncio.run(main())
"""


def test_health_is_fast_while_saturated(server):
    # The load comes from another process, so that this one measures only the server.
    load = subprocess.Popen([sys.executable, "-c", _LOAD_SCRIPT, server.url])
    try:
        deadline = time.time() + 30
        while server.metric("perfxlm:num_requests_running") < 8 and time.time() < deadline:
            time.sleep(0.1)
        latencies = []
        with httpx.Client(timeout=5) as probe:  # one client: building one per call costs more than the answer
            for _ in range(10):
                start = time.perf_counter()
                assert probe.get(server.url + "/health").status_code == 200
                latencies.append(time.perf_counter() - start)
                time.sleep(0.1)
        assert server.metric("perfxlm:num_requests_running") > 0  # it really was busy
    finally:
        load.wait(timeout=300)
    latencies.sort()
    assert latencies[len(latencies) // 2] < 0.1, latencies
    server.wait_idle()


def test_body_size_limit(server):
    r = post(server, "/v1/completions", {"prompt": "x" * (5 << 20)})
    assert r.status_code == 413 and "error" in r.json()


def test_no_cors_unless_allowed(server):
    r = httpx.options(server.url + "/v1/completions", headers={"Origin": "http://evil.example",
                                                                "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_api_key_overload_cors_and_clean_shutdown():
    s = ServerProcess("--api-key", "sekrit", "--max-queued-requests", "2", "--max-num-seqs", "1",
                      "--allowed-origins", "http://good.example")
    try:
        auth = {"Authorization": "Bearer sekrit"}
        assert httpx.get(s.url + "/health").status_code == 200
        assert httpx.get(s.url + "/").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.get(s.url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.url + "/v1/models", headers=auth).status_code == 200
        r = httpx.options(s.url + "/v1/completions", headers={"Origin": "http://good.example",
                                                              "Access-Control-Request-Method": "POST"})
        assert r.headers.get("access-control-allow-origin") == "http://good.example"

        # Overload: one seat, two waiting places; the rest are refused with 503 before any compute.
        async def flood():
            async with httpx.AsyncClient(timeout=120, headers=auth) as c:
                async def one(i):
                    return await c.post(s.url + "/v1/completions",
                                        json={"prompt": f"Story {i}:", "max_tokens": 40, "ignore_eos": True})
                return await asyncio.gather(*(one(i) for i in range(8)))

        codes = [r.status_code for r in asyncio.run(flood())]
        assert codes.count(200) >= 2 and set(codes) <= {200, 503}, codes
        assert 503 in codes
        s.wait_idle(headers=auth)

        # SIGTERM with a stream in flight: the stream ends with finish_reason "abort"; exit code 0.
        reasons = []

        def stream():
            with httpx.stream("POST", s.url + "/v1/completions", headers=auth, timeout=60,
                              json={"prompt": "Story:", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        reasons.append(json.loads(line[6:])["choices"][0]["finish_reason"])

        t = threading.Thread(target=stream)
        t.start()
        while len(reasons) < 3:
            time.sleep(0.05)
        assert s.stop(signal.SIGTERM) == 0
        t.join(timeout=30)
        assert reasons[-1] == "abort"
    finally:
        s.stop()
