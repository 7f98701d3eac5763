"""The served model's runner decides which endpoints answer: the others are registered to return a 400
naming the runner and what it serves, instead of a 404 a client could take for a wrong URL."""

from __future__ import annotations

from fastapi import FastAPI

from perfxlm.entrypoints.openai.errors import APIError

GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")
POOLING_PATHS = ("/v1/embeddings", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
                 "/pooling")
_SERVES = {
    "generate": "text generation (/v1/completions, /v1/chat/completions)",
    "pooling": "embeddings, scores and classes (/v1/embeddings, /score, /rerank, /classify, /pooling)",
}


def add_runner_refusals(app: FastAPI, runner: str, paths: tuple[str, ...]) -> None:
    def refuse(path: str):
        async def endpoint():
            other = "a pooling model (--runner pooling)" if runner == "generate" else "a generative model"
            raise APIError(400, f"{path} is not served: this model runs the {runner!r} runner, which serves "
                                f"{_SERVES[runner]}; {path} needs {other}.", code="wrong_runner")
        return endpoint

    for path in paths:
        app.add_api_route(path, refuse(path), methods=["POST"], include_in_schema=False)
