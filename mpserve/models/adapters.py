"""A model's LoRA adapters, as declared: each checked against the model's GGUF before anything starts.

    models[].adapters {NAME: source}  or  --lora NAME=PATH (repeatable)
        ──parse()─────▶ ((NAME, source), ...) in declaration order (a request's ``lora`` ids count in it); a name
                        as model names are written, a plain path a file here, a Hub source well-formed
        ──check()─────▶ at start and in ``mpserve plan``, after the Hub sources are pulled: the adapter's GGUF
                        header against the model's (``mpserve.models.lora_file``: a LoRA adapter, of the model's
                        architecture, each lora_a/lora_b pair shaped for the base tensor it adapts)
    their tensors' bytes are counted in the memory estimate (``mpserve.gpu.placement``)

Only headers are read (``mpserve.models.gguf_header``): an adapter refused here would otherwise fail in every
instance's load, after the fork. Each refusal is one line naming the file and what to give instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpserve.errors import BadRequest, ConfigError
from mpserve.wire.adapters import NAME_RE

from . import sources

Declared = tuple[tuple[str, str], ...]


def parse(value: Mapping[str, Any] | list[Any] | tuple[Any, ...], where: str) -> Declared:
    """``{NAME: source}`` (YAML) or ``["NAME=source", ...]`` (the ``--lora`` flag) as ordered pairs; a bad name, a
    repeated one, a missing plain file or a malformed Hub source is a ConfigError naming ``where``."""
    if isinstance(value, Mapping):
        pairs = [(k, v) for k, v in value.items()]
    else:
        pairs = [_flag(item, where) for item in value]
    names: set[str] = set()
    for name, source in pairs:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ConfigError(f"{where}: adapter name {name!r}: allowed letters, digits, '.', '_' and '-', starting "
                              "with a letter or digit, at most 64 characters")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"{where}.{name}: got {source!r}, expected a LoRA GGUF file, {sources.FORMS}")
        if name in names:
            raise ConfigError(f"{where}: adapter {name!r} is declared twice; give each adapter its own name")
        names.add(name)
        if sources.is_source(source):
            sources.check(source, f"{where}.{name}")
        elif not Path(source).is_file():
            raise ConfigError(f"{where}.{name}: no such adapter file {source!r}; give the adapter's .gguf file, or "
                              f"{sources.FORMS}")
    return tuple(pairs)


def _flag(item: Any, where: str) -> tuple[str, str]:
    name, sep, source = str(item).partition("=")
    if not sep:
        raise ConfigError(f"{where}: got {item!r}, expected NAME=PATH (e.g. --lora french=french-lora.gguf)")
    return name.strip(), source.strip()


def local(source: str) -> str:
    """The adapter's GGUF on this host (a Hub source must have been pulled: ``sources.pull``)."""
    return sources.local_path(source) if sources.is_source(source) else source


def check(name: str, adapter: str, model: str, where: str) -> None:
    """ConfigError, one line naming ``where``, ``adapter`` and the fix, unless the GGUF at ``adapter`` is a LoRA
    adapter for the model at ``model`` (``lora_file.check_adapter``: its type, architecture and tensor shapes).
    Imported here: reading a GGUF takes numpy and gguf, which the server's and the gateway's processes never load."""
    from .lora_file import check_adapter

    try:
        check_adapter(name, adapter, model)
    except BadRequest as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
