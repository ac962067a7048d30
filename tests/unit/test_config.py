"""Configuration: precedence, and errors that name the key, the value and what is allowed."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from mpserve.config import loader as cfg
from mpserve.errors import ConfigError

pytestmark = pytest.mark.timeout(30)

TWO_MODELS = {"max_queue": 10, "models": [{"name": "a", "path": "builtin:tiny", "instances": 2},
                                          {"name": "b", "path": "echo", "threads": 3}]}


def test_defaults_give_one_instance_of_the_builtin_model() -> None:
    config = cfg.build()
    assert [(m.name, m.path, m.instances) for m in config.models] == [("tiny", "builtin:tiny", 1)]
    assert config.max_queue == 256


def test_file_values_apply_and_flags_override_them() -> None:
    config = cfg.build(TWO_MODELS, server={"max_queue": None}, model={"instances": None})
    assert config.max_queue == 10 and [m.instances for m in config.models] == [2, 1]
    config = cfg.build(TWO_MODELS, server={"max_queue": 3}, model={"instances": 4})
    assert config.max_queue == 3 and [m.instances for m in config.models] == [4, 4]
    config = cfg.build(TWO_MODELS, model={"path": "echo"})
    assert [m.name for m in config.models] == ["echo"]


def test_threads_default_to_cores_divided_by_all_instances() -> None:
    config = dataclasses.replace(cfg.build(TWO_MODELS), threads_total=6)
    assert config.threads_for(config.models[0]) == 2  # 6 cores / 3 instances
    assert config.threads_for(config.models[1]) == 3  # set explicitly


@pytest.mark.parametrize("data, problem", [
    ({"models": [{"name": "a", "instnces": 2}]},
     "models\\[0\\]: unknown key 'instnces'; did you mean 'instances'\\? allowed keys: name"),
    ({"models": [{"name": "a", "zzz": 2}]}, "models\\[0\\]: unknown key 'zzz'; allowed keys: name"),
    ({"max_queu": 3}, "unknown key 'max_queu'"),
    ({"models": [{"instances": "two"}]}, "models\\[0\\].instances: got 'two', expected an integer"),
    ({"models": [{"instances": -1}]}, "instances: got -1, allowed: 0 to 256"),
    ({"models": [{"path": "/no/such.gguf"}]}, "no such model file"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "unique"),
    ({"models": []}, "non-empty list"),
    ({"log_level": "loud"}, "log_level"),
    ({"models": [{"flash_attn": "fast"}]}, "models\\[0\\].flash_attn: got 'fast', allowed: auto, on, off"),
    ({"models": [{"cache_type_k": "q3_k"}]}, "models\\[0\\].cache_type_k: got 'q3_k', allowed: f32, f16, bf16, q8_0"),
    ({"models": [{"cache_type_v": 8}]}, "models\\[0\\].cache_type_v: got 8, expected a string"),
    ({"models": [{"cache_type_v": "q8_0", "flash_attn": False}]},
     "cache_type_v: q8_0 is a quantized type, which llama.cpp stores only with flash attention, and flash_attn is off"),
    ({"models": [{"cache_ram": "lots"}]}, "models\\[0\\].cache_ram: memory size 'lots' is not understood"),
    ({"models": [{"cache_ram": [1]}]}, "models\\[0\\].cache_ram: got \\[1\\], expected a string or an integer"),
    ({"models": [{"reuse": "chunks"}]}, "models\\[0\\].reuse: got 'chunks', allowed: any, exact"),
])
def test_bad_configuration_names_key_value_and_what_is_allowed(data: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        cfg.build(data, source="f.yaml")


@pytest.mark.parametrize("given, mode", [(None, "auto"), ("auto", "auto"), (True, "on"), (False, "off"), ("ON", "on"),
                                         ("false", "off"), ("1", "on")])
def test_flash_attn_is_auto_on_or_off_and_true_false_spell_on_off(given: object, mode: str) -> None:
    models = [{"name": "a"} if given is None else {"name": "a", "flash_attn": given}]
    assert cfg.build({"models": models}).models[0].flash_attn == mode


def test_a_quantized_k_needs_no_flash_attention_and_a_quantized_v_takes_auto() -> None:
    [model] = cfg.build({"models": [{"cache_type_k": "q4_0", "flash_attn": "off"}]}).models
    assert (model.cache_type_k, model.cache_type_v) == ("q4_0", "f16")
    [model] = cfg.build(model={"cache_type_k": "q8_0", "cache_type_v": "q8_0"}).models
    assert (model.cache_type_k, model.cache_type_v, model.flash_attn) == ("q8_0", "q8_0", "auto")


def test_cache_ram_is_a_size_on_by_default_and_zero_turns_it_off() -> None:
    assert cfg.build().models[0].cache_ram == 256 << 20
    assert cfg.build({"models": [{"cache_ram": "1GiB"}]}).models[0].cache_ram == 1 << 30
    assert cfg.build(model={"cache_ram": "0"}).models[0].cache_ram == 0
    assert cfg.build({"models": [{"cache_ram": 0}]}).models[0].cache_ram == 0


def test_the_host_stores_folders_are_created_and_one_that_cannot_be_written_is_refused(tmp_path: Path) -> None:
    model = cfg.build().models[0]
    assert model.cache_disk is None and model.cache_disk_size == 4 << 30 and model.store_dir().startswith("/")
    [model] = cfg.build({"models": [{"cache_disk": str(tmp_path / "a" / "disk"), "cache_disk_size": "1GiB",
                                     "cache_shm": str(tmp_path / "shm")}]}).models
    assert (tmp_path / "a" / "disk").is_dir() and model.cache_disk_size == 1 << 30
    assert model.store_dir() == str(tmp_path / "shm")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"models\[0\].cache_disk: cannot create the host store's disk tier folder "
                                          r".*file/disk"):
        cfg.build({"models": [{"cache_disk": str(tmp_path / "file" / "disk")}]})


def test_reuse_is_any_by_default_and_exact_reaches_the_engine_spec() -> None:
    from mpserve.server.layout import build_layout, worker_specs

    assert cfg.build().models[0].reuse == "any"
    config = cfg.build({"models": [{"path": "echo", "reuse": "exact"}]})
    assert config.models[0].reuse == "exact"
    [spec] = worker_specs(config, build_layout(config), "tcp://127.0.0.1:1", Path("slots"))
    assert spec.engine.reuse == "exact"


def test_busy_poll_is_250_us_by_default_zero_turns_it_off_and_negative_is_refused() -> None:
    assert cfg.build().busy_poll_us == 250
    assert cfg.build({"busy_poll_us": 0}).busy_poll_us == 0
    assert cfg.build(server={"busy_poll_us": 50.0}).busy_poll_us == 50
    with pytest.raises(ConfigError, match="busy_poll_us: got -1.0, allowed: 0 to 100000"):
        cfg.build({"busy_poll_us": -1})


def test_flag_values_are_checked_like_file_values_and_named_by_their_flags() -> None:
    with pytest.raises(ConfigError, match=r"^\[config\] --instances: got -1, allowed: 0 to 256$"):
        cfg.build(model={"instances": -1})
    with pytest.raises(ConfigError, match=r"^\[config\] --n-ctx: got 5, allowed: 16 to 1048576$"):  # not 1.04858e+06
        cfg.build(model={"n_ctx": 5})
    with pytest.raises(ConfigError, match=r"^\[config\] f.yaml: models\[0\].scale_down_after: got 0.0, allowed: 0.1 "
                                          "to 86400$"):
        cfg.build({"models": [{"scale_down_after": 0}]}, source="f.yaml")


def test_start_with_a_bad_file_exits_before_starting_anything(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: tiny\n    instancs: 2\n")
    proc = subprocess.run([sys.executable, "-m", "mpserve", "start", "--config", str(bad)], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 1
    assert "unknown key 'instancs'" in proc.stderr and "Traceback" not in proc.stderr


def test_a_model_path_must_be_a_gguf_file_not_a_folder_or_another_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match=r"models\[0\].path: '.*notes.txt' is not a GGUF model file"):
        cfg.build({"models": [{"path": str(tmp_path / "notes.txt")}]})
    with pytest.raises(ConfigError, match="--model: '.*' is a folder, not a model file; give one of its files: m.gguf"):
        cfg.build(model={"path": str(tmp_path)})
    assert cfg.build(model={"path": str(tmp_path / "m.gguf")}).models[0].name == "m"


@pytest.mark.parametrize("text, problem", [
    ("models:\n  - name: a\n   path: x\n", "line 3, column 4: expected <block end>, but found '<block mapping start>'"),
    ("a: [1,\n", "line 2, column 1: expected the node content, but found '<stream end>'"),
])
def test_broken_yaml_is_named_by_its_file_line_and_column_on_one_line(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        cfg.load_file(path)
    assert caught.value.message.startswith(f"{path}: not valid YAML: {problem}") and "\n" not in caught.value.message


def test_relative_model_paths_in_a_file_are_relative_to_the_file(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    config = cfg.build({"models": [{"path": "m.gguf"}]}, base_dir=tmp_path)
    assert config.models[0].path == str(tmp_path / "m.gguf") and config.models[0].name == "m"


@pytest.mark.parametrize("instances, flags, bounds", [
    (2, {}, (2, 2)),
    ({"min": 1, "max": 4}, {}, (1, 4)),
    ({"min": 0, "max": 3}, {}, (0, 3)),
    ({"max": 3}, {}, (1, 3)),
    (2, {"max_instances": 4}, (2, 4)),
    ({"min": 1, "max": 4}, {"min_instances": 0, "max_instances": 2}, (0, 2)),
])
def test_instances_are_a_fixed_count_or_bounds_that_flags_override(instances: object, flags: dict,
                                                                   bounds: tuple[int, int]) -> None:
    config = cfg.build({"models": [{"path": "echo", "instances": instances}]}, model=flags)
    model = config.models[0]
    assert model.bounds == bounds and model.instances == bounds[0]
    assert config.total_slots == bounds[1]  # the slot table has room for the max


@pytest.mark.parametrize("instances, flags, problem", [
    ({"min": 3, "max": 2}, {}, "min_instances 3 is above max_instances 2"),
    ({"min": 1, "most": 2}, {}, "instances: unknown key 'most'; allowed keys: min, max"),
    ({"min": 1, "max": 0}, {}, "instances.max: got 0, allowed: an integer 1 to 256"),
    ({"min": "one"}, {}, "instances.min: got 'one'"),
    (1, {"max_instances": 0}, "--max-instances: got 0, allowed: 1 to 256"),
    (4, {"max_instances": 2}, "min_instances 4 is above max_instances 2"),
])
def test_bad_instance_bounds_are_refused(instances: object, flags: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        cfg.build({"models": [{"path": "echo", "instances": instances}]}, model=flags)


def test_worker_models_limit_named_pool_keys_and_need_the_keys_folder(tmp_path: Path) -> None:
    import zmq.auth

    from mpserve.server.pool_keys import pool_keys, refusal

    (tmp_path / "workers").mkdir()
    public, _ = zmq.auth.create_certificates(str(tmp_path / "workers"), "pool-a")
    zmq.auth.create_certificates(str(tmp_path), "server")
    curve = {"curve_secret": str(tmp_path / "server.key_secret"), "curve_clients": str(tmp_path),
             "curve_workers": str(tmp_path / "workers")}
    config = cfg.build({**curve, "worker_models": {"pool-a": ["tiny"]}})
    assert config.worker_models == {"pool-a": ("tiny",)}
    keys = pool_keys(str(tmp_path / "workers"), config.worker_models)
    key = keys[zmq.auth.load_certificate(public)[0].decode()]
    assert refusal(key, "tiny") is None and refusal(None, "other") is None  # a key not named: any model
    assert refusal(key, "other") == ("its key pool-a may serve tiny, not other (worker_models in the server's "
                                     "configuration; add other to the key's list there to allow it)")
    with pytest.raises(ConfigError, match=r"worker_models: pool-b: cannot read the public key .*pool-b.key"):
        pool_keys(str(tmp_path / "workers"), {"pool-b": ("tiny",)})
    with pytest.raises(ConfigError, match="worker_models names keys of curve_workers: give --curve-workers DIR"):
        cfg.build({"worker_models": {"pool-a": ["tiny"]}})
    with pytest.raises(ConfigError, match=r"config: worker_models: got 'pool-a': 'tiny', expected a key's name"):
        cfg.build({**curve, "worker_models": {"pool-a": "tiny"}})


def test_a_model_s_reasoning_sets_its_budgets_and_close_message_and_refuses_what_it_cannot_be() -> None:
    from mpserve.config.reasoning import Reasoning

    [model] = cfg.build({"models": [{"path": "builtin:tiny", "reasoning": {"low": 8, "close": "Answer now."}}]}).models
    assert model.reasoning == Reasoning(low=8, close="Answer now.")  # not set: None, the defaults
    assert model.reasoning.budget(None) == Reasoning().medium and model.reasoning.budget("low") == 8
    for given, problem in [({"low": -1}, "low: got -1, allowed: a number of tokens"),
                           ({"huge": 5}, "unknown key 'huge'; allowed keys: low, medium, high, close"),
                           ({"close": 3}, "close: got '3', allowed: a text"),
                           ("fast", "got .fast., expected a mapping")]:
        with pytest.raises(ConfigError, match=rf"models\[0\].reasoning: {problem}"):
            cfg.build({"models": [{"path": "builtin:tiny", "reasoning": given}]})
