"""The engine interface: what a worker drives, and what an engine hands back.

    worker loop                       engine (BatchEngine for models, EchoEngine without one)
    ───────────                       ──────────────────────────────────────────────────────
    ASSIGN   ──admit(slot, …)──▶      queue the prompt in that slot (and the tokens another instance
                                      generated for it, when it resumes a request: ``carried``)
    CHUNK    ──tokens(slot)────▶      the token ids this sequence generated so far (not the carried ones;
                                      an end-of-generation token last, if one ended it)
    loop     ──step()──────────▶      one round for every running sequence; on_token per new piece
             ◀──[(slot, Completion)]  the sequences that ended in it
    CANCEL   ──cancel(slot)────▶      that sequence ends at the start of the next step

Engines know nothing of processes, sockets or the slot table; one thread calls them. ``on_token`` gets
each new piece of text and the number of tokens generated so far, and returns False to stop generating.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from mpserve.protocol import ChatTemplate, GenerateParams

OnToken = Callable[[str, int], bool]
"""Called with each new piece of text and the number of tokens generated so far; returns False to stop
generating (cancellation)."""


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "length" | "stop" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    prompt_s: float
    generate_s: float
    reused_tokens: int = 0  # prompt tokens taken from KV cells instead of computed


class Engine(Protocol):
    """``parallel`` slots, each running at most one sequence."""

    parallel: int
    chat: ChatTemplate

    def free_slots(self) -> list[int]: ...

    def admit(self, slot: int, prompt: str, params: GenerateParams, on_token: OnToken,
              carried: Sequence[int] = ()) -> None: ...

    def tokens(self, slot: int) -> Sequence[int]: ...

    def cancel(self, slot: int) -> None: ...

    def step(self) -> list[tuple[int, Completion]]: ...

    def close(self) -> None: ...
