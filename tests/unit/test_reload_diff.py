"""What a reload changes (``mpserve.server.reload.diff``): settings applied at once, model bounds, models added and
removed, models rolled onto settings that need a new context, and the rest named as needing a restart with its
running value kept."""

from __future__ import annotations

import dataclasses

from mpserve.config.loader import ModelConfig, ServerConfig
from mpserve.server import reload

A = ModelConfig("a", "echo")
B = ModelConfig("b", "echo", instances=2)


def test_nothing_changed_says_so() -> None:
    config = ServerConfig(models=(A, B))
    changes = reload.diff(config, config)
    assert not changes and changes.lines() == ["nothing changed"]


def test_each_kind_of_change_is_sorted_into_its_place() -> None:
    running = ServerConfig(models=(A, B), max_queue=256, bind="ipc:///x")
    c = ModelConfig("c", "builtin:tiny")
    new = ServerConfig(models=(dataclasses.replace(A, max_instances=3, n_ctx=4096, embedding=True), c), max_queue=8,
                       bind="tcp://0.0.0.0:5555", no_instance_timeout=5.0)
    changes = reload.diff(running, new)
    assert changes.at_once == {"max_queue": (256, 8), "no_instance_timeout": (60.0, 5.0)}
    assert list(changes.bounds) == ["a"] and changes.bounds["a"].bounds == (1, 3)
    assert changes.added == (c,) and changes.removed == ("b",)
    assert changes.kept == ("bind 'ipc:///x' -> 'tcp://0.0.0.0:5555'", "models[a].embedding False -> True")
    assert "models[a].embedding False -> True: needs a restart; the running value stays" in changes.lines()
    assert "models[a]: n_ctx 2048 -> 4096: rolling (its instances replaced one at a time)" in changes.lines()
    rolled, what = changes.rolled["a"]
    assert what == ("n_ctx 2048 -> 4096",) and rolled.n_ctx == 4096 and not rolled.embedding  # kept: the running
    after = reload.applied(running, changes)
    assert after.max_queue == 8 and after.bind == "ipc:///x"  # applied at once, kept
    assert [m.name for m in after.models] == ["a", "b", "c"]
    assert after.model("a").bounds == (1, 3) and after.model("a").n_ctx == 4096 and not after.model("a").embedding


def test_a_new_file_and_a_draft_model_roll_too() -> None:
    running = ServerConfig(models=(A,))
    new = ServerConfig(models=(dataclasses.replace(A, path="/m/other.gguf", parallel=4, cache_type_k="q8_0"),))
    changes = reload.diff(running, new)
    assert not changes.kept and not changes.bounds
    assert changes.rolled["a"][1] == ("path echo -> /m/other.gguf", "parallel 1 -> 4", "cache_type_k f16 -> q8_0")
