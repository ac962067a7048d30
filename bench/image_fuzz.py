"""``python -m bench.image_fuzz``: image bytes fuzzed through a worker for as long as it is told, looking for what
crashes or hangs one: llama.cpp's image decoder (stb_image, behind the multimodal library) reads whatever the
header check (``wire.media.check_image``) lets through.

    seeds: PNG (RGB, grey with alpha, palette, an odd size), JPEG (baseline, progressive), GIF, BMP (24-bit,
           8-bit, top-down), written by Pillow
    case: a seed, 1 to 4 mutations drawn from a seeded generator ──▶ bytes
        mutations: bytes flipped (in the header or past it), a byte or a word set to an edge value, the width or
                   height in the header set to an edge value, cut short, a run repeated, bytes inserted, another
                   seed's tail spliced on
    mpserve start --model vision.gguf --mmproj mmproj.gguf --parallel 1 --threads 1 (the random vision pair;
        one thread: a loaded machine's cores are not fought over by a pool that waits spinning)
        each case over the Python client (ZeroMQ, to the broker and the worker, no gateway), 1 token:
        answered | refused (bad_request: the header check, the decoder, the projector) | anything else: a finding,
        its bytes saved to --out
    at the end: the worker's pid against the one at the start (a crash starts another), and a clean image answered

Prints the cases by outcome, the refusals' most common reasons, the findings, and the cases per second. Exit status 1
when there is a finding, or the worker was replaced.

    python -m bench.image_fuzz [--seconds 60] [--seed N] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import random
import re
import struct
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from PIL import Image

from mpserve import Client
from mpserve.errors import ErrorCode, MpserveError
from mpserve.wire.media import MEDIA_MARKER, WithImages

from .procs import MpserveServer

PROMPT = f"<|im_start|>user\n{MEDIA_MARKER}What is this?<|im_end|>\n<|im_start|>assistant\n"
EDGES = (0, 1, 2, 3, 7, 255, 256, 4095, 4096, 8191, 8192, 65535, 0x7FFF_FFFF, 0xFFFF_FFFF)
Mutation = Callable[[bytearray, random.Random, list[bytes]], bytearray]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.image_fuzz", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60, help="how long to fuzz [default: %(default)s]")
    parser.add_argument("--seed", type=int, default=None, help="the generator's seed [default: random]")
    parser.add_argument("--out", type=Path, default=None, help="where findings' bytes go [default: a temp dir]")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    out = args.out or Path(tempfile.mkdtemp(prefix="image-fuzz-"))
    sys.exit(run(args.seconds, seed, out))


def run(seconds: float, seed: int, out: Path) -> int:
    with tempfile.TemporaryDirectory() as folder:
        model, projector = Path(folder) / "vision.gguf", Path(folder) / "mmproj.gguf"
        from mpserve.models.maker import write_model
        from mpserve.models.mmproj_maker import write_projector

        write_model(model, "tiny")
        write_projector(projector)
        server = MpserveServer("--model", str(model), "--mmproj", str(projector), "--name", "vision",
                               "--parallel", "1", "--threads", "1", "--cache-shm", folder)
        try:
            server.wait_ready()
            return _fuzz(server, seconds, seed, out)
        finally:
            server.stop()


def _fuzz(server: MpserveServer, seconds: float, seed: int, out: Path) -> int:
    rng, seeds = random.Random(seed), seed_images()
    outcomes: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    findings: list[str] = []
    pids = server.worker_pids()
    with Client(server.address, timeout=60) as client:
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            data = mutated(rng, seeds)
            outcome, reason = _send(client, data)
            outcomes[outcome] += 1
            if outcome == "refused":
                reasons[re.sub(r"\d+", "N", reason)[:90]] += 1
            elif outcome != "answered":
                out.mkdir(parents=True, exist_ok=True)
                path = out / f"case{sum(outcomes.values())}.bin"
                path.write_bytes(data)
                findings.append(f"{outcome}: {reason} ({path})")
        elapsed = time.monotonic() - started
        clean = _send(client, seeds[0])
    cases = sum(outcomes.values())
    replaced = server.worker_pids() != pids
    print(f"seed {seed}: {cases} cases in {elapsed:.0f} s ({cases / elapsed:.0f}/s): "
          + ", ".join(f"{n} {what}" for what, n in outcomes.most_common()))
    for reason, n in reasons.most_common(8):
        print(f"  refused {n}×: {reason}")
    for finding in findings:
        print(f"  FINDING {finding}")
    print(f"worker {'REPLACED' if replaced else 'the same process throughout'} (pids {pids}); a clean image after: "
          f"{clean[0]}")
    return 1 if findings or replaced or clean[0] != "answered" else 0


def _send(client: Client, data: bytes) -> tuple[str, str]:
    """What became of one case: answered, refused (bad_request, with its reason) or the error's code."""
    try:
        client.generate(WithImages(PROMPT, (data,)), model="vision", max_tokens=1, temperature=0)
    except MpserveError as exc:
        return ("refused" if exc.code is ErrorCode.BAD_REQUEST else exc.code.value), exc.message
    return "answered", ""


def seed_images() -> list[bytes]:
    """The images the cases start from: each format the header check takes, in the forms decoders trip on."""
    rng = random.Random(0)
    noise = Image.frombytes("RGB", (24, 16), bytes(rng.randrange(256) for _ in range(24 * 16 * 3)))

    def saved(image: Image.Image, kind: str, **options: object) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, kind, **options)
        return buffer.getvalue()

    bmp = saved(noise, "BMP")
    top_down = bmp[:22] + struct.pack("<i", -16) + bmp[26:]  # a negative height: rows stored top first
    return [saved(noise, "PNG"), saved(noise.convert("LA"), "PNG"), saved(noise.convert("P"), "PNG"),
            saved(noise.resize((9, 7)), "PNG"),
            saved(noise, "JPEG", quality=80), saved(noise, "JPEG", progressive=True), saved(noise, "GIF"),
            bmp, saved(noise.convert("P"), "BMP"), top_down]


def mutated(rng: random.Random, seeds: list[bytes]) -> bytes:
    data = bytearray(rng.choice(seeds))
    for _ in range(rng.randint(1, 4)):
        data = rng.choice(MUTATIONS)(data, rng, seeds)
    return bytes(data)


def _flip(data: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(min(len(data), 64)) if rng.random() < 0.3 else rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
    return data


def _edge(data: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    size = rng.choice((1, 2, 4))
    at = rng.randrange(max(1, len(data) - size))
    value = rng.choice(EDGES) & ((1 << (8 * size)) - 1)
    data[at:at + size] = value.to_bytes(size, rng.choice(("big", "little")))
    return data


def _dimension(data: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    """The width or the height in the header set to an edge value, where each format keeps it."""
    value = rng.choice(EDGES)
    if data.startswith(b"\x89PNG") and len(data) >= 24:
        at, form = rng.choice((16, 20)), ">I"
    elif data.startswith(b"GIF") and len(data) >= 10:
        at, form = rng.choice((6, 8)), "<H"
    elif data.startswith(b"BM") and len(data) >= 26:  # signed: a negative height stores rows top first
        at, form = rng.choice((18, 22)), "<i"
        value = rng.choice((1, -1)) * min(value, 2**31 - 1)
    elif (sof := re.search(rb"\xff[\xc0\xc2]", data)) is not None and len(data) >= sof.start() + 9:
        at, form = sof.start() + rng.choice((5, 7)), ">H"
    else:
        return data
    size = struct.calcsize(form)
    data[at:at + size] = struct.pack(form, value if form == "<i" else value & ((1 << (8 * size)) - 1))
    return data


def _cut(data: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    return data[:rng.randrange(1, len(data))] if len(data) > 1 else data


def _repeat(data: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    at = rng.randrange(len(data))
    run = data[at:at + rng.randint(1, 64)]
    data[at:at] = run * rng.randint(1, 64)
    return data


def _insert(data: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    at = rng.randrange(len(data) + 1)
    data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 32)))
    return data


def _splice(data: bytearray, rng: random.Random, seeds: list[bytes]) -> bytearray:
    other = rng.choice(seeds)
    return data[:rng.randrange(1, len(data) + 1)] + other[rng.randrange(len(other)):]


MUTATIONS: tuple[Mutation, ...] = (_flip, _flip, _edge, _dimension, _dimension, _cut, _repeat, _insert, _splice)


if __name__ == "__main__":
    main()
