"""The repack probe: llama.cpp's repacked CPU kernels are tried in a child before any model is served, the
verdict is cached per host and build, a crash turns repacking off on the defaults (said once in the log and in
``mpserve doctor``), and an explicit setting wins. The probe's child is swapped for stand-ins that crash, fail or
pass, so every branch runs on any host; the last test runs the real probe of this host."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ServerProcess

from mpserve import repack
from mpserve.config.loader import ModelConfig


def stand_in(tmp_path: Path, body: str) -> str:
    """An executable standing in for the probe's python: it runs ``body`` as a shell script."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return str(script)


def quantized(folder: Path, kind: str) -> str:
    """The built-in tiny model quantized by llama.cpp to ``kind`` (Q4_0, ...), in ``folder``."""
    import ctypes

    import llama_cpp

    from mpserve.models.builtin import builtin_model_path

    target = folder / f"tiny-{kind}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}"), 1
    assert llama_cpp.llama_model_quantize(str(builtin_model_path("tiny")).encode(), str(target).encode(),
                                          ctypes.byref(params)) == 0
    return str(target)


@pytest.mark.timeout(30)
def test_a_crashing_probe_turns_repacking_off_names_the_signal_and_is_cached(tmp_path: Path) -> None:
    crashing = stand_in(tmp_path, 'echo "try Q4_K_M"; kill -SEGV $$')
    verdict = repack.probe(crashing, cache=tmp_path)
    assert not verdict.works and not verdict.cached
    assert verdict.detail == "SIGSEGV at the first decode of Q4_K_M weights"
    assert "served without repacking (repack: true forces it)" in verdict.summary
    passing = stand_in(tmp_path, "echo 'try Q4_0'; echo 'ok Q4_0'")
    again = repack.probe(passing, cache=tmp_path)  # the cached verdict, not a second probe
    assert again.cached and not again.works and again.detail == verdict.detail
    saved = json.loads((tmp_path / f"repack-{repack.host_key()}.json").read_text())
    assert saved["works"] is False and saved["key"] == repack.host_key()


@pytest.mark.timeout(30)
def test_a_passing_probe_keeps_repacking_and_is_cached(tmp_path: Path) -> None:
    passing = stand_in(tmp_path, "echo 'try Q4_0'; echo 'ok Q4_0'; echo 'try Q8_0'; echo 'ok Q8_0'")
    verdict = repack.probe(passing, cache=tmp_path)
    assert verdict.works and verdict.detail == "ran on this host (Q4_0, Q8_0 weights)"
    assert repack.probe(stand_in(tmp_path, "kill -SEGV $$"), cache=tmp_path).cached


@pytest.mark.timeout(30)
@pytest.mark.parametrize("body", ["echo 'ImportError: no llama_cpp' >&2; exit 1", "sleep 30"], ids=["fails", "hangs"])
def test_a_probe_that_fails_by_itself_leaves_repacking_on_and_is_not_cached(tmp_path: Path, body: str) -> None:
    verdict = repack.probe(stand_in(tmp_path, body), cache=tmp_path, timeout=2)
    assert verdict.works and "left on" in verdict.detail
    assert not list(tmp_path.glob("repack-*.json"))


@pytest.mark.timeout(30)
def test_a_corrupt_cache_entry_is_probed_again(tmp_path: Path) -> None:
    (tmp_path / f"repack-{repack.host_key()}.json").write_text('{"works": tru')
    verdict = repack.probe(stand_in(tmp_path, "kill -ILL $$"), cache=tmp_path)
    assert not verdict.works and not verdict.cached and verdict.detail.startswith("SIGILL at the first decode")


@pytest.mark.timeout(30)
def test_an_explicit_setting_wins_over_the_verdict_and_echo_loads_no_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    crashes = repack.Verdict(False, "SIGSEGV", "k")
    monkeypatch.setattr(repack, "host_verdict", lambda: crashes)
    assert repack.repack_for(ModelConfig(name="m", path="m.gguf", repack=True)) is True
    assert repack.repack_for(ModelConfig(name="m", path="m.gguf", repack=False)) is False
    assert repack.repack_for(ModelConfig(name="m", path="m.gguf")) is False  # auto: the verdict
    assert repack.repack_for(ModelConfig(name="e", path="echo")) is True


@pytest.mark.timeout(120)
def test_a_server_on_the_defaults_serves_without_repacking_where_the_verdict_says_crash_and_says_so_once(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    """The verdict of a crashing host, cached for this host's key, as the probe would leave it."""
    cache = Path(os.environ["MPSERVE_CACHE_DIR"])
    entry = cache / f"repack-{repack.host_key()}.json"
    before = entry.read_text() if entry.exists() else None
    cache.mkdir(parents=True, exist_ok=True)
    entry.write_text(json.dumps({"version": repack.CACHE_VERSION, "works": False, "key": repack.host_key(),
                                 "detail": "SIGILL at the first decode of Q4_0 weights", "cached": True}))
    try:  # quantized, so that llama.cpp has weights to repack: what it loaded is in its log (mpserve.llama)
        server = start_server("--model", quantized(tmp_path, "Q4_0"), "--name", "tiny", "--instances", "2",
                              "--log-level", "debug").wait_ready()
        from mpserve import Client

        with Client(server.address, timeout=30) as client:
            assert client.generate("Hello", max_tokens=4, temperature=0).usage.completion_tokens == 4
        said = [line for line in server.log if "repacked CPU kernels crash on this host" in line]
        assert len(said) == 1 and "SIGILL at the first decode of Q4_0 weights" in said[0], server.log
        assert any("repack=False" in line for line in server.log), "a worker's spec does not show repack off"
        buffers = [line for line in server.log if "model buffer size" in line]
        assert buffers and all("CPU_Mapped model buffer" in line for line in buffers), buffers  # none repacked
    finally:
        if before is None:
            entry.unlink()
        else:
            entry.write_text(before)


@pytest.mark.timeout(120)
def test_this_hosts_probe_agrees_with_a_direct_repacked_decode(tmp_path: Path) -> None:
    """The real probe, then the same decode in a plain llama_cpp process: both crash or both run."""
    verdict = repack.probe(cache=tmp_path)
    direct = subprocess.run([sys.executable, "-m", "mpserve.engine.repack_check", str(tmp_path)],
                            capture_output=True, timeout=100)
    crashed = direct.returncode in (-signal.SIGSEGV, -signal.SIGILL, -signal.SIGBUS, -signal.SIGABRT)
    assert verdict.works is not crashed, (verdict, direct.returncode)
    assert verdict.works is (direct.returncode == 0)
