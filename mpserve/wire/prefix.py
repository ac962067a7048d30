"""Shared prefixes of prompts, for prefix-cache routing: their length (texts, token lists), and the summary of a
text's prefixes that travels between worker and broker.

    common_prefix(a, b)    the length of the common prefix: the broker (texts), the batch engine (tokens)
    block_hashes(text, salt)  a stable 64-bit hash of text[:B], text[:2B], … (B = PREFIX_BLOCK characters),
                           keyed with the reuse salt (``mpserve.wire.salt``): the worker sends those of each
                           host-RAM cache entry's text under the entry's salt, the broker computes those of a
                           prompt under its request's and finds the longest run of them an instance holds, so
                           an entry of one salt never steers a prompt of another
    routed(prompt, images) a prompt's text as both sides route by it: each media marker replaced by its image's key
                           (``media_key``, a hash of the image's bytes), so the same image and text match where
                           they were computed and another image does not

``common_prefix`` is a binary search over slice comparisons: each comparison runs in C, so a
100,000-character prompt takes about 17 of them instead of a Python-level loop over every character.
``block_hashes`` chains one blake2b over the blocks (a hash per prefix, not per block: two texts share a
hash only where they share everything before it), and stops after MAX_BLOCKS: a longer prefix is routed
as one of that length.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TypeVar

from .media import MEDIA_MARKER

T = TypeVar("T", str, list[int], tuple[int, ...])

PREFIX_BLOCK = 512  # characters per block: a prefix shorter than one is not summarized
MAX_BLOCKS = 256  # blocks hashed per text, at most


def common_prefix(a: T, b: T) -> int:
    lo, hi = 0, min(len(a), len(b))
    if hi and a[0] != b[0]:
        return 0  # the usual case for unrelated prompts: answered at once
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def block_hashes(text: str, salt: bytes = b"") -> tuple[int, ...]:
    """The hashes of ``text``'s first PREFIX_BLOCK, 2 × PREFIX_BLOCK, … characters (whole blocks only, at most
    MAX_BLOCKS) under ``salt`` (a blake2b key: the empty salt gives the unkeyed hashes), the same in every
    process."""
    running = hashlib.blake2b(digest_size=8, key=salt)
    hashes = []
    for end in range(PREFIX_BLOCK, min(len(text), PREFIX_BLOCK * MAX_BLOCKS) + 1, PREFIX_BLOCK):
        running.update(text[end - PREFIX_BLOCK:end].encode("utf-8", "surrogatepass"))
        hashes.append(int.from_bytes(running.copy().digest(), "little"))
    return tuple(hashes)


def media_key(data: bytes) -> str:
    """An image's place in the text prompts are routed by: a hash of its bytes as sent (the broker does not decode
    images), the same in every process. Wide enough that a prefix ending after an image is routable by it alone."""
    return f"<__media__ {hashlib.blake2b(data, digest_size=16).hexdigest()}>"


def routed(prompt: str, images: Sequence[bytes]) -> str:
    """``prompt`` with its i-th media marker replaced by ``images[i]``'s key; as it is without images (or with
    markers that do not pair up with them, a prompt the worker refuses)."""
    parts = prompt.split(MEDIA_MARKER)
    if not images or len(parts) - 1 != len(images):
        return prompt
    return parts[0] + "".join(media_key(image) + part for image, part in zip(images, parts[1:], strict=True))
