"""A roll at its edges (``mpserve.server.rolling``): rows taken up to the table's last one and one instance after
another, no start while the old and new would pass the target, and the settings line ``mpserve status`` shows."""

from __future__ import annotations

from mpserve.config.loader import ModelConfig
from mpserve.config.speculative import Speculative
from mpserve.server.rolling import Roll, Step, Turn, allocate, settings, step


def test_rows_are_taken_side_by_side_from_the_first_up_to_the_table_s_last() -> None:
    assert allocate(set(), 9, 3, 3, 4) == [(4, 0), (5, 3), (6, 6)]
    assert allocate(set(), 6, 2, 3, 0) == [(0, 0), (1, 3)]
    assert allocate({8}, 9, 3, 3, 0) is None


def test_no_instance_starts_while_the_old_and_new_ones_would_pass_the_target() -> None:
    assert step(Roll({0}, 2), Turn(1, 2, busy=False, room=True, old_ready=True)) is Step.DRAIN


def test_the_settings_line_names_the_file_context_batch_kv_types_and_the_speculation() -> None:
    model = ModelConfig("m", "/models/m.gguf", n_ctx=4096, parallel=4, cache_type_k="q8_0", cache_type_v="f16")
    assert settings(model) == "/models/m.gguf, n_ctx 4096, parallel 4, KV q8_0/f16"
    ngram = ModelConfig("m", "/models/m.gguf", speculative=Speculative())
    assert settings(ngram) == "/models/m.gguf, n_ctx 2048, parallel 1, KV f16/f16, speculative ngram"
    draft = ModelConfig("m", "/models/m.gguf", speculative=Speculative("draft", model="/models/d.gguf"))
    assert settings(draft).endswith(", speculative draft /models/d.gguf")
