"""Common-prefix lengths, as the broker (texts) and the batch engine (tokens) compute them, and the block hashes
of text prefixes that worker and broker compare."""

from __future__ import annotations

import hashlib
import os
import random

import pytest

from mpserve.wire.prefix import MAX_BLOCKS, PREFIX_BLOCK, block_hashes, common_prefix


@pytest.mark.timeout(30)
def test_common_prefix_agrees_with_the_standard_library_on_texts_and_token_lists() -> None:
    rng = random.Random(8)
    for _ in range(5000):
        a, b = ("".join(rng.choice("ab") for _ in range(rng.randint(0, 40))) for _ in range(2))
        expected = len(os.path.commonprefix([a, b]))
        assert common_prefix(a, b) == expected
        assert common_prefix([ord(c) for c in a], [ord(c) for c in b]) == expected


@pytest.mark.timeout(30)
def test_block_hashes_are_one_per_whole_block_equal_exactly_as_far_as_two_texts_agree() -> None:
    text = "".join(f"line {i}, with é and 日本 in it\n" for i in range(200))
    hashes = block_hashes(text)
    assert len(hashes) == len(text) // PREFIX_BLOCK and hashes == block_hashes(text + "more")
    assert block_hashes(text[:PREFIX_BLOCK - 1]) == () and len(block_hashes(text[:PREFIX_BLOCK])) == 1
    changed = text[:3 * PREFIX_BLOCK + 5] + "X" + text[3 * PREFIX_BLOCK + 6:]  # one character in the fourth block
    other = block_hashes(changed)
    assert other[:3] == hashes[:3] and not set(other[3:]) & set(hashes)
    assert block_hashes("\ud800" * PREFIX_BLOCK)  # a lone surrogate does not stop it
    assert len(block_hashes("x" * PREFIX_BLOCK * (MAX_BLOCKS + 3))) == MAX_BLOCKS
    first = hashlib.blake2b(text[:PREFIX_BLOCK].encode(), digest_size=8).digest()  # no per-process salt (as
    assert hashes[0] == int.from_bytes(first, "little")  # hash() has): worker and broker agree
