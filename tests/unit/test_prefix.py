"""Common-prefix lengths, as the broker (texts) and the batch engine (tokens) compute them."""

from __future__ import annotations

import os
import random

import pytest

from mpserve.prefix import common_prefix


@pytest.mark.timeout(30)
def test_common_prefix_agrees_with_the_standard_library_on_texts_and_token_lists() -> None:
    rng = random.Random(8)
    for _ in range(5000):
        a, b = ("".join(rng.choice("ab") for _ in range(rng.randint(0, 40))) for _ in range(2))
        expected = len(os.path.commonprefix([a, b]))
        assert common_prefix(a, b) == expected
        assert common_prefix([ord(c) for c in a], [ord(c) for c in b]) == expected
