"""Per-GPU permits: host-wide, crash-safe, capacity-bounded, fair, and visible from other processes.

Contenders are real processes (``python -c`` children) that share only the lock directory, as two
separate servers on one host would. Exclusivity is proved from hold intervals each child appends
to a shared log with ``HoldLog``.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import as_other_user, shared_place, wait_for

from mpserve.errors import ConfigError, Timeout
from mpserve.gpu.permits import (
    DevicePermits,
    HoldInterval,
    PermitHolder,
    default_lock_dir,
    inspect,
    max_concurrent,
    read_holds,
)

REPO = Path(__file__).resolve().parents[1]
KEY = "GPU-test"

CHILD = """
import os, sys, time
from pathlib import Path
from mpserve.gpu.permits import DevicePermits, HoldLog


mode, lock_dir, capacity, log, *rest = sys.argv[1:]
permits = DevicePermits("GPU-test", int(capacity), Path(lock_dir), on_hold=HoldLog(Path(log)))
if mode == "hold":  # take a permit and keep it until killed
    permits.acquire()
    print("held", flush=True)
elif mode == "hold-and-fork":  # the same, with a forked child that outlives us
    permits.acquire()
    child = os.fork()
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print("held", child, flush=True)
elif mode == "once":  # wait for a permit, keep it briefly, exit
    print("waiting", flush=True)
    with permits.acquire(timeout=30):
        time.sleep(float(rest[0]))
    sys.exit(0)
elif mode == "cycle":  # on "go", take and release a permit again and again
    rounds, hold = int(rest[0]), float(rest[1])
    print("ready", flush=True)
    sys.stdin.readline()
    for _ in range(rounds):
        with permits.acquire(timeout=30):
            time.sleep(hold)
    sys.exit(0)
time.sleep(600)
"""


class Child:
    """One contender process; its first stdout line says it is ready."""

    def __init__(self, mode: str, lock_dir: Path, capacity: int, log: Path, *args: object) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, mode, str(lock_dir), str(capacity), str(log), *map(str, args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.proc.pid

    def expect(self, word: str) -> list[str]:
        assert self.proc.stdout is not None
        first, *rest = self.proc.stdout.readline().split()
        assert first == word
        return rest

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def finish(self) -> int:
        return self.proc.wait(timeout=30)


@pytest.fixture
def lock_dir(tmp_path: Path) -> Path:
    path = tmp_path / "locks"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def log(tmp_path: Path) -> Path:
    return tmp_path / "holds.log"


@pytest.fixture
def permits(lock_dir: Path) -> Iterator[DevicePermits]:
    with DevicePermits(KEY, 1, lock_dir) as opened:
        yield opened


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


def run_cycles(children: list[Child], lock_dir: Path, log: Path, capacity: int, hold: float) -> None:
    children.extend(Child("cycle", lock_dir, capacity, log, 25, hold) for _ in range(4))
    for child in children:
        child.expect("ready")
    for child in children:
        child.go()
    assert [child.finish() for child in children] == [0, 0, 0, 0]


@pytest.mark.timeout(30)
def test_exclusive_permit_holders_never_overlap_across_processes(
    lock_dir: Path, log: Path, children: list[Child]
) -> None:
    run_cycles(children, lock_dir, log, capacity=1, hold=0.002)
    holds = read_holds(log)
    assert len(holds) == 100
    assert {hold.pid for hold in holds} == {child.pid for child in children}
    assert max_concurrent(holds) == 1


@pytest.mark.timeout(30)
def test_capacity_two_admits_two_of_four_contenders_and_never_more(
    lock_dir: Path, log: Path, children: list[Child]
) -> None:
    run_cycles(children, lock_dir, log, capacity=2, hold=0.005)
    holds = read_holds(log)
    assert len(holds) == 100
    assert {hold.slot for hold in holds} == {0, 1}
    assert max_concurrent(holds) == 2


@pytest.mark.timeout(60)
def test_sigkilled_holder_hands_its_permit_to_the_next_waiter_within_a_second_20_times(
    permits: DevicePermits, lock_dir: Path, log: Path
) -> None:
    for _ in range(20):
        holder = Child("hold", lock_dir, 1, log)
        try:
            holder.expect("held")
            got: list[float] = []
            waiter = threading.Thread(target=note_when_acquired, args=(permits, got))
            waiter.start()
            wait_for(lambda: len(permits.waiters()) == 1)
            killed_at = time.monotonic()
            holder.kill()
            waiter.join(timeout=5)
            assert got and got[0] - killed_at < 1.0
        finally:
            holder.kill()
    assert not log.exists()  # the killed holders never released anything


def note_when_acquired(permits: DevicePermits, times: list[float]) -> None:
    with permits.acquire(timeout=5):
        times.append(time.monotonic())


@pytest.mark.timeout(30)
def test_sigkilled_waiter_does_not_hold_up_the_waiters_behind_it(
    permits: DevicePermits, lock_dir: Path, log: Path, children: list[Child]
) -> None:
    held = permits.acquire()
    first = Child("once", lock_dir, 1, log, 0)
    children.append(first)
    first.expect("waiting")
    wait_for(lambda: len(permits.waiters()) == 1)
    second = Child("once", lock_dir, 1, log, 0)
    children.append(second)
    second.expect("waiting")
    wait_for(lambda: len(permits.waiters()) == 2)
    first.kill()
    held.release()
    assert second.finish() == 0
    assert [hold.pid for hold in read_holds(log)] == [second.pid]


@pytest.mark.timeout(30)
def test_waiters_are_served_in_arrival_order(
    permits: DevicePermits, lock_dir: Path, log: Path, children: list[Child]
) -> None:
    held = permits.acquire()
    for _ in range(5):
        child = Child("once", lock_dir, 1, log, 0.01)
        children.append(child)
        child.expect("waiting")
        wait_for(lambda: len(permits.waiters()) == len(children))
    assert [waiter.pid for waiter in permits.waiters()] == [child.pid for child in children]
    held.release()
    assert [child.finish() for child in children] == [0] * 5
    holds = sorted(read_holds(log), key=lambda hold: hold.start)
    assert [hold.pid for hold in holds] == [child.pid for child in children]


@pytest.mark.timeout(30)
def test_holders_and_waiters_are_visible_from_another_process(
    permits: DevicePermits, lock_dir: Path, log: Path, children: list[Child]
) -> None:
    holder = Child("hold", lock_dir, 1, log)
    children.append(holder)
    holder.expect("held")
    [seen] = permits.holders()
    assert (seen.slot, seen.pid) == (0, holder.pid)
    assert abs(seen.since - time.time()) < 60
    waiter = Child("once", lock_dir, 1, log, 30)
    children.append(waiter)
    waiter.expect("waiting")
    wait_for(lambda: [w.pid for w in permits.waiters()] == [waiter.pid])
    holder.kill()
    wait_for(lambda: [(h.slot, h.pid) for h in permits.holders()] == [(0, waiter.pid)])
    assert permits.waiters() == []
    waiter.kill()
    assert permits.holders() == []


@pytest.mark.timeout(30)
def test_acquire_raises_timeout_and_leaves_the_queue(
    permits: DevicePermits, lock_dir: Path, log: Path, children: list[Child]
) -> None:
    holder = Child("hold", lock_dir, 1, log)
    children.append(holder)
    holder.expect("held")
    for timeout in (0, 0.2):
        with pytest.raises(Timeout) as caught:
            permits.acquire(timeout=timeout)
        assert caught.value.code == "timeout"
        assert "1 of 1 held, 0 waiting" in caught.value.message
    assert permits.waiters() == []
    holder.kill()
    permits.acquire(timeout=1).release()


@pytest.mark.timeout(30)
def test_sigkilled_holder_releases_even_when_a_forked_child_outlives_it(
    permits: DevicePermits, lock_dir: Path, log: Path
) -> None:
    holder = Child("hold-and-fork", lock_dir, 1, log)
    try:
        [grandchild] = holder.expect("held")
        holder.kill()
        permits.acquire(timeout=1).release()
    finally:
        holder.kill()
        os.kill(int(grandchild), signal.SIGKILL)


@pytest.mark.timeout(30)
def test_threads_of_one_process_exclude_each_other(lock_dir: Path) -> None:
    holds: list[HoldInterval] = []
    with DevicePermits(KEY, 1, lock_dir, on_hold=holds.append) as shared:

        def contend() -> None:
            for _ in range(50):
                with shared.acquire(timeout=10):
                    time.sleep(0.0002)  # not a wait: the permit held a while

        threads = [threading.Thread(target=contend) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(holds) == 200
    assert max_concurrent(holds) == 1


@pytest.mark.timeout(10)
def test_servers_must_agree_on_a_devices_capacity(lock_dir: Path) -> None:
    with DevicePermits(KEY, 1, lock_dir):
        for other in (2, None):
            with pytest.raises(ConfigError, match="capacity 1.*asks for"):
                DevicePermits(KEY, other, lock_dir)
        with DevicePermits(KEY, 1, lock_dir) as same:
            assert same.holders() == []
    with DevicePermits(KEY, 2, lock_dir) as changed:  # nobody else uses it now: the capacity may change
        with changed.acquire(), changed.acquire():
            assert [holder.slot for holder in changed.holders()] == [0, 1]


@pytest.mark.timeout(10)
def test_unlimited_capacity_never_waits_and_lists_no_holders(lock_dir: Path) -> None:
    holds: list[HoldInterval] = []
    with DevicePermits(KEY, None, lock_dir, on_hold=holds.append) as unlimited:
        first, second = unlimited.acquire(timeout=0), unlimited.acquire(timeout=0)
        assert unlimited.holders() == [] and unlimited.waiters() == []
        first.release()
        second.release()
        second.release()
    assert [hold.slot for hold in holds] == [None, None]


@pytest.mark.timeout(10)
def test_release_is_idempotent_and_close_releases_what_is_held(lock_dir: Path) -> None:
    with DevicePermits(KEY, 1, lock_dir) as observer:
        owner = DevicePermits(KEY, 1, lock_dir)
        permit = owner.acquire()
        assert observer.holders() == [PermitHolder(0, os.getpid(), observer.holders()[0].since)]
        permit.release()
        permit.release()
        assert observer.holders() == []
        owner.acquire()
        owner.close()
        assert observer.holders() == []
        observer.acquire(timeout=0).release()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key", ["", "../etc", "a b", "-x"])
def test_unsafe_device_keys_are_refused(lock_dir: Path, key: str) -> None:
    with pytest.raises(ConfigError, match="device key"):
        DevicePermits(key, 1, lock_dir)


@pytest.mark.timeout(10)
def test_the_default_lock_folder_and_its_files_are_private_to_their_user(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSERVE_LOCK_DIR", str(tmp_path / "mine"))
    path = default_lock_dir()
    assert path == tmp_path / "mine" and stat.S_IMODE(path.stat().st_mode) == 0o700
    with DevicePermits(KEY, 1):
        lock_file = path / f"{KEY}.lock"
        assert stat.S_IMODE(lock_file.stat().st_mode) == 0o600
        tmp_path.chmod(0o755)  # even with its folder opened to them, another user cannot open it to lock a byte
        (tmp_path / "mine").chmod(0o711)
        assert as_other_user(lambda: os.open(lock_file, os.O_RDONLY)).startswith("PermissionError")


@pytest.mark.timeout(10)
def test_a_lock_folder_another_user_made_is_refused_and_its_planted_link_is_never_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    with shared_place() as shared:
        locks = shared / "locks"

        def plant() -> None:  # the other user makes the folder first (/dev/shm is emptied at boot) and a link
            locks.mkdir(mode=0o777)
            locks.chmod(0o1777)
            (locks / f"{KEY}.lock").symlink_to(victim)

        assert as_other_user(plant) == "ok"
        with pytest.raises(ConfigError, match=f"the permit lock folder {locks} belongs to user 65534.*remove it"):
            DevicePermits(KEY, 1, locks)
        monkeypatch.setenv("MPSERVE_LOCK_DIR", str(locks))
        with pytest.raises(ConfigError, match="belongs to user 65534"):
            default_lock_dir()
    assert victim.read_text() == "precious"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", [0o755, 0o1777])
def test_a_lock_folder_open_to_others_is_refused_with_the_fix(lock_dir: Path, mode: int) -> None:
    lock_dir.chmod(mode)
    with pytest.raises(ConfigError, match=f"open to other users .*chmod 700 {lock_dir}"):
        DevicePermits(KEY, 1, lock_dir)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("planted", ["link", "short file", "long file", "foreign header", "fifo"])
def test_a_lock_file_that_is_not_ours_is_refused_and_left_as_it_is(lock_dir: Path, tmp_path: Path,
                                                                      planted: str) -> None:
    victim, path = tmp_path / "victim", lock_dir / f"{KEY}.lock"
    victim.write_bytes(b"precious" * 1000)
    if planted == "link":
        path.symlink_to(victim)
    elif planted == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.write_bytes({"short file": b"precious", "long file": b"precious" * 1000,
                          "foreign header": b"x" * 4096}[planted])
        os.chmod(path, 0o600)
    before = path.read_bytes() if path.is_file() else b""
    with pytest.raises(ConfigError, match=f"{path}.*remove it"):
        DevicePermits(KEY, 1, lock_dir)
    assert victim.read_bytes() == b"precious" * 1000
    if before:
        assert path.read_bytes() == before  # never truncated nor reset
    assert inspect(KEY, lock_dir) is None
