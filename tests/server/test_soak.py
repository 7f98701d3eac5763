"""64 concurrent streaming clients for half a minute, some hanging up mid-stream: every response is a
200 stream, nothing leaks (KV blocks, running requests), and memory stays flat.

What a leak needs is many requests started and ended (and cut off), not seconds: the streams are short
(2-20 tokens, half the 4-40 of a minute-long run), so at the same decode rate half a minute starts about
as many requests, and each hang-up point (1, 3, 8 chunks) still comes before many streams' end."""

import asyncio
import json
import os
import random
import time

import httpx

SECONDS = float(os.environ.get("PERFXLM_SOAK_SECONDS", "30"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def test_64_streaming_clients_with_random_disconnects(server):
    rng = random.Random(0)
    stats = {"completed": 0, "disconnected": 0, "errors": []}

    async def client(i: int, deadline: float, c: httpx.AsyncClient) -> None:
        while time.time() < deadline:
            hang_up_after = rng.choice([None, None, 1, 3, 8])
            body = {"prompt": f"Client {i} says:", "max_tokens": rng.randint(2, 20), "stream": True,
                    "temperature": 0.8}
            try:
                async with c.stream("POST", server.url + "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        stats["errors"].append(r.status_code)
                        continue
                    chunks = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            if "error" in json.loads(line[6:]):
                                stats["errors"].append(line[:200])
                            chunks += 1
                            if hang_up_after is not None and chunks >= hang_up_after:
                                stats["disconnected"] += 1
                                break
                        elif line == "data: [DONE]":
                            stats["completed"] += 1
            except httpx.HTTPError as exc:
                stats["errors"].append(repr(exc))

    async def run(seconds: float) -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            deadline = time.time() + seconds
            await asyncio.gather(*(client(i, deadline, c) for i in range(64)))

    asyncio.run(run(min(10.0, SECONDS / 4)))  # warm-up: allocator pools, caches
    server.wait_idle(timeout=60)
    rss_before = rss_mib(server.proc.pid)
    asyncio.run(run(SECONDS))
    server.wait_idle(timeout=60)
    rss_after = rss_mib(server.proc.pid)
    assert not stats["errors"], stats["errors"][:5]
    assert stats["completed"] > 50 and stats["disconnected"] > 20, stats
    assert rss_after < rss_before * 1.15 + 50, (rss_before, rss_after)
    assert httpx.get(server.url + "/health").status_code == 200
