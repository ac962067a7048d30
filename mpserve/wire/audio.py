"""Audio clips as they travel: read from an ``input_audio`` part, told from images by their first bytes, and their
length read from their header before anything decodes them.

    {"data": BASE64, "format": "wav" | "mp3"} ──audio_bytes()──▶ bytes (the format named checked against the bytes)
    bytes ──is_audio()──▶ a clip (RIFF/WAVE, or MP3: an ID3 tag or an MPEG audio frame) or not (an image)
    bytes ──read_audio()──▶ AudioHeader: format and seconds, from the WAV's fmt and data chunks or by walking the
                            MP3's frame headers; or BadRequest naming what is wrong (cut short, an encoding other
                            than PCM or float, a free-format MP3)

A clip travels among a request's images (``wire.media``: one media marker each, in order; the same bytes bound),
so the worker reads it where its marker is. Its seconds are read here, not found by decoding: a compressed clip of a
few kilobytes can hold hours, which a decoder would allocate for. Only WAV (PCM or float samples, whose bytes bound
their seconds) and MP3 (whose frames are counted) are taken, the two formats chat completions name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from mpserve.errors import BadRequest

from .media import base64_bytes

FORMATS = ("wav", "mp3")
_WAV_ENCODINGS = {1: "PCM", 3: "float", 0xFFFE: "extensible"}  # miniaudio's uncompressed encodings
# MPEG audio: bitrates (kbit/s) by version (1, or 2 and 2.5) and layer, sample rates by version
_BITRATES = {
    (1, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (1, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (1, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (2, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (2, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by the version bits


@dataclass(frozen=True)
class AudioHeader:
    format: str  # wav or mp3
    seconds: float


def audio_bytes(value: object, where: str) -> bytes:
    """The bytes of an ``input_audio`` object ``{"data": BASE64, "format": "wav" | "mp3"}``, their format checked
    against the one named; BadRequest naming ``where`` and what is wrong."""
    if not isinstance(value, dict) or not isinstance(value.get("data"), str) or value.get("format") not in FORMATS:
        raise BadRequest(f"{where}.input_audio must be {{\"data\": BASE64, \"format\": \"wav\" or \"mp3\"}}")
    data = base64_bytes(value["data"], where)
    header = read_audio(data, where)
    if header.format != value["format"]:
        raise BadRequest(f"{where}: the audio is named {value['format']} but its bytes are {header.format}")
    return data


def is_audio(data: bytes) -> bool:
    """Whether ``data`` starts as a WAV or an MP3 file does (no image format starts so)."""
    return data[:4] == b"RIFF" and data[8:12] == b"WAVE" or data[:3] == b"ID3" or _frame_sync(data, 0)


def read_audio(data: bytes, where: str) -> AudioHeader:
    """The clip's format and seconds from its header (WAV) or frame headers (MP3)."""
    try:
        if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
            return AudioHeader("wav", _wav_seconds(data, where))
        if data[:3] == b"ID3" or _frame_sync(data, 0):
            return AudioHeader("mp3", _mp3_seconds(data, where))
    except struct.error:
        raise BadRequest(f"{where}: the audio is cut short ({len(data)} bytes): its header is incomplete") from None
    raise BadRequest(f"{where}: unknown audio format (first bytes {data[:8].hex()}); send WAV or MP3")


def _wav_seconds(data: bytes, where: str) -> float:
    """Seconds of a WAV file: its data chunk's bytes (at most what follows) over the bytes a second of its samples
    takes, from its fmt chunk's channels, sample rate and bits per sample (what a decoder goes by, not the chunk's
    own bytes-per-second field, which may say otherwise)."""
    at, encoding, channels, rate, bits = 12, 0, 0, 0, 0
    while at + 8 <= len(data):
        kind, size = struct.unpack("<4sI", data[at:at + 8])
        if kind == b"fmt ":
            encoding, channels, rate, _, _, bits = struct.unpack("<HHIIHH", data[at + 8:at + 24])
        elif kind == b"data":
            if encoding not in _WAV_ENCODINGS:
                raise BadRequest(f"{where}: the WAV audio's encoding ({encoding:#x}) is not PCM or float samples"
                                 if encoding else f"{where}: the WAV audio has no fmt chunk before its data")
            if not channels or not rate or not bits:
                raise BadRequest(f"{where}: the WAV audio's fmt chunk gives {channels} channels of {bits} bits at "
                                 f"{rate} Hz")
            return float(min(size, len(data) - at - 8) / (channels * -(-bits // 8)) / rate)
        at += 8 + size + (size & 1)
    raise BadRequest(f"{where}: the WAV audio has no data chunk (corrupt or cut short)")


def _mp3_seconds(data: bytes, where: str) -> float:
    """Seconds of an MP3 file: its MPEG audio frames counted, each by the samples its header gives. Past bytes that
    do not start a frame it looks for the next frame header, as a decoder does, so what it counts is at least what
    a decoder would find."""
    at = 0
    if data[:3] == b"ID3":  # a tag first: its size, 4 bytes of 7 bits, after a 10-byte header
        size = data[6] << 21 | data[7] << 14 | data[8] << 7 | data[9]
        at = 10 + size
    seconds, frames = 0.0, 0
    while at + 4 <= len(data):
        if not _frame_sync(data, at):
            if not frames:
                break
            at = data.find(b"\xff", at + 1)
            if at < 0:
                break
            continue
        version, layer = data[at + 1] >> 3 & 3, 4 - (data[at + 1] >> 1 & 3)
        bitrate = _BITRATES[(1 if version == 3 else 2, min(layer, 2) if version != 3 else layer)][data[at + 2] >> 4]
        rate = _RATES[version][data[at + 2] >> 2 & 3]
        if bitrate == 0:
            raise BadRequest(f"{where}: the MP3 audio is free-format (no bitrate in its frame headers)")
        samples = 384 if layer == 1 else 1152 if layer == 2 or version == 3 else 576
        padding = data[at + 2] >> 1 & 1
        at += (12 * bitrate * 1000 // rate + padding) * 4 if layer == 1 else samples // 8 * bitrate * 1000 // rate \
            + padding
        seconds, frames = seconds + samples / rate, frames + 1
    if not frames:
        raise BadRequest(f"{where}: the MP3 audio has no MPEG audio frame where one should start (byte {at})")
    return seconds


def _frame_sync(data: bytes, at: int) -> bool:
    """Whether an MPEG audio frame header starts at ``at``: 11 set bits, then a version, layer, bitrate and sample
    rate that are not reserved."""
    if len(data) < at + 4 or data[at] != 0xFF or data[at + 1] & 0xE0 != 0xE0:
        return False
    return data[at + 1] >> 3 & 3 != 1 and data[at + 1] >> 1 & 3 != 0 and data[at + 2] >> 4 != 15 \
        and data[at + 2] >> 2 & 3 != 3
