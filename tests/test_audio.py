"""Audio in chat completions, end to end: the random audio pair (``mpserve make-model --mmproj --audio``: the tiny
model and a Whisper-style projector llama.cpp's loader accepts) served with ``--mmproj``, WAV clips made here (sines)
sent as ``input_audio`` through the HTTP gateway and both clients, decoded and encoded by llama.cpp's multimodal
library in the worker, and reused from the cache by the decoded samples."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ServerProcess
from helpers import mpserve
from test_audio_input import audio_part, chat, wav
from test_images import PROMPT, RED, answer, clients_say, data_url, gateway_of, replies_as_llama_servers

from mpserve.models.audio_maker import TOKENS_PER_CHUNK

pytestmark = pytest.mark.timeout(180)

A440, A880 = wav(440, 5.0), wav(880, 5.0)  # 5 s: a sixth of the clip's 30-s window is not its silence


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("audio")
    model, projector = folder / "audio.gguf", folder / "mmproj-audio.gguf"
    made = mpserve("make-model", str(model), "--size", "tiny", "--mmproj", str(projector), "--audio")
    assert made.returncode == 0, made.stderr
    return model, projector


@pytest.fixture(scope="module")
def served(pair: tuple[Path, Path]) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    with gateway_of("--model", str(pair[0]), "--mmproj", str(pair[1]), "--name", "audio", "--parallel", "4") as both:
        yield both


@pytest.fixture(scope="module")
def http(served: tuple[ServerProcess, httpx.Client]) -> httpx.Client:
    return served[1]


def said(reply: dict[str, Any]) -> str:
    return str(reply["choices"][0]["message"]["content"])


def test_a_clip_is_answered_and_the_same_clip_again_is_reused_from_the_cache(http: httpx.Client) -> None:
    first = answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=16))
    again = answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=16))
    assert said(first) and said(again) == said(first)
    assert first["usage"]["prompt_tokens"] > TOKENS_PER_CHUNK  # the clip's positions, and the text around it
    assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= TOKENS_PER_CHUNK + 4, again["usage"]


def test_another_clip_gives_another_reply_and_is_not_taken_from_the_first_ones_cells(http: httpx.Client) -> None:
    low = answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=16))
    high = answer(http, chat(PROMPT, audio_part(A880), model="audio", max_tokens=16))
    assert said(high) != said(low)
    assert high["usage"]["prompt_tokens_details"]["cached_tokens"] < \
        high["usage"]["prompt_tokens"] - TOKENS_PER_CHUNK  # the text before the clip may be reused, the clip not


def test_an_image_to_an_audio_projector_is_a_400(http: httpx.Client) -> None:
    body = {"model": "audio", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": data_url(RED)}}]}]}
    reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert "projector takes audio, not images (it has no vision encoder)" in reply.json()["error"]["message"]
    assert said(answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=4)))


@pytest.mark.timeout(120)
def test_the_python_and_node_clients_send_audio_as_the_gateway_does(served: tuple[ServerProcess, httpx.Client],
                                                                     tmp_path: Path) -> None:
    server, http = served
    python, node = clients_say(server.address, A440, tmp_path, "audio")
    assert python == said(answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=16)))
    assert node == python


def test_greedy_replies_with_audio_equal_llama_servers_with_mmproj(http: httpx.Client,
                                                                   pair: tuple[Path, Path]) -> None:
    replies_as_llama_servers(http, pair, (chat(PROMPT, audio_part(A440), model="audio", max_tokens=16),
                                          chat("A", audio_part(A880), "B", model="audio", max_tokens=16)))


def test_an_audio_projector_for_another_model_is_refused_at_start_in_one_line(pair: tuple[Path, Path],
                                                                             tmp_path: Path) -> None:
    from mpserve.models.audio_maker import write_audio_projector

    wide = write_audio_projector(tmp_path / "wide-audio.gguf", "bench")
    started = mpserve("plan", "--model", str(pair[0]), "--mmproj", str(wide))
    assert started.returncode != 0
    assert "embeddings of 768 values and the model's are 64" in started.stderr, started.stderr
    assert mpserve("plan", "--model", str(pair[0]), "--mmproj", str(pair[1])).returncode == 0


SILENT_MP3 = (bytes([0xFF, 0xFB, 0x90, 0x64]) + bytes(413)) * 40  # MPEG-1 layer III frames of nothing: 1.04 s


def test_an_mp3_clip_is_answered_with_a_window_as_a_wavs_is(http: httpx.Client) -> None:
    wav_reply = answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=4))
    mp3_reply = answer(http, chat(PROMPT, audio_part(SILENT_MP3, "mp3"), model="audio", max_tokens=4))
    assert said(mp3_reply)
    assert mp3_reply["usage"]["prompt_tokens"] == wav_reply["usage"]["prompt_tokens"]  # one 30-s window each


def mutations(seed: int, n: int) -> Iterator[tuple[bytes, str]]:
    """``n`` clips made from a WAV and an MP3 by flipping, cutting and repeating bytes: what reaches llama.cpp's
    decoder when a header is sound or nearly so and the rest is not."""
    rng = random.Random(seed)
    for _ in range(n):
        form = rng.choice(["wav", "mp3"])
        data = bytearray(wav(330, 0.5) if form == "wav" else SILENT_MP3[:417 * 8])
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[:rng.randrange(4, len(data))]
        if rng.random() < 0.2:
            at = rng.randrange(len(data))
            data[at:at] = data[at:at + rng.randrange(1, 64)] * rng.randrange(1, 32)
        yield bytes(data), form


@pytest.mark.timeout(300)
def test_fuzzed_clips_are_answered_or_refused_and_no_worker_is_harmed(
        served: tuple[ServerProcess, httpx.Client]) -> None:
    server, http = served
    workers = {row.pid for row in server.slots()}
    statuses = set()
    for clip, form in mutations(62, 60):
        reply = http.post("/v1/chat/completions", json=chat(PROMPT, audio_part(clip, form), model="audio",
                                                            max_tokens=2))
        assert reply.status_code in (200, 400), reply.text
        statuses.add(reply.status_code)
    assert statuses == {200, 400}  # some reached the decoder and the encoder, some were refused
    assert said(answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=4)))
    assert {row.pid for row in server.slots()} == workers  # the same processes: none crashed and was replaced


def test_responses_input_audio_replies_as_the_chat_does(http: httpx.Client) -> None:
    chat_said = said(answer(http, chat(PROMPT, audio_part(A440), model="audio", max_tokens=16)))
    response = http.post("/v1/responses", json={
        "model": "audio", "max_output_tokens": 16, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": PROMPT}, audio_part(A440)]}]})
    assert response.status_code == 200, response.text
    assert response.json()["output"][-1]["content"][0]["text"] == chat_said


def test_clips_and_text_decoded_in_one_batch_reply_as_each_does_alone(http: httpx.Client) -> None:
    from concurrent.futures import ThreadPoolExecutor

    bodies = [chat(PROMPT, audio_part(clip), model="audio", max_tokens=16) for clip in (A440, A880)] + \
        [{**chat(f"Tell me about {topic}.", model="audio", max_tokens=16), "ignore_eos": True}
         for topic in ("rivers", "stones")]
    alone = [said(answer(http, {**body, "cache_salt": "alone"})) for body in bodies]
    for run in range(2):  # each run its own salt: nothing is reused from the runs before
        salted = [{**body, "cache_salt": f"run {run}"} for body in bodies]
        with ThreadPoolExecutor(len(bodies)) as pool:
            together = list(pool.map(lambda body: said(answer(http, body)), salted))
        assert together == alone
