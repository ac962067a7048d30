"""``mpserve.worker.offers``: what an instance whose server died offers the next one. Its answers are kept until two
heartbeats of their broker came after them (read by then), held from the death on, offered after the parked
requests, and sent again once (then noted as sent, for a death of the broker that asked)."""

from __future__ import annotations

import pytest

from mpserve.wire import protocol as wire
from mpserve.worker import offers

pytestmark = pytest.mark.timeout(10)


def _assign(ticket: str) -> wire.Assign:
    return wire.Assign(ticket, wire.Request(f"r-{ticket}", "Once upon a time"), 0.0, 1, report_tokens=True)


def _done(ticket: str) -> bytes:
    return wire.pack(wire.Error(f"r-{ticket}", "cancelled", "cancelled"))


def _said(text: str, ids: list[int]) -> offers.Said:
    said = offers.Said()
    said.add(text[:2], ids[:1])
    said.add(text[2:], ids[1:])
    return said


def test_an_answer_is_let_go_at_the_second_heartbeat_after_it_and_held_if_the_server_dies_before() -> None:
    sent = offers.Sent()
    sent.note(_assign("a"), _said("abc", [1, 2]), wire.MsgType.ERROR, _done("a"))
    sent.beat()
    sent.note(_assign("b"), None, wire.MsgType.ERROR, _done("b"))
    sent.beat()  # "a" had two heartbeats after it: read
    sent.note(_assign("c"), _said("xyz", [7, 8, 9]), wire.MsgType.ERROR, _done("c"))
    sent.hold()
    assert sorted(a.assign.ticket for a in sent.held()) == ["b", "c"]
    sent.beat()  # held answers are not let go by heartbeats
    sent.drop("b")
    taken = sent.take("c")
    assert taken is not None and (taken.said.text, taken.said.ids, taken.body) == ("xyz", [7, 8, 9], _done("c"))
    assert sent.take("c") is None and sent.held() == []
    sent.hold()  # the broker that took "c" died too: offered again
    assert [a.assign.ticket for a in sent.held()] == ["c"]


def test_answers_are_let_go_held_s_after_they_were_sent_held_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    sent = offers.Sent()
    sent.note(_assign("a"), None, wire.MsgType.ERROR, _done("a"))
    sent.hold()
    sent.note(_assign("b"), None, wire.MsgType.ERROR, _done("b"))
    monkeypatch.setattr(offers, "HELD_S", 0.0)
    assert sent.held() == [] and sent.take("a") is None
    sent.note(_assign("c"), None, wire.MsgType.ERROR, _done("c"))  # no heartbeat since "b": let go all the same
    sent.hold()
    monkeypatch.setattr(offers, "HELD_S", 60.0)
    assert [a.assign.ticket for a in sent.held()] == ["c"]


def test_live_offers_the_parked_requests_whose_text_is_all_here_then_the_held_answers() -> None:
    sent = offers.Sent()
    sent.note(_assign("done"), _said("the end", [4, 5]), wire.MsgType.ERROR, _done("done"))
    sent.hold()
    parked = {t: offers.Held(_assign(t), [1, 2, 3]) for t in ("p1", "p2")}
    said = {"p1": _said("once", [1, 2, 3])}
    live = offers.live(parked, said, {"p2"}, sent)  # "p2" was taken over from another instance: not offered
    assert [(one.assign.ticket, one.text, wire.frame_tokens(one.generated), one.answered) for one in live] == [
        ("p1", "once", [1, 2, 3], False), ("done", "the end", [4, 5], True)]
