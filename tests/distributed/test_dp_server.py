"""`perfxlm serve --data-parallel-size 2`: two replica processes behind one server; concurrent requests go
to different replicas (the per-replica gauges say so), /health turns 503 within seconds of a lost replica,
and no process is left when the server stops."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.distributed.test_tp_server import _alive, _children
from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.timeout(240)


def _gauges(server: ServerProcess, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"perfxlm:dp_{name}{{"):
            out[line.split('replica="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_server_with_two_replicas_balances_and_dies_cleanly():
    server = ServerProcess("--data-parallel-size", "2", "--max-num-seqs", "8")
    workers: list[int] = []
    try:
        workers = _children(server.proc.pid)
        replicas = [p for p in workers if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(replicas) == 2, replicas
        model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        first = r.json()["choices"][0]["text"]
        assert first
        # two long requests at once: one per replica while both are in flight
        results: list = []
        long_body = {**body, "max_tokens": 48, "ignore_eos": True}
        threads = [threading.Thread(target=lambda: results.append(
            httpx.post(server.url + "/v1/completions", json=long_body, timeout=120))) for _ in range(2)]
        for t in threads:
            t.start()
        seen = {}
        deadline = time.time() + 60
        while time.time() < deadline and len(results) < 2:
            g = _gauges(server, "num_requests_inflight")
            if sum(g.values()) == 2:
                seen = g
                break
            time.sleep(0.05)
        for t in threads:
            t.join(120)
        assert seen == {"0": 1.0, "1": 1.0}, seen
        assert [x.status_code for x in results] == [200, 200]
        # greedy: the same text whichever replica served it
        assert {x.json()["choices"][0]["text"][: len(first)] for x in results} == {first}
        chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=60) as s:
            assert s.status_code == 200
            assert "[DONE]" in "".join(s.iter_text())
        server.wait_idle()
        os.kill(replicas[1], signal.SIGKILL)
        t0 = time.time()
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            assert time.time() - t0 < 10, "/health still 200 after a replica died"
            time.sleep(0.1)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        assert httpx.post(server.url + "/v1/completions", json=body, timeout=30).status_code == 503
    finally:
        server.stop()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]
