"""Single active backend: at most one model resident (loaded) per device, and fair turns between models.

LocalAI's "single active backend" for a server whose models do not fit a GPU together. Each device has
a *resident* model; only its workers on that device may load and compute. The switching policy:

- The resident model keeps the device while it is the only one with waiting requests.
- Once another model has requests waiting for the device, the resident may start at most
  ``batch`` more requests (counted since it became resident), however many of its slots are free at
  once; then, or as soon as its own queue on the device is empty, the device *drains*: nothing new
  starts on it, and the next resident is the waiting model whose oldest request is oldest.
- When the draining model has no request left running on the device, its loaded workers there are
  told to unload; when the last one has confirmed, the next model becomes resident and its requests
  start (its workers load on their first request).

So every model with waiting requests gets the device within one batch of the others, and a switch
costs one unload and one load, never a request. This module only decides (and logs each turn: a drain
begins, a model becomes resident); the broker acts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger("mpserve.residency")


@dataclass
class DeviceTurn:
    resident: str | None = None
    started: int = 0  # requests started on the device since ``resident`` got it
    next: str | None = None  # set while the resident drains
    contested: bool = False  # another model had requests waiting for the device at the last ``decide``


@dataclass(frozen=True)
class Loaded:
    """A worker on the device whose model is in memory (or being unloaded)."""

    worker: bytes
    model: str
    unloading: bool


class Residency:
    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.turns: dict[int, DeviceTurn] = {}
        self.swaps = 0  # a device's resident model replaced by another, on every device (the broker's STATS)

    def allows(self, device: int, model: str) -> bool:
        """May a request of ``model`` start on ``device`` now? Not once the resident has started its batch while
        another model waits, though slots are free: the broker starts requests on every free slot between two
        ``decide`` calls, and the drain begins only at the next."""
        turn = self.turns.setdefault(device, DeviceTurn())
        spent = turn.contested and turn.started >= self.batch
        return turn.next is None and turn.resident == model and not spent

    def started(self, device: int) -> None:
        self.turns[device].started += 1

    def decide(self, device: int, waiting: Iterable[str], running: Mapping[str, int],
               loaded: Iterable[Loaded]) -> list[bytes]:
        """Advance the device's turn; return the workers to tell to unload now.

        ``waiting``: models with queued requests that can run on the device, oldest head first;
        ``running``: requests running on the device, by model; ``loaded``: its workers holding a model.
        """
        turn = self.turns.setdefault(device, DeviceTurn())
        waiting = list(waiting)
        unload = self._advance(device, turn, waiting, running, list(loaded))
        turn.contested = any(m != turn.resident for m in waiting)
        return unload

    def _advance(self, device: int, turn: DeviceTurn, waiting: list[str], running: Mapping[str, int],
                 loaded: list[Loaded]) -> list[bytes]:
        """``decide``'s step: a drain begun, or ended and the next model resident; the workers to unload."""
        if turn.resident is None:
            if not waiting:
                return []
            turn.next = waiting[0]
        elif turn.next is None:
            others = [m for m in waiting if m != turn.resident]
            if others and (turn.started >= self.batch or turn.resident not in waiting):
                turn.next = others[0]
                log.info("device %d: %s drains after %d request(s) for %s, which has requests waiting", device,
                         turn.resident, turn.started, turn.next)
        if turn.next is None:
            return []
        if any(count for model, count in running.items() if model != turn.next):
            return []  # drain: the outgoing model finishes what it started
        leaving = [w for w in loaded if w.model != turn.next]
        if leaving:
            return [w.worker for w in leaving if not w.unloading]
        log.info("device %d: %s is resident now%s", device, turn.next,
                 f" (after {turn.resident})" if turn.resident else "")
        self.swaps += turn.resident is not None
        turn.resident, turn.next, turn.started = turn.next, None, 0
        return []
