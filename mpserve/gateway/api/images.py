"""A chat message's content parts: text, and images and audio clips as the media markers that place them.

    content: "text" | [{"type": "text", "text"},
                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                       {"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}, ...]
        ──content()──▶ (text with MEDIA_MARKER where each image or clip was, their bytes in order)
                       each image read from its data URL (an http(s) URL: 400, fetching is off) and its header
                       checked (format, and bytes and pixels within the wire's bounds); each clip's header read
                       (its format and seconds, ``wire.audio``)
    messages' images, in order ──the gateway's limits (``dialect.Pipeline``: count, bytes, pixels, its settings)──▶
        ──with_images(prompt)──▶ the prompt the client sends: WithImages(text, images)

The chat template renders the text, markers included, so the images land where the template places the message's
content; the worker's projector turns each marker into the image's positions (``mpserve.engine.media``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpserve.errors import BadRequest
from mpserve.wire.audio import audio_bytes
from mpserve.wire.media import MEDIA_MARKER, WIRE_LIMITS, WithImages, check_image, image_bytes


def content(value: Any, i: int) -> tuple[str, tuple[bytes, ...]]:
    """A message's text and images: a string, or a list of text and image parts (each image's header checked
    against the wire's bounds; the gateway's own limits are checked of the whole request, ``dialect.Pipeline``)."""
    if value is None or isinstance(value, str):
        return value or "", ()
    if not isinstance(value, list):
        raise BadRequest(f"messages[{i}].content must be a string or a list of content parts")
    text, images = [], []
    for j, part in enumerate(value):
        where = f"messages[{i}].content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if MEDIA_MARKER in part["text"]:
                raise BadRequest(f"{where}: the text holds {MEDIA_MARKER}, which marks where an image goes; send "
                                 "images as image_url parts")
            text.append(part["text"])
        elif kind == "image_url":
            data = image_bytes(_url(part.get("image_url"), where), where)
            check_image(data, WIRE_LIMITS, where)
            text.append(MEDIA_MARKER)
            images.append(data)
        elif kind == "input_audio":
            text.append(MEDIA_MARKER)
            images.append(audio_bytes(part.get("input_audio"), where))
        else:
            raise BadRequest(f"{where} must be a text part {{\"type\": \"text\", \"text\"}}, an image part "
                             "{\"type\": \"image_url\", \"image_url\": {\"url\": \"data:...\"}} or an audio part "
                             "{\"type\": \"input_audio\", \"input_audio\": {\"data\", \"format\"}}; files are not "
                             "supported")
    return "".join(text), tuple(images)


def _url(value: Any, where: str) -> str:
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str):
        raise BadRequest(f"{where}.image_url must be {{\"url\": \"data:image/...;base64,...\"}}")
    return url


def from_input_image(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A Responses ``input_image`` part (``image_url``: a data URL) as a chat ``image_url`` part."""
    return {"type": "image_url", "image_url": {"url": _url(part.get("image_url"), where)}}


def from_image_block(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A Messages ``image`` block (``source``: base64 data and its media type, or a URL) as a chat ``image_url``
    part."""
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "url":
        return {"type": "image_url", "image_url": {"url": _url(source, where)}}
    if not isinstance(source, dict) or source.get("type") != "base64" or not isinstance(source.get("data"), str) \
            or not isinstance(source.get("media_type"), str):
        raise BadRequest(f"{where}.source must be {{\"type\": \"base64\", \"media_type\": \"image/png\", "
                         "\"data\": BASE64}")
    return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}


def joined(pieces: Sequence[str | dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A message's content from its pieces in order: their text, or, with an image among them, chat content parts."""
    if all(isinstance(piece, str) for piece in pieces):
        return "".join(piece for piece in pieces if isinstance(piece, str))
    return [{"type": "text", "text": piece} if isinstance(piece, str) else piece for piece in pieces]


def with_images(prompt: str, images: Sequence[bytes]) -> str | WithImages:
    """The prompt a chat sends: its text alone, or with the images its messages carried, in order."""
    if not images:
        return prompt
    if prompt.count(MEDIA_MARKER) != len(images):
        raise BadRequest(f"the chat template placed {prompt.count(MEDIA_MARKER)} of the request's {len(images)} "
                         "images; images go in the content of messages the template shows")
    return WithImages(prompt, tuple(images))
