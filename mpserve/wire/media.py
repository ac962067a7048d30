"""Images as they travel: read from a data URL, their format and size read from their header, and the limits they
must keep, before anything decodes them.

    image_url / input_image / image block ──image_bytes()──▶ bytes (data: URLs only; http(s) refused: fetching is off)
    bytes ──check_image(limits)──▶ format, width, height from the header (PNG, JPEG, GIF, BMP), or BadRequest naming
                                   what is wrong: an unknown format, a header cut short, a size past the limits
    a request's images ──check_images(limits)──▶ their count, then each one as above; its audio clips
                         (``wire.audio``, told apart by their first bytes): their seconds together
    prompt text ──MEDIA_MARKER where each image goes, in order──▶ the worker (``mpserve.engine.media``) decodes them

The limits: the gateway's (its settings, at most the wire's ``BOUNDS``), a tenant's (the broker's ``tenants``
section, checked at admission) and the wire's, each refusal naming the setting it is over.

Pure and cheap: the gateway checks every image before a request is sent, and the worker checks each again against
the wire's own bounds before llama.cpp's decoder sees it (a ZeroMQ client reaches the worker without the gateway).
A header that claims 60,000 × 60,000 pixels is refused here, not found out by a decoder that allocates for it.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from mpserve.errors import BadRequest

MEDIA_MARKER = "<__media__>"
"""Where an image goes in a prompt's text (llama.cpp's multimodal library's default marker)."""

MAX_IMAGES = 16  # images one request may carry on the wire
MAX_IMAGE_BYTES = 3 * 1024 * 1024  # one image's bytes on the wire (a message is at most 4 MiB)
MAX_IMAGE_PIXELS = 8192 * 8192  # width × height the worker decodes at most, whatever the gateway allows
MAX_AUDIO_SECONDS = 600  # seconds of audio (all of a request's clips) the worker decodes at most
BOUNDS = {"max_images": MAX_IMAGES, "max_image_bytes": MAX_IMAGE_BYTES, "max_image_pixels": MAX_IMAGE_PIXELS,
          "max_audio_seconds": MAX_AUDIO_SECONDS}
"""Each media limit's setting (the gateway's flag, a tenant's key) and the most it may be: what the wire carries."""


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be: how many, how many bytes each, how many pixels each; and how many seconds
    its audio clips (``wire.audio``) may last together; ``source``: who set them, as a refusal names the setting:
    the gateway (its flags), the wire (its bounds) or a tenant (by name)."""

    max_images: int = 8
    max_bytes: int = 2 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    source: str = "gateway"
    max_audio_seconds: int = 120

    def setting(self, key: str) -> str:
        """How a refusal names the setting ``key`` (a key of ``BOUNDS``) of these limits."""
        if self.source == "gateway":
            return "the gateway's --" + key.replace("_", "-")
        if self.source == "wire":
            return f"the wire's bound {key.upper()}"
        return f"{key} of tenant {self.source} in the tenants section"


WIRE_LIMITS = ImageLimits(MAX_IMAGES, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, "wire", MAX_AUDIO_SECONDS)


@dataclass(frozen=True)
class WithImages:
    """A text prompt with the images (and audio clips, ``wire.audio``) its media markers place, in order (a client's
    prompt, as text or token ids are)."""

    text: str
    images: tuple[bytes, ...]


@dataclass(frozen=True)
class ImageHeader:
    format: str  # png, jpeg, gif or bmp
    width: int
    height: int


def image_bytes(url: str, where: str) -> bytes:
    """The bytes of an image given as a URL: a ``data:image/...;base64,`` URL. An http(s) URL is refused: fetching
    is off, since a server that fetches what a request names can be made to reach hosts only it can reach (SSRF)."""
    if url.startswith(("http://", "https://")):
        raise BadRequest(f"{where}: fetching images from URLs is off on this server; send the image inline as a "
                         "data URL (data:image/png;base64,...)")
    head, comma, payload = url.partition(",")
    if not url.startswith("data:") or not comma or not head.endswith(";base64"):
        raise BadRequest(f"{where}: an image must be a data URL, data:image/FORMAT;base64,DATA")
    return base64_bytes(payload, where)


def base64_bytes(payload: str, where: str) -> bytes:
    """Base64 text decoded (the padding and alphabet checked), or BadRequest naming ``where``."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: the image's base64 data is not valid base64") from None


def check_image(data: bytes, limits: ImageLimits, where: str) -> ImageHeader:
    """The image's header, read and checked against ``limits``; BadRequest naming ``where``, what is wrong and the
    setting it is over."""
    if len(data) > limits.max_bytes:
        raise BadRequest(f"{where}: the image is {len(data)} bytes; at most {limits.max_bytes} are accepted "
                         f"({limits.setting('max_image_bytes')})")
    header = read_header(data, where)
    if header.width <= 0 or header.height <= 0:
        raise BadRequest(f"{where}: the {header.format} header gives a size of {header.width} × {header.height}")
    if header.width * header.height > limits.max_pixels:
        raise BadRequest(f"{where}: the {header.format} image is {header.width} × {header.height} pixels; at most "
                         f"{limits.max_pixels} pixels are accepted ({limits.setting('max_image_pixels')})")
    return header


def check_images(media: Sequence[bytes], limits: ImageLimits) -> None:
    """A request's images and audio clips (told apart by their first bytes), in order, checked against ``limits``:
    the images' count, then each image (``check_image``), and the clips' seconds together (``wire.audio``)."""
    from .audio import is_audio, read_audio

    images = [data for data in media if not is_audio(data)]
    if len(images) > limits.max_images:
        raise BadRequest(f"the request has {len(images)} images; at most {limits.max_images} are accepted per "
                         f"request ({limits.setting('max_images')})")
    seconds, counts = 0.0, {"audio": 0, "image": 0}
    for data in media:
        kind = "audio" if is_audio(data) else "image"
        counts[kind] += 1
        where = f"{kind} {counts[kind]} of the request"
        if kind == "audio":
            seconds += read_audio(data, where).seconds
        else:
            check_image(data, limits, where)
    if seconds > limits.max_audio_seconds:
        raise BadRequest(f"the request's audio lasts {seconds:.1f} seconds; at most {limits.max_audio_seconds} are "
                         f"accepted per request ({limits.setting('max_audio_seconds')})")


def read_header(data: bytes, where: str) -> ImageHeader:
    """Format, width and height from the first bytes of a PNG, JPEG, GIF or BMP file."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n"):
            if data[12:16] != b"IHDR":
                raise BadRequest(f"{where}: the PNG image has no IHDR header")
            width, height = struct.unpack(">II", data[16:24])
            return ImageHeader("png", width, height)
        if data.startswith((b"GIF87a", b"GIF89a")):
            width, height = struct.unpack("<HH", data[6:10])
            return ImageHeader("gif", width, height)
        if data.startswith(b"BM"):
            width, height = struct.unpack("<ii", data[18:26])
            return ImageHeader("bmp", width, abs(height))  # a negative height: rows stored top-down
        if data.startswith(b"\xff\xd8"):
            width, height = _jpeg_size(data, where)
            return ImageHeader("jpeg", width, height)
    except struct.error:
        raise BadRequest(f"{where}: the image is cut short ({len(data)} bytes): its header is incomplete") from None
    raise BadRequest(f"{where}: unknown image format (first bytes {data[:8].hex()}); send PNG, JPEG, GIF or BMP")


_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (not DHT, JPG, DAC)


def _jpeg_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from a JPEG's first start-of-frame segment, walking the segments before it."""
    at = 2
    while True:
        if data[at:at + 1] != b"\xff":
            raise BadRequest(f"{where}: the JPEG image's segments are corrupt at byte {at}")
        marker, length = struct.unpack(">BH", data[at + 1:at + 4])
        if marker in _JPEG_FRAMES:
            height, width = struct.unpack(">HH", data[at + 5:at + 9])
            return width, height
        if length < 2:
            raise BadRequest(f"{where}: the JPEG image's segments are corrupt at byte {at}")
        at += 2 + length
