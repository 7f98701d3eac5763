"""ASGI middleware: request body size limit (413) and API key check (401), before any parsing."""

from __future__ import annotations

import hmac
import json

from perfxlm.entrypoints.openai.errors import error_body

_OPEN_PATHS = {"/", "/health", "/favicon.ico"}


async def _send_error(send, status: int, message: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class BodySizeLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await _send_error(send, 413, f"Request body larger than {self.max_bytes} bytes.")
        received = 0
        too_big = False

        async def limited_receive():
            nonlocal received, too_big
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    too_big = True
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await _send_error(send, 413, f"Request body larger than {self.max_bytes} bytes.")


class _TooLarge(Exception):
    pass


class APIKeyCheck:
    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
        if not hmac.compare_digest(given, self.expected):  # constant time
            return await _send_error(send, 401, "Invalid or missing API key: send 'Authorization: Bearer KEY'.",
                                     [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)
