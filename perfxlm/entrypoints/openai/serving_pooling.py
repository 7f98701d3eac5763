"""The server of a model on the pooling runner: `/v1/embeddings` (OpenAI), `/score` and `/v1/score`,
`/rerank`, `/v1/rerank`, `/v2/rerank` (Jina / Cohere), `/classify`, `/pooling` (vLLM); the generation
endpoints answer 400 naming the runner.

Inputs are checked and tokenized in a worker thread (a ValueError is the request's 400, before anything
runs), then queued to the `PoolingBatcher`, whose one thread runs what has arrived together."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Any, Callable

import numpy as np
from fastapi import FastAPI
from fastapi.responses import Response

import perfxlm
from perfxlm.entrypoints.openai.app_common import (
    install_error_handlers, install_middleware, parse_allowed_origins,
)
from perfxlm.entrypoints.openai.errors import APIError
from perfxlm.entrypoints.openai.off_loop import run_off_loop
from perfxlm.entrypoints.openai.protocol import TokenizeRequest
from perfxlm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest, EmbeddingRequest, Inputs, PoolingRequest, RerankRequest, ScoreRequest,
)
from perfxlm.entrypoints.openai.serving_base import check_extra_fields
from perfxlm.entrypoints.openai.serving_runner import GENERATE_PATHS, add_runner_refusals
from perfxlm.outputs import PoolingRequestOutput
from perfxlm.pooling import scoring
from perfxlm.pooling.batcher import PoolingBatcher
from perfxlm.pooling.engine import PoolingEngine, PoolingInput
from perfxlm.pooling_params import PoolingParams

logger = logging.getLogger("perfxlm.server")


def _prompts(value: Inputs, field: str = "input") -> list[Any]:
    """OpenAI's input forms: a string, strings, one token-id list, or token-id lists."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [{"prompt_token_ids": list(value)}]
    else:
        items = [v if isinstance(v, str) else {"prompt_token_ids": list(v)} for v in value]
    if not items:
        raise APIError(400, f"{field} must not be empty.", field)
    for item in items:
        if item == "" or (isinstance(item, dict) and not item["prompt_token_ids"]):
            raise APIError(400, f"{field} holds an empty input.", field)
    return items


def _params(req: Any, **fields: Any) -> PoolingParams:
    try:
        return PoolingParams(truncate_prompt_tokens=req.truncate_prompt_tokens, **fields)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


def _encode(values: Any, encoding_format: str) -> Any:
    """A float vector as a JSON list, or as base64 of little-endian float32 (OpenAI's encoding_format)."""
    array = np.asarray(values.tolist() if hasattr(values, "tolist") else values, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(array.tobytes()).decode("ascii")
    return array.tolist()


def _usage(outs: list[PoolingRequestOutput]) -> dict[str, int]:
    n = sum(len(o.prompt_token_ids) for o in outs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


class PoolingServer:
    def __init__(self, engine: PoolingEngine, served_model_name: str, max_queued_requests: int = 256) -> None:
        self.engine = engine
        self.batcher = PoolingBatcher(engine)
        self.name = served_model_name
        self.max_queued_requests = max_queued_requests
        self.inflight = 0

    def check(self, req: Any) -> None:
        check_extra_fields(req)
        if req.model is not None and req.model != self.name:
            raise APIError(404, f"The model `{req.model}` does not exist.", "model", "model_not_found")
        if not self.batcher.alive():
            raise APIError(503, "The pooling engine stopped; restart the server.", code="engine_dead")
        if self.inflight >= self.max_queued_requests:
            raise APIError(503, f"Server overloaded: {self.max_queued_requests} requests already waiting. "
                                "Retry later.", code="overloaded")

    async def run(self, prepare: Callable[[], list[PoolingInput]]) -> list[PoolingRequestOutput]:
        """Check and tokenize off the event loop (ValueError -> 400), then run through the batcher."""
        self.inflight += 1
        try:
            try:
                inputs = await run_off_loop(prepare)
            except ValueError as exc:
                raise APIError(400, str(exc)) from None
            return await asyncio.wrap_future(self.batcher.submit(inputs))
        finally:
            self.inflight -= 1

    def process_all(self, prompts: list[Any], params: PoolingParams, task: str) -> list[PoolingInput]:
        return [self.engine.process(str(i), p, params, task) for i, p in enumerate(prompts)]

    def header(self, kind: str) -> dict[str, Any]:
        return {"id": f"{kind}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": self.name}


def build_pooling_app(engine: PoolingEngine, served_model_name: str, *, api_key: str | None = None,
                      allowed_origins: list[str] | None = None, max_queued_requests: int = 256,
                      max_request_body_bytes: int = 4 << 20) -> FastAPI:
    app = FastAPI(title="perfxlm OpenAI-compatible server (pooling)", version=perfxlm.__version__)
    server = PoolingServer(engine, served_model_name, max_queued_requests)
    app.state.pooling = server
    install_error_handlers(app)
    add_runner_refusals(app, "pooling", GENERATE_PATHS)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest):
        server.check(req)
        prompts = _prompts(req.input)
        params = _params(req, dimensions=req.dimensions, normalize=req.normalize)
        outs = await server.run(lambda: server.process_all(prompts, params, "embed"))
        data = [{"object": "embedding", "index": i, "embedding": _encode(o.outputs.data, req.encoding_format)}
                for i, o in enumerate(outs)]
        return {**server.header("embd"), "data": data, "usage": _usage(outs)}

    @app.post("/pooling")
    async def pooling(req: PoolingRequest):
        server.check(req)
        prompts = _prompts(req.input)
        params = _params(req)
        task = req.task or ("classify" if engine.pooler_config.num_labels else "embed")
        outs = await server.run(lambda: server.process_all(prompts, params, task))
        data = [{"object": "pooling", "index": i, "data": _encode(o.outputs.data, req.encoding_format)
                 if req.encoding_format == "base64" else o.outputs.data.tolist()} for i, o in enumerate(outs)]
        return {**server.header("pool"), "data": data, "usage": _usage(outs)}

    @app.post("/classify")
    async def classify(req: ClassificationRequest):
        server.check(req)
        prompts = _prompts(req.input)
        params = _params(req, use_activation=req.use_activation)
        outs = await server.run(lambda: server.process_all(prompts, params, "classify"))
        labels = getattr(engine.config.hf_config, "id2label", None) or {}
        data = []
        for i, o in enumerate(outs):
            probs = o.outputs.data.tolist()
            best = int(np.argmax(probs))
            data.append({"index": i, "label": labels.get(best, str(best)), "probs": probs, "num_classes": len(probs)})
        return {**server.header("classify"), "data": data, "usage": _usage(outs)}

    async def scores(req: Any, first: Any, second: Any) -> tuple[list[PoolingRequestOutput], list[str]]:
        params = _params(req)
        try:
            a, _ = scoring.pair_up(first, second)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        ids = [str(i) for i in range(len(a))]
        jobs: list[scoring.ScoreJob] = []

        def prepare() -> list[PoolingInput]:
            jobs.append(scoring.prepare(engine, ids, first, second, params))
            return jobs[0].inputs

        outs = await server.run(prepare)
        return jobs[0].finish(outs), ids

    @app.post("/score")
    @app.post("/v1/score")
    async def score(req: ScoreRequest):
        server.check(req)
        outs, _ = await scores(req, req.text_1, req.text_2)
        data = [{"index": i, "object": "score", "score": float(o.outputs.data.reshape(-1)[0])}
                for i, o in enumerate(outs)]
        return {**server.header("score"), "data": data, "usage": _usage(outs)}

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(req: RerankRequest):
        server.check(req)
        if req.query == "" or any(d == "" for d in req.documents):
            raise APIError(400, "query and documents must not be empty strings.", "documents")
        outs, _ = await scores(req, req.query, req.documents)
        results = []
        for i, o in enumerate(outs):
            result: dict[str, Any] = {"index": i, "relevance_score": float(o.outputs.data.reshape(-1)[0])}
            if req.return_documents:
                result["document"] = {"text": req.documents[i]}
            results.append(result)
        results.sort(key=lambda r: -r["relevance_score"])
        if req.top_n:
            results = results[: req.top_n]
        usage = _usage(outs)
        return {"id": f"rerank-{uuid.uuid4().hex}", "model": server.name,
                "usage": {"total_tokens": usage["total_tokens"]}, "results": results}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_extra_fields(req)
        server.check(req)
        if engine.tokenizer is None:
            raise APIError(400, "This server has no tokenizer.")
        if req.prompt is None or req.messages is not None:
            raise APIError(400, "A pooling model tokenizes prompt only (no chat messages).", "prompt")
        ids = await run_off_loop(engine.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "perfxlm", "root": engine.config.model,
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/health")
    async def health():
        return Response(status_code=200 if server.batcher.alive() else 503)

    @app.get("/version")
    async def version():
        return {"version": perfxlm.__version__}

    install_middleware(app, api_key, allowed_origins, max_request_body_bytes)
    return app


def run_pooling_server(args: Any, config: Any, served_model_name: str) -> int:
    import os

    import uvicorn

    engine = PoolingEngine(config)
    api_key = args.api_key or os.environ.get("PERFXLM_API_KEY") or os.environ.get("VLLM_API_KEY")
    app = build_pooling_app(engine, served_model_name, api_key=api_key,
                            allowed_origins=parse_allowed_origins(args.allowed_origins),
                            max_queued_requests=args.max_queued_requests,
                            max_request_body_bytes=args.max_request_body_bytes)
    pc = engine.pooler_config
    logger.info("model %s (served as %r) on the pooling runner: %s pooling, normalize=%s, window %d tokens, "
                "tasks %s", config.model, served_model_name, pc.pooling_type, pc.normalize, engine.max_model_len,
                ", ".join(sorted(pc.tasks)))
    logger.info("serving on http://%s:%d", args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port,
                log_level=getattr(args, "uvicorn_log_level", None) or "warning", timeout_graceful_shutdown=5)
    app.state.pooling.batcher.shutdown()
    return 0
