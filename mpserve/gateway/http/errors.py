"""Errors as HTTP answers: OpenAI's error object, which every API of the gateway sends (Anthropic's Messages
recasts it, ``api.messages.error_body``), with the stable mpserve code and the status it maps to.

    MpserveError (mpserve.errors: code, message, retry_after) ──HttpError.from_mpserve──▶ status, body, headers
    the HTTP layer's own refusals (limits, guard, access, browser) ──HttpError(status, code, message)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mpserve.errors import MpserveError, http_status


@dataclass(frozen=True)
class HttpError:
    """An error as OpenAI sends it: ``{"error": {"message", "type", "param", "code"}}``; ``code`` is the
    stable mpserve code (or a gateway one: ``invalid_api_key``, ``not_found``, ``method_not_allowed``)."""

    status: int
    code: str
    message: str
    retry_after: float | None = None

    @classmethod
    def from_mpserve(cls, exc: MpserveError) -> HttpError:
        return cls(http_status(exc.code), exc.code, exc.message, exc.retry_after)

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 429:
            return "rate_limit_error"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}

    def headers(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, at least 1) on 429 and 503: both are worth retrying."""
        if self.status not in (429, 503):
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after or 1)))}
