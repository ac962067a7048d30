"""Images and audio in a prompt: a model's projector (llama.cpp's multimodal library, ``mtmd``), the images and
audio clips a request sends decoded to bitmaps, and the prompt's tokens with each one's positions in their place.

    Projector(path, model) ──mtmd_init_from_file──▶ the projector, checked against the model by llama.cpp
    image bytes ──wire.media.check_image (the header: format, size)──▶ mtmd's decoder ──▶ Image: RGB pixels, their
                 width and height, their digest (sha256 of the decoded bitmap) and its positions' count
    clip bytes ──wire.audio.read_audio (WAV or MP3: its seconds)──▶ mtmd's decoder ──▶ Clip: float32 samples at
                 the projector's rate, their digest, and the ids of every chunk mtmd makes of it (the text it puts
                 around the clip as its tokens, each 30-s window as placeholders); a projector without the encoder
                 a clip or an image needs refuses it (BadRequest)
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
from mpserve.wire.audio import is_audio
from mpserve.wire.media import MEDIA_MARKER, WIRE_LIMITS, check_images
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


@dataclass(frozen=True)
class Clip(Image):
    """A decoded audio clip, kept as llama.cpp's library keeps one: ``rgb`` holds its ``width`` samples (float32,
    mono, at the projector's rate; ``height`` is 1); ``ids`` are those of every chunk the library makes of it: the
    text it puts around a clip (that text's own tokens) and each 30-second window's placeholders."""


class Projector:
    """A model's projector of images, of audio or of both, loaded beside the model (``mtmd_init_from_file`` checks
    that they fit)."""

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
        self.vision, self.audio = bool(mtmd_cpp.mtmd_support_vision(self._ctx)), \
            bool(mtmd_cpp.mtmd_support_audio(self._ctx))
        if not self.vision and not self.audio:
            self.close()
            raise ValueError(f"the projector {path!r} has neither a vision nor an audio encoder")

    def image(self, data: bytes, where: str) -> Image:
        """``data`` decoded, its header checked against the wire's bounds already (``prompt_tokens``); BadRequest if
        it cannot be."""
        if not self.vision:
            raise BadRequest(f"{where}: this model's projector takes audio, not images (it has no vision encoder)")
        width, height, rgb = self._decoded(data, where, audio=False)
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

    def clip(self, data: bytes, where: str) -> Clip:
        """``data`` (WAV or MP3) decoded, its header read already (``prompt_tokens``: its seconds bounded);
        BadRequest if it cannot be."""
        if not self.audio:
            raise BadRequest(f"{where}: this model's projector takes images, not audio (it has no audio encoder)")
        n_samples, _, samples = self._decoded(data, where, audio=True)
        if not n_samples:
            raise BadRequest(f"{where}: the audio holds no samples")
        mtmd = self._mtmd
        digest = hashlib.sha256(b"audio" + struct.pack("<I", mtmd.mtmd_get_audio_bitrate(self._ctx)) + samples).digest()
        ids: list[int] = []
        with _Chunks(mtmd, self._ctx, samples, n_samples, 1, True) as chunks:
            for chunk in chunks:
                ids += _text_tokens(mtmd, chunk) if mtmd.mtmd_input_chunk_get_type(chunk) == \
                    mtmd.MTMD_INPUT_CHUNK_TYPE_TEXT else placeholder_ids(digest, _n(mtmd, chunk), len(ids))
        return Clip(samples, n_samples, 1, digest, tuple(ids), media_key(data))

    def _decoded(self, data: bytes, where: str, audio: bool) -> tuple[int, int, bytes]:
        """``data`` decoded by llama.cpp's library: an image's width, height and RGB pixels, or a clip's sample
        count, 1 and float32 samples; BadRequest if it is not what ``audio`` says or cannot be decoded."""
        mtmd, what = self._mtmd, "audio" if audio else "image"
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = mtmd.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
        if not bitmap:
            raise BadRequest(f"{where}: the {what} cannot be decoded (corrupt or cut short)")
        try:
            if bool(mtmd.mtmd_bitmap_is_audio(bitmap)) != audio:
                raise BadRequest(f"{where}: the {what} decodes as {'an image' if audio else 'audio'}")
            size = mtmd.mtmd_bitmap_get_n_bytes(bitmap)
            return (mtmd.mtmd_bitmap_get_nx(bitmap), mtmd.mtmd_bitmap_get_ny(bitmap),
                    ctypes.string_at(mtmd.mtmd_bitmap_get_data(bitmap), size))
        finally:
            mtmd.mtmd_bitmap_free(bitmap)

    def decode(self, image: Image, lctx: Any, n_past: int, slot: int, n_batch: int) -> None:
        """Encode ``image`` (or clip) and decode its embeddings into ``slot``'s cells from position ``n_past``: an
        image's image chunk, every chunk of a clip (the text around it too)."""
        mtmd = self._mtmd
        with _Chunks(mtmd, self._ctx, image.rgb, image.width, image.height, isinstance(image, Clip)) as chunks:
            new_n_past = ctypes.c_int32(n_past)
            for chunk in chunks:
                if isinstance(image, Clip) or mtmd.mtmd_input_chunk_get_type(chunk) == \
                        mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    if mtmd.mtmd_helper_eval_chunk_single(self._ctx, lctx, chunk, new_n_past.value, slot, n_batch,
                                                          False, ctypes.byref(new_n_past)):
                        raise RuntimeError("llama.cpp failed to encode or decode an image or audio clip")

    def _n_tokens(self, rgb: bytes, width: int, height: int) -> int:
        with _Chunks(self._mtmd, self._ctx, rgb, width, height) as chunks:
            return sum(_n(self._mtmd, chunk) for chunk in chunks
                       if self._mtmd.mtmd_input_chunk_get_type(chunk) == self._mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE)

    def close(self) -> None:
        if self._ctx:
            self._mtmd.mtmd_free(self._ctx)
            self._ctx = None


class _Chunks:
    """The chunks llama.cpp's library makes of a prompt that is only the marker, for one bitmap: an image's
    ``width`` × ``height`` RGB pixels, or a clip's ``width`` float32 samples (``audio``); freed on leaving."""

    def __init__(self, mtmd: Any, ctx: Any, data: bytes, width: int, height: int, audio: bool = False) -> None:
        self._mtmd, self._ctx, self._data, self._size, self._audio = mtmd, ctx, data, (width, height), audio
        self._chunks: Any = None

    def __enter__(self) -> list[Any]:
        mtmd = self._mtmd
        if self._audio:
            bitmap = mtmd.mtmd_bitmap_init_from_audio(self._size[0], (ctypes.c_float * self._size[0]).from_buffer_copy(
                self._data))
        else:
            pixels = (ctypes.c_uint8 * len(self._data)).from_buffer_copy(self._data)
            bitmap = mtmd.mtmd_bitmap_init(self._size[0], self._size[1], pixels)
        self._chunks = mtmd.mtmd_input_chunks_init()
        try:
            marker = MEDIA_MARKER.encode()
            text = mtmd.mtmd_input_text(marker, len(marker), False, True)
            bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
            if mtmd.mtmd_tokenize(self._ctx, self._chunks, ctypes.byref(text), bitmaps, 1):
                raise BadRequest(f"llama.cpp's projector cannot take this {'audio' if self._audio else 'image'}")
        finally:
            mtmd.mtmd_bitmap_free(bitmap)
        return [mtmd.mtmd_input_chunks_get(self._chunks, i) for i in range(mtmd.mtmd_input_chunks_size(self._chunks))]

    def __exit__(self, *exc: object) -> None:
        self._mtmd.mtmd_input_chunks_free(self._chunks)


def _n(mtmd: Any, chunk: Any) -> int:
    return int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))


def _text_tokens(mtmd: Any, chunk: Any) -> list[int]:
    """A text chunk's token ids."""
    count = ctypes.c_size_t(0)
    tokens = mtmd.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(count))
    return [int(tokens[i]) for i in range(count.value)]


def prompt_tokens(context: Any, prompt: str | list[int], images: Sequence[bytes],
                  prompt_logprobs: bool) -> tuple[list[int], dict[int, Image]]:
    """A prompt's tokens and its images by start (none without images): a text prompt's with each image's placeholder
    ids at its marker, BOS first as ``Context.tokenize_prompt`` gives it; BadRequest naming what cannot be."""
    if not images:
        tokens = context.tokenize_prompt(prompt) if isinstance(prompt, str) else context.in_vocabulary(prompt, "prompt")
        return tokens, {}
    projector: Projector | None = context.projector
    if projector is None:
        raise BadRequest(f"this model has no {'audio' if any(map(is_audio, images)) else 'image'} projector "
                         "(mmproj); it takes text only")
    if not isinstance(prompt, str):
        raise BadRequest(f"images go with a text prompt that places them ({MEDIA_MARKER}), not with token ids")
    if prompt_logprobs:
        raise BadRequest("'prompt_logprobs' cannot score a prompt's image positions; ask without it")
    check_images(images, WIRE_LIMITS)  # each header, and the clips' seconds together, before any is decoded
    decoded = [projector.clip(data, f"audio {i}") if is_audio(data) else projector.image(data, f"image {i}")
               for i, data in enumerate(images)]
    tokens, starts = projector.prompt(prompt, decoded, lambda part, first: (context.bos if first else []) +
                                      context.tokenize(part, False))
    if tokens and (tokens[-1] < 0 or max(start + len(item.ids) for start, item in starts.items()) == len(tokens)):
        raise BadRequest("the prompt ends with an image or audio clip; a prompt's last position must be text, "
                         "whose logits give the first token")
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


def placeholder_ids(digest: bytes, n_tokens: int, first: int = 0) -> tuple[int, ...]:
    """An image's ``n_tokens`` placeholder token ids: negative int32s drawn from its digest, one per position (from
    position ``first`` of its ids)."""
    ids = []
    for i in range(first, first + n_tokens):
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
