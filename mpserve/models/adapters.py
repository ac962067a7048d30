"""A model's LoRA adapters, as declared: each checked against the model's GGUF before anything starts.

    models[].adapters {NAME: source}  or  --lora NAME=PATH (repeatable)
        ──parse()─────▶ ((NAME, source), ...) in declaration order (a request's ``lora`` ids count in it); a name
                        as model names are written, a plain path a file here, a Hub source well-formed
        ──check()─────▶ at start and in ``mpserve plan``, after the Hub sources are pulled: the adapter's GGUF
                        header says general.type "adapter", adapter.type "lora" and the model's architecture, and
                        each lora_a/lora_b pair has the shapes llama.cpp checks against the base tensor it adapts
    their tensors' bytes are counted in the memory estimate (``mpserve.gpu.placement``)

Only headers are read (``mpserve.models.gguf_header``): an adapter refused here would otherwise fail in every
instance's load, after the fork. Each refusal is one line naming the file and what to give instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mpserve.errors import ConfigError
from mpserve.wire.adapters import NAME_RE

from . import sources
from .gguf_header import GGUFHeader, TensorInfo, read_header

_KEYS = ("general.type", "adapter.type", "general.architecture")
_LORA = re.compile(r"^(?P<base>.+)\.lora_(?P<part>[ab])$")
FIX = "give a LoRA adapter GGUF made for this model (convert_lora_to_gguf.py --base THE_MODEL's folder, or mpserve " \
      "make-model ADAPTER.gguf --lora-for MODEL.gguf)"

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
            raise ConfigError(f"{where}.{name}: {sources.not_a_file(source)}; give the adapter's .gguf file")
    return tuple(pairs)


def _flag(item: Any, where: str) -> tuple[str, str]:
    name, sep, source = str(item).partition("=")
    if not sep:
        raise ConfigError(f"{where}: got {item!r}, expected NAME=PATH (e.g. --lora french=french-lora.gguf)")
    return name.strip(), source.strip()


def local(source: str) -> str:
    """The adapter's GGUF on this host (a Hub source must have been pulled: ``sources.pull``)."""
    return sources.local_path(source) if sources.is_source(source) else source


def check(adapter: str, model: str, where: str) -> None:
    """ConfigError, one line naming ``adapter`` and the fix, unless the GGUF at ``adapter`` is a LoRA adapter of
    the architecture of the model at ``model`` whose every tensor pair fits the base tensor it adapts."""
    head = _header(adapter, where)
    kind, lora = head.metadata.get("general.type"), head.metadata.get("adapter.type")
    if kind != "adapter" or lora != "lora":
        found = (f"its adapter.type is {lora!r}, not 'lora'" if kind == "adapter" else
                 f"its general.type is {kind!r}, not 'adapter'" if kind else "it has no general.type: a model file")
        raise ConfigError(f"{where}: {adapter!r} is not a LoRA adapter ({found}); {FIX}")
    base = _header(model, where)
    arch, base_arch = head.metadata.get("general.architecture"), base.metadata.get("general.architecture")
    if arch != base_arch:
        raise ConfigError(f"{where}: {adapter!r} is an adapter for architecture {arch!r}, and the model is "
                          f"{base_arch!r}; {FIX}")
    problem = shape_problem(head.tensors, {t.name: t for t in base.tensors})
    if problem is not None:
        raise ConfigError(f"{where}: {adapter!r} does not fit the model: {problem}; {FIX}")


def shape_problem(tensors: tuple[TensorInfo, ...], base: Mapping[str, TensorInfo]) -> str | None:
    """What llama.cpp's adapter load would refuse of these lora_a/lora_b tensors against the base tensors
    (llama-adapter.cpp's checks, in GGUF's dimension order: a is [in, rank], b is [rank, out]); None if nothing."""
    pairs: dict[str, dict[str, TensorInfo]] = {}
    for tensor in tensors:
        found = _LORA.match(tensor.name)
        if found is not None:
            pairs.setdefault(found["base"], {})[found["part"]] = tensor
    if not pairs:
        return "it has no lora_a/lora_b tensors"
    for name, pair in sorted(pairs.items()):
        if set(pair) != {"a", "b"}:
            return f"{name} has lora_{'a' if 'a' in pair else 'b'} without its other half"
        target = base.get(name)
        if target is None:
            return f"it adapts {name}, which the model does not have"
        a, b, w = pair["a"].shape, pair["b"].shape, target.shape
        if len(a) < 2 or len(b) < 2 or len(w) < 2:
            return f"{name}: a LoRA pair adapts a matrix"
        if name.startswith("token_embd"):  # llama.cpp stores this pair the other way round
            fits = w[0] == b[1] and w[1] == a[1]
        else:
            fits = w[0] == a[0] and w[1] == b[1] and a[1] == b[0]
        if not fits:
            return f"{name} is {list(w)} in the model, and its lora_a {list(a)} and lora_b {list(b)} do not fit it"
    return None


def _header(path: str, where: str) -> GGUFHeader:
    try:
        return read_header(path, lambda key: key in _KEYS)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such adapter file {path!r}; give the adapter's .gguf file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path!r}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {path!r}: {exc}; {FIX}") from None
