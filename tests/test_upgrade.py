"""An upgrade to another mpserve version under load (``mpserve upgrade``): the new start adopts the old version's
instances (their worker link revision is the previous one, which it still takes) and rolls them onto its own code
one at a time, each handing its streams over (``mpserve.server.rolling``). No stream fails or changes; the model
is loaded once more (the old zygote's code is not the new one's), while the old instances serve.

The old version is this code with another version string and the previous link revision, copied to a folder that
is "installed" through PYTHONPATH (a link); the upgrade installs the new one by pointing the link at this
checkout, as an upgrade in place changes what the environment imports."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
from helpers import mpserve, wait_for
from test_adoption import ARGS, MAX_TOKENS, PROMPTS, _worker_pids, upgrade_under_streams

from mpserve import Client
from mpserve.runtime import ServerInfo
from mpserve.wire.messages import PREVIOUS_LINK, WORKER_LINK

REPO = Path(__file__).resolve().parent.parent
OLD_VERSION = "0.0.9+old"


def _old_version(folder: Path) -> Path:
    """This checkout's package as the previous version: another version string, the previous link revision."""
    shutil.copytree(REPO / "mpserve", folder / "mpserve", ignore=shutil.ignore_patterns("__pycache__"))
    for name, old, new in (("__init__.py", '__version__ = "', f'__version__ = "{OLD_VERSION}"  # '),
                           ("wire/messages.py", f'WORKER_LINK = "{WORKER_LINK}"', f'WORKER_LINK = "{PREVIOUS_LINK}"')):
        path = folder / "mpserve" / name
        text = path.read_text()
        assert old in text, (name, old)
        path.write_text(text.replace(old, new, 1))
    return folder


@pytest.mark.timeout(240)
def test_an_upgrade_to_another_version_rolls_the_adopted_instances_onto_it_with_no_stream_failed(
        start_server, tmp_path: Path) -> None:
    installed = tmp_path / "site-packages"
    installed.symlink_to(_old_version(tmp_path / "old"))
    # reuse: exact: the streams the roll hands over keep the uninterrupted text (with ``any`` the instance they go
    # to decodes their tokens in runs, and what follows may turn at a near-tie)
    server = start_server(*ARGS, "--reuse", "exact", env={"PYTHONPATH": str(installed), "PYTHONSAFEPATH": "1"}
                          ).wait_ready()
    assert server.info.version == OLD_VERSION
    with Client(server.address) as client:
        whole = [client.generate(p, max_tokens=MAX_TOKENS, temperature=0).text for p in PROMPTS]
    old_pids = _worker_pids(server)

    def install_the_new_version() -> None:  # in place: the environment imports this checkout from now on
        installed.unlink()
        installed.symlink_to(REPO)

    upgraded, _ = upgrade_under_streams(server, whole, install_the_new_version)
    assert f"(was {OLD_VERSION})" in upgraded.stdout, upgraded.stdout

    wait_for(lambda: any("roll of tiny done" in line for line in server.log), 60, "the roll onto the new version")
    new_pids = _worker_pids(server)
    assert len(new_pids) == 2 and not set(new_pids) & set(old_pids), (old_pids, new_pids)
    log = "\n".join(server.log)
    assert "instances of another mpserve version" in log and f"{OLD_VERSION} {PREVIOUS_LINK}" in log, log
    assert sum("instances are forked from here" in line for line in server.log) == 2, log  # once more, no more
    steps = [line for line in server.log if "roll of tiny:" in line]
    assert sum("starting worker" in line for line in steps) == 2, log  # one at a time, each its own step
    assert not server.tracebacks(), log


@pytest.mark.timeout(90)
def test_an_upgrade_that_does_not_come_back_in_time_says_how_far_it_got(start_server) -> None:
    """``mpserve upgrade --wait`` of a server that cannot act on the signal yet (stopped): it fails naming the
    stage it saw, not only the time; the signal waits, and the server upgrades once it runs again."""
    server = start_server("--instances", "1").wait_ready()
    before = server.info
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        late = mpserve("upgrade", "--server-name", server.name, "--wait", "1")
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert late.returncode != 0, late.stdout
    assert "did not come back within 1 s after the hand-off: the server had not ended its old start" in late.stderr
    wait_for(lambda: (info := ServerInfo.read(server.name)) is not None and info.started != before.started, 60,
             "the upgrade, once the server runs again")
