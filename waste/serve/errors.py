"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""
from __future__ import annotations

from fastapi.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
         503: "service_unavailable_error"}


# every error carries a code (a client switches on it): the status's own when the raiser names none
CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
         413: "request_too_large", 429: "rate_limited", 500: "internal_error", 503: "unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or CODES.get(status, "invalid_request" if status < 500 else "internal_error")
        self.type = type or TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers, self.extra = headers or {}, extra or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_request") -> APIError:
    return APIError(400, message, param, code)


def unsupported(param: str, what: str) -> APIError:
    """A field the engine or the model cannot honour: refused by name, never dropped."""
    return APIError(400, f"{param}: {what}", param, "unsupported_parameter")


def from_exception(e: BaseException) -> APIError:
    """An error raised by the engine, the chat layer or the text layer, as the API reports it."""
    from ..chat import ChatRequestError, UnsupportedChatFormat
    from ..errors import WasteError
    from ..text.errors import TextError
    from ..text.grammar import GrammarError

    if isinstance(e, APIError):
        return e
    if isinstance(e, UnsupportedChatFormat):
        return APIError(400, str(e), "messages", "unsupported_chat_format", extra={"reasons": e.reasons})
    if isinstance(e, ChatRequestError):
        code = "context_length_exceeded" if "the context is" in str(e) else e.code
        return APIError(400, str(e), e.param, code)
    if isinstance(e, GrammarError):
        return APIError(400, str(e), e.param, e.code)
    if isinstance(e, TextError):
        return APIError(400, str(e), "messages", "invalid_request")
    if isinstance(e, WasteError):
        return APIError(500, str(e), None, "engine_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", None, "internal_error")
