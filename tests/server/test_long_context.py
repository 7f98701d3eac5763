"""A model whose context is longer than the KV pool can hold serves chat requests out of the box: the
engine lowers max_model_len to the pool at start, and the chat endpoint's default max_tokens (fill the
context) then fits. The default model with a deliberately small pool stands in for a 128k-context model."""

from __future__ import annotations

import asyncio

import httpx

from perfxlm.config import EngineConfig
from perfxlm.engine.async_engine import AsyncLLM
from perfxlm.entrypoints.openai.api_server import build_app
from tests.conftest import default_model_or_skip


def test_chat_without_max_tokens_is_served_when_the_context_exceeds_the_pool():
    engine = AsyncLLM(EngineConfig(model=default_model_or_skip(), dtype="float32", kv_cache_gib=0.01))
    try:
        cfg = engine.engine.config
        pool_tokens = engine.engine.num_kv_blocks * cfg.block_size
        assert engine.engine.resolved.max_model_len == pool_tokens < 8192  # lowered from the model's 8192
        app = build_app(engine, "m")

        async def chat() -> httpx.Response:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=300) as c:
                models = (await c.get("/v1/models")).json()
                assert models["data"][0]["max_model_len"] == pool_tokens
                return await c.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Count from one to one hundred."}], "temperature": 0,
                })

        r = asyncio.run(chat())
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert body["usage"]["total_tokens"] <= pool_tokens
    finally:
        engine.shutdown()
