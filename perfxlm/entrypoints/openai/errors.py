"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}, small and never echoing input."""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "server_overloaded", 500: "server_error"}
_MAX_MESSAGE = 500


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; what the request ran is aborted, and the
    answer (499, nginx's "client closed request") goes nowhere."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE - 3] + "..."
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)
