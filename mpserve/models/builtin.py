"""Where the built-in models live: the user's cache directory, one file per size and format version, written by
``mpserve.models.maker`` the first time it is asked for.

    builtin:tiny ──config──▶ builtin_model_path("tiny") ──▶ ~/.cache/mpserve/mpserve-tiny-v1.gguf
                                                        └─ missing: maker.write_model (gguf, numpy) first

Their shapes are in ``shapes``, which both this module and the writer import (neither imports the other
at module level: the writer is imported here only when a file is missing).

Kept apart from the writer so that finding a model already written imports neither gguf nor numpy: the
server resolves ``builtin:`` names at every start.
"""

from __future__ import annotations

import os
from pathlib import Path

from .shapes import shape_for

# Bump whenever the generator's output changes, so cached default models are rewritten under a new name.
FORMAT_VERSION = 1


def default_model_path() -> Path:
    """The built-in tiny model in the user's cache directory, written there first if missing."""
    return builtin_model_path("tiny")


def builtin_model_path(size: str) -> Path:
    """A built-in model (``tiny`` or ``bench``) in the user's cache directory, written there first if missing."""
    shape_for(size)  # refuse an unknown size before touching the cache
    path = cache_dir() / f"mpserve-{size}-v{FORMAT_VERSION}.gguf"
    if not path.exists():
        from .maker import write_model  # the writer imports gguf and numpy: only when there is one to write

        write_model(path, size)
    return path


def cache_dir() -> Path:
    """``$MPSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpserve``, else ``~/.cache/mpserve``."""
    if explicit := os.environ.get("MPSERVE_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mpserve"
