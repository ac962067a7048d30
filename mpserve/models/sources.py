"""A model's ``path`` when it names a model kept elsewhere: on the Hugging Face Hub (``mpserve.models.hub``) or
in Ollama's store (``mpserve.models.ollama``); a plain path, builtin: and echo are not sources.

    path ──check()──────▶ at config time: a well-formed name (Hub), a model in the store (Ollama)
         ──pull()───────▶ `mpserve pull`, `mpserve start` and `mpserve worker` before anything starts: the Hub
                          model downloaded unless cached, an Ollama blob checked against its digest; a GGUF
         ──local_path()─▶ the GGUF file to load (no network: the cache, the store)
         ──template_hint()─▶ Ollama's template, for choosing a chat template family (mpserve.models.templates)
"""

from __future__ import annotations

import re
from pathlib import Path

from mpserve.errors import ConfigError

from . import hub, ollama

FORMS = f"{hub.FORMS}, ollama://NAME[:TAG]"


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
