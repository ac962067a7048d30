"""Error codes and the error hierarchy. Every error has a stable ``code`` that travels on the wire.

A request always ends with exactly one terminal message; when that message is an ERROR, its ``code`` is an
``ErrorCode``, and the client raises the matching exception class. ``CODES`` is the one table of what each
code means, its HTTP status on the gateway and whether a client should retry; the docs' error tables are
generated from it (docs/hooks.py, checked by tests/test_docs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ErrorCode(str, Enum):
    BAD_REQUEST = "bad_request"
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_ADAPTER = "unknown_adapter"
    BUSY = "busy"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    GRAMMAR_TOO_COMPLEX = "grammar_too_complex"
    WORKER_LOST = "worker_lost"
    WORKER_STALLED = "worker_stalled"
    POISON_REQUEST = "poison_request"
    MODEL_FAILED = "model_failed"
    NO_INSTANCE = "no_instance"
    DOES_NOT_FIT = "does_not_fit"
    SHUTTING_DOWN = "shutting_down"
    CONNECTION = "connection"
    PROTOCOL = "protocol"
    FORBIDDEN = "forbidden"
    CONFIG = "config"
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CodeInfo:
    http_status: int
    retryable: bool
    meaning: str


CODES: dict[ErrorCode, CodeInfo] = {
    ErrorCode.BAD_REQUEST: CodeInfo(400, False, "invalid parameters, duplicate id, prompt longer than the context"),
    ErrorCode.UNKNOWN_MODEL: CodeInfo(404, False, "the model is not served; the message lists those that are"),
    ErrorCode.UNKNOWN_ADAPTER: CodeInfo(404, False, "the model serves no LoRA adapter of that name; the message "
                                                    "lists those it serves, with their ids"),
    ErrorCode.BUSY: CodeInfo(429, True, "the model's queue is full, or the caller's tenant is at one of its limits "
                                        "(`max_queued`, `tokens_per_minute`, `max_pending_per_client`), which the "
                                        "message names with its value and the use; `retry_after` suggests when to "
                                        "retry"),
    ErrorCode.TIMEOUT: CodeInfo(504, True, "the request's `timeout` passed, queued or running"),
    ErrorCode.CANCELLED: CodeInfo(500, False, "cancelled by the client"),
    ErrorCode.GRAMMAR_TOO_COMPLEX: CodeInfo(400, False, "the request's grammar (given, or compiled from its JSON "
                                                        "Schema) opens too many alternatives that begin alike at one "
                                                        "point (refused at admission), or one sampling step under it "
                                                        "ran past its budget (the request ends there, the others on "
                                                        "its instance go on); the message names the measure and the "
                                                        "limit"),
    ErrorCode.WORKER_LOST: CodeInfo(502, True, "the instance died after it had streamed text without reporting "
                                               "its tokens (a worker older than the hand-over), or the request lost 8 "
                                               "instances that were killed or went away, the bound on hand-overs; "
                                               "others continue elsewhere"),
    ErrorCode.WORKER_STALLED: CodeInfo(502, True, "(servers older than the hand-over) the instance generated "
                                                  "nothing for `stall_timeout`; now its requests continue elsewhere"),
    ErrorCode.POISON_REQUEST: CodeInfo(500, False, "the request was running on two instances that crashed "
                                                   "(SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) or stalled; it is "
                                                   "not retried again"),
    ErrorCode.MODEL_FAILED: CodeInfo(503, False, "the model failed to load 3 times in a row (the message has the "
                                                 "load error), its instance or its zygote exited 5 times in a row "
                                                 "before it started (the server log has why), or its instances "
                                                 "crashed on 3 different requests in a row (the message names the "
                                                 "signal and the settings to try)"),
    ErrorCode.NO_INSTANCE: CodeInfo(503, True, "no instance of the model could serve the request within "
                                               "`no_instance_timeout` (none registered, its pool gone), or its "
                                               "`timeout` passed while the model was still loading, or no instance "
                                               "has a LoRA adapter it names loaded nor will (its load failed on each); "
                                               "the message says which and what to do"),
    ErrorCode.DOES_NOT_FIT: CodeInfo(503, False, "the model does not fit the device's memory (at start, or a "
                                                 "load)"),
    ErrorCode.SHUTTING_DOWN: CodeInfo(503, True, "the server is stopping"),
    ErrorCode.CONNECTION: CodeInfo(503, True, "no server answers at the address (client side), or the Hugging "
                                              "Face Hub cannot be reached for a model to download"),
    ErrorCode.PROTOCOL: CodeInfo(400, False, "a malformed message"),
    ErrorCode.FORBIDDEN: CodeInfo(403, False, "an operator's call (CONTROL, SLOT_ACTION) sent without the admin "
                                              "credential: the admin socket (`admin_bind`), or over CURVE a key in "
                                              "`curve_admins`; or a request on the clients' socket naming a "
                                              "`tenant` other than its connection's"),
    ErrorCode.CONFIG: CodeInfo(500, False, "a bad setting: file, key, value and what is allowed (at start)"),
    ErrorCode.INTERNAL: CodeInfo(500, False, "a bug or a llama.cpp failure; the server log has the details"),
}


class MpserveError(Exception):
    """Base class. ``code`` is stable across releases; ``retryable`` tells clients whether to try again."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return CODES[self.code].retryable

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class BadRequest(MpserveError):
    code = ErrorCode.BAD_REQUEST


class UnknownModel(MpserveError):
    code = ErrorCode.UNKNOWN_MODEL


class UnknownAdapter(MpserveError):
    code = ErrorCode.UNKNOWN_ADAPTER


class Busy(MpserveError):
    code = ErrorCode.BUSY


class Timeout(MpserveError):
    code = ErrorCode.TIMEOUT


class Cancelled(MpserveError):
    code = ErrorCode.CANCELLED


class GrammarTooComplex(MpserveError):
    """A grammar whose sampling would hold up the instance: refused at admission, or ended at a step too long."""

    code = ErrorCode.GRAMMAR_TOO_COMPLEX


class ShuttingDown(MpserveError):
    code = ErrorCode.SHUTTING_DOWN


class WorkerLost(MpserveError):
    code = ErrorCode.WORKER_LOST


class WorkerStalled(MpserveError):
    code = ErrorCode.WORKER_STALLED


class PoisonRequest(MpserveError):
    code = ErrorCode.POISON_REQUEST


class ModelFailed(MpserveError):
    code = ErrorCode.MODEL_FAILED


class NoInstance(MpserveError):
    code = ErrorCode.NO_INSTANCE


class ModelDoesNotFit(MpserveError):
    code = ErrorCode.DOES_NOT_FIT


class ProtocolError(MpserveError):
    code = ErrorCode.PROTOCOL


class Forbidden(MpserveError):
    """An operator's call on the clients' socket: only the admin socket takes it; or a request there that names
    another tenant than its connection's."""

    code = ErrorCode.FORBIDDEN


class ConnectionFailed(MpserveError):
    """The client could not reach a server (not started, stopped, or wrong address)."""

    code = ErrorCode.CONNECTION


class ConfigError(MpserveError):
    code = ErrorCode.CONFIG


class InternalError(MpserveError):
    code = ErrorCode.INTERNAL


_BY_CODE: dict[str, type[MpserveError]] = {
    cls.code.value: cls
    for cls in (
        BadRequest, UnknownModel, UnknownAdapter, Busy, Timeout, Cancelled, GrammarTooComplex, ShuttingDown,
        WorkerLost, WorkerStalled, PoisonRequest, ModelFailed, NoInstance, ModelDoesNotFit, ProtocolError, Forbidden,
        ConnectionFailed, ConfigError, InternalError,
    )
}


def error_from_code(code: str, message: str, retry_after: float | None = None) -> MpserveError:
    """Rebuild the exception that a wire ERROR stands for; an unknown code becomes an InternalError."""
    cls = _BY_CODE.get(code, InternalError)
    err = cls(message, retry_after=retry_after)
    if cls is InternalError and code != InternalError.code:
        err.message = f"{code}: {message}"
    return err


def http_status(code: str) -> int:
    """The gateway's HTTP status for a wire code; 500 for a code this version does not know."""
    try:
        return CODES[ErrorCode(code)].http_status
    except ValueError:
        return 500


def markdown_table() -> str:
    """The table of error codes, as the docs show it (docs/operations.md, docs/protocol.md)."""
    lines = ["| code | HTTP | meaning | retry? |", "|---|---|---|---|"]
    lines += [f"| `{code}` | {info.http_status} | {info.meaning} | {'yes' if info.retryable else 'no'} |"
              for code, info in CODES.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
