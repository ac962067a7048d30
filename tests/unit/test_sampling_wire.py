"""The sampling parameters added for OpenAI's surface, on the wire: defaults, round trips, refusals."""

from __future__ import annotations

import msgpack
import pytest

from mpserve.errors import BadRequest, ProtocolError
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import GenerateParams


def test_old_requests_get_the_defaults_and_new_ones_round_trip() -> None:
    assert wire.GenerateParams.from_wire({"max_tokens": 3}) == wire.GenerateParams(max_tokens=3)
    params = wire.GenerateParams.from_wire({"presence_penalty": 0.5, "frequency_penalty": -1, "min_p": 0.2,
                                            "typical_p": 0.9, "ignore_eos": True,
                                            "logit_bias": {"12": -100, 7: 2.5}})
    assert params.logit_bias == ((12, -100.0), (7, 2.5)) and params.frequency_penalty == -1.0
    req = wire.Request("r", "p", None, params)
    assert wire.decode(wire.encode(req)) == req  # on the wire logit_bias travels as [token, bias] pairs


@pytest.mark.parametrize("params, problem", [
    ({"presence_penalty": 2.01}, "'presence_penalty' must be between"),
    ({"frequency_penalty": float("inf")}, "'frequency_penalty' must be a finite number"),
    ({"logit_bias": {"3": -101}}, "'logit_bias' must be between -100.0 and 100.0"),
    ({"logit_bias": {"-3": 1}}, "'logit_bias' keys must be token ids"),
    ({"logit_bias": {str(2**64): 1}}, "'logit_bias' keys must be token ids"),  # int32; was an OverflowError
    ({"logit_bias": {"3": "up"}}, "'logit_bias' values must be numbers"),
    ({"logit_bias": [[1, 2, 3]]}, "'logit_bias' must be a map"),
    ({"logit_bias": [[i, 1] for i in range(wire.MAX_LOGIT_BIAS + 1)]}, "at most"),
    ({"min_p": -0.5}, "'min_p' must be between"), ({"typical_p": 2}, "'typical_p' must be between"),
    ({"ignore_eos": "yes"}, "'ignore_eos' must be a boolean"),
])
def test_bad_values_are_bad_requests_naming_the_parameter(params: dict[str, object], problem: str) -> None:
    with pytest.raises(BadRequest, match=problem):
        wire.GenerateParams.from_wire(params)
    bias = params.get("logit_bias")
    if bias is not None:  # on the wire: the pairs OpenAI's map stands for, refused naming the parameter
        params, problem = {"logit_bias": [[k, v] for k, v in bias.items()] if isinstance(bias, dict) else bias}, \
            "'logit_bias'"
    with pytest.raises(BadRequest, match=problem):  # as the broker decodes it
        wire.decode([wire.VERSION, b"\x01", msgpack.packb({"id": "a", "prompt": "p", "params": params})])


def test_on_the_wire_logit_bias_is_the_pairs_its_declaration_names() -> None:
    body = msgpack.packb({"id": "a", "prompt": "p", "params": {"logit_bias": {"3": 1.0}}})
    with pytest.raises(BadRequest, match="field 'logit_bias' must be a list, got a map"):
        wire.decode([wire.VERSION, b"\x01", body])


def test_choice_i_is_seeded_seed_plus_i_and_asks_for_one() -> None:
    params = GenerateParams(seed=2**32 - 2, n=3, temperature=0.5)
    assert [p.seed for p in map(params.choice_params, range(3))] == [2**32 - 2, 2**32 - 1, 0]
    assert params.choice_params(2) == GenerateParams(seed=0, temperature=0.5)
    assert GenerateParams(n=2).choice_params(1).seed is None
    for n in (0, 129):
        with pytest.raises(BadRequest, match="'n' must be between 1 and 128"):
            GenerateParams.from_wire({"n": n})
    chunk = wire.decode_as(wire.Chunk, wire.pack(wire.Chunk("r", "x", index=3)))
    assert chunk.index == 3 and wire.decode_as(wire.Chunk, wire.pack({"id": "r", "text": "x"})).index == 0
    with pytest.raises(ProtocolError, match="'index' must be between 0 and 127, got 128"):
        wire.decode_as(wire.Chunk, wire.pack({"id": "r", "text": "x", "index": 128}))
