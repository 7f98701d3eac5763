"""`perfxlm serve --tensor-parallel-size 2`: serves, answers /health 503 within seconds of losing a
worker, and leaves no process behind when stopped. (The whole server suite runs against worker processes
with PERFXLM_TEST_SERVER_ARGS="--tensor-parallel-size 2".)"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from tests.server.conftest import ServerProcess

pytestmark = pytest.mark.timeout(300)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def test_server_with_two_ranks_serves_and_dies_cleanly():
    server = ServerProcess("--tensor-parallel-size", "2", "--max-num-seqs", "8")
    try:
        workers = _children(server.proc.pid)
        assert len(workers) >= 2, workers  # the two ranks (and multiprocessing's resource tracker)
        body = {"model": "x", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        models = httpx.get(server.url + "/v1/models", timeout=10).json()
        body["model"] = models["data"][0]["id"]
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]
        chat = {"model": body["model"], "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=chat, timeout=60) as s:
            assert s.status_code == 200
            assert "[DONE]" in "".join(s.iter_text())
        ranks = [p for p in workers if "spawn_main" in open(f"/proc/{p}/cmdline").read()]
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGKILL)
        t0 = time.time()
        while httpx.get(server.url + "/health", timeout=5).status_code == 200:
            assert time.time() - t0 < 10, "/health still 200 after a worker died"
            time.sleep(0.1)
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 503
    finally:
        server.stop()
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
