"""The server with LoRA adapters (in-process, ASGI): adapters listed in /v1/models and picked by the
request's `model`, output equal to peft's; runtime load / unload behind vLLM's environment flag; bad
adapters and unknown names answered with OpenAI-style errors while other requests go on."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from perfxlm import AsyncLLM, EngineConfig
from perfxlm.entrypoints.openai.api_server import build_app
from perfxlm.entrypoints.openai.serving_lora import parse_lora_modules
from tests.lora.conftest import make_adapter, peft_greedy

PROMPT = [5, 17, 40, 9, 300, 2]
NEW = 8


@pytest.fixture
def engine(lora_base):
    engine = AsyncLLM(EngineConfig(model=lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=64,
                                   enable_lora=True, max_loras=2, max_lora_rank=8))
    yield engine
    engine.shutdown()


def _run(app, fn):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await fn(client)

    return asyncio.run(main())


async def _complete(client, model):
    r = await client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": NEW,
                                                   "temperature": 0, "logprobs": 0, "ignore_eos": True})
    if r.status_code != 200:
        return r.status_code, r.json()
    body = r.json()
    # without a tokenizer the logprob tokens are the ids themselves
    return body["model"], [int(t) for t in body["choices"][0]["logprobs"]["tokens"]]


def _pool_whole(engine):
    assert engine.engine.core.check_invariants()["used"] == 0


def test_adapters_by_model_name(engine, lora_base, adapters, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("PERFXLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    app = build_app(engine, "tiny", lora_modules=[("a", adapters["a"], None), ("b", adapters["b"], "tiny")])

    async def go(client):
        models = (await client.get("/v1/models")).json()["data"]
        results = await asyncio.gather(*(_complete(client, m) for m in ("a", "tiny", "b", "missing")))
        load = await client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
        return models, results, load

    models, (a, base, b, missing), load = _run(app, go)
    cards = {m["id"]: m for m in models}
    assert set(cards) == {"tiny", "a", "b"}
    assert cards["a"]["root"] == adapters["a"] and cards["a"]["parent"] == "tiny"
    assert a == ("a", peft_greedy(lora_base, adapters["a"], PROMPT, NEW))
    assert b == ("b", peft_greedy(lora_base, adapters["b"], PROMPT, NEW))
    assert base == ("tiny", peft_greedy(lora_base, None, PROMPT, NEW))
    assert missing[0] == 404 and missing[1]["error"]["code"] == "model_not_found"
    assert load.status_code == 404  # runtime updating is off unless the operator allows it
    _pool_whole(engine)


def test_runtime_load_and_unload(engine, lora_base, adapters, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    app = build_app(engine, "tiny")
    too_big = make_adapter(lora_base, str(tmp_path / "r12"), seed=9, r=12, targets=("o_proj",))

    async def go(client):
        out = {}
        out["load"] = await client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
        out["again"] = await client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["a"]})
        out["rank"], out["c"] = await asyncio.gather(
            client.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": too_big}),
            _complete(client, "c"))
        out["missing"] = await client.post("/v1/load_lora_adapter",
                                           json={"lora_name": "m", "lora_path": str(tmp_path / "none")})
        out["no_path"] = await client.post("/v1/load_lora_adapter", json={"lora_name": "m"})
        out["models"] = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        out["unload"] = await client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        out["after"] = await _complete(client, "c")
        out["unload_unknown"] = await client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        return out

    out = _run(app, go)
    assert out["load"].status_code == 200 and "added successfully" in out["load"].text
    assert out["again"].status_code == 400 and "already been loaded" in out["again"].json()["error"]["message"]
    err = out["rank"].json()["error"]
    assert out["rank"].status_code == 400 and "more than max_lora_rank (8)" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert out["c"] == ("c", peft_greedy(lora_base, adapters["c"], PROMPT, NEW))  # unaffected by the bad load
    assert out["missing"].status_code == 400 and "does not exist" in out["missing"].json()["error"]["message"]
    assert out["no_path"].status_code == 400
    assert out["models"] == ["tiny", "c"]
    assert out["unload"].status_code == 200 and "removed successfully" in out["unload"].text
    assert out["after"][0] == 404
    assert out["unload_unknown"].status_code == 404
    _pool_whole(engine)


def test_lora_modules_need_enable_lora_and_a_good_adapter(lora_base, adapters, tmp_path):
    plain = AsyncLLM(EngineConfig(model=lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16))
    try:
        with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
            build_app(plain, "tiny", lora_modules=[("a", adapters["a"], None)])
    finally:
        plain.shutdown()
    lora = AsyncLLM(EngineConfig(model=lora_base, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16,
                                 enable_lora=True, max_lora_rank=8))
    try:
        with pytest.raises(ValueError, match="does not exist"):
            build_app(lora, "tiny", lora_modules=[("x", str(tmp_path / "nowhere"), None)])
    finally:
        lora.shutdown()


def test_parse_lora_modules():
    assert parse_lora_modules(["a=/x/y", '{"name": "b", "path": "/z", "base_model_name": "m"}']) == [
        ("a", "/x/y", None), ("b", "/z", "m")]
    for bad in ("a", "=/x", "a=", '{"name": "b"}', "{oops"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_adapter_gone_from_disk_is_a_400(engine, adapters, tmp_path):
    """An adapter the engine's cache dropped is read again when a request names it: a folder removed
    since is that request's 400, and the base model still answers."""
    import shutil

    copy = shutil.copytree(adapters["c"], tmp_path / "c")
    app = build_app(engine, "tiny", lora_modules=[("c", str(copy), None)])
    engine.engine.loras.remove(app.state.ctx.adapters.get("c").lora_int_id)
    shutil.rmtree(copy)

    async def go(client):
        return await _complete(client, "c"), await _complete(client, "tiny")

    gone, base = _run(app, go)
    assert gone[0] == 400 and "does not exist" in gone[1]["error"]["message"]
    assert base[0] == "tiny" and len(base[1]) == NEW
    _pool_whole(engine)
