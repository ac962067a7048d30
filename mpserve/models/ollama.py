"""Models a user pulled with Ollama, served from Ollama's store in place (nothing copied).

    ollama://NAME[:TAG] ──split──▶ registry.ollama.ai/library/NAME/TAG (USER/NAME: registry.ollama.ai/USER/NAME,
                                   HOST/NS/NAME: as written; TAG: latest)
        ──find──▶ $OLLAMA_MODELS (else ~/.ollama/models)/manifests/HOST/NS/NAME/TAG, a JSON manifest whose
                  digests are sha256:HEX (64 digits), else refused
                  ├─ layer application/vnd.ollama.image.model ────▶ blobs/sha256-HEX, the GGUF
                  ├─ layer application/vnd.ollama.image.template ─▶ blobs/sha256-HEX, a Go template, which
                  │  names the chat template family where the GGUF has none (mpserve.models.templates)
                  └─ layer application/vnd.ollama.image.projector ─▶ blobs/sha256-HEX, the model's projector GGUF
                     (mmproj), if it has one: what ``mmproj: auto`` serves
        ──verify──▶ the GGUF's sha256 equal to its digest (`pull`, `start`, `worker`, before anything starts); with
                    ``projector=True``, the projector's too
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec

from mpserve.errors import ConfigError

PREFIX = "ollama://"
REGISTRY = "registry.ollama.ai"
_MODEL = "application/vnd.ollama.image.model"
_TEMPLATE = "application/vnd.ollama.image.template"
_PROJECTOR = "application/vnd.ollama.image.projector"
Digest = Annotated[str, msgspec.Meta(pattern="^sha256:[0-9a-f]{64}$")]


class _Layer(msgspec.Struct):
    mediaType: str  # noqa: N815 (the manifest's own key)
    digest: Digest


class _Manifest(msgspec.Struct):
    """What mpserve reads of an Ollama manifest (an OCI image manifest); other keys are Ollama's."""

    layers: list[_Layer]


@dataclass(frozen=True)
class OllamaModel:
    spec: str  # ollama://NAME[:TAG]
    model: Path  # the GGUF blob
    digest: str  # its manifest digest, sha256:HEX
    template: str  # Ollama's chat template (Go text/template), "" if the manifest has none
    projector: Path | None = None  # the projector GGUF blob (mmproj), None if the manifest names none
    projector_digest: str = ""  # its manifest digest


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
    again = f"pull it again with: ollama pull {name}:{tag}"
    try:
        layers = msgspec.json.decode(manifest.read_bytes(), type=_Manifest).layers
    except OSError as exc:
        raise ConfigError(f"{spec}: cannot read its manifest {manifest}: {exc.strerror}") from None
    except msgspec.DecodeError as exc:  # not JSON, or not a manifest (the digests' form included)
        raise ConfigError(f"{spec}: its manifest {manifest} is not one Ollama writes ({exc}); {again}") from None
    digests = {layer.mediaType: layer.digest for layer in layers}
    if _MODEL not in digests:
        raise ConfigError(f"{spec}: its manifest {manifest} names no model layer; {again}")
    model = _blob(digests[_MODEL])
    if not model.is_file():
        raise ConfigError(f"{spec}: its model blob {model} is missing; {again}")
    template = ""
    if _TEMPLATE in digests and _blob(digests[_TEMPLATE]).is_file():
        data = _blob(digests[_TEMPLATE]).read_bytes()
        if f"sha256:{hashlib.sha256(data).hexdigest()}" != digests[_TEMPLATE]:
            raise ConfigError(f"{spec}: its template blob {_blob(digests[_TEMPLATE])} does not match its digest; "
                              f"{again}")
        template = data.decode(errors="replace")
    projector = _blob(digests[_PROJECTOR]) if _PROJECTOR in digests else None
    return OllamaModel(spec, model, digests[_MODEL], template, projector, digests.get(_PROJECTOR, ""))


def verify(found: OllamaModel, projector: bool = False) -> None:
    """The GGUF blob's content is what its manifest names (a file changed or damaged since Ollama pulled it is
    refused), and with ``projector`` the projector's, if it has one; it reads the whole files."""
    name, tag = split(found.spec)
    blobs = [("model", found.model, found.digest)]
    if projector and found.projector is not None:
        blobs.append(("projector", found.projector, found.projector_digest))
    for what, path, expected in blobs:
        digest = hashlib.sha256()
        try:
            with path.open("rb") as blob:
                while chunk := blob.read(1 << 20):
                    digest.update(chunk)
        except OSError as exc:
            raise ConfigError(f"{found.spec}: cannot read its {what} blob {path}: {exc.strerror}; pull it again "
                              f"with: ollama pull {name}:{tag}") from None
        if f"sha256:{digest.hexdigest()}" != expected:
            raise ConfigError(f"{found.spec}: its {what} blob {path} does not match its digest (its sha256 is "
                              f"{digest.hexdigest()}); the file was changed or damaged; pull it again with: ollama "
                              f"pull {name}:{tag}")


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
