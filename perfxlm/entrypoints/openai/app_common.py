"""What every app of the server installs alike: OpenAI-style error handlers and the ASGI middleware."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException

from perfxlm.engine.threaded_engine import EngineDeadError
from perfxlm.entrypoints.openai.errors import APIError, ClientDisconnected, error_response
from perfxlm.entrypoints.openai.middleware import APIKeyCheck, BodySizeLimit
from perfxlm.entrypoints.openai.serving_base import engine_dead_error

logger = logging.getLogger("perfxlm.server")


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-style error bodies for every failure: an APIError's status, 400 for a body that does not
    validate, 503 for a dead engine, 500 (logged) for anything else."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError):
        err = engine_dead_error(exc)
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(_: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # no one reads it: not an error of the server, nothing logged

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception):
        logger.exception("internal error")
        return error_response(500, "Internal server error.")


def install_middleware(app: FastAPI, api_key: str | None, allowed_origins: list[str] | None,
                       max_request_body_bytes: int) -> None:
    # Outermost first: size limit, then CORS (so browsers see CORS headers on errors), then the key.
    if api_key:
        app.add_middleware(APIKeyCheck, api_key=api_key)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # the top-level field; the message gives the full path
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    if first.get("type") == "extra_forbidden":
        names = sorted({".".join(str(p) for p in e["loc"] if p != "body") for e in errors
                        if e.get("type") == "extra_forbidden"})
        return f"Unsupported field(s): {', '.join(names)}.", names[0].split(".")[0]
    return f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}.", param


def parse_allowed_origins(values: list[str] | None) -> list[str] | None:
    """--allowed-origins as perfxlm spells it (origins as separate arguments) or as vLLM does (one JSON
    list, e.g. '["*"]')."""
    if not values:
        return values
    import json

    out: list[str] = []
    for v in values:
        if v.strip().startswith("["):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError:
                raise ValueError(f"--allowed-origins {v!r} is not a valid JSON list.") from None
            if not all(isinstance(o, str) for o in parsed):
                raise ValueError(f"--allowed-origins {v!r} must list strings.")
            out.extend(parsed)
        else:
            out.append(v)
    return out
