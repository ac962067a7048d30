"""Images in chat completions, end to end: the random vision pair (``mpserve make-model --mmproj``) served with
``--mmproj``, images sent as data URLs through the HTTP gateway, decoded and projected by llama.cpp's multimodal
library in the worker, and reused from the cache like the tokens they stand for."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from helpers import config_file, http_up, mpserve, wait_for

from bench.procs import HttpServer, find_llama_server, free_port
from mpserve import Client
from mpserve.gateway.http.keys import tenant_of
from mpserve.models.mmproj_maker import TOKENS_PER_IMAGE
from mpserve.wire.media import MEDIA_MARKER, WithImages

pytestmark = pytest.mark.timeout(180)

PROMPT = "What is this?"
SMALL_KEY, OTHER_KEY = "small-images-key", "other-key"


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A PNG of one colour, written by hand (zlib and the chunk layout)."""
    raw = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


RED, BLUE = png(16, 16, (255, 0, 0)), png(16, 16, (0, 0, 255))


def data_url(image: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(image).decode()}"


def chat(*parts: Any, model: str = "vision", max_tokens: int = 24) -> dict[str, Any]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": p[0]}}
               for p in parts]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("vision")
    model, projector = folder / "vision.gguf", folder / "mmproj.gguf"
    made = mpserve("make-model", str(model), "--size", "tiny", "--mmproj", str(projector))
    assert made.returncode == 0, made.stderr
    return model, projector


@pytest.fixture(scope="module")
def served(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    """A server with the vision pair (``vision``; ``narrow``: with a context of 64 tokens) and the tiny model without a
    projector (``tiny``), whose tenant of API key ``SMALL_KEY`` may send images of 100 pixels at most, and a client of
    its gateway (without keys)."""
    model, projector = pair
    config = config_file(tmp_path_factory.mktemp("config"), "images",
                         models=[{"name": "vision", "path": str(model), "mmproj": str(projector)},
                                 {"name": "tiny", "path": "builtin:tiny"},
                                 {"name": "narrow", "path": str(model), "mmproj": str(projector), "n_ctx": 64}],
                         tenants={tenant_of(SMALL_KEY): {"max_image_pixels": 100}})
    with gateway_of("--config", config) as both:
        yield both


@contextlib.contextmanager
def gateway_of(*args: str) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    """A server started with ``args`` and an HTTP client of a gateway (without keys) in front of it; both stopped on
    leaving."""
    from gateway_thread import GatewayThread  # uvicorn: loaded by the tests that use it

    server = ServerProcess(*args).wait_ready()
    gateway = GatewayThread(server_name=server.name)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as client:
            yield server, client
    finally:
        gateway.stop()
        server.stop()


@pytest.fixture(scope="module")
def http(served: tuple[ServerProcess, httpx.Client]) -> httpx.Client:
    return served[1]


def answer(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def refused(http: httpx.Client, body: dict[str, Any]) -> str:
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    return str(reply.json()["error"]["message"])


def test_an_image_is_answered_and_the_same_image_again_is_reused_from_the_cache(http: httpx.Client) -> None:
    first = answer(http, chat(PROMPT, (data_url(RED),)))
    again = answer(http, chat(PROMPT, (data_url(RED),)))
    assert first["choices"][0]["message"]["content"]
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= TOKENS_PER_IMAGE + 4, again["usage"]  # the image's positions, and the text around it
    assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]


def test_another_image_gives_another_reply_and_is_not_taken_from_the_first_ones_cells(http: httpx.Client) -> None:
    red = answer(http, chat(PROMPT, (data_url(RED),)))
    blue = answer(http, chat(PROMPT, (data_url(BLUE),)))
    assert blue["choices"][0]["message"]["content"] != red["choices"][0]["message"]["content"]
    # the text before the image may be reused, the image's positions not
    assert blue["usage"]["prompt_tokens_details"]["cached_tokens"] < blue["usage"]["prompt_tokens"] - TOKENS_PER_IMAGE


def test_two_images_in_one_message_count_in_order(http: httpx.Client) -> None:
    one = answer(http, chat("A", (data_url(RED),), "B", (data_url(BLUE),)))
    swapped = answer(http, chat("A", (data_url(BLUE),), "B", (data_url(RED),)))
    assert one["usage"]["prompt_tokens"] == swapped["usage"]["prompt_tokens"]
    assert one["choices"][0]["message"]["content"] != swapped["choices"][0]["message"]["content"]


BAD = {
    "corrupt": (data_url(RED[:40] + bytes(64) + RED[104:]), "cannot be decoded"),
    "truncated": (data_url(RED[:30]), "cannot be decoded"),
    "cut header": (data_url(RED[:20]), "cut short"),
    "unknown format": (data_url(b"RIFF\x00\x00\x00\x00WEBPVP8 " + bytes(32), "webp"), "unknown image format"),
    "bomb": (data_url(png(1, 1, (0, 0, 0))[:16] + struct.pack(">II", 60_000, 60_000) + bytes(64)), "pixels"),
    "not base64": ("data:image/png;base64,@@@@", "not valid base64"),
    "http": ("http://169.254.169.254/latest/meta-data", "fetching images from URLs is off"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_image_is_a_400_naming_what_is_wrong_and_the_server_answers_after(http: httpx.Client,
                                                                               case: str) -> None:
    url, words = BAD[case]
    assert words in refused(http, chat(PROMPT, (url,)))
    assert answer(http, chat(PROMPT))["choices"][0]["message"]["content"]


def test_an_image_to_a_model_without_a_projector_is_a_400(http: httpx.Client) -> None:
    assert "no image projector" in refused(http, chat(PROMPT, (data_url(RED),), model="tiny"))
    assert answer(http, chat(PROMPT, model="tiny"))["choices"][0]["message"]["content"]


def test_an_image_the_context_cannot_hold_is_a_400(http: httpx.Client) -> None:
    assert "the context holds 64" in refused(http, chat("Hi", (data_url(RED),), (data_url(BLUE),), model="narrow"))
    assert answer(http, chat("Hi", model="narrow", max_tokens=4))["choices"][0]["message"]["content"]


SMALL = png(4, 4, (9, 9, 9))  # 16 pixels, 71 bytes
LIMITED = {"max_images": 1, "max_image_bytes": "200", "max_image_pixels": 100}  # as the flags give them
OVER_LIMITS = {  # what the default limits take and LIMITED refuses, with the setting the refusal names
    "max_images": (chat("A", (data_url(SMALL),), "B", (data_url(SMALL),)), "--max-images"),
    "max_image_bytes": (chat(PROMPT, (data_url(SMALL + bytes(200)),)), "--max-image-bytes"),  # after IEND: read
    "max_image_pixels": (chat(PROMPT, (data_url(RED),)), "--max-image-pixels"),
}


def test_the_gateways_image_limits_are_settings_and_lowered_refuse_what_the_defaults_take(
        served: tuple[ServerProcess, httpx.Client]) -> None:
    from gateway_thread import GatewayThread

    from mpserve.gateway.run import configure

    server, http = served
    gateway = GatewayThread(server_name=server.name, images=configure(LIMITED).images)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as lowered:
            for key, (body, setting) in OVER_LIMITS.items():
                assert answer(http, {**body, "max_tokens": 2})["choices"], key
                assert setting in refused(lowered, body), key
            assert answer(lowered, chat(PROMPT, (data_url(SMALL),), max_tokens=2))["choices"]
    finally:
        gateway.stop()
    over = mpserve("gateway", "--max-image-bytes", "4MiB", "--server-name", server.name)
    assert over.returncode != 0 and over.stderr.strip().splitlines() == [
        "error: [config] --max-image-bytes is 4194304; it must be from 1 to 3145728, what the wire carries"]


@pytest.mark.timeout(120)
def test_start_http_takes_the_image_limits_as_flags_and_refuses_one_past_the_wire_before_starting(
        pair: tuple[Path, Path], start_server: type[ServerProcess]) -> None:
    over = mpserve("start", "--model", "builtin:tiny", "--http", f"127.0.0.1:{free_port()}", "--max-image-bytes",
                   "4MiB")
    assert over.returncode != 0 and over.stderr.strip().splitlines() == [
        "error: [config] --max-image-bytes is 4194304; it must be from 1 to 3145728, what the wire carries"]
    model, projector = pair
    port = free_port()
    flags = [arg for key, value in LIMITED.items() for arg in ("--" + key.replace("_", "-"), str(value))]
    start_server("--model", str(model), "--mmproj", str(projector), "--name", "vision", "--http", f"127.0.0.1:{port}",
                 *flags).wait_ready()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as lowered:
        wait_for(lambda: http_up(f"http://127.0.0.1:{port}"), 30, "the gateway of start --http")
        for key, (body, setting) in OVER_LIMITS.items():
            assert setting in refused(lowered, body), key
        assert answer(lowered, chat(PROMPT, (data_url(SMALL),), max_tokens=2))["choices"]


def test_a_tenants_image_limit_refuses_its_requests_only(served: tuple[ServerProcess, httpx.Client]) -> None:
    from gateway_thread import GatewayThread

    server, _ = served
    gateway = GatewayThread(server_name=server.name, api_keys=(SMALL_KEY, OTHER_KEY))
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            small, other = ({"authorization": f"Bearer {key}"} for key in (SMALL_KEY, OTHER_KEY))
            reply = http.post("/v1/chat/completions", json=chat(PROMPT, (data_url(RED),)), headers=small)
            assert reply.status_code == 400, reply.text
            assert f"max_image_pixels of tenant {tenant_of(SMALL_KEY)}" in reply.json()["error"]["message"]
            for key, image in ((small, SMALL), (other, RED)):
                reply = http.post("/v1/chat/completions", json=chat(PROMPT, (data_url(image),), max_tokens=2),
                                  headers=key)
                assert reply.status_code == 200, reply.text
    finally:
        gateway.stop()


def test_a_projector_for_another_model_is_refused_at_start_in_one_line(pair: tuple[Path, Path],
                                                                       tmp_path: Path) -> None:
    bench = tmp_path / "wide-mmproj.gguf"
    from mpserve.models.mmproj_maker import write_projector

    write_projector(bench, "bench")
    started = mpserve("plan", "--model", str(pair[0]), "--mmproj", str(bench))
    assert started.returncode != 0
    assert "embeddings of 768 values and the model's are 64" in started.stderr, started.stderr


def test_responses_input_image_and_messages_image_block_reply_as_the_chat_does(http: httpx.Client) -> None:
    said = answer(http, chat(PROMPT, (data_url(RED),)))["choices"][0]["message"]["content"]
    response = http.post("/v1/responses", json={
        "model": "vision", "max_output_tokens": 24, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": PROMPT}, {"type": "input_image", "image_url": data_url(RED)}]}]})
    assert response.status_code == 200, response.text
    assert response.json()["output"][-1]["content"][0]["text"] == said
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()}
    message = http.post("/v1/messages", json={
        "model": "vision", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": PROMPT}, {"type": "image", "source": source}]}]})
    assert message.status_code == 200, message.text
    assert message.json()["content"][0]["text"] == said


def test_greedy_replies_with_images_equal_llama_servers_with_mmproj(http: httpx.Client,
                                                                    pair: tuple[Path, Path]) -> None:
    replies_as_llama_servers(http, pair, (chat(PROMPT, (data_url(RED),)),
                                          chat("A", (data_url(BLUE),), "B", (data_url(RED),))))


def replies_as_llama_servers(http: httpx.Client, pair: tuple[Path, Path], bodies: Sequence[dict[str, Any]]) -> None:
    """Each chat of ``bodies`` answered through ``http`` as ``llama-server --mmproj`` of ``pair`` answers it (greedy,
    one slot, no cache); the test is skipped without a llama-server binary."""
    binary = find_llama_server(None)
    if binary is None:
        pytest.skip("no llama-server binary: put one on PATH or under /opt/llama-server/ (bench/README.md)")
    port = free_port()
    model, projector = pair
    with HttpServer([binary, "--model", str(model), "--mmproj", str(projector), "--host", "127.0.0.1", "--port",
                     str(port), "--threads", "1", "--threads-batch", "1", "--parallel", "1", "--ctx-size", "2048"],
                    port, "/health") as peer:
        peer.wait_ready()
        for body in bodies:
            theirs = httpx.post(f"{peer.url}/v1/chat/completions", json={**body, "cache_prompt": False}, timeout=120)
            assert theirs.status_code == 200, theirs.text
            assert answer(http, body)["choices"][0]["message"]["content"] == \
                theirs.json()["choices"][0]["message"]["content"]


def mutations(seed: int, n: int) -> Iterator[bytes]:
    """``n`` images made from the test images by flipping, cutting and repeating bytes past their headers: what
    reaches llama.cpp's decoder when a header is sound and the rest is not."""
    rng = random.Random(seed)
    for _ in range(n):
        data = bytearray(rng.choice([RED, BLUE, png(7, 5, (1, 2, 3))]))
        for _ in range(rng.randrange(1, 8)):
            at = rng.randrange(24, len(data))
            data[at] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[:rng.randrange(24, len(data))]
        if rng.random() < 0.2:
            at = rng.randrange(24, len(data))
            data[at:at] = data[at:at + rng.randrange(1, 64)] * rng.randrange(1, 32)
        yield bytes(data)


@pytest.mark.timeout(300)
def test_fuzzed_image_bytes_are_answered_or_refused_and_no_worker_is_harmed(
        served: tuple[ServerProcess, httpx.Client]) -> None:
    server, http = served
    workers = {row.pid for row in server.slots()}
    for image in mutations(61, 120):
        reply = http.post("/v1/chat/completions", json=chat(PROMPT, (data_url(image),), max_tokens=2))
        assert reply.status_code in (200, 400), reply.text
    assert answer(http, chat(PROMPT, (data_url(RED),)))["choices"][0]["message"]["content"]
    assert {row.pid for row in server.slots()} == workers  # the same processes: none crashed and was replaced


@contextlib.contextmanager
def vision_gateway(pair: tuple[Path, Path], start_server: type[ServerProcess], *args: str
                   ) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    """A server of the vision pair started with ``args``, and an HTTP client of a gateway in front of it."""
    from gateway_thread import GatewayThread

    model, projector = pair
    server = start_server("--model", str(model), "--mmproj", str(projector), "--name", "vision", *args).wait_ready()
    gateway = GatewayThread(server_name=server.name)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            yield server, http
    finally:
        gateway.stop()


@pytest.mark.timeout(240)
def test_an_image_restored_from_the_host_store_after_its_instance_was_killed_gives_the_same_text(
        pair: tuple[Path, Path], start_server: type[ServerProcess]) -> None:
    """With ``reuse: exact``, whole prompt chunks are kept in the host store: the first one here holds the image, and
    the broker, told of it by its key, routes the prompt by it."""
    body = chat("Look: ", (data_url(BLUE),), " and then" + " the" * 600 + ". What is it?")
    with vision_gateway(pair, start_server, "--reuse", "exact") as (server, http):
        first = answer(http, body)
        [worker] = {row.pid for row in server.slots()}
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: {row.pid for row in server.slots()} not in ({worker}, {0}, set()), 60,
                 "the killed instance started again")
        again = answer(http, body)
        with Client(server.address) as client:
            counters = client.stats().counters
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512  # the first chunk, the image in it
    assert counters["routed_ram_prefix"] == 1, counters  # the store's entry told the broker of its image's key


@pytest.mark.timeout(180)
def test_a_prompt_with_an_image_is_routed_to_the_instance_holding_that_image_and_another_image_is_not(
        pair: tuple[Path, Path], start_server: type[ServerProcess]) -> None:
    """Two instances of one slot each; the text before the image is shorter than routing needs, so only the image's
    key can route. Without it, blue would follow red's text to red's instance, and red then find blue there."""
    model, projector = pair
    server = start_server("--model", str(model), "--mmproj", str(projector), "--name", "vision", "--instances", "2",
                          "--parallel", "1").wait_ready()
    wait_for(lambda: len(server.slots()) == 2, 60, "both instances registered")
    prompt = f"<|im_start|>user\n{MEDIA_MARKER}{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    with Client(server.address, timeout=60) as client:
        def run(image: bytes) -> Any:
            return client.generate(WithImages(prompt, (image,)), model="vision", max_tokens=4, temperature=0)

        red, blue = run(RED), run(BLUE)
        assert blue.worker != red.worker  # by load: blue shares too little with red's prompt
        again = {"red": run(RED), "blue": run(BLUE)}
        counters = client.stats().counters
    assert again["red"].worker == red.worker and again["blue"].worker == blue.worker
    for name, done in again.items():
        assert done.timings.cached_tokens >= TOKENS_PER_IMAGE + 2, (name, done.timings)  # the image and text before
    assert counters["routed_kv_prefix"] == 2 and counters["routed_least_busy"] == 2, counters


def memory(pid: int) -> dict[str, int]:
    """Process ``pid``'s memory by kind, in bytes (``/proc/PID/smaps_rollup``: Private_Dirty, Shared_Dirty, ...)."""
    rows = (line.split() for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:])
    return {row[0].rstrip(":"): int(row[1]) * 1024 for row in rows if len(row) == 3 and row[2] == "kB"}


@pytest.mark.timeout(240)
def test_forked_instances_share_the_projector_their_zygote_loaded_and_both_answer_images(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    """The projector's weights are in anonymous memory, not a file mapping: each fork's private memory (pages no
    other process maps) is smaller than the projector, which a copy of its own would be part of, and its shared
    memory holds them. The projector is made wide for it (about 67 MiB, several times an instance's own memory)."""
    from concurrent.futures import ThreadPoolExecutor

    from mpserve.models.maker import write_model
    from mpserve.models.mmproj_maker import write_projector

    pair = write_model(tmp_path / "vision.gguf", "tiny"), write_projector(tmp_path / "wide.gguf", hidden=180_000)
    weights = pair[1].stat().st_size
    with vision_gateway(pair, start_server, "--instances", "2") as (server, http), ThreadPoolExecutor(4) as pool:
        said = answer(http, chat(PROMPT, (data_url(RED),)))["choices"][0]["message"]["content"]
        for _ in range(20):  # until each instance answered one (requests go to the least busy)
            replies = list(pool.map(lambda _: answer(http, chat(PROMPT, (data_url(RED),))), range(4)))
            assert {r["choices"][0]["message"]["content"] for r in replies} == {said}
            if all(row.served for row in server.slots()):
                break
        assert all(row.served for row in server.slots()), server.slots()
        forks = {pid: memory(pid) for pid in (row.pid for row in server.slots())}
    for pid, kinds in forks.items():
        assert kinds["Private_Clean"] + kinds["Private_Dirty"] < weights, (pid, weights, kinds)
        assert kinds["Shared_Clean"] + kinds["Shared_Dirty"] > weights, (pid, weights, kinds)
    loads = [line for line in server.log if "loaded the projector" in line]
    assert len(loads) == 1 and "zygote" in loads[0] and "instances share it" in loads[0], loads
    assert not [line for line in server.log if "clip_" in line or "image slice" in line]  # llama.cpp's info lines


@pytest.mark.timeout(120)
def test_the_python_and_node_clients_send_images_as_the_gateway_does(served: tuple[ServerProcess, httpx.Client],
                                                                      tmp_path: Path) -> None:
    server, http = served
    python, node = clients_say(server.address, RED, tmp_path, "vision")
    assert python == answer(http, chat(PROMPT, (data_url(RED),), max_tokens=16))["choices"][0]["message"]["content"]
    assert node == python


def clients_say(address: str, media: bytes, folder: Path, model: str) -> tuple[str, str]:
    """What the Python and the Node.js clients generate (greedy, 16 tokens) for PROMPT with ``media`` (an image or
    an audio clip) at its marker, in a ChatML turn as the tiny model's template writes it."""
    prompt = f"<|im_start|>user\n{PROMPT}{MEDIA_MARKER}<|im_end|>\n<|im_start|>assistant\n"
    with Client(address) as client:
        python = client.generate(WithImages(prompt, (media,)), model=model, max_tokens=16, temperature=0).text
    (folder / "media").write_bytes(media)
    node = subprocess.run([shutil.which("node") or "node", "test/images.mjs", address, str(folder / "media"), model],
                          cwd=Path(__file__).parents[1] / "clients" / "node", capture_output=True, text=True,
                          timeout=100)
    assert node.returncode == 0, node.stderr
    return python, str(json.loads(node.stdout.strip().splitlines()[-1])["text"])
