"""Adoption's rules, driven directly: which READY may show the dead server's secret, what an adoptee's LIVE
requests become, a client's reattach to them (or to nothing), and the client's side: text that comes again is
dropped, text that differs ends the stream."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from brokers import broker_fixture  # noqa: F401  (the fixture "broker")

from mpserve.client_track import Track
from mpserve.errors import ConnectionFailed
from mpserve.server import adoption
from mpserve.server.broker import Broker
from mpserve.server.state import Pending
from mpserve.wire import protocol as wire

pytestmark = pytest.mark.timeout(10)

OLD = "the-secret-of-the-server-that-died"


def _sent(broker: Broker) -> tuple[list[tuple[bytes, Any]], list[tuple[bytes, Any]]]:
    """What the broker sends from now on: to clients, and to workers (each decoded)."""
    clients: list[tuple[bytes, Any]] = []
    workers: list[tuple[bytes, Any]] = []

    def to_client(client: bytes, frames: list[bytes]) -> bool:
        clients.append((client, wire.decode(frames)))
        return True

    def to_worker(identity: bytes, frames: list[bytes]) -> bool:
        workers.append((identity, wire.decode(frames[:3] if len(frames) > 3 else frames)))
        return True

    broker.answers.to_client = to_client  # type: ignore[method-assign]
    broker.outbox.send = to_worker  # type: ignore[method-assign]
    return clients, workers


def _live(rid: str, ticket: str, text: str, tenant: str = "") -> wire.Live:
    request = wire.Request(rid, "Once upon a time", stream=True, tenant=tenant)
    return wire.Live(wire.Assign(ticket, request, 0.0, 1, report_tokens=True), text, wire.token_frame([5, 6, 7]))


def test_only_an_expected_adoptee_may_show_the_dead_servers_secret(broker: Broker) -> None:
    broker.expect([1], (OLD,), wait=30)
    clients, workers = _sent(broker)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD), None)  # not among the survivors
    assert b"w0" not in broker.tables.workers and broker.tables.stats["refused_worker_ready"] == 1
    broker.registry.register(b"w1", wire.Ready("w1", "m", -1, 2, 101, proof=OLD), None)
    assert broker.tables.workers[b"w1"].index == 1
    this_start = wire.Ready("w0", "m", -1, 2, 102, proof=broker.link_secret)  # this start's own
    broker.registry.register(b"w0", this_start, None)
    assert broker.tables.workers[b"w0"].index == 0


def test_a_reattached_request_gets_its_whole_text_then_resumes_where_its_sequence_is_parked(broker: Broker) -> None:
    broker.expect([0], (OLD,), wait=30)
    clients, workers = _sent(broker)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD,
                                               live=(_live("r1", "T1", "Hello, wor"),)), None)
    assert broker.tables.stats["adopted_requests"] == 1 and broker.tables.workers[b"w0"].parked == {"T1"}
    assert "T1" not in broker.tables.requests  # until its client comes back
    broker.clients.admit(b"client", wire.Request("r1", "Once upon a time", stream=True, reattach=True))
    broker.flush()
    assert clients == [(b"client", wire.Chunk("r1", "Hello, wor"))]
    assert workers[0] == (b"w0", wire.Heartbeat("w0", pid=os.getpid()))  # adopted: told at once, with the pid
    [(to, assigns)] = workers[1:]
    assert to == b"w0" and [a.ticket for a in getattr(assigns, "assigns", (assigns,))] == ["T1"]
    p = broker.tables.requests["T1"]
    assert p.client == b"client" and bytes(p.generated) == wire.token_frame([5, 6, 7]) and p.tokens_known
    assert broker.tables.stats["reattached"] == 1


def test_a_reattach_another_tenant_sends_finds_nothing_and_runs_anew(broker: Broker) -> None:
    broker.expect([0], (OLD,), wait=30)
    clients, workers = _sent(broker)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD,
                                               live=(_live("r1", "T1", "secret text", tenant="key:aaaa"),)), None)
    broker.clients.admit(b"other", wire.Request("r1", "Once upon a time", stream=True, reattach=True),
                         tenant="key:bbbb")
    assert not any(isinstance(m, wire.Chunk) for _, m in clients)
    assert broker.tables.stats["reattached"] == 0 and broker.tables.stats["accepted"] == 1  # a request of its own
    assert "T1" not in broker.tables.requests


def test_a_reattach_before_its_adoptee_registered_waits_for_it(broker: Broker) -> None:
    broker.expect([0], (OLD,), wait=30)
    clients, workers = _sent(broker)
    broker.clients.admit(b"client", wire.Request("r1", "Once upon a time", stream=True, reattach=True))
    assert broker.tables.stats["accepted"] == 0 and broker.tables.stats["reattached"] == 0  # held
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD, live=(_live("r1", "T1", "Hi"),)), None)
    assert broker.tables.stats["reattached"] == 1 and clients == [(b"client", wire.Chunk("r1", "Hi"))]


def test_a_held_reattach_runs_anew_once_the_adoptees_are_no_longer_expected(broker: Broker) -> None:
    broker.expect([0], (OLD,), wait=30)
    _sent(broker)
    broker.clients.admit(b"client", wire.Request("r1", "Once upon a time", stream=True, reattach=True))
    broker.adoptee_lost(0)  # killed for not registering in time
    assert broker.tables.stats["accepted"] == 1 and broker.tables.stats["reattached"] == 0


def test_an_adopted_request_no_client_comes_back_for_is_forgotten_on_its_instance(broker: Broker) -> None:
    broker.expect([0], (OLD,), wait=30)
    clients, workers = _sent(broker)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD, live=(_live("r1", "T1", "Hi"),)), None)
    broker.expire_adoptions(time.monotonic() + adoption.HOLD_S + 1)
    assert (b"w0", wire.Cancel("T1")) in workers and not broker.tables.workers[b"w0"].parked
    assert broker.tables.stats["adopted_unclaimed"] == 1


def test_three_sockets_of_one_client_held_for_the_adoptee_leave_it_to_the_newest_and_nothing_runs_anew(
        broker: Broker) -> None:
    """A client that hears nothing reattaches on a new socket each half second, so several of its sockets may claim a
    request while the adoptee is still expected. Released, the first takes it up; the two later claims wait for the
    socket that has it to be found gone. The second takes it from the first; the third's claim came after the
    second's, and the second was not heard from since (taking a request up is not hearing from it): it waits again,
    then takes the request up. Nothing runs anew."""
    broker.expect([0], (OLD,), wait=30)
    clients, workers = _sent(broker)
    request = wire.Request("r1", "Once upon a time", stream=True, reattach=True)
    for socket in (b"first", b"second", b"third"):
        broker.clients.admit(socket, request)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD, live=(_live("r1", "T1", "Hi"),)), None)
    stats = broker.tables.stats
    assert (stats["reattached"], stats["accepted"], len(broker.clients.contested)) == (1, 0, 2)
    gone: set[bytes] = set()
    send = broker.answers.to_client
    broker.answers.to_client = lambda client, frames: client not in gone and send(client, frames)  # type: ignore
    for later, (socket, owner) in enumerate(((b"first", b"second"), (b"second", b"third")), start=1):
        gone.add(socket)  # ZeroMQ saw it close
        broker.clients.retry_contested(time.monotonic() + later)
        assert broker.tables.requests["T1"].client == owner and stats["accepted"] == 0
    assert not broker.clients.contested and stats["rebound"] == 2


def test_a_claim_held_for_the_adoptee_past_the_client_timeout_gives_its_client_the_timeout_from_its_release(
        broker: Broker) -> None:
    """A reattach held while the adoptees are expected: its client's pings meanwhile count for no request, so once
    released the client's silence counts from then, not from its claim."""
    broker.expect([0], (OLD,), wait=30)
    clients, _ = _sent(broker)
    claimed = time.monotonic() - 2 * broker.clients.client_timeout
    broker.clients.admit(b"client", wire.Request("r1", "Once upon a time", stream=True, reattach=True), since=claimed)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD, live=(_live("r1", "T1", "Hi"),)), None)
    broker.clients.expire(time.monotonic() + broker.clients.client_timeout / 2)
    assert broker.tables.stats["client_expired"] == 0 and broker.tables.requests["T1"].client == b"client"


def _answered(rid: str, ticket: str) -> wire.Live:
    live = _live(rid, ticket, "The end.")
    return wire.Live(live.assign, live.text, live.generated, answered=True)


def test_an_answer_sent_as_the_server_died_is_held_if_its_journal_has_it_live_and_asked_for_it_answers_at_once(
        broker: Broker) -> None:
    """The dead server's journal had r1 live (its DONE unread) and not r2 (its client got it): r1's answer waits for its
    client, r2's is forgotten on its instance. r1 reattached goes to its instance, which answers it again."""
    row = Pending("J1", b"", wire.Request("r1", "Once upon a time", stream=True), "m", time.monotonic(), None)
    broker.adopter.journaled([(row, "The e")], found=True)
    broker.expect([0], (OLD,), wait=30)
    clients, workers = _sent(broker)
    live = (_live("r0", "T0", "Once"), _answered("r1", "T1"), _answered("r2", "T2"))
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD, live=live), None)
    stats = broker.tables.stats
    assert (stats["adopted_requests"], stats["adopted_answers"]) == (1, 1) and broker.tables.workers[b"w0"].parked == {
        "T0", "T1"}
    assert (b"w0", wire.Cancel("T2")) in workers and (b"w0", wire.Cancel("J1")) not in workers
    broker.clients.admit(b"client", wire.Request("r1", "Once upon a time", stream=True, reattach=True))
    broker.flush()
    assert clients == [(b"client", wire.Chunk("r1", "The end."))]  # the whole text, not the journal's
    [(to, assign)] = [(to, m) for to, m in workers if isinstance(m, wire.Assign)]
    assert to == b"w0" and assign.ticket == "T1"


def test_the_choices_of_one_request_answered_on_two_instances_as_the_server_died_are_both_held(broker: Broker) -> None:
    """The first adoptee's answer takes the journal's rows of the request out; the second's is held all the same."""
    row = Pending("J1", b"", wire.Request("r1", "Once upon a time", stream=True), "m", time.monotonic(), None)
    broker.adopter.journaled([(row, "")], found=True)
    broker.expect([0, 1], (OLD,), wait=30)
    _, workers = _sent(broker)
    for index in (0, 1):
        live = _answered("r1", f"T{index}")
        live = wire.Live(wire.Assign(live.assign.ticket, live.assign.request, 0.0, 1, report_tokens=True, index=index),
                         live.text, live.generated, answered=True)
        broker.registry.register(f"w{index}".encode(), wire.Ready(f"w{index}", "m", -1, 2, 100 + index, proof=OLD,
                                                                  live=(live,)), None)
    assert broker.tables.stats["adopted_answers"] == 2
    assert not any(isinstance(m, wire.Cancel) for _, m in workers)


def test_without_a_journal_of_the_server_before_every_answer_sent_as_it_died_is_held(broker: Broker) -> None:
    broker.adopter.journaled([], found=False)
    broker.expect([0], (OLD,), wait=30)
    _, workers = _sent(broker)
    broker.registry.register(b"w0", wire.Ready("w0", "m", -1, 2, 100, proof=OLD, live=(_answered("r2", "T2"),)), None)
    assert broker.tables.stats["adopted_answers"] == 1 and not any(isinstance(m, wire.Cancel) for _, m in workers)


def test_text_that_comes_again_after_a_reattach_is_dropped_and_the_rest_delivered() -> None:
    track = Track(wire.Request("r1", "p", stream=True), "start-1")
    assert track.fresh(0, "Hello") == "Hello"
    assert track.fresh(0, ", wor") == ", wor"
    track.reattached()
    assert track.fresh(0, "Hel") == ""  # the whole text so far, in pieces
    assert track.fresh(0, "lo, world") == "ld"
    assert track.fresh(0, "!") == "!"


def test_text_that_differs_after_a_reattach_ends_the_stream() -> None:
    track = Track(wire.Request("r1", "p", stream=True), "start-1")
    track.fresh(0, "Hello")
    track.reattached()
    with pytest.raises(ConnectionFailed, match="differs"):
        track.fresh(0, "Help")


def test_a_secret_file_that_is_a_link_adopts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSERVE_RUNTIME_DIR", str(tmp_path))
    from mpserve.runtime import ServerPaths
    paths = ServerPaths.for_name("linked")
    planted = tmp_path / "planted.json"
    planted.write_text(f'["{OLD}"]')
    os.symlink(planted, adoption.secrets_path(paths))
    assert adoption.survey(paths, []) == adoption.Survivors()
    adoption.secrets_path(paths).unlink()
    adoption.write_secrets(paths, (OLD,))
    assert adoption._read_secrets(adoption.secrets_path(paths)) == (OLD,)
    assert adoption.secrets_path(paths).stat().st_mode & 0o777 == 0o600


@pytest.mark.timeout(30)
def test_an_instance_is_its_rows_however_late_it_wrote_them_and_a_process_that_began_after_them_is_not() -> None:
    """The survey's pid check (``adoption._ours_since``): an instance writes its row's start time once it runs,
    which on a loaded host, or after a spawned worker's imports, is seconds after its process began; a process that
    began after the row was written took the pid of the one that wrote it."""
    before = time.time()
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert adoption._ours_since(child.pid, time.time() + 3.0)  # its row written 3 s after it began
        assert not adoption._ours_since(child.pid, before - 3.0)  # a row written 3 s before it began: another's
    finally:
        child.kill()
        child.wait()
    assert not adoption._ours_since(child.pid, time.time())  # gone
