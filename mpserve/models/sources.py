"""A model's ``path`` when it names a model kept elsewhere: on the Hugging Face Hub (``mpserve.models.hub``) or
in Ollama's store (``mpserve.models.ollama``); a plain path, builtin: and echo are not sources.

    path ──check()──────▶ at config time: a well-formed name (Hub), a model in the store (Ollama)
         ──pull()───────▶ `mpserve pull`, `mpserve start` and `mpserve worker` before anything starts: the Hub
                          model downloaded unless cached, an Ollama blob checked against its digest; a GGUF
         ──local_path()─▶ the GGUF file to load (no network: the cache, the store)
         ──template_hint()─▶ Ollama's template, for choosing a chat template family (mpserve.models.templates)
         ──pull_projector() / projector()─▶ with ``mmproj: auto``, the projector the source ships beside the
                          model (the Hub repo's mmproj GGUF, the Ollama manifest's projector layer): pulled, then
                          found with no network, as the model is
"""

from __future__ import annotations

import re
from pathlib import Path

from mpserve.errors import ConfigError

from . import hub, ollama

FORMS = f"{hub.FORMS}, ollama://NAME[:TAG]"
AUTO = "auto"  # a model's mmproj: the projector its source ships beside it


def not_a_file(path: str) -> str:
    """Why ``path``, which names no file here, may not be what was meant: a Hub repo named without its
    quantization gets what to write; anything else, that there is no such file."""
    return hub.repo_without_quant(path) or f"no such model file {path!r}"


def is_source(path: str) -> bool:
    return path.startswith((hub.PREFIX, ollama.PREFIX)) or hub.parse(path) is not None


def check(path: str, where: str) -> Path | None:
    """What can be checked of a source without the network: ConfigError naming ``where`` if not right. The
    GGUF, where it is on this host already (Ollama's store)."""
    try:
        if path.startswith(ollama.PREFIX):
            return ollama.find(path).model
        hub.parse(path)
        return None
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None


def pull(path: str) -> Path | None:
    """The source's GGUF on this host, downloaded first where it is a Hub model not in the cache; None when
    ``path`` is no source."""
    ref = hub.parse(path)
    if ref is not None:
        return hub.pull(ref)
    if path.startswith(ollama.PREFIX):
        found = ollama.find(path)
        ollama.verify(found)
        return found.model
    return None


def local_path(path: str) -> str:
    """The GGUF file a model's ``path`` loads; a Hub model must have been pulled (``pull``)."""
    ref = hub.parse(path)
    if ref is not None:
        found = hub.cached(ref)
        if found is None:
            raise ConfigError(f"{ref} is not downloaded; run: mpserve pull {ref}")
        return str(found)
    if path.startswith(ollama.PREFIX):
        return str(ollama.find(path).model)
    return path


def pull_projector(path: str) -> Path:
    """The projector that the source ``path`` ships beside its model, on this host: downloaded first (with the model)
    where it is on the Hub, checked against its digest where it is in Ollama's store. ConfigError when ``path`` is no
    source, or its source has no projector."""
    ref = hub.parse(path)
    if ref is not None:
        return hub.pull_projector(ref)
    found = _ollama_projector(path)
    ollama.verify(found, projector=True)
    assert found.projector is not None  # _ollama_projector refuses a manifest without one
    return found.projector


def projector_file(path: str, mmproj: str | None, pull: bool = False) -> str | None:
    """The projector GGUF a model of ``path`` loads, its ``mmproj`` setting given: the file it names, or with AUTO
    the one its source ships beside the model (``pull``: downloaded first where it is not cached); None: none."""
    if mmproj != AUTO:
        return mmproj
    return str(pull_projector(path)) if pull else projector(path)


def check_auto(path: str, where: str) -> None:
    """What can be checked of ``mmproj: auto`` for a model of ``path`` without the network: its path is a source,
    and Ollama's names a projector; ConfigError naming ``where`` if not."""
    try:
        if hub.parse(path) is None:
            _ollama_projector(path)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None


def projector(path: str) -> str:
    """The projector GGUF of the source ``path`` on this host (no network: the cache, the store); a Hub model's must
    have been pulled (``pull_projector``)."""
    ref = hub.parse(path)
    if ref is None:
        return str(_ollama_projector(path).projector)
    found = hub.cached_projector(ref)
    if found is None:
        raise ConfigError(f"{ref}'s projector is not downloaded; mpserve start pulls it, and mpserve pull --config "
                          f"FILE does for a model with mmproj: {AUTO}")
    return str(found)


def _ollama_projector(path: str) -> ollama.OllamaModel:
    """The Ollama model ``path`` names, which has a projector; ConfigError when ``path`` is not one of Ollama's, or
    its manifest names no projector."""
    if not path.startswith(ollama.PREFIX):
        raise ConfigError(f"{AUTO} finds the projector of a model on the Hub or in Ollama's store, and {path!r} is "
                          "neither; give the projector's file")
    found = ollama.find(path)
    if found.projector is None:
        name, tag = ollama.split(path)
        raise ConfigError(f"{path}: its manifest names no projector layer (Ollama's {name}:{tag} takes text only); "
                          f"leave mmproj out, or give it a file")
    return found


def template_hint(path: str) -> str:
    """A template the source keeps beside the GGUF (Ollama's), or ""."""
    return ollama.find(path).template if path.startswith(ollama.PREFIX) else ""


def default_name(path: str) -> str | None:
    """The name clients use for a source's model: the file's stem, the repo's name with its quantization, or
    Ollama's name with its tag (not latest); None when ``path`` is no source."""
    ref = hub.parse(path)
    if ref is not None:
        name = Path(ref.filename).stem if ref.filename else f"{ref.repo.split('/')[1]}-{ref.quant or 'Q4_K_M'}"
    elif path.startswith(ollama.PREFIX):
        model, tag = ollama.split(path)
        name = f"{model.rsplit('/', 1)[-1]}" + ("" if tag == "latest" else f"-{tag}")
    else:
        return None
    return re.sub(r"[^A-Za-z0-9._-]", "-", name).lstrip("._-")[:48] or "model"
