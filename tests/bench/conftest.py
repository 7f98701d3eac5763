"""Fixtures for the benchmark tests: the default model's tokenizer, a fake OpenAI-compatible server."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest

SHAREGPT_SAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "datasets",
                                "sharegpt_samples_1024.json")


@pytest.fixture(scope="session")
def sharegpt_samples() -> str:
    path = os.path.abspath(SHAREGPT_SAMPLES)
    if not os.path.isfile(path):
        pytest.skip(f"the ShareGPT sample file is not there ({path})")
    return path


@pytest.fixture(scope="session")
def smol_tokenizer(default_model):
    from perfxlm.tokenizer import get_tokenizer

    return get_tokenizer(default_model)


@pytest.fixture(scope="session")
def smol_tokenizer_dir(smol_tokenizer, tmp_path_factory) -> str:
    """The default model's tokenizer saved as a Hugging Face folder (for --tokenizer PATH)."""
    path = str(tmp_path_factory.mktemp("smol_tokenizer"))
    smol_tokenizer.save_pretrained(path)
    return path


class FakeOpenAIServer:
    """A small OpenAI-compatible server on loopback that streams `/v1/completions`: after
    `first_delay` s one chunk per token every `gap` s (text " t0", " t1", ...), the finish_reason on
    the last token's chunk, then a usage chunk when asked for, then [DONE]. It records every request
    and the most requests it had in flight at once."""

    def __init__(self, first_delay: float = 0.02, gap: float = 0.005, send_usage: bool = True,
                 status: int = 200, model: str = "fake-model") -> None:
        self.first_delay, self.gap, self.send_usage, self.status, self.model = first_delay, gap, send_usage, status, model
        self.requests: list[dict] = []
        self.arrivals: list[float] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request):
        from aiohttp import web

        body = await request.json()
        self.requests.append(body)
        self.arrivals.append(time.perf_counter())
        if self.status != 200:
            return web.json_response({"error": {"message": "nope"}}, status=self.status)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body.get("max_tokens") or 16)
            await asyncio.sleep(self.first_delay)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.gap)
                chunk = {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                         "choices": [{"index": 0, "text": f" t{i}", "finish_reason": "length" if i == n - 1 else None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
                await resp.write(b"data: " + json.dumps({"id": "cmpl-1", "choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture
def fake_server():
    servers: list[FakeOpenAIServer] = []

    def start(**kwargs) -> FakeOpenAIServer:
        server = FakeOpenAIServer(**kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
