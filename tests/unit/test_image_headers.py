"""Image headers read before anything decodes an image (``mpserve.wire.media``): each format's size, the limits, and
whatever bytes come, a header or a BadRequest naming what is wrong (never another error)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpserve.config.tenants import parse_tenants
from mpserve.errors import BadRequest, ConfigError
from mpserve.wire.media import (
    MAX_IMAGES,
    WIRE_LIMITS,
    ImageHeader,
    ImageLimits,
    check_image,
    check_images,
    image_bytes,
    read_header,
)

pytestmark = pytest.mark.timeout(60)

PNG = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">IIBBBBB", 40, 30, 8, 2, 0, 0, 0)
GIF = b"GIF89a" + struct.pack("<HH", 40, 30) + bytes(8)
BMP = b"BM" + bytes(16) + struct.pack("<ii", 40, -30) + bytes(8)
JPEG = (b"\xff\xd8" + b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00" + bytes(9)
        + b"\xff\xc0" + struct.pack(">HBHH", 17, 8, 30, 40) + bytes(12))


@pytest.mark.parametrize("data, kind", [(PNG, "png"), (GIF, "gif"), (BMP, "bmp"), (JPEG, "jpeg")])
def test_each_formats_header_gives_its_size(data: bytes, kind: str) -> None:
    assert read_header(data, "image") == ImageHeader(kind, 40, 30)


def test_a_header_claiming_more_pixels_than_allowed_is_refused_before_decoding() -> None:
    bomb = PNG[:16] + struct.pack(">II", 60_000, 60_000) + PNG[24:]
    with pytest.raises(BadRequest, match="60000 × 60000 pixels; at most"):
        check_image(bomb, ImageLimits(), "image")
    with pytest.raises(BadRequest, match="129 bytes; at most 100 are accepted"):
        check_image(PNG + bytes(100), ImageLimits(max_bytes=100), "image")


def test_a_refusal_names_the_setting_of_the_limit_it_is_over() -> None:
    with pytest.raises(BadRequest, match=r"3 images; at most 2 .* \(the gateway's --max-images\)"):
        check_images([PNG] * 3, ImageLimits(max_images=2))
    with pytest.raises(BadRequest, match=r"image 2 of the request: .* \(the wire's bound MAX_IMAGE_PIXELS\)"):
        check_images([PNG, PNG[:16] + struct.pack(">II", 60_000, 60_000) + PNG[24:]], WIRE_LIMITS)
    local = parse_tenants({"local": {"max_image_bytes": "16B"}}).of("").images("local")
    assert local == ImageLimits(MAX_IMAGES, 16, WIRE_LIMITS.max_pixels, "local", WIRE_LIMITS.max_audio_seconds)
    with pytest.raises(BadRequest, match=r"at most 16 are accepted \(max_image_bytes of tenant local in the tenants"):
        check_images([PNG], local)


@pytest.mark.parametrize("entry", [{"max_images": MAX_IMAGES + 1}, {"max_image_bytes": "4MiB"},
                                   {"max_image_pixels": 0}, {"max_images": True}])
def test_a_tenants_image_limit_past_what_the_wire_carries_is_refused(entry: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match=f"tenants.local.{next(iter(entry))}: got .* what the wire carries"):
        parse_tenants({"local": entry})
    assert parse_tenants({"local": {}}).of("").images("local") is None


def test_an_http_url_is_refused_and_a_data_url_read() -> None:
    with pytest.raises(BadRequest, match="fetching images from URLs is off"):
        image_bytes("https://example.com/cat.png", "image")
    assert image_bytes("data:image/png;base64,aGVsbG8=", "image") == b"hello"


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([PNG, GIF, BMP, JPEG, b""]), st.binary(max_size=64), st.integers(0, 40))
def test_any_bytes_give_a_header_or_a_bad_request(start: bytes, tail: bytes, cut: int) -> None:
    data = start[:cut] + tail
    try:
        header = check_image(data, WIRE_LIMITS, "image")
    except BadRequest:
        return
    assert header.width * header.height <= WIRE_LIMITS.max_pixels and header.width > 0 and header.height > 0
