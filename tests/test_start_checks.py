"""`mpserve start` as a new user tries it: each address, port, folder and model file it cannot use ends the
command with exit status 1 and one line naming the problem and the fix, and leaves nothing behind (no slot
table, no info file, no socket, no process)."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from helpers import as_other_user, mpserve, shared_place

from mpserve.config import loader
from mpserve.errors import ConfigError
from mpserve.runtime import ServerPaths, runtime_dir
from mpserve.server.preflight import check_bind, check_start, claim


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def leftovers(name: str, session: int) -> list[str]:
    """What a server named ``name`` whose session was ``session`` left: its slot table, its files in the
    runtime directory, processes of its session or with its name on their command line."""
    found = [str(p) for p in [ServerPaths.for_name(name).slots] if p.exists()]
    found += [str(p) for p in runtime_dir(create=False).glob(f"{name}.*")]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[3]) == session or f" {name} " in f" {cmdline} ":
            found.append(f"process {proc.name}: {cmdline}")
    return found


def _bad_inputs(tmp: Path, busy: int) -> dict[str, tuple[list[str], str]]:
    """Case name: (the flags, the one line ``start`` must print)."""
    return {
        "bind busy": (["--bind", f"tcp://127.0.0.1:{busy}"], f"--bind tcp://127.0.0.1:{busy}: cannot bind: the "
                      "address is in use (another server or program listens there); stop it or give another port"),
        "bind no scheme": (["--bind", "127.0.0.1:5555"], "--bind 127.0.0.1:5555: not a ZeroMQ address; give "
                           "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555) or ipc:///PATH"),
        "bind no permission": (["--bind", "ipc:///sys/mpserve-test.sock"], "--bind ipc:///sys/mpserve-test.sock: "
                               "cannot bind: no permission to bind it"),
        "bind no folder": (["--bind", f"ipc://{tmp}/none/x.sock"], f"--bind ipc://{tmp}/none/x.sock: cannot bind: "
                           "its folder does not exist; create it or give another path"),
        "workers bind busy": (["--workers-bind", f"tcp://127.0.0.1:{busy}"],
                              f"--workers-bind tcp://127.0.0.1:{busy}: cannot bind: the address is in use"),
        "http busy": (["--http", f"127.0.0.1:{busy}"], f"--http 127.0.0.1:{busy}: cannot bind: the address is in "
                      "use"),
        "not a gguf": (["--model", "/etc/passwd"], "--model: '/etc/passwd' is not a GGUF model file (it "
                       "does not start with GGUF); give a .gguf file"),
        "a folder": (["--model", str(tmp)], f"--model: '{tmp}' is a folder, not a model file; give one of its "
                     "files: m.gguf"),
        "no lock dir": (["--lock-dir", str(tmp / "none")], f"--lock-dir {tmp / 'none'}: no such folder; give "
                        "--lock-dir a folder you can write"),
        "lock dir shared": (["--lock-dir", "/tmp"], "the permit lock folder /tmp "),  # others may enter it
    }


CASES = list(_bad_inputs(Path("/"), 1))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", CASES)
def test_a_bad_input_ends_start_with_one_line_and_leaves_nothing(case: str, tmp_path: Path, busy_port: int) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")  # for "a folder": the message names the model files in it
    args, line = _bad_inputs(tmp_path, busy_port)[case]
    name = f"ff{os.getpid()}-{CASES.index(case)}"
    proc = subprocess.Popen([sys.executable, "-m", "mpserve", "start", "--server-name", name, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: [config] {line}"), stderr
    assert stdout == ""
    assert leftovers(name, proc.pid) == []


@pytest.mark.timeout(60)
def test_a_runtime_directory_that_cannot_be_made_ends_start_with_one_line() -> None:
    proc = mpserve("start", env={"MPSERVE_RUNTIME_DIR": "/proc/self/mpserve"})
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "error: [config] cannot create the runtime directory /proc/self/mpserve (No such file or directory); set "
        "MPSERVE_RUNTIME_DIR to a folder you can write"]


@pytest.mark.timeout(60)
def test_a_store_folder_another_user_made_first_ends_start_with_one_line_naming_it_and_the_fix() -> None:
    with shared_place() as shared:
        store = shared / "mpserve-store-0"  # the name is predictable, and /dev/shm is emptied at boot
        assert as_other_user(lambda: store.mkdir(mode=0o777)) == "ok"
        proc = mpserve("start", "--server-name", f"fs{os.getpid()}", env={"MPSERVE_CACHE_SHM": str(store)})
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"error: [config] command line: models[0].cache_shm: the host store's ram tier folder {store} belongs to "
            f"user 65534, not to you ({os.geteuid()}): another user may read or change what is in it; remove it "
            f"(rm -r {store}, as root) or give a folder of yours"]
        assert list(store.iterdir()) == []


@pytest.mark.timeout(30)
def test_the_default_store_folder_is_checked_at_start_too(monkeypatch: pytest.MonkeyPatch) -> None:
    with shared_place() as shared:
        monkeypatch.setattr(loader, "shm_dir", lambda: shared)
        monkeypatch.delenv("MPSERVE_CACHE_SHM")
        config = loader.build(server={"server_name": f"fd{os.getpid()}"})
        store = shared / f"mpserve-store-{os.getuid()}"
        assert config.models[0].store_dir() == str(store)
        check_start(config)
        assert stat.S_IMODE(store.stat().st_mode) == 0o700  # made private
        store.chmod(0o777)
        with pytest.raises(ConfigError, match=f"ram tier folder {store} is open to other users .*chmod 700"):
            check_start(config)


@pytest.mark.timeout(90)
def test_instances_that_do_not_fit_the_hosts_ram_end_plan_and_start_naming_the_parts() -> None:
    """The CPU estimate, as a GPU's: weights (once: its instances share them) and each instance's KV cache and
    buffers, against the RAM available (here --ram-budget, below what 2 instances need)."""
    args = ["--model", "builtin:bench", "--instances", "2", "--parallel", "4", "--n-ctx", "8192"]
    planned = mpserve("plan", *args)
    assert planned.returncode == 0 and "shared by its instances" in planned.stdout, planned.stderr
    assert "host RAM:" in planned.stdout and "KV cache" in planned.stdout
    refused = [*args, "--ram-budget", "200MiB"]
    planned = mpserve("plan", *refused)
    assert planned.returncode == 1 and "error: [does_not_fit] the instances on the CPU need" in planned.stderr
    for part in ("weights", "KV cache", "parallel 4 × n_ctx 8192", "200.0 MiB is available (ram_budget)",
                 "a smaller parallel (now 4)"):
        assert part in planned.stderr, planned.stderr
    name = f"ram{os.getpid()}"
    proc = subprocess.Popen([sys.executable, "-m", "mpserve", "start", "--server-name", name, *refused],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "[does_not_fit] the instances on the CPU need" in stderr, stderr
    assert "Traceback" not in stderr and leftovers(name, proc.pid) == []


@pytest.mark.timeout(30)
def test_a_leftover_the_servers_user_cannot_remove_is_refused_in_one_line() -> None:
    with shared_place() as shared:
        planted = shared / "mpserve-65534-x.slots"
        planted.write_bytes(b"")  # another user's (root's, here), in a sticky folder the server cannot clear
        paths = ServerPaths(f"fl{os.getpid()}", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", shared / "none.json",
                            planted)
        outcome = as_other_user(lambda: claim(paths))
        assert outcome == (f"ConfigError: [config] cannot remove {planted}, which is in the way of this server's "
                           "(Operation not permitted); remove it as its owner or root, or give this server another "
                           "--server-name"), outcome
        assert planted.exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["ipc", "tcp"])
def test_start_checks_its_address_without_listening_there(kind: str, tmp_path: Path) -> None:
    """``check_bind`` never accepts a connection at the address it checks: a client waiting there for its server
    to come back connects to nothing during the check."""
    if kind == "ipc":
        path = tmp_path / "front.sock"
        address = f"ipc://{path}"
    else:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        address = f"tcp://127.0.0.1:{port}"
    connected, done = threading.Event(), threading.Event()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RECONNECT_IVL, 1)
    events = dealer.get_monitor_socket(zmq.EVENT_CONNECTED)

    def watch() -> None:
        while not done.is_set():
            if events.poll(10):
                connected.set()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    dealer.connect(address)
    for _ in range(200):  # a client retrying every millisecond, beside two hundred checks
        check_bind("--bind", address)
    done.set()
    watcher.join(5)
    dealer.disable_monitor()
    events.close()
    dealer.close()
    assert not connected.is_set(), "a client connected to the address while start checked it"
    if kind == "ipc":
        assert not os.path.exists(path) and not any(tmp_path.iterdir()), list(tmp_path.iterdir())
