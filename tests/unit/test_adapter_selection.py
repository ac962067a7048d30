"""A request's LoRA adapters as clients write them (BASE:NAME, {name: scale}, names, llama-server's lora list of
ids or names) become one set: sorted by name, scale 0 left out; each bad selection is refused naming the fix."""

from __future__ import annotations

import pytest

from mpserve.errors import BadRequest, UnknownAdapter
from mpserve.wire import adapters

DECLARED = adapters.Served(["fr", "de", "es"])


def test_a_selection_is_one_set_however_it_is_written() -> None:
    assert adapters.selection("tiny:fr", {"de": 0.5}) == ("tiny", (("de", 0.5), ("fr", 1.0)))
    assert adapters.selection("tiny", ["de", ("fr", 1)]) == ("tiny", (("de", 1.0), ("fr", 1.0)))
    assert adapters.selection(None, {"fr": 0.0}) == (None, ())
    assert adapters.from_lora([{"id": 2, "scale": 0.25}, {"name": "de"}], DECLARED, "tiny") == \
        (("de", 1.0), ("es", 0.25))


@pytest.mark.parametrize(("lora", "error", "words"), [
    ([{"id": 3}], BadRequest, "no LoRA adapter with id 3 (an unloaded adapter's id is not reused); served "
                              "adapters: tiny:fr (id 0), tiny:de (id 1)"),
    ([{"id": True}], BadRequest, "with id True"),
    ([{"id": 0, "scale": 4.5}], BadRequest, "scale 4.5 is out of range; give a number from -4 to 4"),
    ([{"id": 0, "scale": "1"}], BadRequest, "scale '1' must be a number"),
    ([{"id": 0}, {"name": "fr"}], BadRequest, "'fr' is given twice"),
    ([{"id": 0, "name": "fr"}], BadRequest, "each item is {\"id\": N"),
    ({"id": 0}, BadRequest, "'lora' must be a list"),
])
def test_a_bad_lora_list_is_refused_naming_the_fix(lora: object, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=None) as refused:
        adapters.from_lora(lora, DECLARED, "tiny")
    assert words in str(refused.value)


def test_the_broker_names_the_adapters_served() -> None:
    missing = adapters.unknown((("it", 1.0),), DECLARED, "tiny")
    assert isinstance(missing, UnknownAdapter) and "no LoRA adapter 'it'" in missing.message
    assert adapters.unknown((("fr", 1.0),), DECLARED, "tiny") is None
    assert "declare them in its models[].adapters" in str(adapters.unknown((("fr", 1.0),), {}, "tiny"))


def test_an_id_is_given_once_and_an_unloaded_one_s_id_is_refused() -> None:
    served = adapters.Served(["french", "support"])
    served.remove("french")
    assert served.add("german") == 2 and served.add("french") == 3 and dict(served) == {
        "support": 1, "german": 2, "french": 3}
    assert adapters.from_lora([{"id": 1}, {"id": 2, "scale": 0.5}], served, "m") == (("german", 0.5), ("support", 1.0))
    with pytest.raises(BadRequest, match="serves no LoRA adapter with id 0 .* m:support \\(id 1\\), m:german"):
        adapters.from_lora([{"id": 0}], served, "m")


def test_an_instance_s_active_sets_are_those_its_running_slots_show() -> None:
    from mpserve.wire.slots import CacheRow, SlotRow, SlotState, active_sets

    def row(state: SlotState, label: str) -> SlotRow:
        return SlotRow(0, 1, 0, 0, state, -1, "m", "r", 0, 0, 0.0, 0.0, 0.0, 0, 0, CacheRow(0, 0, 0, 0, 0, 0, 0, 0),
                       label)

    rows = [row(SlotState.BUSY, "fr"), row(SlotState.BUSY, ""), row(SlotState.IDLE, "de"),
            row(SlotState.WAITING, "fr"), row(SlotState.BUSY, "de*0.5+fr")]
    assert active_sets(rows) == ["base", "de*0.5+fr", "fr"]  # an idle slot's last set is not active
    assert active_sets(rows[2:3]) == []
