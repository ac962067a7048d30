"""A models directory (``models_dir``): its GGUF files become models that clients name by file stem, listed by
``GET /v1/models`` and loaded when a request asks for one, as LocalAI and llama-swap serve a folder.

    models_dir ──entries()──▶ one models[] entry per *.gguf (projector files and split parts after the first
                              left out): path, and instances {min: 0, max: 1} unless the flags say otherwise
               ──▶ config.build appends them to the configured models, which keep their names and files

A model with no instance until a request asks is the existing ``min_instances: 0`` (the request waits for the
load); ``single_active_backend`` and ``max_instances`` hold for these models as for any.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mpserve.errors import ConfigError

ON_DEMAND: dict[str, int] = {"min": 0, "max": 1}
_LATER_PART = re.compile(r"-(?!00001)\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


def entries(folder: str, where: str, taken: set[str]) -> list[dict[str, Any]]:
    """A models[] entry for each GGUF in ``folder`` whose file is not in ``taken`` (resolved paths of the
    models configured otherwise); ConfigError naming ``where`` when it is not a folder."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"{where}: {folder!r} is not a folder; give the folder that holds your .gguf files")
    files = sorted(p for p in root.iterdir() if p.suffix.lower() == ".gguf" and p.is_file()
                   and "mmproj" not in p.name.lower() and not _LATER_PART.search(p.name))
    return [{"path": str(p), "instances": dict(ON_DEMAND)} for p in files if str(p.resolve()) not in taken]
