"""Mid-stream hand-over: a streamed request whose instance dies (SIGKILL, once or twice) or stops (SIGSTOP,
past the stall timeout) continues on another instance from the tokens it had streamed; the client sees one
stream, nothing repeated or missing, and greedy text equal to an uninterrupted run, token for token. A stream
whose client dies is taken up by another client where it is, nothing computed again."""

from __future__ import annotations

import contextlib
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import caught_mid_request, dealer, received, server_idle, wait_for

from mpserve import Client
from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotRow

PROMPT = "Once upon a time"
MAX_TOKENS = 400
SCENES = 5  # runs of a scene whose request ended before it was interrupted as it should be, at most
STALL_TIMEOUT_S = 2.0


EXACT = ("--reuse", "exact")  # a stream handed over keeps the text of the uninterrupted run (with ``any`` the
# carried tokens are decoded in runs, and what follows may turn at a near-tie)


def _handed_over(server, client: Client, interrupt: int, times: int = 1, exact: bool = True) -> None:
    """The same greedy request uninterrupted, then streamed while ``interrupt`` hits its instance, ``times``
    times (each time the instance it went on on). ``exact``: the server runs with ``reuse: exact``, and the text is
    the uninterrupted run's; else it goes on from where it was cut."""
    whole = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, timeout=120)
    with Client(server.address) as observer:
        for _ in range(SCENES):  # again where the request ended before each interrupt hit it mid-run
            before = observer.stats().counters
            stream = client.stream(PROMPT, max_tokens=MAX_TOKENS, temperature=0, timeout=120)
            chunks = iter(stream)
            texts = [next(chunks)]
            if (row := _interrupted(server, observer, interrupt, times)) is not None:
                break
            list(chunks)
        else:
            pytest.fail(f"in each of {SCENES} runs the request ended before it was interrupted {times} time(s)")
    try:
        texts += list(chunks)
    finally:
        if interrupt == signal.SIGSTOP:
            with contextlib.suppress(ProcessLookupError):  # reaped already, if the supervisor killed it
                os.kill(row.pid, signal.SIGKILL)  # the supervisor's SIGTERM would wait for a SIGCONT
    result = stream.result
    assert result is not None
    assert "".join(texts) == result.text  # one stream, nothing repeated or missing
    if exact:
        assert result.text == whole.text
        assert (result.finish_reason, result.usage) == (whole.finish_reason, whole.usage)
    else:
        assert result.text[:len(texts[0])] == whole.text[:len(texts[0])] == texts[0]
        assert result.usage.prompt_tokens == whole.usage.prompt_tokens
    assert result.timings.attempts == times + 1
    assert times > 1 or result.worker != f"w{row.worker}"  # after two, it may end on the first one's replacement
    counters = client.stats().counters
    assert counters.get("resumed", 0) - before.get("resumed", 0) == times and not counters.get("poison_request"), \
        counters


def _interrupted(server, observer: Client, interrupt: int, times: int) -> SlotRow | None:
    """``interrupt`` sent ``times`` times to the instance running the one request, each time caught running it
    (``caught_mid_request``: stopped, its row busy), so that it cannot end the request first: the last one's row.
    None where the request ended before (it runs again elsewhere between two hits, and may end there)."""
    hit: list[int] = []
    row = None
    for _ in range(times):
        row = caught_mid_request(lambda: [r for r in server.slots() if r.pid not in hit], None,
                                 lambda: server_idle(observer))
        if row is None:
            return None
        os.kill(row.pid, interrupt)  # SIGKILL or SIGSTOP: either way it takes no step again
        hit.append(row.pid)
    return row


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reuse", ["any", "exact"])
def test_a_stream_whose_instance_is_killed_continues_on_another(start_server, reuse: str) -> None:
    server = start_server("--instances", "2", "--reuse", reuse).wait_ready()
    with Client(server.address) as client:
        _handed_over(server, client, signal.SIGKILL, exact=reuse == "exact")
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_a_stream_killed_from_outside_twice_is_handed_over_twice_not_failed_as_poison(start_server) -> None:
    """SIGKILL is no crash of the request (it did not cause it): after two kills it goes on, where two crashes
    (SIGSEGV) would end it as ``poison_request``."""
    server = start_server("--instances", "2", *EXACT).wait_ready()
    with Client(server.address) as client:
        _handed_over(server, client, signal.SIGKILL, times=2)
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_a_stream_whose_instance_stops_continues_on_another_after_the_stall_timeout(start_server) -> None:
    server = start_server("--instances", "2", "--stall-timeout", str(STALL_TIMEOUT_S), *EXACT).wait_ready()
    with Client(server.address) as client:
        _handed_over(server, client, signal.SIGSTOP)
    assert not server.tracebacks(), "\n".join(server.log)
    # the stalled instance is replaced, not scaled: nothing drains, and no scale-up is tried (nor said skipped)
    assert not [line for line in server.log if "scale-up of" in line], "\n".join(server.log)


@pytest.mark.timeout(120)
def test_the_choices_of_a_request_whose_instance_is_killed_continue_on_another_each_on_its_own(start_server) -> None:
    server = start_server("--instances", "2", "--parallel", "2", *EXACT).wait_ready()
    with Client(server.address) as client:
        whole = client.choices(PROMPT, n=2, max_tokens=MAX_TOKENS, temperature=0, timeout=120)
        with Client(server.address) as observer:
            for _ in range(SCENES):  # again where the request ended before its instance was caught running it
                before = observer.stats().counters
                stream = client.stream(PROMPT, n=2, max_tokens=MAX_TOKENS, temperature=0, timeout=120)
                texts, killed = ["", ""], None
                for text in stream:
                    texts[stream.chunk_index] += text
                    if killed is None and sum(map(len, texts)) > 40:
                        killed = _interrupted(server, observer, signal.SIGKILL, 1)
                        if killed is None:
                            break  # it had ended
                if killed is not None:
                    break
            else:
                pytest.fail(f"in each of {SCENES} runs the request ended before its instance was caught running it")
        assert texts == [r.text for r in stream.results] == [r.text for r in whole]  # nothing repeated or missing
        assert [r.index for r in stream.results] == [0, 1]
        assert all(r.timings.attempts == 2 and r.worker != f"w{killed.worker}" for r in stream.results)
        counters = client.stats().counters
        assert sum(counters.get(k, 0) - before.get(k, 0) for k in ("resumed", "retried")) == 2, counters
        assert not counters.get("worker_lost")
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_a_stream_killed_after_several_chunks_continues_from_all_of_their_tokens(start_server) -> None:
    """The hand-over carries every token the killed instance streamed, not only its last chunk's: the kill comes
    once the client has read CHUNKS chunks, and the text is still the uninterrupted greedy text."""
    chunks_read, max_tokens = 12, 1500  # ignore_eos: all of it
    server = start_server("--instances", "2", *EXACT).wait_ready()
    with Client(server.address) as client:
        whole = client.generate(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=120)
        with Client(server.address) as observer:
            for _ in range(SCENES):  # again where the request ended before its instance was caught running it
                stream = client.stream(PROMPT, max_tokens=max_tokens, temperature=0, ignore_eos=True, timeout=120)
                chunks = iter(stream)
                texts = [next(chunks) for _ in range(chunks_read)]
                if _interrupted(server, observer, signal.SIGKILL, 1) is not None:
                    break
                list(chunks)
            else:
                pytest.fail(f"in each of {SCENES} runs the request ended before its instance was caught running it")
        texts += list(chunks)
        result = stream.result
        assert result is not None and result.timings.attempts == 2, "the stream was not handed over"
        assert "".join(texts) == whole.text, (f"the hand-over after {chunks_read} chunks did not go on from all "
                                              "their tokens: the text streamed differs from the uninterrupted one")
        assert result.text == whole.text and result.usage == whole.usage
        assert client.stats().counters.get("resumed") == 1
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_a_stream_whose_client_dies_is_taken_up_by_another_client_where_it_is(start_server) -> None:
    """What a gateway process does with the stream of one that died: it sends the request again, marked reattach,
    with the text the dead one had delivered. The broker, which kept the stream's text, sends it that text and the
    rest as it comes: the request is not accepted anew, and the text is the uninterrupted run's."""
    server = start_server("--instances", "1").wait_ready()
    sampling = {"max_tokens": 1900, "temperature": 0.0, "ignore_eos": True}
    with Client(server.address) as client:
        whole = client.generate(PROMPT, timeout=120, **sampling)
        with dealer(server.address) as doomed:
            doomed.send_multipart(wire.encode(wire.Request("taken-1", PROMPT, None, wire.GenerateParams(**sampling),
                                                           stream=True)))
            had = ""
            while len(had) < 20:
                message = received(doomed, 30)
                had += "".join(c.text for c in (message.chunks if isinstance(message, wire.Chunks) else [message]))
        wait_for(lambda: client.stats().counters.get("client_gone"), 30, "the broker to find the client gone")
        accepted = client.stats().counters["accepted"]
        rest = "".join(client.stream(PROMPT, request_id="taken-1", delivered={0: had}, timeout=120, **sampling))
        counters = client.stats().counters
        assert had + rest == whole.text
        assert counters.get("rebound") == 1 and counters["accepted"] == accepted, counters
        for attempt in range(2):  # a client found gone that comes back under its routing id is answered again
            with dealer(server.address, identity=b"back") as sock:
                sock.send_multipart(wire.encode(wire.Request(f"back-{attempt}", PROMPT, None,
                                                             wire.GenerateParams(**sampling), stream=True)))
                received(sock, 30)
                if attempt:
                    while not isinstance(message := received(sock, 60), wire.Done):
                        assert isinstance(message, (wire.Chunk, wire.Chunks)), message
            wait_for(lambda: client.stats().counters.get("client_gone", 0) >= 2, 30, "the client found gone")
    assert not server.tracebacks(), "\n".join(server.log)


def _owner_has(sock, request_id: str, sampling: dict[str, float | bool]) -> str:
    """A stream ``request_id`` sent by the raw client ``sock``, read until it has 20 characters: what it had."""
    sock.send_multipart(wire.encode(wire.Request(request_id, PROMPT, None, wire.GenerateParams(**sampling),
                                                 stream=True)))
    had = ""
    while len(had) < 20:
        message = received(sock, 30)
        had += "".join(c.text for c in (message.chunks if isinstance(message, wire.Chunks) else [message]))
    return had


@pytest.mark.timeout(120)
def test_a_stream_whose_client_is_connected_but_silent_is_taken_up_once_its_silence_passes_the_bound(
        start_server) -> None:
    """A client the broker does not find gone (its connection open: a process whose death ZeroMQ has not seen yet,
    or one that hangs) holds a stream that another client claims: the claim waits, and once the holder has been
    silent past OWNER_SILENT_S (a live client pings every second), the stream is taken up where it is."""
    server = start_server("--instances", "1").wait_ready()
    sampling = {"max_tokens": 1900, "temperature": 0.0, "ignore_eos": True}
    with Client(server.address) as client, ThreadPoolExecutor(1) as pool:
        whole = client.generate(PROMPT, timeout=120, **sampling)
        with dealer(server.address) as silent:
            had = _owner_has(silent, "held-1", sampling)
            instance = next(row.pid for row in server.slots() if row.request == "held-1")
            os.kill(instance, signal.SIGSTOP)  # no more text for the holder, who reads no more
            try:
                accepted = client.stats().counters["accepted"]
                claimant = Client(server.address)
                rest = pool.submit(lambda: "".join(claimant.stream(PROMPT, request_id="held-1", delivered={0: had},
                                                                   timeout=120, **sampling)))
                counters = wait_for(lambda: (c := client.stats().counters).get("rebound") and c, 30,
                                    "the stream taken up from its silent holder")
            finally:
                os.kill(instance, signal.SIGCONT)
            assert had + rest.result() == whole.text
            claimant.close()
    assert counters["accepted"] == accepted, counters  # not computed again
    assert not server.tracebacks(), "\n".join(server.log)


@pytest.mark.timeout(120)
def test_a_stream_whose_client_still_pings_is_not_taken_from_it(start_server) -> None:
    """The same claim on a stream whose holder pings (alive): the claim runs anew, and the holder's stream goes on
    to its end."""
    server = start_server("--instances", "1", "--reuse", "exact").wait_ready()  # two streams at once, each exact
    sampling = {"max_tokens": 300, "temperature": 0.0, "ignore_eos": True}
    with Client(server.address) as client, dealer(server.address) as alive, ThreadPoolExecutor(1) as pool:
        whole = client.generate(PROMPT, timeout=120, **sampling)
        had = _owner_has(alive, "kept-1", sampling)

        def read_on_and_ping() -> str:
            text = had
            while True:
                alive.send_multipart(wire.encode(wire.Ping(1)))
                if not alive.poll(300):
                    continue
                message = wire.decode(alive.recv_multipart())
                if isinstance(message, wire.Done):
                    return text
                if isinstance(message, (wire.Chunk, wire.Chunks)):
                    text += "".join(c.text for c in (message.chunks if isinstance(message, wire.Chunks)
                                                     else [message]))

        holder = pool.submit(read_on_and_ping)
        accepted = client.stats().counters["accepted"]
        claimed = "".join(client.stream(PROMPT, request_id="kept-1", delivered={0: had}, timeout=120, **sampling))
        assert holder.result(timeout=60) == whole.text  # its stream, whole
        assert had + claimed == whole.text  # the claim ran anew: its first characters came again, dropped
        counters = client.stats().counters
    assert counters["accepted"] == accepted + 1 and not counters.get("rebound"), counters
    assert not server.tracebacks(), "\n".join(server.log)
