"""The zygote's and its spare's sockets serve the server alone (docs/security.md): a peer that cannot prove the
server's secret, and a peer of another user that can, are refused at each; the server's own start is adopted.

    test ──spawn──▶ zygote_main(tiny, pipe, Adoptable(z.sock, SECRET)) ──fork──▶ its spare, at z.spare.sock
    the zygote lives: at z.spare.sock  a wrong secret ─▶ refused    SECRET from another uid ─▶ refused
    the pipe closed (its server gone): at z.sock the same two refused, then SECRET from this user ─▶ "adopted"

"Refused" is what the peer sees: its proof rejected, or its connection closed, and never the zygote's "adopted"
message (after which it would take fork orders). The sockets are opened to everyone here (mode 0666, in a shared
folder) as a mistaken runtime folder would leave them: the uid check is then what stands.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from collections.abc import Iterator
from multiprocessing import AuthenticationError, connection
from pathlib import Path

import pytest
from helpers import OTHER_USER, as_other_user, shared_place, wait_for

from mpserve.worker.spec import Adoptable, EngineSpec
from mpserve.worker.zygote import CHALLENGE_TIMEOUT_S, zygote_main

SECRET = "the server's link secret"
REFUSED = "refused"


@pytest.fixture
def zygote(tiny_model_path: str) -> Iterator[tuple[Adoptable, connection.Connection, int]]:
    """A zygote of the tiny model and its spare, both listening; its server's end of the pipe and its pid."""
    with shared_place() as folder:
        adoptable = Adoptable(str(Path(folder) / "z.sock"), SECRET, wait=60.0)
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        engine = EngineSpec(tiny_model_path, n_ctx=256, threads=1, n_gpu_layers=0)
        proc = ctx.Process(target=zygote_main, args=(engine, "tiny", theirs, "warning", adoptable), daemon=True)
        proc.start()
        theirs.close()
        assert proc.pid is not None
        try:
            wait_for(lambda: os.path.exists(adoptable.spare_path), 60, "the zygote's spare listening")
            for path in (adoptable.path, adoptable.spare_path):
                os.chmod(path, 0o666)
            yield adoptable, ours, proc.pid
        finally:
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the zygote and its spare (its own session)
            proc.join(10)


def knock(path: str, secret: str) -> str:
    """What a peer that proves ``secret`` at ``path`` (as the server does, both ways) is told: the zygote's first
    message, or REFUSED."""
    client = connection.Client(path, family="AF_UNIX")
    try:
        with contextlib.suppress(AuthenticationError, EOFError, ConnectionError):
            connection.answer_challenge(client, secret.encode())
            connection.deliver_challenge(client, secret.encode())
        if not client.poll(CHALLENGE_TIMEOUT_S + 10):
            return "nothing: the connection was left open"
        return repr(client.recv())
    except (EOFError, ConnectionError):
        return REFUSED
    finally:
        client.close()


def refused_for_another_user(path: str, secret: str) -> str:
    """``knock`` from a child of this process that became another local user: "ok" when refused."""
    def knocked() -> None:
        told = knock(path, secret)
        if told != REFUSED:
            raise PermissionError(f"served: {told}")
    return as_other_user(knocked)


@pytest.mark.timeout(120)
def test_a_wrong_secret_and_another_user_are_refused_at_the_spare_s_and_the_zygote_s_socket(
        zygote: tuple[Adoptable, connection.Connection, int]) -> None:
    adoptable, pipe, pid = zygote
    told = knock(adoptable.spare_path, "a guess")
    assert told == REFUSED, f"the spare served a peer that did not prove the server's secret: {told}"
    told = refused_for_another_user(adoptable.spare_path, SECRET)
    assert told == "ok", f"the spare served a peer of another user (uid {OTHER_USER}): {told}"
    pipe.close()  # the server is gone: the zygote waits for its next start at its own socket
    told = knock(adoptable.path, "a guess")
    assert told == REFUSED, f"the zygote served a peer that did not prove the server's secret: {told}"
    told = refused_for_another_user(adoptable.path, SECRET)
    assert told == "ok", f"the zygote served a peer of another user (uid {OTHER_USER}): {told}"
    client = connection.Client(adoptable.path, family="AF_UNIX", authkey=SECRET.encode())  # the server's next start
    try:
        adopted = client.recv()
        assert adopted[:2] == ("adopted", pid)
        client.send(None)  # stop
    finally:
        client.close()
