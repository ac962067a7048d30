"""The error hierarchy. Every error has a stable ``code`` that travels on the wire.

A request always ends with exactly one terminal message; when that message is an ERROR, its
``code`` is one of the codes below, and the client raises the matching exception class.
"""

from __future__ import annotations


class MpserveError(Exception):
    """Base class. ``code`` is stable across releases; ``retryable`` tells clients whether to try again."""

    code = "internal"
    retryable = False

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class BadRequest(MpserveError):
    code = "bad_request"


class UnknownModel(MpserveError):
    code = "unknown_model"


class Busy(MpserveError):
    code = "busy"
    retryable = True


class Timeout(MpserveError):
    code = "timeout"
    retryable = True


class Cancelled(MpserveError):
    code = "cancelled"


class ShuttingDown(MpserveError):
    code = "shutting_down"
    retryable = True


class WorkerLost(MpserveError):
    code = "worker_lost"
    retryable = True


class WorkerStalled(MpserveError):
    code = "worker_stalled"
    retryable = True


class PoisonRequest(MpserveError):
    code = "poison_request"


class ModelFailed(MpserveError):
    code = "model_failed"


class ModelDoesNotFit(MpserveError):
    code = "does_not_fit"


class ProtocolError(MpserveError):
    code = "protocol"


class ConnectionFailed(MpserveError):
    """The client could not reach a server (not started, stopped, or wrong address)."""

    code = "connection"
    retryable = True


class ConfigError(MpserveError):
    code = "config"


class InternalError(MpserveError):
    code = "internal"


_BY_CODE: dict[str, type[MpserveError]] = {
    cls.code: cls
    for cls in (
        BadRequest, UnknownModel, Busy, Timeout, Cancelled, ShuttingDown, WorkerLost, WorkerStalled,
        PoisonRequest, ModelFailed, ModelDoesNotFit, ProtocolError, ConnectionFailed, ConfigError,
        InternalError,
    )
}


def error_from_code(code: str, message: str, retry_after: float | None = None) -> MpserveError:
    """Rebuild the exception that a wire ERROR stands for; an unknown code becomes an InternalError."""
    cls = _BY_CODE.get(code, InternalError)
    err = cls(message, retry_after=retry_after)
    if cls is InternalError and code != InternalError.code:
        err.message = f"{code}: {message}"
    return err
