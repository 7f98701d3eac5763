"""The pooling endpoints in-process (ASGI) on random encoders: OpenAI's /v1/embeddings (float and base64,
dimensions, token-id input, usage), /score, /rerank (Jina / Cohere bodies), /classify, /pooling; 400s for
bad input that leave other requests unharmed; each runner's server refusing the other's endpoints."""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from perfxlm import LLM, AsyncLLM, EngineConfig
from perfxlm.entrypoints.openai.api_server import build_app
from perfxlm.entrypoints.openai.serving_pooling import build_pooling_app
from perfxlm.pooling.engine import PoolingEngine
from tests.pooling.checkpoints import make_encoder, make_sentence_transformer


def _run(app, fn):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await fn(client)

    return asyncio.run(main())


def _post(app, path, body):
    return _run(app, lambda c: c.post(path, json=body))


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("srv") / "bge")
    make_sentence_transformer(path, "bert", "cls", True, max_seq_length=20, matryoshka_dimensions=[8, 36])
    engine = PoolingEngine(EngineConfig(model=path, dtype="float32"))
    return path, build_pooling_app(engine, "bge")


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = make_encoder(str(tmp_path_factory.mktemp("srv") / "reranker"), "xlmr", classifier=True, num_labels=1,
                        seed=7)
    engine = PoolingEngine(EngineConfig(model=path, dtype="float32"))
    return path, build_pooling_app(engine, "reranker")


def test_embeddings_float_base64_dimensions_and_token_ids(embedder):
    path, app = embedder
    texts = ["what is the capital of france?", "a cat sat on the mat"]
    expected = np.array([o.outputs.embedding for o in LLM(path, dtype="float32").embed(texts, use_tqdm=False)])
    r = _post(app, "/v1/embeddings", {"model": "bge", "input": texts})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "bge"
    got = np.array([d["embedding"] for d in sorted(body["data"], key=lambda d: d["index"])])
    np.testing.assert_allclose(got, expected, atol=1e-6)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    r = _post(app, "/v1/embeddings", {"input": texts[0], "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, expected[0], atol=1e-6)
    r = _post(app, "/v1/embeddings", {"input": texts[0], "dimensions": 8})
    cut = np.array(r.json()["data"][0]["embedding"])
    assert cut.shape == (8,) and abs(np.linalg.norm(cut) - 1) < 1e-5
    ids = [2, 14, 15, 3]
    one = _post(app, "/v1/embeddings", {"input": ids}).json()
    many = _post(app, "/v1/embeddings", {"input": [ids, ids[:3]]}).json()
    assert len(one["data"]) == 1 and len(many["data"]) == 2
    np.testing.assert_allclose(one["data"][0]["embedding"], many["data"][0]["embedding"], atol=1e-6)


@pytest.mark.parametrize("body,needle", [
    ({"input": []}, "must not be empty"),
    ({"input": ""}, "empty input"),
    ({"input": ["ok", ""]}, "empty input"),
    ({"input": " ".join(["cat"] * 40)}, "window of 20"),
    ({"input": "the cat", "dimensions": 12}, "supports [8, 36]"),
    ({"input": "the cat", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "the cat", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": [[3, 10**7]]}, "outside the vocabulary"),
    ({"input": "the cat", "logits_processors": ["x"]}, "Unsupported field"),
])
def test_bad_embedding_requests_are_400(embedder, body, needle):
    _, app = embedder

    async def go(client):
        good = {"input": "the red dog"}
        # a bad request between good ones, concurrently: only it fails
        results = await asyncio.gather(client.post("/v1/embeddings", json=good),
                                       client.post("/v1/embeddings", json=body),
                                       client.post("/v1/embeddings", json=good))
        return results

    ok1, bad, ok2 = _run(app, go)
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert ok1.status_code == ok2.status_code == 200
    assert ok1.json()["data"][0]["embedding"] == ok2.json()["data"][0]["embedding"]


def test_truncation_and_bi_encoder_score(embedder):
    _, app = embedder
    long_text = " ".join(["cat"] * 40)
    r = _post(app, "/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 20
    r = _post(app, "/score", {"text_1": "the red dog", "text_2": ["the red dog", "blue"]})
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and scores[1] < scores[0]
    assert _post(app, "/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}).status_code == 400
    assert _post(app, "/classify", {"input": "the cat"}).status_code == 400  # not a classifier


def test_rerank_and_score_on_a_cross_encoder(reranker):
    from sentence_transformers import CrossEncoder

    path, app = reranker
    query, docs = "what is paris", ["paris is the capital of france", "a cat", "berlin germany", "red"]
    expected = CrossEncoder(path, device="cpu").predict([(query, d) for d in docs])
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = _post(app, route, {"model": "reranker", "query": query, "documents": docs, "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-expected)[:3])
        for x in results:
            assert x["relevance_score"] == pytest.approx(float(expected[x["index"]]), abs=1e-5)
            assert x["document"]["text"] == docs[x["index"]]
    bare = _post(app, "/rerank", {"query": query, "documents": docs, "return_documents": False}).json()["results"]
    assert len(bare) == 4 and "document" not in bare[0]
    r = _post(app, "/v1/score", {"text_1": query, "text_2": docs})
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], expected, atol=1e-5)
    for body in ({"query": query}, {"query": query, "documents": []}, {"query": "", "documents": ["a"]}):
        bad = _post(app, "/rerank", body)
        assert bad.status_code == 400 and "documents" in bad.json()["error"]["message"], bad.text
    r = _post(app, "/classify", {"input": ["paris", "a cat"]})
    assert r.status_code == 200 and r.json()["data"][0]["num_classes"] == 1
    r = _post(app, "/v1/embeddings", {"input": "paris"})
    assert r.status_code == 400 and "classifier" in r.json()["error"]["message"]
    r = _post(app, "/pooling", {"input": "paris"})
    assert r.status_code == 200 and len(r.json()["data"][0]["data"]) == 1


def test_each_runner_refuses_the_others_endpoints(embedder, tiny_llama):
    _, app = embedder
    r = _post(app, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "'pooling' runner" in r.json()["error"]["message"]
    assert _run(app, lambda c: c.get("/health")).status_code == 200
    assert _run(app, lambda c: c.get("/v1/models")).json()["data"][0]["max_model_len"] == 20
    tokens = _post(app, "/tokenize", {"prompt": "the cat"}).json()
    assert tokens["count"] == 4 and tokens["max_model_len"] == 20  # [CLS] the cat [SEP]
    engine = AsyncLLM(EngineConfig(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", num_kv_blocks=16))
    try:
        gen_app = build_app(engine, "tiny")
        for path in ("/v1/embeddings", "/rerank", "/score", "/classify"):
            r = _post(gen_app, path, {"input": "hi"})
            assert r.status_code == 400 and "'generate' runner" in r.json()["error"]["message"], (path, r.text)
    finally:
        engine.shutdown()


def test_batcher_fails_only_the_request_whose_input_fails():
    from perfxlm.pooling.batcher import PoolingBatcher
    from perfxlm.pooling.engine import PoolingInput
    from perfxlm.pooling.runner import PoolingSeq
    from perfxlm.pooling_params import PoolingParams

    class FlakyEngine:
        def __init__(self):
            self.calls = []

        def run(self, inputs):
            self.calls.append(len(inputs))
            if any(x.seq.token_ids == [666] for x in inputs):
                raise RuntimeError("bad input")
            return [x.seq.token_ids for x in inputs]

    def item(ids):
        return [PoolingInput("0", PoolingSeq(ids), "embed", PoolingParams(), "CLS")]

    engine = FlakyEngine()
    batcher = PoolingBatcher(engine)
    # hold the thread's first run so that the later requests queue up and are merged into one list
    import threading

    gate = threading.Event()
    original = engine.run
    engine.run = lambda inputs: (gate.wait(5), original(inputs))[1]
    first = batcher.submit(item([1]))
    futures = [batcher.submit(item(ids)) for ids in ([2], [666], [3])]
    gate.set()
    assert first.result(5) == [[1]]
    assert futures[0].result(5) == [[2]] and futures[2].result(5) == [[3]]
    with pytest.raises(RuntimeError, match="bad input"):
        futures[1].result(5)
    assert max(engine.calls) >= 3 and engine.calls[-3:] == [1, 1, 1]  # merged once, then retried one by one
    batcher.shutdown()


def test_serve_command_runs_the_pooling_server(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.server.conftest import free_port

    path = make_encoder(str(tmp_path / "e5"), "bert")
    port = free_port()
    log = open(tmp_path / "log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "perfxlm.entrypoints.cli", "serve", path, "--port", str(port),
                             "--dtype", "float32", "--pooler-config", '{"pooling_type": "MEAN"}'],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, (tmp_path / "log").read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json={"model": "e5", "input": ["the cat"]}, timeout=30)
        assert r.status_code == 200, r.text
        expected = LLM(path, dtype="float32", pooler_config={"pooling_type": "MEAN"}).embed("the cat", use_tqdm=False)
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], expected[0].outputs.embedding, atol=1e-6)
        assert "MEAN pooling" in (tmp_path / "log").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
