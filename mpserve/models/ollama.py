"""Models a user pulled with Ollama, served from Ollama's store in place (nothing copied).

    ollama://NAME[:TAG] ──split──▶ registry.ollama.ai/library/NAME/TAG (USER/NAME: registry.ollama.ai/USER/NAME,
                                   HOST/NS/NAME: as written; TAG: latest)
        ──find──▶ $OLLAMA_MODELS (else ~/.ollama/models)/manifests/HOST/NS/NAME/TAG, a JSON manifest
                  ├─ layer application/vnd.ollama.image.model ────▶ blobs/sha256-HEX, the GGUF
                  └─ layer application/vnd.ollama.image.template ─▶ blobs/sha256-HEX, a Go template, which
                     names the chat template family where the GGUF has none (mpserve.models.templates)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from mpserve.errors import ConfigError

PREFIX = "ollama://"
REGISTRY = "registry.ollama.ai"
_MODEL = "application/vnd.ollama.image.model"
_TEMPLATE = "application/vnd.ollama.image.template"


@dataclass(frozen=True)
class OllamaModel:
    model: Path  # the GGUF blob
    template: str  # Ollama's chat template (Go text/template), "" if the manifest has none


def store() -> Path:
    """Ollama's model folder: $OLLAMA_MODELS, else ~/.ollama/models."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def split(spec: str) -> tuple[str, str]:
    """(name, tag) of ``ollama://name[:tag]``; the tag is latest unless given."""
    rest = spec[len(PREFIX):] if spec.startswith(PREFIX) else spec
    name, _, tag = rest.rpartition(":") if ":" in rest.rsplit("/", 1)[-1] else (rest, "", "latest")
    return name, tag


def find(spec: str) -> OllamaModel:
    """The GGUF and the template of ``ollama://name[:tag]`` in Ollama's store; ConfigError naming what is
    missing and what the store holds."""
    name, tag = split(spec)
    parts = name.split("/")
    if not name or any(not p or p in (".", "..") for p in parts) or len(parts) > 3 or not tag:
        raise ConfigError(f"{spec!r} is not an Ollama model name; write ollama://NAME or ollama://NAME:TAG")
    full = {1: [REGISTRY, "library"], 2: [REGISTRY], 3: []}[len(parts)] + parts
    manifest = store().joinpath("manifests", *full, tag)
    if not manifest.is_file():
        pulled = _pulled()
        held = f"it holds {', '.join(pulled[:8])}" if pulled else "it holds no models"
        raise ConfigError(f"{spec} is not in Ollama's store ({store()}; set OLLAMA_MODELS for another); {held}; "
                          f"pull it with: ollama pull {name}:{tag}")
    try:
        layers = json.loads(manifest.read_text())["layers"]
        digests = {layer["mediaType"]: layer["digest"] for layer in layers}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{spec}: cannot read its manifest {manifest}: {exc}") from None
    if _MODEL not in digests:
        raise ConfigError(f"{spec}: its manifest {manifest} names no model layer")
    model = _blob(digests[_MODEL])
    if not model.is_file():
        raise ConfigError(f"{spec}: its model blob {model} is missing; pull it again with: ollama pull {name}:{tag}")
    template = _blob(digests[_TEMPLATE]) if _TEMPLATE in digests else None
    return OllamaModel(model, template.read_text(errors="replace") if template and template.is_file() else "")


def _blob(digest: str) -> Path:
    return store() / "blobs" / digest.replace(":", "-")


def _pulled() -> list[str]:
    """The models in the store, as Ollama names them (``ollama list``)."""
    root = store() / "manifests"
    found = []
    for manifest in sorted(p for p in root.rglob("*") if p.is_file()):
        host, *names, tag = manifest.relative_to(root).parts
        if host == REGISTRY and names[:1] == ["library"]:
            names = names[1:]
        found.append(f"{'/'.join(names if host == REGISTRY else [host, *names])}:{tag}")
    return found
