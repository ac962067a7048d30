"""A model's speculative decoding setting (``models[].speculative``), shared by the config, the worker spec
and the engine (``mpserve.engine.speculation`` and ``mpserve.engine.draft`` do the work).

    YAML {type: ngram, n_max: 8, ...} ──config.build──▶ Speculative ──EngineSpec──▶ BatchEngine
         {type: draft, model: PATH, ...}     │
                                             └─ server.layout.check_model: check_draft (the vocabularies)

``parse`` checks the mapping; a bad key or value raises ValueError with what is allowed, which the config
turns into a ConfigError naming the file and the key. ``check_draft`` reads both GGUF headers' token lists
(before anything starts) and refuses a draft whose vocabulary is not the target's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from os import PathLike
from typing import Any

TYPES = ("ngram", "draft")
SIZINGS = ("measured", "fixed")


@dataclass(frozen=True)
class Speculative:
    """``ngram`` (prompt lookup): draft the tokens that followed the latest earlier occurrence of the
    sequence's last ``ngram_max`` .. ``ngram_min`` tokens (longest first), in its own prompt and output.
    ``draft``: the greedy continuation by the draft ``model`` (a GGUF file with the target's vocabulary).
    Either way at most ``n_max`` drafts a step, none when fewer than ``n_min`` would be worth verifying;
    ``sizing`` measured: as many as the measured decode times and the sequence's acceptance say pay (the
    draft model's decodes counted too), fixed: ``n_max`` whenever the decode has rows for them. ``exact``:
    a decode that verifies drafts holds only as many rows as llama.cpp's CPU kernels compute exactly as a
    lone row (``mpserve.engine.speculation.exact_rows``: fewer with repacked weights), so the output equals
    the output without speculation token for token; false: as many as the drafts need (llama-server's way), whose larger
    batches go through other kernels, faster per row, whose logits differ from a lone row's, so a close
    greedy choice may differ from the unspeculated one."""

    type: str = "ngram"
    n_max: int = 8
    n_min: int = 1
    ngram_min: int = 2
    ngram_max: int = 4
    model: str | None = None  # type draft: the draft model's GGUF file
    sizing: str = "measured"
    exact: bool = True


_RANGES = {"n_max": (1, 64), "n_min": (1, 64), "ngram_min": (1, 16), "ngram_max": (1, 16)}
_TOKENS_KEY = "tokenizer.ggml.tokens"
_SPECIAL_KEYS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")
_DRAFT_CHECK = frozenset({_TOKENS_KEY, *_SPECIAL_KEYS})  # the metadata a draft's vocabulary check reads


def parse(value: Mapping[str, Any] | str) -> Speculative:
    """``{type: ngram, n_max: ..., ...}``, or just ``ngram`` for the defaults, or ``draft:PATH`` for a draft
    model with the defaults."""
    given: Mapping[str, Any]
    if isinstance(value, str):
        kind, _, path = value.partition(":")
        given = {"type": kind.strip().lower(), **({"model": path} if path else {})}
    else:
        given = value
    allowed = [f.name for f in fields(Speculative)]
    unknown = [k for k in given if k not in allowed]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r}; allowed keys: {', '.join(allowed)}")
    kind = given.get("type", "ngram")
    if kind not in TYPES:
        raise ValueError(f"type: got {kind!r}, allowed: {', '.join(TYPES)} (draft:PATH for a draft model)")
    for key, (lo, hi) in _RANGES.items():
        v = given.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi):
            raise ValueError(f"{key}: got {v!r}, allowed: an integer {lo} to {hi}")
    if given.get("sizing", "measured") not in SIZINGS:
        raise ValueError(f"sizing: got {given['sizing']!r}, allowed: {', '.join(SIZINGS)}")
    if not isinstance(given.get("exact", True), bool):
        raise ValueError(f"exact: got {given['exact']!r}, allowed: true, false")
    model = given.get("model")
    if kind == "draft" and (not isinstance(model, str) or not model):
        raise ValueError("type draft needs model: the draft model's GGUF file (flag: --speculative draft:PATH)")
    if kind != "draft" and model is not None:
        raise ValueError(f"model: a draft model goes with type draft, not {kind}")
    spec = Speculative(**given)
    if spec.n_min > spec.n_max or spec.ngram_min > spec.ngram_max:
        raise ValueError(f"n_min must be at most n_max and ngram_min at most ngram_max, got {spec}")
    return spec


def check_draft(name: str, target: str | PathLike[str], draft: str | PathLike[str]) -> None:
    """ValueError, naming both files, unless ``draft`` is a GGUF file whose vocabulary is ``target``'s: the
    same number of tokens, the same BOS and EOS ids, and the same text for every token. Drafts are token
    ids of the target's vocabulary, so any other draft would propose noise."""
    from mpserve.models.gguf_header import read_header

    headers = []
    for path in (target, draft):
        try:
            headers.append(read_header(path, _DRAFT_CHECK.__contains__))
        except (OSError, ValueError) as exc:
            raise ValueError(f"model {name!r}: cannot read {path} as GGUF: {exc}") from None
    tokens = [header.metadata.get(_TOKENS_KEY) for header in headers]
    if tokens[0] is None or tokens[1] is None:
        missing = draft if tokens[1] is None else target
        raise ValueError(f"model {name!r}: {missing} has no token list ({_TOKENS_KEY}) to compare")
    prefix = f"model {name!r}: the draft model {draft} does not have the vocabulary of {target}"
    if len(tokens[0]) != len(tokens[1]):
        raise ValueError(f"{prefix}: {len(tokens[1])} tokens against {len(tokens[0])}")
    for key in _SPECIAL_KEYS:
        ids = [header.metadata.get(key) for header in headers]
        if ids[0] != ids[1]:
            raise ValueError(f"{prefix}: {key} is {ids[1]} against {ids[0]}")
    if tokens[0] != tokens[1]:
        differing = next(i for i, (a, b) in enumerate(zip(*tokens, strict=True)) if a != b)
        raise ValueError(f"{prefix}: token {differing} is {tokens[1][differing]!r} against "
                         f"{tokens[0][differing]!r}")
