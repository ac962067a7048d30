"""Counts in messages: a number with its noun, in the singular for one ("1 request", "2 requests")."""

from __future__ import annotations


def counted(number: int, noun: str) -> str:
    """``number`` and ``noun``, the noun taking an "s" unless the number is one."""
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"
