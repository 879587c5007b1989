"""OpenAI-shaped errors: one exception type for every 4xx/5xx the server answers, and its body.

Every error leaves the server as ``{"error": {"message", "type", "code", "param"}}`` with the
HTTP status of its kind, whether it came from request validation, from the engine's
``ServiceError`` hierarchy, from routing (404/405) or from an unexpected failure (500), so a
client has one shape to parse. The ``type`` strings are llama-server's
(``invalid_request_error``, ``authentication_error``, ``not_found_error``,
``unavailable_error``, ``exceed_context_size_error``, ``server_error``); ``code`` is a short
machine-readable reason where one helps (``model_not_found``, ``queue_full``, ...).
"""

from __future__ import annotations

from typing import Any

from ds4_app.engine.api import QueueFull, ServiceError

# Seconds a client should wait before retrying a 503 (queue full, loading, shutting down).
RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered to the client: status, OpenAI error type, optional code, param and headers."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {...}}``."""
        return error_body(self.message, self.type, self.code, self.param)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "code": code, "param": param}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 ``invalid_request_error`` naming the offending field."""
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> ApiError:
    """A 503 ``unavailable_error`` with Retry-After (loading, shutting down, queue full)."""
    return ApiError(503, message, type="unavailable_error", code=code,
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def from_service_error(e: ServiceError) -> ApiError:
    """Map an engine error to its answer through the error's own http_status and error_type."""
    status = int(getattr(e, "http_status", 500))
    etype = str(getattr(e, "error_type", "server_error"))
    message = str(e) or type(e).__name__
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
    code = _CODES.get(type(e).__name__)
    if isinstance(e, QueueFull):
        code = "queue_full"
    return ApiError(status, message, type=etype, code=code, headers=headers)


# Codes for the engine's error classes, by name so subclasses added later still get the base
# class's status and type without being listed here.
_CODES = {
    "ContextLengthExceeded": "context_length_exceeded",
    "ExceedsPool": "exceeds_pool",
    "EngineUnavailable": "engine_unavailable",
}
