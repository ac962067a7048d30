"""A model rolled onto new settings by a reload: its instances replaced one at a time, and no request failed.

    reload: a model's settings that need a new context (n_ctx, parallel, KV types, the draft model, ...) or other
    weights (its file) ──▶ Instances.roll(the new entry)
        the new entry serves every instance started from then on (the roll's, scale-ups, restarts); the running
        ones are superseded (``Supervisor.supersede``: none restarts from the old spec) ──▶ Roll(old, target)
    each loop turn while an old instance runs ──▶ turn(...) ──▶ step(Turn) ──▶
        WAIT   an instance of the model is starting, or one is draining, or an old one left and has not exited
        START  one on the new settings, where an index is free and it fits (blue/green: every old one still
               serves, and the new one takes requests beside them)
        DRAIN  the old one running least: it takes nothing new and is told to stop at once; its requests are
               handed over (``Broker.hand_over``: each goes on elsewhere, first in line, from the tokens it
               streamed, as after a worker's loss), or, where one could not go on so, it finishes them first; it
               exits, and its index is free for its replacement (drain, then swap)
    no old instance left, and as many new ones as the old were (or no room for more) ──▶ DONE

A zygote (``mpserve.worker.zygote``) whose weights the new settings keep forks the new instances as it forked the
old ones: nothing is loaded again; one whose weights they change (another file) is stopped at the first new start,
and a new zygote loads the new file while the old instances still serve (``Supervisor._zygote``).

Rows: a new instance takes its index's slot-table rows where its ``parallel`` needs no more rows than the index was
given; more, and the roll takes rows of its own from the table's free ones (``allocate``: those no model reserves,
``--spare-slots``), fresh indices with them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum

from mpserve.config.loader import ModelConfig


class Step(Enum):
    WAIT = "wait"
    START = "start"
    DRAIN = "drain"
    DONE = "done"


@dataclass
class Roll:
    """A model's roll in progress: the worker indices of its instances on the settings before (those still
    running), and how many instances it keeps serving meanwhile (those it ran when the roll began)."""

    old: set[int]
    target: int


@dataclass(frozen=True)
class Turn:
    """The model as the roll sees it in one loop turn."""

    old: int  # instances on the old settings still running (ready, draining, or starting)
    new: int  # instances on the new settings, ready or starting
    busy: bool  # an instance of the model is starting or draining
    room: bool  # one more instance can start now (a free index, and it fits)
    old_ready: bool  # an old instance can be drained (registered, not draining)


def turn(old: set[int], registered: Mapping[int, bool], starting: int, room: Callable[[], bool]) -> Turn:
    """The model as the roll sees it this turn, from the indices of its old instances still running (``old``), each
    registered instance's index and whether it drains (``registered``), how many start, and whether one more can
    (``room``, asked only where nothing is busy). Busy: one starts or drains, or an old one has left the broker (told
    to stop, its requests handed over) and not exited yet: its index is not free, and a drain of the next meanwhile
    would leave the model with none of its old instances serving and no new one started."""
    busy = starting > 0 or any(registered.values()) or any(index not in registered for index in old)
    new = starting + sum(1 for index, draining in registered.items() if index not in old and not draining)
    old_ready = any(index in registered and not registered[index] for index in old)
    return Turn(len(old), new, busy, not busy and room(), old_ready)


def step(roll: Roll, turn: Turn) -> Step:
    """What the roll does this turn: one change at a time, a start before a drain where there is room; done once
    no old instance is left and the new ones are as many as the old were (or no more can start)."""
    if turn.busy:
        return Step.WAIT
    if turn.room and turn.old + turn.new <= roll.target and (turn.old or turn.new < roll.target):
        return Step.START
    if turn.old == 0:
        return Step.DONE
    return Step.DRAIN if turn.old_ready else Step.WAIT


def allocate(taken: set[int], table_rows: int, count: int, width: int, first_index: int
             ) -> list[tuple[int, int]] | None:
    """(worker index, first row) for ``count`` instances of ``width`` rows each, first fit among the rows of the
    table not ``taken``, with indices from ``first_index`` on; None if they do not fit."""
    found: list[tuple[int, int]] = []
    row = 0
    while len(found) < count and row + width <= table_rows:
        clash = next((r for r in range(row, row + width) if r in taken), None)
        if clash is None:
            found.append((first_index + len(found), row))
            row += width
        else:
            row = clash + 1
    return found if len(found) == count else None


def settings(model: ModelConfig) -> str:
    """A model's settings that a roll changes, in one line (``mpserve status``)."""
    spec = model.speculative
    draft = "" if spec is None else f", speculative {spec.type}" + (f" {spec.model}" if spec.model else "")
    return (f"{model.path}, n_ctx {model.n_ctx}, parallel {model.parallel}, KV {model.cache_type_k}/"
            f"{model.cache_type_v}{draft}")
