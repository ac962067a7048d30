"""llama.cpp's own log lines as records of the ``mpserve.llama`` logger, each at its level, the known-harmless
ones left out.

    llama.cpp, its multimodal library ──llama_log_set, mtmd_log_set(_callback)──▶ pieces
        ──joined into lines (CONT continues the last level)──▶
        WARN: warning, ERROR: error, the rest: debug ──HARMLESS dropped──▶ logging.getLogger("mpserve.llama")

llama-cpp-python installs a callback of its own when it is imported, which reads ggml's levels as they were
numbered before ggml renumbered them (it takes a warning for an error) and prints what it keeps to stderr, so
every warning reached the server's output whatever its log level. ``install`` replaces it in the process
that loads a model (a worker, a zygote); llama.cpp's reason for a failed load is an ERROR line and still shows.

Some of llama.cpp's reasons bypass its log: its grammar parser writes them to the process's stderr
(``fprintf``). ``reasons`` collects, around one call, those lines and the ERROR lines of the log, so that a
refusal can name llama.cpp's reason.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
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
    # A LoRA adapter's tensors (float) have no repacked layout: llama.cpp puts each in plain CPU memory, one line
    # per tensor, in every process that loads the adapter (issue 58: 162 lines for 3 adapters on 2 instances).
    re.compile(r"lora for '.*' cannot use buft 'CPU_REPACK', fallback to CPU"),
)

_state: dict[str, Any] = {"level": NONE, "line": "", "callback": None, "errors": None}


def install(lib: Any) -> None:
    """Route llama.cpp's log (``lib``: the llama_cpp module) into ``mpserve.llama``; once per process (a fork
    keeps it)."""
    if _state["callback"] is None:
        _state["callback"] = lib.llama_log_callback(_receive)  # kept: llama.cpp holds only its address
        lib.llama_log_set(_state["callback"], ctypes.c_void_p(0))


def install_media(lib: Any, mtmd: Any) -> None:
    """Route the multimodal library's log (``mtmd``: llama_cpp's mtmd module) the same way: its projector's load and
    each image's encoding write lines of their own, which would otherwise all reach the server's output."""
    install(lib)
    mtmd.mtmd_log_set(_state["callback"], ctypes.c_void_p(0))
    mtmd.mtmd_helper_log_set(_state["callback"], ctypes.c_void_p(0))


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
        if level == ERROR and _state["errors"] is not None:
            _state["errors"].append(line.strip())


@dataclass
class Said:
    """What llama.cpp wrote during a ``reasons`` block, filled in when the block ends."""

    printed: list[str] = field(default_factory=list)  # to stderr directly, each line
    errors: list[str] = field(default_factory=list)  # its log's ERROR lines


@contextlib.contextmanager
def reasons() -> Iterator[Said]:
    """What llama.cpp writes in this block (a call in this thread): to stderr directly, and as ERROR log lines.
    The process's stderr goes to a file meanwhile and is written back whole after, so nothing is lost."""
    said = Said()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        _state["errors"] = said.errors
        try:
            yield said
        finally:
            _state["errors"] = None
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            written = caught.read()
            if written:
                os.write(2, written)
            said.printed[:] = [line.strip() for line in written.decode("utf-8", "replace").splitlines()
                               if line.strip()]
