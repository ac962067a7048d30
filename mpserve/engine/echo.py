"""``EchoEngine``: the backend without a model, so benchmarks can measure the serving path alone.

It answers each request with its prompt, cut into ``max_tokens`` pieces of about equal size, one piece per
sequence per ``step``, through the same interface (``mpserve.engine.interface``) and the same worker loop as
``BatchEngine``. Its vocabulary is the 256 byte values.

With a ``tick`` it stands in for a model of a given speed, for the broker's benchmark: each ``step`` waits
for the next tick (fixed times, ``tick`` apart, so a late step does not delay the ones after it), and every
running sequence makes one piece, the ``time.monotonic_ns()`` it was made at, followed by a space; a request
gets ``max_tokens`` of them. The clock is the host's, so a client on the same host subtracts a piece's time
from its arrival time to get what the serving path added.

    step: sleep until tick k → each sequence: piece "<monotonic ns> " → on_token → CHUNK (worker loop)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire
from mpserve.wire.protocol import ChatTemplate, GenerateParams

from .interface import Completion, NoAdapters, NoCells, OnToken, refuse_adapters


@dataclass
class _Echo:
    prompt: str
    pieces: int  # how many the prompt is cut into
    size: int  # characters per piece
    on_token: OnToken
    admitted_at: float = field(default_factory=time.perf_counter)
    sent: list[str] = field(default_factory=list)
    cancel_requested: bool = False


class EchoEngine(NoCells, NoAdapters):
    chat = ChatTemplate()

    def __init__(self, parallel: int = 1, tick: float = 0.0) -> None:
        self.parallel = parallel
        self.tick = tick  # seconds per step; 0: no wait, and the pieces are the prompt's
        self._next_tick = 0.0
        self._running: dict[int, _Echo] = {}
        self._parked: dict[str, _Echo] = {}

    def free_slots(self) -> list[int]:
        return [slot for slot in range(self.parallel) if slot not in self._running]

    def admit(self, slot: int, prompt: str | list[int], params: GenerateParams, on_token: OnToken,
              carried: Sequence[int] = (), adapters: Sequence[tuple[str, float]] = (), salt: bytes = b"",
              alone: bool = False, images: Sequence[bytes] = ()) -> None:
        """``carried`` is ignored: echo has no tokens, so its requests are never resumed (``tokens`` is empty); nor
        cells, so ``salt`` has nothing to keep apart; ``alone`` too: every sequence makes its piece each step."""
        if not 0 <= slot < self.parallel or slot in self._running:
            raise ValueError(f"slot {slot} is not a free slot of 0..{self.parallel - 1}")
        refuse_adapters(adapters)
        if images:
            raise BadRequest("the echo backend has no image projector; it takes text only")
        if params.logprobs is not None:
            raise BadRequest("the echo backend has no log-probabilities")
        if not isinstance(prompt, str):
            prompt = b"".join(map(self.token_bytes, prompt)).decode("utf-8", "replace")
        pieces = params.max_tokens if self.tick else max(1, min(params.max_tokens, len(prompt)))
        self._running[slot] = _Echo(prompt, pieces, -(-len(prompt) // pieces) if prompt else 1, on_token)

    def take_logprobs(self, slot: int) -> wire.Logprobs | None:
        return None

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        return list(text.encode())

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < 256:
            raise BadRequest(f"token {token} is not in the vocabulary of 256 tokens")
        return bytes([token])

    def tokens(self, slot: int) -> Sequence[int]:
        return ()

    def cancel(self, slot: int) -> None:
        echo = self._running.get(slot)
        if echo is not None:
            echo.cancel_requested = True

    def park(self, slot: int, key: str) -> bool:
        echo = self._running.get(slot)
        if echo is None or echo.cancel_requested:
            return False
        self._parked[key] = self._running.pop(slot)
        return True

    def resume(self, key: str, slot: int, on_token: OnToken) -> bool:
        echo = self._parked.pop(key, None)
        if echo is None:
            return False
        echo.on_token = on_token
        self._running[slot] = echo
        return True

    def drop(self, key: str) -> None:
        self._parked.pop(key, None)

    def step(self) -> list[tuple[int, Completion]]:
        """The next piece of every running sequence (after the next tick, with one)."""
        if self.tick:
            self._wait_for_tick()
        done = []
        for slot, echo in list(self._running.items()):
            reason = "cancelled" if echo.cancel_requested else None
            if reason is None:
                i = len(echo.sent)
                piece = f"{time.monotonic_ns()} " if self.tick else echo.prompt[i * echo.size:(i + 1) * echo.size]
                echo.sent.append(piece)
                go_on = echo.on_token(echo.sent[-1], i + 1)
                reason = "length" if len(echo.sent) == echo.pieces else None if go_on else "cancelled"
            if reason is not None:
                del self._running[slot]
                done.append((slot, Completion(
                    text="".join(echo.sent), finish_reason=reason, prompt_tokens=len(echo.prompt),
                    completion_tokens=len(echo.sent), prompt_s=0.0,
                    generate_s=time.perf_counter() - echo.admitted_at)))
        return done

    def _wait_for_tick(self) -> None:
        now = time.monotonic()
        if self._next_tick <= now - self.tick:  # idle since, or more than a tick late: start afresh from now
            self._next_tick = now
        time.sleep(max(0.0, self._next_tick - now))
        self._next_tick += self.tick

    def close(self) -> None:
        self._running.clear()
        self._parked.clear()
