"""A model that no instance can serve: how long its queued requests wait, and what they are told.

    every watchdog period (``Broker.expire_unserved``), per model:
        an instance registered and not draining, or one loading ─▶ served (``unserved_since`` None)
        (loading: the supervisor started one, or restarts one, that has not registered yet)
        else ─▶ unserved since the first period that saw it so ─▶ each queued request that has waited
                ``no_instance_timeout`` (``due``) ends: ERROR ``no_instance``, saying why (``refusal``)
    a queued request whose own ``timeout`` passes while its model has no instance ─▶ ``no_instance`` too, saying
        why (still loading, or as above), instead of ``timeout``

A request waits from when it was queued or from when its model became unserved, whichever is later: one
queued when the model's last pool had been gone for long still waits the whole bound for a pool to come
back, and a stream whose last instance was lost is requeued (``Registry._after_loss``) and waits the bound
from that loss; it then ends with this error after the text it streamed. While an instance loads, requests
wait for it: a load that fails often enough fails the model (``model_failed``).
"""

from __future__ import annotations

from .state import ModelQueue

DEFAULT_TIMEOUT_S = 60.0


def due(accepted: float, unserved_since: float, now: float, timeout: float) -> bool:
    """Whether a request queued at ``accepted`` for a model unserved since ``unserved_since`` waited long enough."""
    return now - max(accepted, unserved_since) >= timeout


def refusal(mq: ModelQueue, loading: bool, now: float) -> str:
    """Why no instance serves ``mq``'s model, and what to do: still loading, its last instance lost (a pool gone,
    or a local one not restarted), or none ever registered."""
    name = mq.name
    if loading:
        return (f"model {name} is still loading: no instance of it is ready yet; retry once one is (GET /health or "
                "mpserve status shows it), or give the request a longer timeout")
    lost = mq.lost
    if lost is None:
        return (f"no instance of model {name} has registered with this server: it starts none here, or they failed "
                f"to start (see the server log); connect a pool that serves it (mpserve worker --connect) or start it "
                f"here (mpserve load {name}, within its max instances)")
    ago = f"{now - lost.at:.0f} s ago"
    if lost.remote:
        return (f"the pool serving model {name} is gone: its last instance was lost {ago} ({lost.what}) and none "
                f"has registered since; start the pool again (mpserve worker --connect) or start the model here "
                f"(mpserve load {name}, within its max instances)")
    return (f"model {name} has no instance: its last one went {ago} ({lost.what}) and none is starting; load it "
            f"again (mpserve load {name}) or see the server log")
