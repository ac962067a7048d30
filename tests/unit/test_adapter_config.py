"""Declared LoRA adapters: the YAML mapping and the --lora flag, and the check of each adapter's GGUF header against
its model (a non-LoRA GGUF, another architecture, shapes that do not fit, a missing file: each one line naming the
file and the fix), and their bytes in the memory estimate."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_adapter

from mpserve.config import loader
from mpserve.errors import ConfigError
from mpserve.gpu.placement import estimate_request
from mpserve.models.builtin import builtin_model_path
from mpserve.server.layout import model_request


def build(tmp: Path, adapters: object, **model: object) -> loader.ServerConfig:
    return loader.build({"models": [{"path": "builtin:tiny", "adapters": adapters, **model}]}, base_dir=tmp)


def test_adapters_are_declared_in_order_and_relative_to_the_file(tmp_path: Path) -> None:
    write_adapter(tmp_path / "b.gguf")
    write_adapter(tmp_path / "a.gguf")
    model = build(tmp_path, {"second": "b.gguf", "first": "a.gguf"}).models[0]
    assert model.adapters == (("second", str(tmp_path / "b.gguf")), ("first", str(tmp_path / "a.gguf")))
    loader.check_adapters(model)


def test_the_lora_flag_declares_them_for_the_model_on_the_command_line(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "fr.gguf")
    config = loader.build({}, model={"path": "builtin:tiny", "adapters": [f"fr={path}"]})
    assert config.models[0].adapters == (("fr", str(path)),)
    with pytest.raises(ConfigError, match="--lora: got 'fr', expected NAME=PATH"):
        loader.build({}, model={"path": "builtin:tiny", "adapters": ["fr"]})
    two = {"models": [{"path": "builtin:tiny"}, {"path": "builtin:tiny", "name": "other"}]}
    with pytest.raises(ConfigError, match="--lora declares adapters of the model given with --model"):
        loader.build(two, model={"adapters": [f"fr={path}"]})


@pytest.mark.parametrize("case", ["model file", "architecture", "shape", "missing tensor", "missing file", "name",
                                  "twice"])
def test_a_bad_adapter_is_refused_in_one_line_naming_the_file_and_the_fix(case: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    adapters: object = {"x": str(bad)}
    if case == "model file":
        adapters = {"x": str(builtin_model_path("tiny"))}
        expected = "is a model GGUF, not a LoRA adapter"
    elif case == "architecture":
        write_adapter(bad, arch="gemma3")
        expected = "adapts a 'gemma3' model, and this model is 'llama'"
    elif case == "shape":
        write_adapter(bad, pairs={"blk.0.attn_q.weight": (64, 96)})
        expected = "'blk.0.attn_q.weight' pair has shapes [64, 4] and [4, 96]"
    elif case == "missing tensor":
        write_adapter(bad, pairs={"blk.9.attn_q.weight": (64, 64)})
        expected = "'blk.9.attn_q.weight.lora_a' has no tensor of that name"
    elif case == "missing file":
        expected = "no such adapter file"
    elif case == "name":
        write_adapter(bad)
        adapters, expected = {"base:x": str(bad)}, "adapter name 'base:x': allowed letters"
    else:
        write_adapter(bad)
        adapters, expected = [f"x={bad}", f"x={bad}"], "adapter 'x' is declared twice"
    with pytest.raises(ConfigError) as refused:
        loader.check_adapters(build(tmp_path, adapters).models[0])
    message = refused.value.message
    assert expected in message and "\n" not in message
    assert "adapters" in message
    if case not in ("name", "twice"):
        assert "give" in message and ("bad.gguf" in message or "mpserve-tiny" in message)


def test_adapters_count_in_the_memory_estimate_once_when_forked(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a.gguf", rank=8, pairs={f"blk.0.{t}.weight": (64, 64)
                                                              for t in ("attn_q", "attn_k", "attn_v")})
    model = build(tmp_path, {"a": str(path)}, instances=2).models[0]
    plain = estimate_request(model_request(build(tmp_path, {}, instances=2).models[0]))
    adapted = estimate_request(model_request(model))
    assert adapted.adapters == 3 * 2 * 8 * 64 * 4  # three pairs of rank 8 × 64 float32 values
    assert adapted.total - plain.total == adapted.adapters


def test_the_host_counts_adapters_once_when_its_instances_are_forked_from_one_zygote(tmp_path: Path) -> None:
    from mpserve.server.host_ram import RamNeed

    one = estimate_request(model_request(build(tmp_path, {"a": str(write_adapter(tmp_path / "a.gguf"))}).models[0]))
    forked = RamNeed("m", 4, one, shared=True, host_store=0, parallel=1, n_ctx=64, forked=True)
    each = RamNeed("m", 4, one, shared=True, host_store=0, parallel=1, n_ctx=64, forked=False)
    assert forked.weights == one.weights + one.adapters
    assert each.weights == one.weights + 4 * one.adapters
