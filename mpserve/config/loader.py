"""Server configuration from a YAML file, environment variables and command-line flags; the keys, their
types, ranges and choices come from their declarations (``mpserve.config.settings``).

Precedence: flag > environment (``MPSERVE_…``, read by the CLI) > file (``--config``) > default. Flags
and variables that describe a model (``--model``, ``--instances``, ``--threads``, ``--n-ctx``,
``--n-gpu-layers``) apply to every model; ``--model`` replaces the file's model list with that one model.

A bad value is a ``ConfigError`` naming the key, the value and what is allowed; nothing starts with a
half-valid configuration, or with a file others may change (``private.read_guarded``).

Example file::

    max_queue: 256
    models:
      - name: tiny
        path: builtin:tiny      # the built-in model; or a .gguf path; or "echo" (no model, for benchmarks)
        instances: 2          # or {min: 1, max: 4}: the count follows the load (scale_up_after, scale_down_after)
        n_ctx: 2048
        threads: 1
        n_gpu_layers: 0
        speculative: ngram    # or {type: ngram, n_max: 8, ...}: prompt-lookup speculative decoding;
                              # {type: draft, model: small.gguf, n_max: 4}: a draft model's proposals
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from mpserve.config import reasoning, remote_tier, settings, speculative
from mpserve.config.kv_types import DEFAULT_KV_TYPE, KV_TYPES
from mpserve.config.reasoning import Reasoning
from mpserve.config.remote_tier import RemoteTier
from mpserve.config.sizes import parse_memory
from mpserve.config.speculative import Speculative
from mpserve.config.tenants import Tenants, parse_tenants
from mpserve.errors import ConfigError
from mpserve.models import adapters as adapter_sources
from mpserve.models import projector, sources, templates
from mpserve.models.builtin import builtin_model_path
from mpserve.models.folder import entries as folder_entries
from mpserve.models.shapes import MODEL_SIZES
from mpserve.private import private_dir, read_guarded
from mpserve.wire.slots import shm_dir

BUILTIN_PREFIX = "builtin:"
DEFAULT_MODEL = "builtin:tiny"
ECHO_MODEL = "echo"
GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file (``gguf_header`` reads the rest)
_FLAGS = "command line"  # where flag and environment values come from: named by their flags in errors
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,47}$")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: str
    instances: int = 1
    n_ctx: int = 2048
    threads: int | None = None  # None: cores ÷ all instances, at least 1
    n_gpu_layers: int | None = None  # None: all layers on a GPU, 0 on the CPU
    parallel: int = 1  # sequences one instance decodes together (continuous batching); n_ctx is per sequence
    flash_attn: str = "auto"  # llama.cpp's flash attention: auto (on where supported, as llama-server), on, off
    repack: bool | None = None  # llama.cpp's repacked weight layouts; None: auto (on unless they crash here)
    echo_tick_ms: float = 0.0  # the echo backend's time per step; its pieces are then their CLOCK_MONOTONIC ns
    cache_type_k: str = DEFAULT_KV_TYPE  # KV cache types (mpserve.config.kv_types); a quantized V needs flash attention
    cache_type_v: str = DEFAULT_KV_TYPE
    cache_ram: int = 256 << 20  # bytes of the host store's RAM tier, for the whole host; 0: no store
    cache_shm: str | None = None  # the RAM tier's folder; None: STORE_DIR in the shared-memory folder
    cache_disk: str | None = None  # the disk tier's folder; None: no disk tier
    cache_disk_size: int = 4 << 30  # its bytes
    cache_remote: str | None = None  # the remote tier's address (mpserve.config.remote_tier); None: none
    cache_remote_ttl: int = 3600  # seconds an entry stays there
    cache_remote_size: int = 256 << 20  # the largest entry written there or read
    cache_remote_password_file: str | None = None  # its password's file; None: MPSERVE_CACHE_REMOTE_PASSWORD
    reuse: str = "any"  # which cells a prompt starts from: any shared prefix, or exact (whole prompt chunks only)
    slot_save_path: str | None = None  # the folder of slot files (save and restore); None: off
    adapter_dir: str | None = None  # the folder hot-loaded adapters must be in; None: the model's and its adapters'
    devices: tuple[int, ...] | None = None  # pin the model's instances to these GPU indices
    requires_memory: int | None = None  # declared GPU bytes per instance; None: estimated from the GGUF
    embedding: bool = False  # serves embeddings (mpserve.engine.embed), not completions
    pooling: str | None = None  # an embedding model's pooling; None: the GGUF's
    min_instances: int | None = None  # the count follows the load within min .. max; None: instances, fixed
    max_instances: int | None = None
    scale_up_after: float = 2.0  # seconds the oldest waiting request waits before one more instance starts
    scale_down_after: float = 60.0  # seconds an instance's worth of slots idles before one instance drains
    speculative: Speculative | None = None  # speculative decoding (prompt lookup, a draft model); None: off
    reasoning: Reasoning | None = None  # thinking budgets per effort and close message; None: the defaults
    chat_template: str | None = None  # a family's name or a Jinja2 file (mpserve.models.templates); None: the GGUF's
    adapters: adapter_sources.Declared = ()  # LoRA adapters (name, source), in declaration order (models.adapters)
    mmproj: str | None = None  # the projector GGUF (models.projector), or auto: its source's (sources); None: none

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) instances; ``instances``, the count started with, is the min."""
        low = self.instances if self.min_instances is None else self.min_instances
        return low, max(low, self.instances if self.max_instances is None else self.max_instances)

    def store_dir(self) -> str:
        """The host store's RAM tier: ``cache_shm``, else one folder per user in /dev/shm."""
        return self.cache_shm or str(shm_dir() / f"mpserve-store-{os.getuid()}")

    def remote_tier(self) -> RemoteTier | None:
        """The host store's remote tier, if there is one (and a RAM tier to restore its entries into)."""
        if self.cache_remote is None or not self.cache_ram:
            return None
        return RemoteTier(self.cache_remote, self.cache_remote_ttl, self.cache_remote_size,
                          self.cache_remote_password_file)

    def resolved_path(self) -> str:
        """The GGUF file to load ("echo" for the echo backend); writes the built-in model if needed."""
        if self.path.startswith(BUILTIN_PREFIX):
            return str(builtin_model_path(self.path[len(BUILTIN_PREFIX):]))
        return sources.local_path(self.path)

    def adapter_paths(self) -> dict[str, str]:
        """Each adapter's GGUF on this host, by name, in declaration order (Hub sources pulled first)."""
        return {name: adapter_sources.local(source) for name, source in self.adapters}


def tier_folder(tier: str) -> str:
    """How the folder of the host store's ``tier`` ("ram", "disk") is named where it is refused."""
    return f"host store's {tier} tier folder"


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelConfig, ...]
    server_name: str = "default"
    bind: str | None = None
    workers_bind: str | None = None
    admin_bind: str | None = None  # the operators' socket (mpserve.server.roles)
    spare_slots: int = 0  # slot-table rows for models added at run time
    max_queue: int = 256
    max_queue_total: int = 4096
    max_pending_per_client: int = 128  # so that one client cannot fill the queues
    grace: float = 30.0
    stall_timeout: float = 60.0
    start_method: str = "fork"  # or "spawn" (mpserve.worker.spec.start_mode)
    idle_timeout: float = 0.0  # 0: never unload
    client_timeout: float = 5.0
    adopt_wait: float = 30.0  # a dead server's instances wait this long for the next one to adopt them (0: exit)
    no_instance_timeout: float = 60.0  # a request waits this long while no instance of its model is up or loading
    stream_interval: float = 0.02  # seconds between a streamed request's chunks after its first; 0: every token
    kv_events: str | None = None  # where instances publish their KV events (mpserve.worker.kv_publisher); None: not
    busy_poll_us: float = 250.0  # the broker polls this long after a message before it sleeps (mpserve.server.waiting)
    curve_secret: str | None = None
    curve_clients: str | None = None
    curve_workers: str | None = None  # folder of allowed remote workers' public keys
    worker_models: dict[str, tuple[str, ...]] | None = None  # key name in curve_workers -> the models it may serve
    curve_admins: str | None = None  # folder of operators' public keys (a tcp admin_bind)
    tenants: Tenants | None = None  # None: no section, nothing capped (mpserve.config.tenants)
    insecure: bool = False
    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 5  # a remote worker silent for interval × liveness is lost
    gpus: tuple[int, ...] | None = None  # None: every GPU found
    simulate_gpus: str | None = None  # e.g. "2x24GiB": devices without CUDA, for tests and planning
    gpu_mode: str = "shared"  # or "exclusive": one computing request per GPU, host-wide
    max_active_per_gpu: int | None = None  # None: unlimited (in shared mode)
    gpu_memory_budget: int | None = None  # bytes per device, if less than its free memory
    ram_budget: int | None = None  # host RAM for the instances on the CPU, if less than is available
    single_active_backend: bool = False
    switch_batch: int = 8  # single active backend: requests a resident model may serve while another waits
    lock_dir: str | None = None  # permit lock files; None: the host-wide default
    permit_log: str | None = None  # append every permit hold interval here (audits, tests)
    log_level: str = "info"
    models_dir: str | None = None  # a folder whose GGUFs are models too, loaded on demand (mpserve.models.folder)
    threads_total: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))

    @property
    def total_instances(self) -> int:
        return sum(m.instances for m in self.models)

    @property
    def total_slots(self) -> int:
        """Slot-table rows: room for every model's max instances, so scaling up needs no new table."""
        return sum(m.bounds[1] * m.parallel for m in self.models) + self.spare_slots

    def threads_for(self, model: ModelConfig) -> int:
        return model.threads or max(1, self.threads_total // max(1, sum(m.bounds[1] for m in self.models)))

    def model(self, name: str) -> ModelConfig:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def permit_capacity(self) -> int | None:
        """How many requests may compute on one GPU at once, host-wide (None: no limit, no permits)."""
        return 1 if self.gpu_mode == "exclusive" else self.max_active_per_gpu

    def check_access(self, source: str) -> None:
        """A client socket open to the network needs CURVE keys, unless the user said --insecure."""
        if self.bind and _is_network_tcp(self.bind) and self.curve_secret is None and not self.insecure:
            raise ConfigError(f"{source}: bind {self.bind} is reachable from other hosts; give CURVE keys "
                              "(--curve-secret FILE --curve-clients DIR, made with `mpserve keygen`), bind to "
                              "127.0.0.1, or pass --insecure to accept anyone who can reach the port")
        if (self.workers_bind and _is_network_tcp(self.workers_bind) and self.curve_workers is None
                and not self.insecure):
            raise ConfigError(f"{source}: workers_bind {self.workers_bind} is reachable from other hosts; give "
                              "--curve-secret FILE --curve-clients DIR --curve-workers DIR (keys from `mpserve "
                              "keygen`), bind to 127.0.0.1, or pass --insecure")
        if self.admin_bind and self.admin_bind.startswith("tcp://") and self.curve_admins is None:
            raise ConfigError(f"{source}: admin_bind {self.admin_bind} is a tcp address: give --curve-secret FILE "
                              "and --curve-admins DIR (the operators' public keys, from `mpserve keygen`), or leave "
                              "admin_bind to its ipc default, open to this user alone")
        if self.curve_admins is not None and self.curve_secret is None:
            raise ConfigError(f"{source}: curve_admins needs curve_secret (the server's secret key file)")
        if self.curve_workers is not None and self.curve_secret is None:
            raise ConfigError(f"{source}: curve_workers needs curve_secret (the server's secret key file)")
        if self.worker_models is not None and self.curve_workers is None:
            raise ConfigError(f"{source}: worker_models names keys of curve_workers: give --curve-workers DIR (the "
                              "remote pools' public keys, from `mpserve keygen`)")
        if (self.curve_secret is None) != (self.curve_clients is None):
            raise ConfigError(f"{source}: curve_secret and curve_clients go together (the server's secret key "
                              "file and the folder of allowed client public keys)")
        for key in ("curve_secret", "curve_clients", "curve_workers", "curve_admins"):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                raise ConfigError(f"{source}: {key}: {value} does not exist; create keys with `mpserve keygen`")


def _is_network_tcp(address: str) -> bool:
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return not (host.startswith("127.") or host in ("localhost", "::1"))


_MODEL_KEYS = {s.key: s.kinds for s in settings.scoped("model")}
_REQUIRES_KEYS: dict[str, tuple[type, ...]] = {"memory": (str, int), "gpus": (int,)}
_SERVER_KEYS = {**{s.key: s.kinds for s in settings.scoped("server")}, "models": (list,)}
_RANGES = {s.key: r for s in settings.SETTINGS if (r := s.range) is not None}
_GPU_MODES = settings.BY_KEY["gpu_mode"].choices or ()
_START_METHODS = settings.BY_KEY["start_method"].choices or ()
FLASH_ATTN_MODES = settings.BY_KEY["flash_attn"].choices or ()
_FLASH_ATTN_SPELLINGS = {True: "on", False: "off", "true": "on", "false": "off", "1": "on", "0": "off",
                         "yes": "on", "no": "off"}
_LOG_LEVELS = settings.BY_KEY["log_level"].choices or ()
_POOLINGS = settings.BY_KEY["pooling"].choices or ()
_REUSE_MODES = settings.BY_KEY["reuse"].choices or ()


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        text = read_guarded(path, "configuration file").decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys ({', '.join(_SERVER_KEYS)})")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """PyYAML's problem and where it is, on one line (its own text spans lines and names no file)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        return " ".join(str(exc).split())
    mark = exc.problem_mark
    return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}" + (
        f" ({exc.context})" if exc.context else "")


def build(file_data: Mapping[str, Any] | None = None, server: Mapping[str, Any] | None = None,
          model: Mapping[str, Any] | None = None, source: str = "config", base_dir: Path | None = None
          ) -> ServerConfig:
    """Merge file values with overrides (flags and environment, already merged by the CLI; None = unset).

    ``server`` overrides server keys; ``model`` overrides model keys of every model, and a ``path`` in it
    replaces the file's model list. Relative model paths in the file are relative to ``base_dir`` (the
    file's folder); those on the command line, to the current directory.
    """
    data = dict(file_data or {})
    _check_keys(data, _SERVER_KEYS, source)
    server_values = {k: _checked(k, v, _SERVER_KEYS[k], source) for k, v in data.items() if k != "models"}
    server_values.update({k: _checked(k, v, _SERVER_KEYS[k], _FLAGS)
                          for k, v in (server or {}).items() if v is not None})

    overrides = {k: _checked(k, v, _MODEL_KEYS[k], _FLAGS) for k, v in (model or {}).items()
                 if v is not None}
    raw_models = data.get("models")
    folder = server_values.get("models_dir")
    if folder and base_dir is not None and not Path(folder).is_absolute():
        folder = server_values["models_dir"] = str(base_dir / folder)
    if "path" in overrides or raw_models is None:
        raw_models = [{}] if "path" in overrides or not folder else []
    if not isinstance(raw_models, list) or not (raw_models or folder):
        raise ConfigError(f"{source}: 'models' must be a non-empty list of model entries")
    if base_dir is not None:
        raw_models = [_relative_to(base_dir, m) for m in raw_models]
    if "adapters" in overrides and len(raw_models) != 1:
        raise ConfigError(f"--lora declares adapters of the model given with --model; {source} has "
                          f"{len(raw_models)} models: give --model, or declare them in its models[].adapters")
    models = tuple(_model(i, m, overrides, source) for i, m in enumerate(raw_models))
    if folder:  # its files, but for those configured already; the flags' model settings bar the file
        shared = {k: v for k, v in overrides.items() if k not in ("path", "name", "adapters")}
        taken = {os.path.realpath(m.path) for m in models}
        found = folder_entries(str(folder), f"{source}: models_dir", taken)
        models += tuple(_model(len(models) + i, m, shared, source) for i, m in enumerate(found))
        if not models:
            raise ConfigError(f"{source}: models_dir: {folder!r} holds no .gguf files and no models are configured")
    names = [m.name for m in models]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(f"{source}: model names must be unique; repeated: {', '.join(dupes)}")
    server_values = _server_conversions(server_values, source)
    config = ServerConfig(models=models, **server_values)
    if config.log_level not in _LOG_LEVELS:
        raise ConfigError(f"{source}: log_level: got {config.log_level!r}, allowed: {', '.join(_LOG_LEVELS)}")
    config.check_access(source)
    if not _NAME_RE.match(config.server_name):
        raise ConfigError(f"{source}: server_name: got {config.server_name!r}, allowed: letters, digits, "
                          "'.', '_' and '-', at most 48 characters")
    return config


def _server_conversions(values: dict[str, Any], source: str) -> dict[str, Any]:
    """Turn file/flag spellings into ServerConfig's types: "0,2" -> (0, 2), "20GiB" -> bytes."""

    out = dict(values)
    if "gpus" in out:
        out["gpus"] = _index_list(out["gpus"], f"{source}: gpus")
    if "gpu_memory_budget" in out:
        out["gpu_memory_budget"] = _bytes(out["gpu_memory_budget"], f"{source}: gpu_memory_budget", parse_memory)
    if "ram_budget" in out:
        out["ram_budget"] = _bytes(out["ram_budget"], f"{source}: ram_budget", parse_memory)
    if "worker_models" in out:
        out["worker_models"] = _worker_models(out["worker_models"], f"{source}: worker_models")
    if "tenants" in out:
        out["tenants"] = parse_tenants(out["tenants"], f"{source}: tenants")
    if out.get("gpu_mode", "shared") not in _GPU_MODES:
        raise ConfigError(f"{source}: gpu_mode: got {out['gpu_mode']!r}, allowed: {', '.join(_GPU_MODES)}")
    if out.get("start_method", "fork") not in _START_METHODS:
        raise ConfigError(f"{source}: start_method: got {out['start_method']!r}, allowed: "
                          f"{', '.join(_START_METHODS)}")
    return out


def _worker_models(value: dict[Any, Any], where: str) -> dict[str, tuple[str, ...]]:
    """``{KEY: [MODEL, ...]}``: each key's name (its KEY.key in curve_workers) and the names of its models."""
    limits = {}
    for key, models in value.items():
        if (not isinstance(key, str) or not _NAME_RE.match(key) or not isinstance(models, list)
                or not all(isinstance(m, str) and m for m in models)):
            raise ConfigError(f"{where}: got {key!r}: {models!r}, expected a key's name (its KEY.key file in "
                              "curve_workers) and a list of model names, e.g. {pool-a: [llama, qwen]}")
        limits[key] = tuple(models)
    return limits


def _index_list(value: Any, where: str) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value
    try:
        indices = tuple(int(str(i).strip()) for i in items if str(i).strip() != "")
    except ValueError:
        indices = ()
    if not indices or any(i < 0 for i in indices) or any(isinstance(i, bool) for i in items):
        raise ConfigError(f"{where}: got {value!r}, expected GPU indices like [0, 2] or \"0,2\"")
    return indices


def _bytes(value: Any, where: str, parse: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(parse(str(value)))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None


def _store_folder(value: str, tier: str, where: str) -> str:
    """The folder of the host store's ``tier``: created 0700 if missing (with its parents), refused unless it is
    this user's alone (``mpserve.private``) and writable."""
    try:
        path = private_dir(Path(value).expanduser(), tier_folder(tier))
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc.message}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {str(path)!r} is not a folder you can write; give one you can")
    return str(path)


def _model(index: int, entry: Any, overrides: Mapping[str, Any], source: str) -> ModelConfig:

    where = f"{source}: models[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a mapping with keys {', '.join(_MODEL_KEYS)}")
    _check_keys(entry, _MODEL_KEYS, where)
    values = {k: _checked(k, v, _MODEL_KEYS[k], where) for k, v in entry.items()}
    values.update(overrides)
    path = str(values.setdefault("path", DEFAULT_MODEL))
    if "name" not in values:
        values["name"] = _default_name(path)
    if not _NAME_RE.match(values["name"]):
        raise ConfigError(f"{where}.name: got {values['name']!r}, allowed: letters, digits, '.', '_' and '-', "
                          "starting with a letter or digit, at most 48 characters")
    _check_path(path, "--model" if "path" in overrides else f"{where}.path", where)
    if values.get("pooling") is not None and values["pooling"] not in _POOLINGS:
        raise ConfigError(f"{where}.pooling: got {values['pooling']!r}, allowed: {', '.join(_POOLINGS)}")
    if values.get("reuse", "any") not in _REUSE_MODES:
        raise ConfigError(f"{where}.reuse: got {values['reuse']!r}, allowed: {', '.join(_REUSE_MODES)} (exact: output "
                          "equal to a fresh computation)")
    if values.get("pooling") is not None and not values.get("embedding"):
        raise ConfigError(f"{where}.pooling: applies to embedding models; set embedding: true too")
    if values.get("embedding") and path == ECHO_MODEL:
        raise ConfigError(f"{where}.embedding: the echo backend has no embeddings; give a GGUF file")
    if "devices" in values:
        values["devices"] = _index_list(values["devices"], f"{where}.devices")
    if "flash_attn" in values:
        values["flash_attn"] = _flash_attn(values["flash_attn"], f"{where}.flash_attn")
    for key in ("cache_type_k", "cache_type_v"):
        if key in values and values[key] not in KV_TYPES:
            raise ConfigError(f"{where}.{key}: got {values[key]!r}, allowed: {', '.join(KV_TYPES)}")
    v_type = values.get("cache_type_v", DEFAULT_KV_TYPE)
    if KV_TYPES[v_type].quantized and values.get("flash_attn") == "off":
        raise ConfigError(f"{where}.cache_type_v: {v_type} is a quantized type, which llama.cpp stores only with "
                          "flash attention, and flash_attn is off; set flash_attn to auto or on, or cache_type_v "
                          "to f16, bf16 or f32")
    if values.get("mmproj") is not None:
        _check_mmproj(str(values["mmproj"]), path, bool(values.get("embedding")), f"{where}.mmproj")
    for folder in ("slot_save_path", "adapter_dir"):
        if folder in values and not Path(values[folder]).is_dir():
            raise ConfigError(f"{where}.{folder}: {values[folder]!r} is not a folder; create it first")
    if "chat_template" in values:
        values["chat_template"] = templates.check_setting(values["chat_template"], f"{where}.chat_template")
    _check_store(values, where)
    if "adapters" in values:
        values["adapters"] = _adapters(values["adapters"], path,
                                       "--lora" if "adapters" in overrides else f"{where}.adapters")
    if "requires" in values:
        values["requires_memory"] = _requires(values.pop("requires"), f"{where}.requires")
    if "speculative" in values:
        values["speculative"] = _speculative(values["speculative"], f"{where}.speculative",
                                             bool(values.get("embedding")))
    if "reasoning" in values:
        values["reasoning"] = _reasoning(values["reasoning"], f"{where}.reasoning")
    low, high = _instance_bounds(values, where)
    values.update(instances=low, min_instances=low, max_instances=high)
    return ModelConfig(**values)


def _check_path(path: str, path_where: str, where: str) -> None:
    """A model's path (``path_where``: the flag or key that gave it): a GGUF file, one on the Hub or in Ollama's store
    (checked when it is cached already), a built-in model or the echo backend."""
    if sources.is_source(path):
        local = sources.check(path, path_where)
        if local is not None:
            _check_gguf(local, f"{path_where} ({path})")
    elif not (path == ECHO_MODEL or path.startswith(BUILTIN_PREFIX)):
        _check_gguf(Path(path), path_where)
    if path.startswith(BUILTIN_PREFIX) and path[len(BUILTIN_PREFIX):] not in MODEL_SIZES:
        raise ConfigError(f"{where}.path: unknown built-in model {path!r}; allowed: {_builtin_names()}")


def _check_store(values: dict[str, Any], where: str) -> None:
    """A model's host store settings, checked and read in place: the remote tier's address and password file, the
    sizes in bytes, the RAM and disk tiers' folders."""
    if values.get("cache_remote") is not None:
        values["cache_remote"] = remote_tier.check_url(str(values["cache_remote"]), f"{where}.cache_remote")
    if values.get("cache_remote_password_file") is not None:
        remote_tier.check_password_file(str(values["cache_remote_password_file"]),
                                        f"{where}.cache_remote_password_file")
    for size in ("cache_ram", "cache_disk_size", "cache_remote_size"):
        if size in values:
            values[size] = _bytes(values[size], f"{where}.{size}", parse_memory)
    for folder, tier in (("cache_shm", "ram"), ("cache_disk", "disk")):
        if values.get(folder) is not None:
            values[folder] = _store_folder(str(values[folder]), tier, f"{where}.{folder}")


def _check_mmproj(mmproj: str, path: str, embedding: bool, where: str) -> None:
    """A model's image projector, for a model llama.cpp serves for completions: a GGUF file that fits the model
    (checked against its header here, or once pulled for a model named on the Hub: ``pull_sources``), or auto."""
    if path == ECHO_MODEL or embedding:
        raise ConfigError(f"{where}: an image projector goes with a model served for completions by llama.cpp, not "
                          "the echo backend or an embedding model")
    if mmproj == sources.AUTO:
        return sources.check_auto(path, where)
    _check_gguf(Path(mmproj), where)
    if not sources.is_source(path):
        builtin = path.startswith(BUILTIN_PREFIX)
        projector.check(mmproj, str(builtin_model_path(path[len(BUILTIN_PREFIX):])) if builtin else path, where)


def _check_gguf(path: Path, where: str) -> None:
    """A model file must be a file that starts as GGUF files do (its magic), so that a wrong path is refused at
    start rather than by three failed loads."""
    others = f"give a .gguf file, {sources.FORMS}, {_builtin_names()}, or echo"
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.gguf"))[:3]
        raise ConfigError(f"{where}: {str(path)!r} is a folder, not a model file; "
                          + (f"give one of its files: {', '.join(found)}" if found else others))
    if not path.is_file():
        raise ConfigError(f"{where}: {sources.not_a_file(str(path))}; {others}")
    try:
        with path.open("rb") as file:
            magic = file.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {str(path)!r}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ConfigError(f"{where}: {str(path)!r} is not a GGUF model file (it does not start with "
                          f"{GGUF_MAGIC.decode()}); {others}")


def pull_sources(config: ServerConfig) -> None:
    """Download each model and adapter named on the Hub that is not in its cache (``mpserve.models.sources``),
    before anything starts, then check each adapter against its model; a download that fails, a file that is not a
    GGUF, or an adapter that does not fit its model is a ConfigError."""
    for model in config.models:
        local = sources.pull(model.path)
        if local is not None:
            _check_gguf(local, f"models[{model.name}].path ({model.path})")
        for _, source in model.adapters:
            sources.pull(source)
        check_adapters(model)
        if model.mmproj is not None and sources.is_source(model.path):
            mmproj = str(sources.projector_file(model.path, model.mmproj, pull=True))
            projector.check(mmproj, model.resolved_path(), f"models[{model.name}].mmproj")


def check_adapters(model: ModelConfig, pulled: bool = True) -> None:
    """Each of the model's adapters against its GGUF header (``mpserve.models.adapters.check``). Not ``pulled``
    (before the downloads): only a model whose files are all on this host already."""
    files = (model.path, *(source for _, source in model.adapters))
    if not model.adapters or not pulled and any(sources.is_source(f) for f in files):
        return
    base = model.resolved_path()
    for name, path in model.adapter_paths().items():
        adapter_sources.check(name, path, base, f"models[{model.name}].adapters")


def _instance_bounds(values: Mapping[str, Any], where: str) -> tuple[int, int]:
    """``instances: N`` (fixed) or ``instances: {min, max}``; min_instances / max_instances (the flags) win."""
    given = values.get("instances", 1)
    if isinstance(given, dict):
        _check_keys(given, {"min": (int,), "max": (int,)}, f"{where}.instances")
        for key, value in given.items():
            lo, hi = _RANGES[f"{key}_instances"]
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ConfigError(f"{where}.instances.{key}: got {value!r}, allowed: an integer {_shown(lo)} to "
                                  f"{_shown(hi)}")
        low = given.get("min", 1)
        high = given.get("max", low)
    else:
        low = high = given
    low, high = values.get("min_instances", low), values.get("max_instances", high)
    if low > high:
        raise ConfigError(f"{where}: min_instances {low} is above max_instances {high}; give min ≤ max")
    return low, high


def added_model(entry: Mapping[str, Any], index: int, source: str) -> ModelConfig:
    """A model added at run time, checked as a ``models[]`` entry of the file is (paths as given)."""
    return _model(index, dict(entry), {}, source)


def _adapters(value: Any, path: str, where: str) -> adapter_sources.Declared:
    """The declared adapters (``mpserve.models.adapters.parse``); the echo backend has no weights to adapt."""
    declared = adapter_sources.parse(value, where)
    if declared and path == ECHO_MODEL:
        raise ConfigError(f"{where}: the echo backend has no weights to adapt; give the model's GGUF file as path")
    return declared


def _flash_attn(value: str | bool, where: str) -> str:
    """auto, on or off; true/false (and 1/0, yes/no) are on/off."""
    key = value.strip().lower() if isinstance(value, str) else value
    mode = _FLASH_ATTN_SPELLINGS.get(key, key)
    if mode not in FLASH_ATTN_MODES:
        raise ConfigError(f"{where}: got {value!r}, allowed: {', '.join(FLASH_ATTN_MODES)}")
    return str(mode)


def _requires(value: dict[str, Any], where: str) -> int | None:
    _check_keys(value, _REQUIRES_KEYS, where)
    for key, kind in _REQUIRES_KEYS.items():
        if key in value and (not isinstance(value[key], kind) or isinstance(value[key], bool)):
            expected = "a size like 7GiB" if key == "memory" else "an integer"
            raise ConfigError(f"{where}.{key}: got {value[key]!r}, expected {expected}")
    if value.get("gpus", 1) != 1:
        raise ConfigError(f"{where}.gpus: got {value['gpus']}, allowed: 1 (an instance runs on one GPU; "
                          "use instances to spread a model over several)")
    return None if "memory" not in value else _bytes(value["memory"], f"{where}.memory", parse_memory)


def _reasoning(value: Any, where: str) -> Reasoning:
    try:
        return reasoning.parse(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _speculative(value: dict[str, Any] | str, where: str, embedding: bool) -> Speculative | None:
    """A mapping (in YAML, or a flag's ``{type: draft, model: PATH, ...}``), or ``ngram``, ``draft:PATH`` for
    the defaults; ``none`` or ``off``: no speculation (a flag turning it off). A draft model must be a file,
    and an embedding model generates nothing to draft."""
    if isinstance(value, str) and value.strip().lower() in ("none", "off"):
        return None
    if isinstance(value, str) and value.strip().startswith("{"):  # a flag's YAML mapping: {type: draft, ...}
        try:
            value = cast(dict[str, Any], yaml.safe_load(value))  # "{" opens a flow mapping, always
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: not a YAML mapping: {exc}") from None
    try:
        spec = speculative.parse(value.strip() if isinstance(value, str) else value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if spec.model is not None and embedding:
        raise ConfigError(f"{where}: an embedding model generates no tokens to draft; drop speculative or "
                          "embedding")
    if spec.model is not None and not Path(spec.model).is_file():
        raise ConfigError(f"{where}.model: no such draft model file {spec.model!r}; give a .gguf file with the "
                          "model's vocabulary (mpserve make-model --size tiny-draft writes one for builtin:tiny)")
    return spec


def _relative_to(base_dir: Path, entry: Any) -> Any:
    """A models[] entry with its model file, and its draft model's, relative to ``base_dir``."""
    if not isinstance(entry, dict):
        return entry
    draft = entry.get("speculative")
    if isinstance(draft, dict) and isinstance(draft.get("model"), str) and not Path(draft["model"]).is_absolute():
        entry = {**entry, "speculative": {**draft, "model": str(base_dir / draft["model"])}}
    declared = entry.get("adapters")
    if isinstance(declared, dict):
        entry = {**entry, "adapters": {k: v if not isinstance(v, str) or Path(v).is_absolute() or sources.is_source(v)
                                       else str(base_dir / v) for k, v in declared.items()}}
    template = entry.get("chat_template")
    if isinstance(template, str) and template not in templates.FAMILIES and not Path(template).is_absolute():
        entry = {**entry, "chat_template": str(base_dir / template)}
    path = entry.get("path")
    if (not isinstance(path, str) or path == ECHO_MODEL or path.startswith(BUILTIN_PREFIX) or Path(path).is_absolute()
            or sources.is_source(path)):
        return entry
    return {**entry, "path": str(base_dir / path)}


def _default_name(path: str) -> str:
    if (named := sources.default_name(path)) is not None:
        return named
    if path.startswith(BUILTIN_PREFIX):
        return path[len(BUILTIN_PREFIX):]
    stem = re.sub(r"[^A-Za-z0-9._-]", "-", Path(path).stem).lstrip("._-")
    return stem[:48] or "model"


def _check_keys(entry: Mapping[str, Any], allowed: Mapping[str, Any], where: str) -> None:
    if unknown := [k for k in entry if k not in allowed]:
        close = difflib.get_close_matches(str(unknown[0]), [str(k) for k in allowed], n=1)
        guess = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; {guess}allowed keys: {', '.join(allowed)}")


def _checked(key: str, value: Any, kinds: tuple[type, ...], where: str) -> Any:
    """``value`` if it has one of ``kinds`` and lies in the key's range; a flag's value is named by its flag."""
    flag = settings.BY_KEY[key].flag if key in settings.BY_KEY else None
    name = flag if where == _FLAGS and flag else f"{where}.{key}"
    if kinds == (float,) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = {int: "an integer", float: "a number", str: "a string", list: "a list", bool: "true or false",
                 dict: "a mapping"}
        expected = " or ".join(names[k] for k in kinds)
        raise ConfigError(f"{name}: got {value!r}, expected {expected}")
    if key in _RANGES and not isinstance(value, dict):  # instances: {min, max} is checked by _instance_bounds
        lo, hi = _RANGES[key]
        if not lo <= cast(float, value) <= hi:  # ranged keys are numbers, checked above
            raise ConfigError(f"{name}: got {value!r}, allowed: {_shown(lo)} to {_shown(hi)}")
    return value


def _shown(bound: float) -> str:
    """A range's bound as people write it: 1048576, not 1.04858e+06; 0.1 stays 0.1."""
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


def _builtin_names() -> str:
    return ", ".join(BUILTIN_PREFIX + m for m in MODEL_SIZES)
