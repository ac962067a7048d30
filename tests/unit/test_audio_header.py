"""An audio clip's format and seconds read from its header (``wire.audio``), before anything decodes it."""

from __future__ import annotations

import io
import struct
import wave

import pytest

from mpserve.errors import BadRequest
from mpserve.wire.audio import is_audio, read_audio
from mpserve.wire.media import ImageLimits, check_images


def wav(seconds: float, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(bytes(int(seconds * rate) * channels * width))
    return out.getvalue()


def frame(header: bytes) -> bytes:
    """One MPEG audio frame: ``header`` and zeros to the length it gives (MPEG-1 layer III here)."""
    bitrate = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)[header[2] >> 4]
    rate = (44100, 48000, 32000)[header[2] >> 2 & 3]
    return header + bytes(144 * bitrate * 1000 // rate + (header[2] >> 1 & 1) - 4)


MP3_32K = frame(bytes([0xFF, 0xFB, 0x10, 0x00]))  # 32 kbit/s at 44.1 kHz: 104 bytes of 1152 samples
MP3_320K_PADDED = frame(bytes([0xFF, 0xFB, 0xE2, 0x00]))  # 320 kbit/s, padded: 1045 bytes


def test_a_wavs_seconds_are_its_data_over_its_bytes_per_second() -> None:
    assert read_audio(wav(1.5), "clip").seconds == pytest.approx(1.5)
    assert read_audio(wav(2, rate=8000, channels=2, width=2), "clip").seconds == pytest.approx(2)


def test_a_wav_that_claims_more_data_than_it_has_is_measured_by_what_it_has() -> None:
    data = bytearray(wav(1))
    data[40:44] = struct.pack("<I", 0xFFFFFFF0)  # the data chunk's size: streaming writers leave it so
    assert read_audio(bytes(data), "clip").seconds == pytest.approx(1)


def test_a_wav_is_measured_by_its_rate_and_sample_size_not_the_bytes_per_second_it_claims() -> None:
    data = bytearray(wav(1, rate=8000))
    data[28:32] = struct.pack("<I", 1 << 30)  # the fmt chunk's byte rate: a decoder goes by the rate and sample size
    assert read_audio(bytes(data), "clip").seconds == pytest.approx(1)
    data[24:28] = struct.pack("<I", 1)  # one sample a second: 8000 seconds, which a decoder would resample
    assert read_audio(bytes(data), "clip").seconds == pytest.approx(8000)


def test_mp3_frames_past_bytes_that_are_not_a_frame_are_counted_as_a_decoder_finds_them() -> None:
    clip = MP3_32K * 2 + b"junk\xff\x00" + MP3_32K * 3
    assert read_audio(clip, "clip").seconds == pytest.approx(5 * 1152 / 44100)


def test_mp3_frames_are_counted_after_an_id3_tag() -> None:
    tag = b"ID3\x04\x00\x00" + bytes([0, 0, 1, 0]) + bytes(128)  # a 128-byte tag (7 bits a byte)
    clip = tag + MP3_32K * 10 + MP3_320K_PADDED * 5
    header = read_audio(clip, "clip")
    assert header.format == "mp3" and header.seconds == pytest.approx(15 * 1152 / 44100)


def test_images_are_not_audio_and_clips_are() -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(32)
    jpeg = b"\xff\xd8\xff\xe0" + bytes(32)
    assert not is_audio(png) and not is_audio(jpeg)
    assert is_audio(wav(0.1)) and is_audio(MP3_32K) and is_audio(b"ID3" + bytes(16))


def test_a_requests_clips_count_together_against_its_seconds() -> None:
    limits = ImageLimits(max_audio_seconds=3, source="tenant t")
    check_images((wav(1), wav(1.5)), limits)
    with pytest.raises(BadRequest, match=r"lasts 3\.5 seconds; at most 3 .*max_audio_seconds of tenant t"):
        check_images((wav(1), wav(1.5), wav(1)), limits)


@pytest.mark.parametrize(("data", "words"), [
    (b"RIFF\x00\x00\x00\x00WAVEfmt ", "cut short"),
    (wav(1)[:12] + b"LIST" + struct.pack("<I", 4) + b"abcd", "no data chunk"),
    (MP3_32K[:2], "unknown audio format"),
    (b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"garbage!", "no MPEG audio frame"),
])
def test_a_bad_header_is_refused_naming_what_is_wrong(data: bytes, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        read_audio(data, "clip")
