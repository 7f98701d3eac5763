"""32 well-behaved greedy streaming clients while one hostile client sends a malformed or abusive
request every half second, each kind at least once: every well-behaved stream completes with output
identical to a quiet run, no hostile request gets a 5xx, and afterwards the KV pool is whole and the
server healthy.

The server trusts request chat templates, so abusive templates are rendered (in the bounded sandbox)
rather than refused at the door. Loopback only; the soak lasts until every kind of hostile request was
sent once, and at least PERFXLM_HOSTILE_SOAK_SECONDS (about 10 s at two a second).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

SECONDS = float(os.environ.get("PERFXLM_HOSTILE_SOAK_SECONDS", "10"))
HOSTILE_INTERVAL = 0.5  # seconds from one hostile request's start to the next's
CLIENTS = 32
MAX_TOKENS = 16

# (path, body): a dict is sent as JSON, bytes as they are
HOSTILE: list[tuple[str, dict | bytes]] = [
    ("/v1/completions", {"prompt": "Hi", "n": 1_000_000, "stream": True}),
    ("/v1/completions", {"prompt": "Hi", "best_of": 1_000_000, "n": 2}),
    ("/v1/completions", {"prompt": "Hi", "seed": 10**23, "temperature": 1.0, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "seed": -(2**70), "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**63, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 10**6, "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**12}),
    ("/v1/completions", {"prompt": [10**9, -5], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "cache_salt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "Hi", "frobnicate": True, "also_unknown": [1]}),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": NaN}'),
    ("/v1/completions", b'{"prompt": "unterminated'),
    ("/v1/completions", b"\xff\xfe garbage \x00\x01"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "chat_template": '{{ "a" * 10**9 }}'}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "chat_template": "{% for i in range(60000) %}{% for j in range(60000) %}"
                                               "{% endfor %}{% endfor %}"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "chat_template": "{{ cycler.__init__.__globals__.os.system('true') }}"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 10**9, "stream": True}),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
]


def _client_body(i: int) -> tuple[str, dict]:
    if i % 2:
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Client {i}: name a color and a number."}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        }
    return "/v1/completions", {"prompt": f"Client {i} writes: once upon a time", "max_tokens": MAX_TOKENS,
                               "temperature": 0, "stream": True}


async def _stream_text(c: httpx.AsyncClient, url: str, i: int) -> str:
    path, body = _client_body(i)
    parts = []
    async with c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200, (i, r.status_code, await r.aread())
        done = False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, (i, event)
                for choice in event["choices"]:
                    parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
        assert done, f"client {i}: stream ended without [DONE]"
    return "".join(parts)


@pytest.fixture(scope="module")
def trusting_server():
    s = ServerProcess("--max-num-seqs", "64", "--trust-request-chat-template")
    yield s
    s.stop()


def test_hostile_client_does_not_disturb_32_streams(trusting_server):
    server = trusting_server
    limits = httpx.Limits(max_connections=CLIENTS + 8)

    async def quiet() -> list[str]:
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            return list(await asyncio.gather(*(_stream_text(c, server.url, i) for i in range(CLIENTS))))

    reference = asyncio.run(quiet())
    assert sum(len(t) > 0 for t in reference) >= CLIENTS // 2
    server.wait_idle(timeout=60)

    stats = {"rounds": 0, "hostile": [], "mismatch": []}

    hostile_done = asyncio.Event()

    async def good(c: httpx.AsyncClient, i: int) -> None:
        while not hostile_done.is_set():  # streams for as long as the hostile client sends
            text = await _stream_text(c, server.url, i)
            stats["rounds"] += 1
            if text != reference[i]:
                stats["mismatch"].append((i, reference[i], text))

    async def hostile(c: httpx.AsyncClient, deadline: float) -> None:
        # every kind at least once, however slowly the served ones (huge top_k) finish on a busy machine,
        # then on until the deadline
        k = 0
        while k < len(HOSTILE) or time.monotonic() < deadline:
            path, body = HOSTILE[k % len(HOSTILE)]
            k += 1
            start = time.monotonic()
            try:
                if isinstance(body, bytes):
                    r = await c.post(server.url + path, content=body, headers={"content-type": "application/json"})
                else:
                    r = await c.post(server.url + path, json=body)
                stats["hostile"].append((path, str(body)[:60], r.status_code, round(time.monotonic() - start, 2)))
            except httpx.HTTPError as exc:
                stats["hostile"].append((path, str(body)[:60], repr(exc), 0))
            await asyncio.sleep(max(0.0, HOSTILE_INTERVAL - (time.monotonic() - start)))
        hostile_done.set()

    async def soak() -> None:
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            deadline = time.monotonic() + SECONDS
            await asyncio.gather(hostile(c, deadline), *(good(c, i) for i in range(CLIENTS)))

    asyncio.run(soak())
    assert not stats["mismatch"], stats["mismatch"][:3]
    assert stats["rounds"] >= CLIENTS, stats["rounds"]
    # refused with a 4xx, or (huge top_k means "off") served: never a 5xx, never a dropped connection
    bad = [h for h in stats["hostile"] if not isinstance(h[2], int) or h[2] >= 500]
    assert not bad, bad
    assert len(stats["hostile"]) >= len(HOSTILE)
    server.wait_idle(timeout=60)  # no running request, no KV block held, nothing in flight
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
