"""Audio in chat completions, where it cannot be served: ``input_audio`` parts read and checked by the gateway, and
each bad clip, or a clip sent to a model that cannot hear it (no projector, or an image projector), a 400 that says
which, with no worker harmed."""

from __future__ import annotations

import base64
import io
import math
import re
import struct
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from helpers import config_file, free_port, mpserve
from test_images import gateway_of

from mpserve.gateway.http.keys import tenant_of

pytestmark = pytest.mark.timeout(180)

PROMPT = "What do you hear?"
SHORT_KEY = "short-audio-key"


def wav(freq: float, seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A sine of ``freq`` Hz, 16-bit mono PCM."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(12000 * math.sin(2 * math.pi * freq * i / rate)))
                               for i in range(int(seconds * rate))))
    return out.getvalue()


A440 = wav(440)


def audio_part(data: bytes, form: str = "wav") -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": form}}


def chat(*parts: str | dict[str, Any], model: str, max_tokens: int = 8) -> dict[str, Any]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    """A server of the vision pair (``vision``: an image projector only, 4 slots) and the tiny model without a projector
    (``tiny``), the tenant of ``SHORT_KEY`` may send 1 second of audio; and a client of its gateway."""
    folder = tmp_path_factory.mktemp("vision")
    model, projector = folder / "vision.gguf", folder / "mmproj.gguf"
    made = mpserve("make-model", str(model), "--size", "tiny", "--mmproj", str(projector))
    assert made.returncode == 0, made.stderr
    config = config_file(folder, "audio", models=[{"name": "vision", "path": str(model), "mmproj": str(projector),
                                                   "parallel": 4},
                                                  {"name": "tiny", "path": "builtin:tiny"}],
                         tenants={tenant_of(SHORT_KEY): {"max_audio_seconds": 1}})
    with gateway_of("--config", config) as both:
        yield both


def refused(http: httpx.Client, body: dict[str, Any], path: str = "/v1/chat/completions",
            headers: dict[str, str] | None = None) -> str:
    reply = http.post(path, json=body, headers=headers)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "bad_request", reply.text
    return str(reply.json()["error"]["message"])


def answered(http: httpx.Client, model: str) -> None:
    reply = http.post("/v1/chat/completions", json=chat(PROMPT, model=model))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


MP3_FRAME = bytes([0xFF, 0xFB, 0x10, 0x00]) + bytes(100)  # MPEG-1 layer III, 32 kbit/s, 44.1 kHz: 104 bytes, 1152
BAD = {  # what each bad clip's refusal says
    "not base64": ({"data": "@@@@", "format": "wav"}, "not valid base64"),
    "no format": ({"data": base64.b64encode(A440).decode()}, "\"format\": \"wav\" or \"mp3\""),
    "flac": ({"data": base64.b64encode(b"fLaC" + bytes(64)).decode(), "format": "wav"}, "unknown audio format"),
    "named mp3, is wav": ({"data": base64.b64encode(A440).decode(), "format": "mp3"}, "its bytes are wav"),
    "cut header": ({"data": base64.b64encode(A440[:30]).decode(), "format": "wav"}, "cut short"),
    "no data chunk": ({"data": base64.b64encode(A440[:36]).decode(), "format": "wav"}, "no data chunk"),
    "adpcm": ({"data": base64.b64encode(A440[:20] + b"\x02\x00" + A440[22:]).decode(), "format": "wav"},
              "not PCM or float"),
    "free-format mp3": ({"data": base64.b64encode(b"\xff\xfb\x00\x00" + bytes(64)).decode(), "format": "mp3"},
                        "free-format"),
    "too long": ({"data": base64.b64encode(MP3_FRAME * 5000).decode(), "format": "mp3"},  # 130 s in 520 kB
                 "at most 120 are accepted per request (the gateway's --max-audio-seconds)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_clip_is_a_400_naming_what_is_wrong_and_the_server_answers_after(
        served: tuple[ServerProcess, httpx.Client], case: str) -> None:
    server, http = served
    workers = {row.pid for row in server.slots()}
    value, words = BAD[case]
    assert words in refused(http, chat(PROMPT, {"type": "input_audio", "input_audio": value}, model="vision"))
    answered(http, "vision")
    assert {row.pid for row in server.slots()} == workers


def test_audio_to_a_model_without_a_projector_or_with_an_image_projector_is_a_400_and_harms_no_worker(
        served: tuple[ServerProcess, httpx.Client]) -> None:
    server, http = served
    workers = {row.pid for row in server.slots()}
    assert "this model has no audio projector (mmproj)" in refused(http, chat(PROMPT, audio_part(A440),
                                                                              model="tiny"))
    assert "projector takes images, not audio (it has no audio encoder)" in refused(
        http, chat(PROMPT, audio_part(A440), model="vision"))
    for model in ("tiny", "vision"):
        answered(http, model)
    assert {row.pid for row in server.slots()} == workers


def test_a_refused_clip_does_not_disturb_the_requests_running_beside_it(
        served: tuple[ServerProcess, httpx.Client]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    _, http = served
    long = {**chat(PROMPT, model="vision", max_tokens=64), "ignore_eos": True}
    alone = http.post("/v1/chat/completions", json=long).json()["choices"][0]["message"]["content"]
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(http.post, "/v1/chat/completions", json=long) for _ in range(3)]
        assert "no audio encoder" in refused(http, chat(PROMPT, audio_part(A440), model="vision"))
        for future in running:
            assert future.result().json()["choices"][0]["message"]["content"] == alone


def test_a_tenants_audio_limit_refuses_its_requests_only_and_a_zeromq_clients_clip_meets_the_workers_checks(
        served: tuple[ServerProcess, httpx.Client]) -> None:
    from gateway_thread import GatewayThread

    from mpserve import Client
    from mpserve.errors import BadRequest
    from mpserve.wire.media import MEDIA_MARKER, WithImages

    server, _ = served
    gateway = GatewayThread(server_name=server.name, api_keys=(SHORT_KEY, "other-key"))
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            body = chat(PROMPT, audio_part(wav(440, 2.0)), model="vision")
            message = refused(http, body, headers={"authorization": f"Bearer {SHORT_KEY}"})
            assert f"lasts 2.0 seconds; at most 1 are accepted per request (max_audio_seconds of tenant " \
                   f"{tenant_of(SHORT_KEY)}" in message
            # the other tenant's request passes the limit, and reaches the projector that has no audio encoder
            assert "no audio encoder" in refused(http, body, headers={"authorization": "Bearer other-key"})
    finally:
        gateway.stop()
    long = bytes([0xFF, 0xE3, 0x18, 0xC0]) + bytes(68)  # MPEG-2.5 layer III, 8 kbit/s at 8 kHz: 72 bytes, 72 ms
    with Client(server.address) as client:  # no gateway: the worker checks what the wire carries
        for clip, words in ((A440, "no audio encoder"), (long * 8400, "lasts 604.8 seconds; at most 600 are "
                                                                      "accepted per request (the wire's bound")):
            with pytest.raises(BadRequest, match=re.escape(words)):
                client.generate(WithImages(f"{PROMPT}{MEDIA_MARKER} then", (clip,)), model="vision", max_tokens=2)


def test_responses_input_audio_is_read_as_chats_and_messages_has_no_audio_block(
        served: tuple[ServerProcess, httpx.Client]) -> None:
    _, http = served
    body = {"model": "vision", "max_output_tokens": 8, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": PROMPT}, audio_part(A440, "mp3")]}]}
    assert "its bytes are wav" in refused(http, body, "/v1/responses")
    body["input"][0]["content"][1] = audio_part(A440)
    assert "no audio encoder" in refused(http, body, "/v1/responses")


def test_the_gateways_audio_limit_is_a_setting_bounded_by_what_the_wire_carries() -> None:
    for command in (("gateway", "--server-name", "nowhere"), ("start", "--model", "builtin:tiny", "--http",
                                                              f"127.0.0.1:{free_port()}")):
        over = mpserve(*command, "--max-audio-seconds", "601")
        assert over.returncode != 0 and over.stderr.strip().splitlines() == [
            "error: [config] --max-audio-seconds is 601; it must be from 1 to 600, what the wire carries"], command
