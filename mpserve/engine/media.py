"""Images in a prompt: a model's projector (llama.cpp's multimodal library, ``mtmd``), the images a request sends
decoded to bitmaps, and the prompt's tokens with each image's positions in their place.

    Projector(path, model) ──mtmd_init_from_file──▶ the projector, checked against the model by llama.cpp
    image bytes ──wire.media.check_image (the header: format, size)──▶ mtmd's decoder ──▶ Image: RGB pixels, their
                 width and height, their digest (sha256 of the decoded bitmap) and its positions' count
    prompt text (MEDIA_MARKER per image) ──prompt()──▶ tokens: the text's own, and per image n_tokens placeholder
                 ids, negative (never a vocabulary's) and drawn from the image's digest: the same image gives the
                 same ids, another image others ──▶ cells, the host store and slot reuse compare them as tokens
    Sequence.images {start: Image} ──decode()──▶ mtmd encodes the image and decodes its embeddings at its positions
    a prefix of the tokens ──spelled()──▶ the text routing reads (each whole image as its key, ``wire.prefix.routed``)

An image is a prefix like tokens: its placeholder ids are its content address, so a prompt that repeats an image
reuses the cells computed for it, and one with another image does not. An image's cells are computed whole: a
prefix that ends inside one is cut back to the image's start (``inside``).
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mpserve.errors import BadRequest
from mpserve.wire.media import MEDIA_MARKER, WIRE_LIMITS, check_image
from mpserve.wire.prefix import media_key

from .llama_log import install_media
from .sequence import PROMPT_CHUNK


@dataclass(frozen=True)
class Image:
    """A decoded image: ``rgb`` holds ``width`` × ``height`` pixels of 3 bytes; ``ids`` its placeholder tokens;
    ``key`` its place in the text routing reads (of its bytes as sent: ``wire.prefix.media_key``)."""

    rgb: bytes
    width: int
    height: int
    digest: bytes
    ids: tuple[int, ...]
    key: str


class Projector:
    """A model's image projector, loaded beside the model (``mtmd_init_from_file`` checks that they fit)."""

    def __init__(self, path: str, model: Any, threads: int, use_gpu: bool, warmup: bool = True) -> None:
        import llama_cpp
        from llama_cpp import mtmd_cpp

        install_media(llama_cpp, mtmd_cpp)
        self._mtmd: Any = mtmd_cpp
        params = mtmd_cpp.mtmd_context_params_default()
        params.use_gpu, params.n_threads, params.print_timings, params.warmup = use_gpu, threads, False, warmup
        self._ctx: Any = mtmd_cpp.mtmd_init_from_file(path.encode(), model, params)
        if not self._ctx:
            raise ValueError(f"llama.cpp cannot load the projector {path!r} with this model (its log says why)")
        if not mtmd_cpp.mtmd_support_vision(self._ctx):
            self.close()
            raise ValueError(f"the projector {path!r} has no vision encoder; mpserve serves image projectors")

    def image(self, data: bytes, where: str) -> Image:
        """``data`` decoded, after its header was checked against the wire's bounds; BadRequest if it cannot be."""
        check_image(data, WIRE_LIMITS, where)
        mtmd = self._mtmd
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
        if not bitmap:
            raise BadRequest(f"{where}: the image cannot be decoded (corrupt or cut short)")
        try:
            width, height = mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap)
            size = mtmd.mtmd_bitmap_get_n_bytes(bitmap)
            rgb = ctypes.string_at(mtmd.mtmd_bitmap_get_data(bitmap), size)
        finally:
            mtmd.mtmd_bitmap_free(bitmap)
        digest = hashlib.sha256(struct.pack("<II", width, height) + rgb).digest()
        n_tokens = self._n_tokens(rgb, width, height)
        return Image(rgb, width, height, digest, placeholder_ids(digest, n_tokens), media_key(data))

    def prompt(self, text: str, images: Sequence[Image], tokenize: Any) -> tuple[list[int], dict[int, Image]]:
        """The tokens of ``text`` (``tokenize(part, first)`` gives a text part's) with each image's placeholder ids
        where its marker is, and where each image starts; BadRequest if markers and images do not pair up."""
        parts = text.split(MEDIA_MARKER)
        if len(parts) - 1 != len(images):
            raise BadRequest(f"the prompt places {len(parts) - 1} images ({MEDIA_MARKER}) but the request carries "
                             f"{len(images)}")
        tokens: list[int] = tokenize(parts[0], True)
        starts: dict[int, Image] = {}
        for image, part in zip(images, parts[1:], strict=True):
            starts[len(tokens)] = image
            tokens += image.ids
            tokens += tokenize(part, False)
        return tokens, starts

    def decode(self, image: Image, lctx: Any, n_past: int, slot: int, n_batch: int) -> None:
        """Encode ``image`` and decode its embeddings into ``slot``'s cells from position ``n_past``."""
        mtmd = self._mtmd
        with self._chunks(image.rgb, image.width, image.height) as chunk:
            new_n_past = ctypes.c_int32(0)
            if mtmd.mtmd_helper_eval_chunk_single(self._ctx, lctx, chunk, n_past, slot, n_batch, False,
                                                  ctypes.byref(new_n_past)):
                raise RuntimeError("llama.cpp failed to encode or decode an image")

    def _n_tokens(self, rgb: bytes, width: int, height: int) -> int:
        with self._chunks(rgb, width, height) as chunk:
            return int(self._mtmd.mtmd_input_chunk_get_n_tokens(chunk))

    def _chunks(self, rgb: bytes, width: int, height: int) -> _ImageChunk:
        return _ImageChunk(self._mtmd, self._ctx, rgb, width, height)

    def close(self) -> None:
        if self._ctx:
            self._mtmd.mtmd_free(self._ctx)
            self._ctx = None


class _ImageChunk:
    """The one image chunk of a prompt that is only the marker, tokenized for ``rgb``; freed on leaving."""

    def __init__(self, mtmd: Any, ctx: Any, rgb: bytes, width: int, height: int) -> None:
        self._mtmd, self._ctx, self._rgb, self._size = mtmd, ctx, rgb, (width, height)
        self._chunks: Any = None

    def __enter__(self) -> Any:
        mtmd = self._mtmd
        pixels = (ctypes.c_uint8 * len(self._rgb)).from_buffer_copy(self._rgb)
        bitmap = mtmd.mtmd_bitmap_init(self._size[0], self._size[1], pixels)
        self._chunks = mtmd.mtmd_input_chunks_init()
        try:
            marker = MEDIA_MARKER.encode()
            text = mtmd.mtmd_input_text(marker, len(marker), False, True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd.mtmd_tokenize(self._ctx, self._chunks, ctypes.byref(text), bitmaps, 1):
                raise BadRequest("llama.cpp's projector cannot take this image")
        finally:
            mtmd.mtmd_bitmap_free(bitmap)
        for i in range(mtmd.mtmd_input_chunks_size(self._chunks)):
            chunk = mtmd.mtmd_input_chunks_get(self._chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                return chunk
        raise BadRequest("llama.cpp's projector made no image chunk of this image")

    def __exit__(self, *exc: object) -> None:
        self._mtmd.mtmd_input_chunks_free(self._chunks)


def prompt_tokens(context: Any, prompt: str | list[int], images: Sequence[bytes],
                  prompt_logprobs: bool) -> tuple[list[int], dict[int, Image]]:
    """A prompt's tokens and its images by start (none without images): a text prompt's with each image's placeholder
    ids at its marker, BOS first as ``Context.tokenize_prompt`` gives it; BadRequest naming what cannot be."""
    if not images:
        tokens = context.tokenize_prompt(prompt) if isinstance(prompt, str) else context.in_vocabulary(prompt, "prompt")
        return tokens, {}
    projector: Projector | None = context.projector
    if projector is None:
        raise BadRequest("this model has no image projector (mmproj); it takes text only")
    if not isinstance(prompt, str):
        raise BadRequest(f"images go with a text prompt that places them ({MEDIA_MARKER}), not with token ids")
    if prompt_logprobs:
        raise BadRequest("'prompt_logprobs' cannot score a prompt's image positions; ask without it")
    decoded = [projector.image(data, f"image {i}") for i, data in enumerate(images)]
    tokens, starts = projector.prompt(prompt, decoded, lambda part, first: (context.bos if first else []) +
                                      context.tokenize(part, False))
    if tokens and tokens[-1] < 0:
        raise BadRequest("the prompt ends with an image; a prompt's last position must be text, whose logits give "
                         "the first token")
    return tokens, starts


def prefill(context: Any, keeping: Any, seq: Any) -> int:
    """Decode the image ``seq``'s prefill is at, if it is at one (after cutting cells that end inside an image back to
    its start), its cells then kept as a prompt chunk's are (``Keeping.save_computed``): the positions computed, 0 if
    its next positions are text. A prompt never ends with an image (``prompt_tokens``)."""
    start = inside(seq.images, seq.n_past)
    if start is not None:  # reused or copied cells that end inside an image: it is computed again, whole
        context.seq_rm(seq.slot, start, -1)
        seq.n_past, seq.reused = start, min(seq.reused, start)
    image, projector = seq.images.get(seq.n_past), context.projector
    if image is None or projector is None:
        return 0
    projector.decode(image, context.ctx, seq.n_past, seq.slot, PROMPT_CHUNK)
    seq.n_past += len(image.ids)
    keeping.save_computed(seq, len(image.ids))
    return len(image.ids)


def placeholder_ids(digest: bytes, n_tokens: int) -> tuple[int, ...]:
    """An image's ``n_tokens`` placeholder token ids: negative int32s drawn from its digest, one per position."""
    ids = []
    for i in range(n_tokens):
        word = hashlib.blake2b(digest + i.to_bytes(4, "little"), digest_size=4).digest()
        ids.append(-1 - int.from_bytes(word, "little") % (2**31 - 1))
    return tuple(ids)


def inside(images: Mapping[int, Image], position: int) -> int | None:
    """The start of the image that ``position`` falls strictly inside (cells up to it hold part of the image)."""
    for start, image in images.items():
        if start < position < start + len(image.ids):
            return start
    return None


def spelled(kept: Sequence[int], skip: int, images: Mapping[int, Image],
            detokenize: Callable[[list[int]], str]) -> str:
    """The text routing reads that ``kept`` (a prefix of a prompt's tokens, whose images start as ``images`` gives)
    spells after its first ``skip`` (BOS): its text runs detokenized, each image it holds whole as its key, up to
    the first it holds in part."""
    spelt: list[str] = []
    at = skip
    for start, image in sorted(images.items()):
        spelt.append(detokenize(list(kept[at:start])))
        at = start + len(image.ids)
        if at > len(kept):
            return "".join(spelt)
        spelt.append(image.key)
    return "".join(spelt) + detokenize(list(kept[at:]))


def outside(images: Mapping[int, Image], marks: tuple[int, ...]) -> tuple[int, ...]:
    """The ``marks`` (positions where a prompt's cells are saved) that are not inside an image."""
    return tuple(mark for mark in marks if inside(images, mark) is None)
