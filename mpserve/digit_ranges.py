"""GBNF for the decimal integers in a range, digit by digit: the JSON Schema compiler's bounded integers and
numbers (``mpserve.structured``).

    integers(low, high) ──▶ "-" naturals(...) for the negatives | naturals(...) for the rest
    naturals(low, high) ──▶ one alternative per count of digits ──▶ _same_length(lo, hi), recursing per digit
"""

from __future__ import annotations

MAX_DIGITS = 15  # integer digits generated for an integer or number without an upper bound


def integers(low: int | None, high: int | None) -> str:
    """GBNF for the JSON integers in [low, high] (None: unbounded that side)."""
    alternatives = []
    if low is None or low < 0:  # negatives: "-" then the naturals from 1 (or -high) up to -low
        top = -1 if high is None else min(high, -1)
        if top < 0 and (low is None or low <= top):
            alternatives.append(f'"-" ( {naturals(-top, None if low is None else -low)} )')
    if high is None or high >= 0:
        alternatives.append(naturals(max(low or 0, 0), high))
    return " | ".join(f"( {a} )" for a in alternatives)


def naturals(low: int, high: int | None) -> str:
    """GBNF for the decimal numbers (no leading zeros) in [low, high]; high None: up to MAX_DIGITS digits."""
    alternatives = []
    last = len(str(high)) if high is not None else MAX_DIGITS
    for digits in range(len(str(low)), last + 1):
        lo = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        hi = min(high, 10 ** digits - 1) if high is not None else 10 ** digits - 1
        if high is None and lo == 10 ** (digits - 1) and digits > 1:  # every longer number is allowed
            alternatives.append(f"[1-9] [0-9]{{{digits - 1},{MAX_DIGITS - 1}}}")
            break
        if lo <= hi:
            alternatives.append(_same_length(str(lo), str(hi)))
    return " | ".join(alternatives)


def _same_length(lo: str, hi: str) -> str:
    """GBNF for the digit strings of one length between ``lo`` and ``hi``."""
    if lo == hi:
        return f'"{lo}"'
    n = len(lo) - 1
    if lo[1:] == "0" * n and hi[1:] == "9" * n:
        return f"[{lo[0]}-{hi[0]}]" + (f" [0-9]{{{n}}}" if n else "")
    if lo[0] == hi[0]:
        return f'"{lo[0]}" ( {_same_length(lo[1:], hi[1:])} )'
    parts = [f'"{lo[0]}" ( {_same_length(lo[1:], "9" * n)} )']
    if int(lo[0]) + 1 <= int(hi[0]) - 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}] [0-9]{{{n}}}")
    parts.append(f'"{hi[0]}" ( {_same_length("0" * n, hi[1:])} )')
    return " | ".join(f"( {p} )" for p in parts)
