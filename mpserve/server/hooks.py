"""What the broker tells the rest of the server, and asks of it: one object, given to the broker when it is built
(gunicorn's server hooks), never patched onto it afterwards.

    broker (registry) ── worker_ready(entry) ─────▶ a local instance registered (READY): the supervisor's view
                      ── load_failed(index, why) ─▶ a local instance could not load its model (FAILED)
    broker (dispatch) ── worker_drained(entry) ───▶ a drained or replaced instance was told to STOP
    broker (clients)  ── control(call) ───────────▶ an operator's CONTROL, answered with its CONTROL_REPLY
                      ── scaling(model) ──────────▶ a model's scaling figures, for STATS
    broker (root)     ── loading(model) ──────────▶ whether an instance of the model is starting (``unserved``)

``BrokerHooks`` answers as a broker alone would (no supervisor, no instances: the unit tests' broker); the server's
loop gives its own (``mpserve.server.loop``).
"""

from __future__ import annotations

from mpserve.errors import BadRequest
from mpserve.wire import protocol as wire

from .state import WorkerEntry


class BrokerHooks:
    """A broker with nobody around it: nothing is told, no control call is taken, no instance is starting."""

    def worker_ready(self, entry: WorkerEntry) -> None:
        """Local instance ``entry`` registered, with its model loaded or not (``entry.loaded``)."""

    def load_failed(self, index: int, message: str) -> None:
        """Local instance ``index`` could not load its model (``message``: the load error)."""

    def worker_drained(self, entry: WorkerEntry) -> None:
        """``entry`` was told to STOP: it was drained (scaled down) or replaced by a roll."""

    def control(self, call: wire.Control) -> wire.ControlReply:
        """An operator's CONTROL call; raises BadRequest where none is taken."""
        raise BadRequest("this server takes no control calls")

    def scaling(self, model: str) -> wire.ModelScaling:
        """``model``'s scaling figures for STATS."""
        return wire.ModelScaling()

    def loading(self, model: str) -> bool:
        """Whether an instance of ``model`` is starting."""
        return False
