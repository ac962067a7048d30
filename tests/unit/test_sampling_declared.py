"""Each sampling parameter is declared once (``GenerateParams``: name, type, limits, default, meaning); the
gateway's mapping, the engine, the Node client's list and the docs' table are checked against that declaration."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import msgspec
import pytest

from mpserve.gateway.api import openai
from mpserve.wire import messages

pytestmark = pytest.mark.timeout(10)

ROOT = Path(__file__).resolve().parents[2]
# what the gateway sets from other OpenAI fields, not by the parameter's own name
FROM_OTHER_FIELDS = {"logprobs": "logprobs / top_logprobs", "prompt_logprobs": "echo with logprobs",
                     "grammar": "its own field or response_format", "json_schema": "response_format or tools",
                     "reasoning_end": "the chat template's thinking tags", "reasoning_budget": "reasoning.Ask",
                     "reasoning_effort": "reasoning.Ask"}
CHOICES = {"n"}  # split into one-choice requests by the broker (``choice_params``), never seen by an engine


def _declared(hint: object) -> tuple[object, list[msgspec.Meta]]:
    """A field's type without ``Annotated`` and ``| None``, and the Meta it carried."""
    if typing.get_origin(hint) is typing.Annotated:
        kind, metas = _declared(typing.get_args(hint)[0])
        return kind, metas + [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return _declared(args[0]) if type(None) in typing.get_args(hint) else (hint, [])


def test_every_parameter_is_declared_with_its_limits_default_and_meaning() -> None:
    hints = typing.get_type_hints(messages.GenerateParams, include_extras=True)
    for field in msgspec.structs.fields(messages.GenerateParams):
        kind, metas = _declared(hints[field.name])
        assert any(m.description for m in metas), f"{field.name} declares no meaning"
        assert field.default is not msgspec.NODEFAULT, f"{field.name} declares no default"
        assert kind is bool or any(m.le is not None or m.max_length is not None for m in metas), \
            f"{field.name} declares no limit"


def test_the_gateways_sampling_names_are_the_declared_ones() -> None:
    assert set(openai._SAMPLING) <= set(messages.SAMPLING), set(openai._SAMPLING) - set(messages.SAMPLING)
    assert set(messages.SAMPLING) - set(openai._SAMPLING) == set(FROM_OTHER_FIELDS), \
        "a new sampling parameter must be mapped by the gateway (gateway/api/openai.py's _SAMPLING)"
    assert {"grammar", "json_schema"} <= set(openai._COMMON)


def test_the_engine_reads_every_declared_parameter() -> None:
    source = "\n".join(p.read_text() for p in (ROOT / "mpserve" / "engine").rglob("*.py"))
    read = set(re.findall(r"params\.(\w+)", source))
    assert set(messages.SAMPLING) - CHOICES <= read, set(messages.SAMPLING) - CHOICES - read


def test_the_node_clients_list_is_the_declared_one_in_its_order() -> None:
    source = (ROOT / "clients" / "node" / "index.js").read_text()
    listed = re.search(r"SAMPLING_PARAMS = Object\.freeze\(\[(.*?)\]\)", source, re.S)
    assert listed, "clients/node/index.js declares SAMPLING_PARAMS"
    assert tuple(re.findall(r'"(\w+)"', listed.group(1))) == messages.SAMPLING
