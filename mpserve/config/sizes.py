"""Memory sizes as settings, flags and ``$MPSERVE_SIMULATE_GPUS`` write them: "24GiB", "512MiB", "7GB" or a
plain byte count, read into bytes (``parse_memory``); a size that is not understood is a ConfigError naming the units.
"""

from __future__ import annotations

import re

from mpserve.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*")


def parse_memory(text: str) -> int:
    """Bytes from "24GiB", "512MiB", "7GB", "1.5GiB" or a plain byte count such as "1024"."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"memory size {text!r} is not understood: write a number of bytes, or a number with a unit: "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '24GiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])
