"""Models named on the Hugging Face Hub (a local stand-in speaking its API, ``fake_hub``) and in Ollama's store (laid
out as Ollama lays it out), through ``mpserve pull`` and ``mpserve start``: downloads resumed, checked and done
once per host, the cache used offline, and each bad source refused before anything starts."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from fake_hub import COMMIT, FakeHub
from gateway_thread import GatewayThread
from helpers import mpserve, wait_for

from mpserve import Client
from mpserve.errors import ConfigError
from mpserve.models import hub, templates
from mpserve.models.builtin import default_model_path
from mpserve.models.mmproj_maker import TOKENS_PER_IMAGE, write_projector
from mpserve.models.progress import Progress, downloads
from mpserve.wire.media import MEDIA_MARKER, WithImages

pytestmark = pytest.mark.timeout(60)

REPO, VISION_REPO = "acme/tiny-GGUF", "acme/vision-GGUF"
TINY = default_model_path().read_bytes()  # the text model of the random vision pair too
VISION_PROMPT = f"<|im_start|>user\n{MEDIA_MARKER}What is this?<|im_end|>\n<|im_start|>assistant\n"


@functools.cache
def projector_bytes() -> bytes:
    """The random vision pair's projector (``mpserve make-model --size tiny --mmproj``), as a file's bytes."""
    with tempfile.TemporaryDirectory() as folder:
        return write_projector(Path(folder) / "mmproj.gguf").read_bytes()


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    served = FakeHub({REPO: {"tiny-Q4_K_M.gguf": TINY, "tiny-Q8_0.gguf": TINY, "notes.gguf": b"not a model",
                             "README.md": b"# tiny"},
                      "acme/split-GGUF": {"big-Q8_0-00001-of-00002.gguf": TINY[:300_000],
                                          "big-Q8_0-00002-of-00002.gguf": TINY[300_000:]},
                      "acme/private-GGUF": {"tiny-Q4_K_M.gguf": TINY},
                      VISION_REPO: {"vision-Q4_K_M.gguf": TINY, "mmproj-F32.gguf": projector_bytes(),
                                    "mmproj-vision-F16.gguf": projector_bytes(), "old/mmproj-F16.gguf": b"no"}},
                      private={"acme/private-GGUF": "sekret"})
    yield served
    served.stop()


@pytest.fixture
def hf_env(fake_hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    """The Hub's variables for a subprocess: the stand-in, a cache of the test's own, no token."""
    return {"HF_ENDPOINT": fake_hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "", "HF_HUB_OFFLINE": ""}


def _mpserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return mpserve(*args, env=env, timeout=50)


def _storage(env: dict[str, str]) -> Path:
    return Path(env["HF_HOME"]) / "hub" / "models--acme--tiny-GGUF"


# --- names and choices ----------------------------------------------------------------------------------


def test_hub_names_parse_as_llama_server_s_and_local_paths_stay_paths(tmp_path: Path) -> None:
    assert hub.parse("hf://acme/tiny-GGUF/sub/tiny-Q8_0.gguf") == hub.HubRef(REPO, "main", "sub/tiny-Q8_0.gguf")
    assert hub.parse("hf://acme/tiny-GGUF@v1.0/tiny.gguf") == hub.HubRef(REPO, "v1.0", "tiny.gguf")
    assert hub.parse("acme/tiny-GGUF:q8_0") == hub.HubRef(REPO, "main", None, "q8_0")
    assert hub.parse("acme/tiny-GGUF@v2:Q4_K_M") == hub.HubRef(REPO, "v2", None, "Q4_K_M")
    assert hub.parse("hf://acme/tiny-GGUF") == hub.HubRef(REPO)
    assert hub.parse("models/tiny.gguf") is None and hub.parse("builtin:tiny") is None
    (tmp_path / "acme").mkdir()
    (tmp_path / "acme" / "x:Q4").write_bytes(b"GGUF")
    assert hub.parse(str(tmp_path / "acme" / "x:Q4")) is None  # a file of that name is the file
    with pytest.raises(ConfigError, match="is not a Hub model; write hf://OWNER/REPO/FILE.gguf"):
        hub.parse("hf://just-a-name")


@pytest.mark.parametrize("name", [
    "hf://acme/tiny-GGUF/../../x.gguf", "hf://acme/tiny-GGUF/sub/../../../x.gguf", "hf://acme/tiny-GGUF//etc/x.gguf",
    "hf://acme/tiny-GGUF/./x.gguf", "hf://acme/tiny-GGUF/..\\..\\x.gguf", "hf://acme/tiny-GGUF@../x.gguf",
    "hf://acme/tiny-GGUF@..:Q4_K_M", "acme/tiny-GGUF@..:Q4_K_M", "acme/tiny-GGUF@a\\b:Q4_K_M"])
def test_a_hub_file_or_revision_that_leaves_the_repo_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="leaves the repo"):
        hub.parse(name)


def test_a_hub_repo_named_without_its_quantization_gets_the_forms_offline(hf_env: dict[str, str]) -> None:
    offline = {**hf_env, "HF_ENDPOINT": "http://127.0.0.1:9"}  # nothing is asked of any Hub
    started = _mpserve("start", "--model", REPO, "--server-name", f"noq{os.getpid()}", env=offline)
    assert started.returncode == 1, started.stderr
    assert f"'{REPO}' is no file here; if it is a repo on the Hugging Face Hub, name its quantization, " \
           f"{REPO}:Q4_K_M" in started.stderr
    assert "hf://OWNER/REPO/FILE.gguf" in started.stderr and "ollama://NAME" in started.stderr
    pulled = _mpserve("pull", REPO, env=offline)
    assert pulled.returncode == 1 and f"{REPO}:Q4_K_M" in pulled.stderr, pulled.stderr
    assert "not a model on the Hub" not in pulled.stderr and "pull takes hf://OWNER/REPO/FILE.gguf" in pulled.stderr
    for local, said in ((__file__, "is a file here; pull takes"), ("acme/none.gguf", "no such model file")):
        refused = _mpserve("pull", local, env=offline)
        assert refused.returncode == 1 and said in refused.stderr and ":Q4_K_M" not in refused.stderr, refused.stderr
    helped = _mpserve("start", "--help", env={"COLUMNS": "400"})
    for form in ("hf://OWNER/REPO/FILE.gguf", "OWNER/REPO:QUANT", "ollama://NAME:TAG"):
        assert form in helped.stdout, form


def test_a_hub_that_cannot_be_reached_is_a_connection_error_not_a_config_one(hf_env: dict[str, str]) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        pulled = _mpserve("pull", f"{REPO}:Q4_K_M", env={**hf_env, "HF_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert pulled.returncode == 1
    assert f"error: [connection] cannot reach the Hub (http://127.0.0.1:{port}) for {REPO}:Q4_K_M" in pulled.stderr


def test_the_file_is_chosen_by_quantization_as_llama_server_does() -> None:
    files = ["README.md", "m-Q8_0.gguf", "m-Q4_K_M.gguf", "m-IQ4_XS.gguf", "mmproj-m-Q4_K_M.gguf",
             "big/m-Q6_K-00001-of-00002.gguf", "big/m-Q6_K-00002-of-00002.gguf"]
    assert hub.choose(files, None) == "m-Q4_K_M.gguf"
    assert hub.choose(files, "q8_0") == "m-Q8_0.gguf"
    assert hub.choose(files, "Q6_K") == "big/m-Q6_K-00001-of-00002.gguf"
    assert hub.choose(["m-Q8_0.gguf", "m-F16.gguf"], None) == "m-Q8_0.gguf"
    assert hub.choose(["b-F16.gguf", "a-BF16.gguf"], None) == "a-BF16.gguf"
    with pytest.raises(ValueError, match="no Q2_K GGUF; its GGUF files: m-IQ4_XS.gguf, m-Q4_K_M.gguf"):
        hub.choose(files[:4], "Q2_K")
    with pytest.raises(ValueError, match="no GGUF files"):
        hub.choose(["README.md"], None)
    assert hub.parts("big/m-Q6_K-00001-of-00003.gguf") == [
        "big/m-Q6_K-00001-of-00003.gguf", "big/m-Q6_K-00002-of-00003.gguf", "big/m-Q6_K-00003-of-00003.gguf"]


def test_the_projector_is_the_mmproj_gguf_beside_the_model_f16_first() -> None:
    files = ["m-Q4_K_M.gguf", "mmproj-m-BF16.gguf", "mmproj-m-f16.gguf", "mmproj-m-F32.gguf", "sub/m-Q8_0.gguf",
             "sub/mmproj-Q8_0.gguf", "other/mmproj-F16.gguf", "README.md", "mmproj-notes.txt"]
    assert hub.choose_projector(files, "m-Q4_K_M.gguf") == "mmproj-m-f16.gguf"
    assert hub.choose_projector(files[1:], "m-Q4_K_M.gguf") == "mmproj-m-f16.gguf"
    assert hub.choose_projector([f for f in files if "16" not in f], "m-Q4_K_M.gguf") == "mmproj-m-F32.gguf"
    assert hub.choose_projector(files, "sub/m-Q8_0.gguf") == "sub/mmproj-Q8_0.gguf"
    assert hub.choose_projector(["m.gguf", "b-mmproj.gguf", "a-mmproj.gguf"], "m.gguf") == "a-mmproj.gguf"
    assert hub.choose_projector(["m.gguf", "sub/mmproj-F16.gguf"], "m.gguf") is None


def test_progress_draws_a_bar_on_a_terminal_and_logs_each_tenth_elsewhere(caplog: pytest.LogCaptureFixture,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("MPSERVE_RUNTIME_DIR", str(tmp_path))  # its status files, apart from real downloads'
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    bar = Progress("m.gguf", screen)
    bar.start(10 << 20)
    bar.advance(5 << 20)
    bar.finish()
    last = screen.getvalue().split("\r")[-1]
    assert last.startswith("m.gguf  50% [############            ] 5.0 MiB/10.0 MiB, ") and "/s, " in last
    assert last.endswith(" s left\n")
    with caplog.at_level(logging.INFO, "mpserve.download"):
        logged = Progress("m.gguf", io.StringIO())
        logged.start(1000, done=250)
        for _ in range(75):
            logged.advance(10)
    assert [d["done_bytes"] for d in downloads()] == [250]  # published when it started; the next after 0.5 s
    logged.close()
    assert downloads() == []
    shares = [r.getMessage().split(": ")[1].split(" ")[0] for r in caplog.records[1:]]
    assert caplog.records[0].getMessage() == "m.gguf: resuming at 250 B of 1000 B"
    assert shares == ["30%", "40%", "50%", "60%", "70%", "80%", "90%", "100%"]


# --- the Hub --------------------------------------------------------------------------------------------


def test_a_cut_connection_resumes_where_it_stopped_and_the_file_is_checked(fake_hub: FakeHub,
                                                                            hf_env: dict[str, str]) -> None:
    fake_hub.cut_after = 200_000
    pulled = _mpserve("pull", "hf://acme/tiny-GGUF/tiny-Q8_0.gguf", env=hf_env)
    assert pulled.returncode == 0, pulled.stderr
    assert fake_hub.downloads("tiny-Q8_0.gguf") == [0, 200_000]
    assert "connection lost at 200000 of" in pulled.stderr
    path = Path(pulled.stdout.strip())
    assert path == _storage(hf_env) / "snapshots" / COMMIT / "tiny-Q8_0.gguf" and path.read_bytes() == TINY
    assert path.resolve().name == hashlib.sha256(TINY).hexdigest()  # huggingface_hub's layout: blobs by sha256
    again = _mpserve("pull", "acme/tiny-GGUF:Q8_0", env=hf_env)  # cached: nothing more is downloaded
    assert again.returncode == 0 and Path(again.stdout.strip()) == path
    assert fake_hub.downloads("tiny-Q8_0.gguf") == [0, 200_000]


def test_a_partial_file_left_by_an_earlier_run_is_resumed(fake_hub: FakeHub, hf_env: dict[str, str]) -> None:
    partial = _storage(hf_env) / "blobs" / f"{hashlib.sha256(TINY).hexdigest()}.incomplete"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(TINY[:100_000])
    pulled = _mpserve("pull", "acme/tiny-GGUF:Q4_K_M", env=hf_env)
    assert pulled.returncode == 0, pulled.stderr
    assert fake_hub.downloads("tiny-Q4_K_M.gguf") == [100_000]
    assert Path(pulled.stdout.strip()).read_bytes() == TINY and not partial.exists()


def test_a_checksum_mismatch_keeps_the_bytes_serves_nothing_and_the_next_pull_starts_afresh(
        fake_hub: FakeHub, hf_env: dict[str, str]) -> None:
    fake_hub.corrupt.add("tiny-Q4_K_M.gguf")
    refused = _mpserve("start", "--model", "acme/tiny-GGUF:Q4_K_M", "--server-name", f"sum{os.getpid()}",
                       env=hf_env)
    assert refused.returncode == 1
    assert "checksum mismatch: the file's sha256 is " in refused.stderr
    assert f"the Hub's {hashlib.sha256(TINY).hexdigest()}; the bytes are kept in" in refused.stderr
    assert "ready:" not in refused.stderr + refused.stdout
    blobs = _storage(hf_env) / "blobs"
    assert [p.name for p in blobs.iterdir()] == [f"{hashlib.sha256(TINY).hexdigest()}.incomplete"]
    assert not (_storage(hf_env) / "snapshots" / COMMIT / "tiny-Q4_K_M.gguf").exists()
    fake_hub.corrupt.clear()
    pulled = _mpserve("pull", "acme/tiny-GGUF:Q4_K_M", env=hf_env)
    assert pulled.returncode == 0, pulled.stderr
    assert fake_hub.downloads("tiny-Q4_K_M.gguf") == [0, 0] and Path(pulled.stdout.strip()).read_bytes() == TINY


def test_a_split_gguf_comes_with_all_its_parts_side_by_side(fake_hub: FakeHub, hf_env: dict[str, str]) -> None:
    pulled = _mpserve("pull", "acme/split-GGUF:Q8_0", env=hf_env)
    assert pulled.returncode == 0, pulled.stderr
    first = Path(pulled.stdout.strip())
    assert first.name == "big-Q8_0-00001-of-00002.gguf"  # llama.cpp loads the other parts from its folder
    assert (first.parent / "big-Q8_0-00002-of-00002.gguf").read_bytes() == TINY[300_000:]
    assert sorted(path for path, _ in fake_hub.gets) == ["big-Q8_0-00001-of-00002.gguf", "big-Q8_0-00002-of-00002.gguf"]


def test_hf_token_opens_a_private_repo(hf_env: dict[str, str]) -> None:
    hidden = _mpserve("pull", "acme/private-GGUF:Q4_K_M", env=hf_env)
    assert hidden.returncode == 1 and "set HF_TOKEN if it is private" in hidden.stderr
    pulled = _mpserve("pull", "acme/private-GGUF:Q4_K_M", env={**hf_env, "HF_TOKEN": "sekret"})
    assert pulled.returncode == 0, pulled.stderr
    assert Path(pulled.stdout.strip()).read_bytes() == TINY


@pytest.mark.parametrize(("name", "expected"), [
    ("acme/nothing:Q4_K_M", "no repo acme/nothing on the Hub (http://127.0.0.1:"),
    ("hf://acme/tiny-GGUF/tiny-F16.gguf", "acme/tiny-GGUF has no file 'tiny-F16.gguf' at main"),
    ("acme/tiny-GGUF@v9:Q8_0", "acme/tiny-GGUF has no revision 'v9'"),
    ("acme/tiny-GGUF:Q2_K", "no Q2_K GGUF; its GGUF files: notes.gguf, tiny-Q4_K_M.gguf, tiny-Q8_0.gguf"),
    ("hf://acme/tiny-GGUF/notes.gguf", "is not a GGUF model file (it does not start with GGUF)"),
], ids=["unknown-repo", "unknown-file", "unknown-revision", "unknown-quant", "not-gguf"])
def test_a_bad_hub_source_is_refused_with_what_is_wrong(hf_env: dict[str, str], name: str, expected: str) -> None:
    pulled = _mpserve("pull", name, env=hf_env)
    assert pulled.returncode == 1 and expected in pulled.stderr, pulled.stderr


@pytest.mark.timeout(120)
def test_offline_the_cache_serves_and_a_model_not_in_it_is_refused_before_anything_starts(
        fake_hub: FakeHub, hf_env: dict[str, str], start_server: type[ServerProcess]) -> None:
    offline = {**hf_env, "HF_HUB_OFFLINE": "1"}
    refused = _mpserve("start", "--model", "acme/tiny-GGUF:Q8_0", "--server-name", f"off{os.getpid()}", env=offline)
    assert refused.returncode == 1
    assert "acme/tiny-GGUF:Q8_0 is not in the Hugging Face cache" in refused.stderr
    assert "HF_HUB_OFFLINE is set; pull it where the Hub can be reached" in refused.stderr
    assert fake_hub.gets == []
    assert _mpserve("pull", "acme/tiny-GGUF:Q8_0", env=hf_env).returncode == 0
    fake_hub.stop()  # offline for real: nothing answers there any more
    server = start_server("--model", "acme/tiny-GGUF:Q8_0", env=offline).wait_ready()
    with Client(server.address) as client:
        assert client.generate("Hello", model="tiny-GGUF-Q8_0", max_tokens=3).usage.completion_tokens == 3


@pytest.mark.timeout(120)
def test_servers_starting_at_once_download_the_model_once(fake_hub: FakeHub, hf_env: dict[str, str],
                                                          start_server: type[ServerProcess]) -> None:
    fake_hub.delay_s = 0.3  # 9 chunks: the download lasts while the other server starts
    servers = [start_server("--model", "acme/tiny-GGUF:Q4_K_M", env=hf_env) for _ in range(2)]
    for server in servers:
        server.wait_ready(90)
    assert fake_hub.downloads("tiny-Q4_K_M.gguf") == [0]
    logs = ["\n".join(server.log) for server in servers]
    assert sum("another process is downloading it; waiting" in log for log in logs) == 1
    assert sum("tiny-Q4_K_M.gguf: done" in log for log in logs) == 1


def test_two_names_of_one_file_pulled_at_once_download_it_once(fake_hub: FakeHub, hf_env: dict[str, str]) -> None:
    fake_hub.delay_s = 0.3
    pulls = [subprocess.Popen([sys.executable, "-m", "mpserve", "pull", name], env={**os.environ, **hf_env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in ("hf://acme/tiny-GGUF/tiny-Q4_K_M.gguf", "acme/tiny-GGUF:Q4_K_M")]
    outputs = [p.communicate(timeout=50) for p in pulls]
    assert [p.returncode for p in pulls] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0] and fake_hub.downloads("tiny-Q4_K_M.gguf") == [0]


def image_answered(server: ServerProcess) -> int:
    """The prompt tokens of a request with an image to ``server``'s one model (refused without a projector)."""
    from test_images import RED

    with Client(server.address) as client:
        done = client.generate(WithImages(VISION_PROMPT, (RED,)), max_tokens=2, temperature=0)
    assert done.usage.prompt_tokens > TOKENS_PER_IMAGE
    return done.usage.prompt_tokens


@pytest.mark.timeout(120)
def test_mmproj_auto_pulls_the_projector_beside_a_hub_model_and_its_images_are_answered(
        fake_hub: FakeHub, hf_env: dict[str, str], start_server: type[ServerProcess]) -> None:
    server = start_server("--model", f"{VISION_REPO}:Q4_K_M", "--mmproj", "auto", env=hf_env).wait_ready()
    image_answered(server)
    assert fake_hub.downloads("mmproj-vision-F16.gguf") == [0]
    assert fake_hub.downloads("mmproj-F32.gguf") == fake_hub.downloads("old/mmproj-F16.gguf") == []
    loaded = [line for line in server.log if "loaded the projector" in line]
    assert loaded and f"/snapshots/{COMMIT}/mmproj-vision-F16.gguf" in loaded[0], loaded
    offline = start_server("--model", f"{VISION_REPO}:Q4_K_M", "--mmproj", "auto",
                           env={**hf_env, "HF_HUB_OFFLINE": "1"}).wait_ready()  # from the cache
    image_answered(offline)
    assert fake_hub.downloads("mmproj-vision-F16.gguf") == [0]


def test_mmproj_auto_for_a_hub_repo_without_a_projector_or_a_local_file_is_refused_in_one_line(
        hf_env: dict[str, str], tmp_path: Path) -> None:
    refused = _mpserve("start", "--model", f"{REPO}:Q8_0", "--mmproj", "auto", "--server-name",
                       f"nomm{os.getpid()}", env=hf_env)
    assert refused.returncode == 1 and refused.stderr.strip().splitlines()[-1] == (  # after the model's download
        f"error: [config] {REPO}:Q8_0: its repo has no projector (a GGUF named mmproj*) beside tiny-Q8_0.gguf; give "
        "mmproj a file"), refused.stderr
    local = tmp_path / "tiny.gguf"
    local.write_bytes(TINY)
    refused = _mpserve("start", "--model", str(local), "--mmproj", "auto", env=hf_env)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert (f"models[0].mmproj: auto finds the projector of a model on the Hub or in Ollama's store, and '{local}' is "
            "neither; give the projector's file") in refused.stderr, refused.stderr


# --- Ollama's store -------------------------------------------------------------------------------------

GEMMA_GO_TEMPLATE = "{{- range .Messages }}<start_of_turn>{{ .Role }}\n{{ .Content }}<end_of_turn>\n{{ end }}"


def _ollama_store(root: Path, projector: bytes | None = None) -> Path:
    """An Ollama store holding tiny:latest (the tiny model with a Gemma template) as ``ollama pull`` leaves it, with
    ``projector`` as its projector layer if given (a vision model's)."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    layers = []
    given = [("model", TINY), ("template", GEMMA_GO_TEMPLATE.encode()), ("params", b'{"stop": []}')]
    for media, data in given + ([("projector", projector)] if projector is not None else []):
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        (blobs / digest.replace(":", "-")).write_bytes(data)
        layers.append({"mediaType": f"application/vnd.ollama.image.{media}", "digest": digest, "size": len(data)})
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers, "config": {
        "mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:0", "size": 2}}))
    return root


def test_an_ollama_model_is_served_in_place_with_its_template_s_family(tmp_path: Path,
                                                                       start_server: type[ServerProcess]) -> None:
    store = _ollama_store(tmp_path / "ollama")
    server = start_server("--model", "ollama://tiny", env={"OLLAMA_MODELS": str(store)}).wait_ready()
    with Client(server.address) as client:  # named as Ollama names it
        assert client.stats().models["tiny"].chat_template == templates.FAMILIES["gemma"]
    blob = f"{store}/blobs/sha256-{hashlib.sha256(TINY).hexdigest()}"
    assert any(f"{blob} has no chat template: using the gemma family's, chosen by its Ollama template's turn "
               "markers" in line for line in server.log)


def test_an_ollama_name_not_in_the_store_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    store = _ollama_store(tmp_path / "ollama")
    refused = _mpserve("start", "--model", "ollama://llama3.2:1b", "--server-name", f"oll{os.getpid()}",
                       env={"OLLAMA_MODELS": str(store)})
    assert refused.returncode == 1
    assert (f"ollama://llama3.2:1b is not in Ollama's store ({store}; set OLLAMA_MODELS for another); it holds "
            "tiny:latest; pull it with: ollama pull llama3.2:1b") in refused.stderr


@pytest.mark.parametrize(("change", "expected"), [
    (lambda m: {"schemaVersion": 2}, "is not one Ollama writes (Object missing required field `layers`)"),
    (lambda m: "{not json", "is not one Ollama writes (JSON is malformed"),
    (lambda m: {"layers": [{**m["layers"][0], "digest": "sha256:../../../etc/passwd"}]},
     "is not one Ollama writes (Expected `str` matching regex '^sha256:[0-9a-f]{64}$' - at `$.layers[0].digest`)"),
    (lambda m: {"layers": [{**m["layers"][0], "digest": "sha512:" + "0" * 128}]}, "at `$.layers[0].digest`"),
], ids=["no-layers", "not-json", "digest-path", "digest-kind"])
def test_a_corrupt_ollama_manifest_is_refused_in_one_line(tmp_path: Path, change: Any, expected: str) -> None:
    store = _ollama_store(tmp_path / "ollama")
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / "tiny" / "latest"
    changed = change(json.loads(manifest.read_text()))
    manifest.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    refused = _mpserve("pull", "ollama://tiny", env={"OLLAMA_MODELS": str(store)})
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.startswith("error: [config] ") and expected in refused.stderr, refused.stderr
    assert f"ollama://tiny: its manifest {manifest} is not one Ollama writes" in refused.stderr
    assert "pull it again with: ollama pull tiny:latest" in refused.stderr


def test_an_ollama_blob_that_differs_from_its_digest_is_refused_before_anything_starts(tmp_path: Path) -> None:
    store = _ollama_store(tmp_path / "ollama")
    env = {"OLLAMA_MODELS": str(store)}
    assert _mpserve("pull", "ollama://tiny", env=env).returncode == 0
    blob = store / "blobs" / f"sha256-{hashlib.sha256(TINY).hexdigest()}"
    blob.write_bytes(TINY[:-1] + bytes([TINY[-1] ^ 1]))  # still a GGUF, one bit changed
    for command in (["pull", "ollama://tiny"], ["start", "--model", "ollama://tiny", "--server-name",
                                                f"bit{os.getpid()}"]):
        refused = _mpserve(*command, env=env)
        assert refused.returncode == 1
        assert f"ollama://tiny: its model blob {blob} does not match its digest" in refused.stderr, refused.stderr


@pytest.mark.timeout(120)
def test_mmproj_auto_serves_the_projector_layer_of_an_ollama_model_checked_against_its_digest(
        tmp_path: Path, start_server: type[ServerProcess]) -> None:
    store = _ollama_store(tmp_path / "ollama", projector_bytes())
    env = {"OLLAMA_MODELS": str(store)}
    blob = store / "blobs" / f"sha256-{hashlib.sha256(projector_bytes()).hexdigest()}"
    server = start_server("--model", "ollama://tiny", "--mmproj", "auto", env=env).wait_ready()
    assert image_answered(server) and any(f"loaded the projector {blob}" in line for line in server.log)
    server.stop()
    blob.write_bytes(projector_bytes()[:-1] + bytes([projector_bytes()[-1] ^ 1]))
    refused = _mpserve("start", "--model", "ollama://tiny", "--mmproj", "auto", "--server-name",
                       f"mmb{os.getpid()}", env=env)
    assert refused.returncode == 1
    assert f"ollama://tiny: its projector blob {blob} does not match its digest" in refused.stderr, refused.stderr
    text_only = _ollama_store(tmp_path / "text")
    refused = _mpserve("start", "--model", "ollama://tiny", "--mmproj", "auto", env={"OLLAMA_MODELS": str(text_only)})
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert ("models[0].mmproj: ollama://tiny: its manifest names no projector layer (Ollama's tiny:latest takes text "
            "only); leave mmproj out, or give it a file") in refused.stderr, refused.stderr


# --- a models directory ---------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_models_directory_is_listed_and_each_model_loads_when_a_request_names_it(
        tmp_path: Path, start_server: type[ServerProcess]) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    for name in ("alpha.gguf", "beta.gguf", "big-00002-of-00002.gguf"):
        (folder / name).write_bytes(TINY)
    (folder / "notes.txt").write_text("not a model")
    (tmp_path / "mpserve.yaml").write_text("models_dir: models\nsingle_active_backend: true\n"
                                           "models:\n  - path: builtin:tiny\n")
    server = start_server("--config", str(tmp_path / "mpserve.yaml")).wait_ready()
    gateway = GatewayThread(server_name=server.name)
    try:
        client = gateway.openai()
        assert [m.id for m in client.models.list().data] == ["tiny", "alpha", "beta"]
        with Client(server.address) as zc:
            assert {name: m.instances for name, m in zc.stats().models.items()} == {"tiny": 1, "alpha": 0, "beta": 0}
        for model in ("beta", "alpha", "tiny"):  # one resident at a time: each request loads its model
            reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
            assert reply.model == model and reply.usage.completion_tokens == 4
    finally:
        gateway.stop()


def test_a_models_directory_that_is_not_a_folder_or_holds_nothing_is_refused(tmp_path: Path) -> None:
    from mpserve.config.loader import build

    with pytest.raises(ConfigError, match="models_dir: '/nowhere' is not a folder; give the folder that holds"):
        build({"models_dir": "/nowhere"})
    with pytest.raises(ConfigError, match="holds no .gguf files and no models are configured"):
        build({"models_dir": str(tmp_path)})
    assert [m.name for m in build({"models_dir": str(tmp_path)}, model={"path": "builtin:tiny"}).models] == ["tiny"]


@pytest.mark.timeout(120)
def test_the_monitor_and_the_console_show_a_download_before_the_server_starts(
        fake_hub: FakeHub, hf_env: dict[str, str], start_server: type[ServerProcess]) -> None:
    fake_hub.delay_s = 1.0  # 9 chunks: the download lasts while the gateway comes up
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = start_server("--model", "acme/tiny-GGUF:Q4_K_M", "--http", f"127.0.0.1:{port}", env=hf_env)

    def downloading() -> list[dict[str, Any]]:
        try:
            shown = httpx.get(f"{url}/backend/monitor", timeout=2).json().get("downloads", [])
        except httpx.TransportError:
            return []
        return [d for d in shown if d["file"] == "tiny-Q4_K_M.gguf"]  # this host's downloads: this test's

    (shown,) = wait_for(downloading, 60, "a download in /backend/monitor", interval=0.2)
    assert shown["file"] == "tiny-Q4_K_M.gguf" and shown["total_bytes"] == len(TINY)
    assert 0 <= shown["done_bytes"] < len(TINY) and shown["pid"] == server.proc.pid
    console = httpx.get(f"{url}/console/state", timeout=5).json()
    assert "tiny-Q4_K_M.gguf" in [d["file"] for d in console["downloads"]] and console["models"] == []
    server.wait_ready(60)
    monitor = httpx.get(f"{url}/backend/monitor", timeout=5).json()
    assert "tiny-Q4_K_M.gguf" not in [d["file"] for d in monitor["downloads"]]
    assert monitor["instances"][0]["model"] == "tiny-GGUF-Q4_K_M"
