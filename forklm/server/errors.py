"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations

from typing import Any

MAX_QUOTE = 100  # characters of a client's value quoted back in an error
MAX_MESSAGE = 1000  # characters of any error message (a last guard: values are quoted cut already)


def clip(value: Any, limit: int = MAX_QUOTE) -> str:
    """A client's value as text for an error message, cut to `limit` characters plus "..."."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class APIError(Exception):
    """An error the server answers with (never a stack trace)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        message = clip(message, MAX_MESSAGE)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = None if param is None else clip(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def param_of_message(message: str) -> str | None:
    """forklm's argument errors start with the argument's name ("top_p must be ...")."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head.replace("_", "").isalnum() and head.islower() else None
