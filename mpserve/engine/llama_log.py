"""llama.cpp's own log lines as records of the ``mpserve.llama`` logger, each at its level, the known-harmless
ones left out.

    llama.cpp ──llama_log_set(_callback)──▶ pieces ──joined into lines (CONT continues the last level)──▶
        WARN: warning, ERROR: error, the rest: debug ──HARMLESS dropped──▶ logging.getLogger("mpserve.llama")

llama-cpp-python installs a callback of its own when it is imported, which reads ggml's levels as they were
numbered before ggml renumbered them (it takes a warning for an error) and prints what it keeps to stderr, so
every warning reached the server's output whatever its log level. ``install`` replaces it in the process
that loads a model (a worker, a zygote); llama.cpp's reason for a failed load is an ERROR line and still shows.
"""

from __future__ import annotations

import ctypes
import logging
import re
from typing import Any

log = logging.getLogger("mpserve.llama")

# ggml.h's enum ggml_log_level
NONE, DEBUG, INFO, WARN, ERROR, CONT = range(6)
LEVELS = {WARN: logging.WARNING, ERROR: logging.ERROR}  # the rest (INFO, DEBUG): logging.DEBUG

# Lines llama.cpp writes on every load of a sound model, each followed by what llama.cpp does about it itself:
HARMLESS = (
    # Gemma 3's GGUF types `</s>` as a normal token; llama.cpp makes it a control token at load (the same as
    # llama-server does, where the line shows too), and Gemma never emits it.
    re.compile(r"control-looking token: .* was not control-type"),
    # mpserve asks for the full-size sliding-window cache (swa_full) on purpose: mpserve.engine.batch says why.
    re.compile(r"using full-size SWA cache"),
)

_state: dict[str, Any] = {"level": NONE, "line": "", "callback": None}


def install(lib: Any) -> None:
    """Route llama.cpp's log (``lib``: the llama_cpp module) into ``mpserve.llama``; once per process (a fork
    keeps it)."""
    if _state["callback"] is None:
        _state["callback"] = lib.llama_log_callback(_receive)  # kept: llama.cpp holds only its address
        lib.llama_log_set(_state["callback"], ctypes.c_void_p(0))


def _receive(level: int, text: bytes, _user: Any) -> None:
    if level != CONT:
        _state["level"] = level
    _state["line"] += text.decode("utf-8", "replace")
    while "\n" in _state["line"]:
        line, _state["line"] = _state["line"].split("\n", 1)
        record(_state["level"], line)


def record(level: int, line: str) -> None:
    """One whole line of llama.cpp's log at ggml ``level``, as mpserve logs it."""
    if line.strip() and not any(p.search(line) for p in HARMLESS):
        log.log(LEVELS.get(level, logging.DEBUG), "%s", line.rstrip())
