"""Prompts with images as routing reads them: each image by the key of its bytes (``wire.prefix.routed``) on the
broker's side, and the same text spelled from a prefix of the prompt's tokens on the worker's (``media.spelled``),
so an instance's cached prompts with images match the same image and text, and not another image."""

from __future__ import annotations

import pytest

from mpserve.engine.media import Image, placeholder_ids, spelled
from mpserve.server.routing import MIN_SHARED_PREFIX, Source, choose_slots
from mpserve.server.state import WorkerEntry
from mpserve.wire.media import MEDIA_MARKER
from mpserve.wire.prefix import common_prefix, media_key, routed

pytestmark = pytest.mark.timeout(10)

RED, BLUE = b"red image bytes", b"blue image bytes"
PROMPT = f"user: {MEDIA_MARKER} What is this?"


def test_the_routed_text_holds_each_images_key_where_its_marker_was() -> None:
    text = routed(PROMPT, (RED,))
    assert text == f"user: {media_key(RED)} What is this?" and MEDIA_MARKER not in text
    assert routed(PROMPT, (RED,)) == text and routed(PROMPT, (BLUE,)) != text
    assert common_prefix(routed(PROMPT, (BLUE,)), text) < MIN_SHARED_PREFIX  # "user: " and the key's opening
    assert routed(f"{MEDIA_MARKER}a{MEDIA_MARKER}", (RED, BLUE)) == f"{media_key(RED)}a{media_key(BLUE)}"
    assert routed(PROMPT, ()) == PROMPT and routed(PROMPT, (RED, BLUE)) == PROMPT  # not paired: the worker refuses


def entry(name: str, text: str) -> WorkerEntry:
    return WorkerEntry(name.encode(), None, "m", -1, 1, pid=1, prompts={0: (b"", text)})


def test_a_prompt_with_an_image_goes_where_that_image_was_and_another_image_goes_by_load() -> None:
    red, blue = routed(PROMPT, (RED,)), routed(PROMPT, (BLUE,))
    workers = {b"a": entry("a", red), b"b": entry("b", "")}
    free = [(b"b", 0), (b"a", 0)]  # b free the longest
    route = choose_slots(free, workers, red + " Say more.", 1)
    assert route is not None and route.slots == [(b"a", 0)] and route.source is Source.KV
    route = choose_slots(free, workers, blue, 1)
    assert route is not None and route.slots == [(b"b", 0)] and route.source is Source.LOAD


def image(key: bytes, n: int) -> Image:
    return Image(b"", 1, 1, key, placeholder_ids(key, n), media_key(key))


def test_a_prefix_of_the_tokens_spells_the_routed_text_as_far_as_it_holds_whole_images() -> None:
    def detokenize(tokens: list[int]) -> str:
        assert all(t >= 0 for t in tokens)
        return "".join(chr(t) for t in tokens)

    red, blue = image(RED, 5), image(BLUE, 3)
    tokens = [1, *map(ord, "ab"), *red.ids, *map(ord, "cd"), *blue.ids, *map(ord, "e")]  # BOS, then the prompt
    images = {3: red, 10: blue}
    text = routed(f"ab{MEDIA_MARKER}cd{MEDIA_MARKER}e", (RED, BLUE))
    assert spelled(tokens, 1, images, detokenize) == text
    assert spelled(tokens + [ord("!")], 1, images, detokenize) == text + "!"  # a generated token after it
    assert spelled(tokens[:10], 1, images, detokenize) == "ab" + red.key + "cd"
    assert spelled(tokens[:12], 1, images, detokenize) == "ab" + red.key + "cd"  # inside blue: up to its start
    assert spelled(tokens[:5], 1, images, detokenize) == "ab"
    assert spelled(tokens[:13], 1, images, detokenize) == "ab" + red.key + "cd" + blue.key
