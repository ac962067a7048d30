"""Every setting, declared once: name, scope, types, range, choices, default, environment variable, flag and
help text.

    SETTINGS ──▶ config.build      YAML keys, types and ranges, checked with the file, key and value
             ├─▶ cli               the typer options of `start`, `worker`, `plan`, `devices` and `gateway`, with
             │                     their environment variables and "(default: …)" help
             ├─▶ markdown_table()  a table of every setting (python -m mpserve.config.settings), with the commands
             │                     that take each flag (a test keeps each command's flags the declared ones)
             └─▶ docs/hooks.py     the configuration page: a section per setting, rewritten by `--write`

Precedence: flag > environment > file > default. A setting's ``scope`` says where it lives: ``server``
(``ServerConfig``, a top-level YAML key), ``model`` (``ModelConfig``, a key of each ``models[]`` entry; a flag
or variable applies to every model), or ``cli`` (a flag of ``mpserve start`` or ``mpserve gateway``, not in the file:
its range is checked by the command line).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from mpserve.config.kv_types import DEFAULT_KV_TYPE, KV_TYPES
from mpserve.models.shapes import MODEL_SIZES
from mpserve.wire import media

Scope = Literal["server", "model", "cli"]
Command = Literal["start", "worker", "plan", "devices", "gateway"]

_FOR_SERVERS: tuple[Command, ...] = ("start",)
_FOR_POOLS: tuple[Command, ...] = ("start", "worker")
_SIZING: tuple[Command, ...] = ("start", "worker", "plan")  # what an instance's memory estimate depends on
_FOR_HTTP: tuple[Command, ...] = ("start", "gateway")  # the HTTP gateway's, for the gateways start --http runs too
_GATEWAY: tuple[Command, ...] = ("gateway",)
_IMAGES = media.ImageLimits()  # the gateway's image limits as they are by default


@dataclass(frozen=True)
class Setting:
    key: str  # the ServerConfig / ModelConfig field and the YAML key
    scope: Scope
    kinds: tuple[type, ...]  # what a YAML value may be
    default: str  # the default as users read it (--help, the docs)
    help: str
    flag: str | None = None  # None: file only
    short: str | None = None
    env: str | None = None
    cli_type: Any = str  # what the flag parses its value as (list[str]: a repeatable flag)
    negated: bool = False  # a bool flag that sets the setting false (--no-repack: repack false)
    range: tuple[float, float] | None = None
    choices: tuple[str, ...] | None = None
    commands: tuple[Command, ...] = _FOR_SERVERS  # the commands that take the flag
    own_in: tuple[Command, ...] = ()  # commands with a flag of this name of their own (another help, another default)

    @property
    def param(self) -> str:
        """The flag's parameter name in the CLI functions."""
        return self.flag[2:].replace("-", "_") if self.flag else self.key

    @property
    def yaml(self) -> str:
        return {"server": self.key, "model": f"models[].{self.key}", "cli": ""}[self.scope]

    def help_text(self) -> str:
        return f"{self.help} (default: {self.default})."

    def literal_default(self) -> Any:
        """The default as a value of the flag's type (None for "none"), for a setting whose default is one rather
        than words: the gateway's, which has no file to merge them with."""
        if self.default == "none":
            return None
        return self.default == "true" if self.cli_type is bool else self.cli_type(self.default)


def _s(key: str, scope: Scope, kinds: type | tuple[type, ...], default: str, help: str, *, flag: str | None = "",
       env: str | None = "", **kw: Any) -> Setting:
    """A setting whose flag is --KEY and whose variable is MPSERVE_KEY unless told otherwise ("" = derived,
    None = none)."""
    derived_flag = "--" + key.replace("_", "-")
    return Setting(key, scope, kinds if isinstance(kinds, tuple) else (kinds,), default, help,
                   flag=derived_flag if flag == "" else flag,
                   env=f"MPSERVE_{key.upper()}" if env == "" else env, **kw)


SETTINGS: tuple[Setting, ...] = (
    # --- models ----------------------------------------------------------------------------------------
    _s("name", "model", str, "the file's stem", "Name clients use for the model", env="MPSERVE_MODEL_NAME",
       commands=_FOR_POOLS),
    _s("path", "model", str, "builtin:tiny",
       "GGUF file; a model on the Hugging Face Hub, hf://OWNER/REPO/FILE.gguf or OWNER/REPO:QUANT "
       "(hf://OWNER/REPO:QUANT, @REVISION after the repo); one in Ollama's store, ollama://NAME or ollama://NAME:TAG; "
       f"{', '.join('builtin:' + m for m in MODEL_SIZES)}; or echo (no model)",
       flag="--model", short="-m", env="MPSERVE_MODEL", commands=("start", "worker", "plan")),
    _s("instances", "model", (int, dict), "1", "Worker processes per model; {min: 1, max: 4} in the file lets the "
       "count follow the load", short="-n", cli_type=int, range=(0, 256), commands=("start", "worker", "plan")),
    _s("min_instances", "model", int, "instances", "Fewest instances when the count follows the load (0: none "
       "while idle; a request waits for a load)", cli_type=int, range=(0, 256)),
    _s("max_instances", "model", int, "instances", "Most instances when the count follows the load (the slot "
       "table is sized for it at start)", cli_type=int, range=(1, 256)),
    _s("scale_up_after", "model", float, "2", "Start one more instance (up to max) once the oldest waiting "
       "request has waited this long, in s", cli_type=float, range=(0, 3600)),
    _s("scale_down_after", "model", float, "60", "Drain one instance (down to min) once an instance's worth of "
       "slots has been idle this long, in s", cli_type=float, range=(0.1, 86400)),
    _s("parallel", "model", int, "1", "Requests one instance decodes together in one batch, each with n_ctx "
       "tokens", short="-p", cli_type=int, range=(1, 64), commands=_SIZING),
    _s("n_ctx", "model", int, "2048", "Context tokens per request (per sequence: an instance holds parallel × "
       "n_ctx)", cli_type=int, range=(16, 1 << 20), commands=_SIZING),
    _s("threads", "model", int, "cores ÷ all instances, at least 1", "llama.cpp threads per instance",
       cli_type=int, range=(1, 1024), commands=_FOR_POOLS),
    _s("n_gpu_layers", "model", int, "all on a GPU, none on the CPU", "Layers offloaded to the GPU (-1: all)",
       cli_type=int, range=(-1, 100000), commands=_SIZING),
    _s("flash_attn", "model", (str, bool), "auto", "llama.cpp flash attention: auto is on where llama.cpp "
       "supports it (always on a CPU), as llama-server does; true/false mean on/off",
       choices=("auto", "on", "off"), commands=_FOR_POOLS),
    _s("cache_type_k", "model", str, DEFAULT_KV_TYPE, "KV cache type of the keys, as llama-server's --cache-type-k; "
       "a quantized type takes less memory per cell", choices=tuple(KV_TYPES), commands=_SIZING),
    _s("cache_type_v", "model", str, DEFAULT_KV_TYPE, "KV cache type of the values; a quantized type needs flash "
       "attention (flash_attn auto or on)", choices=tuple(KV_TYPES), commands=_SIZING),
    _s("repack", "model", bool, "auto", "llama.cpp's repacked weight layouts for this CPU; auto: on, unless a "
       "probe finds that those kernels crash on this host (cached per CPU and llama.cpp build; mpserve doctor "
       "shows it); true forces them; --no-repack loads weights as stored, as llama-server's --no-repack "
       "(create_completion always repacks, so output equals it only with repacking on)", flag="--no-repack",
       env="MPSERVE_NO_REPACK",
       cli_type=bool, negated=True, commands=_FOR_POOLS),
    _s("echo_tick_ms", "model", float, "0", "The echo backend's time per step, in ms, to stand in for a model's "
       "decode speed in benchmarks; each streamed piece is then the CLOCK_MONOTONIC time it was made, in ns "
       "(0: the prompt echoed at once)", flag=None, env=None, range=(0, 60_000)),
    _s("speculative", "model", (dict, str), "none", "Speculative decoding: {type: ngram, n_max: 8, n_min: 1, "
       "ngram_min: 2, ngram_max: 4} drafts up to n_max tokens a step from the sequence's own prompt and output "
       "(prompt lookup), {type: draft, model: PATH, n_max: 8} has a draft model with the same vocabulary "
       "propose them, and one decode verifies them; output is unchanged; sizing: measured drafts what the "
       "measured times say pays, fixed always n_max; exact: false lets a decode verify more than the rows "
       "llama.cpp's CPU kernels compute as they compute one (7; 3 with repacked weights), faster on copy-heavy "
       "text, and greedy output may then differ from the output without speculation; ngram and draft:PATH are "
       "short for the defaults; the flag takes a mapping too, as '{type: draft, model: PATH, n_max: 4}'",
       flag="--speculative", cli_type=str, commands=_SIZING),
    _s("cache_ram", "model", (str, int), "256MiB", "RAM for the host store of saved prompt states, for the whole "
       "host (every instance and server on it shares one store), e.g. 1GiB: the KV cells of computed prompts, "
       "restored by any compatible instance for a prompt that starts with them, as llama-server's --cache-ram "
       "(0: off); servers on one host that give different sizes each keep the store within their own",
       commands=_FOR_POOLS),
    _s("cache_shm", "model", str, "/dev/shm/mpserve-store-UID", "Folder of the host store's RAM tier (a tmpfs): "
       "instances share the entries of one folder", commands=_FOR_POOLS),
    _s("cache_disk", "model", str, "none", "Folder of the host store's disk tier: entries pushed out of RAM go "
       "there and survive restarts and reboots (none: off)", commands=_FOR_POOLS),
    _s("cache_disk_size", "model", (str, int), "4GiB", "Size of the disk tier, e.g. 20GiB", commands=_FOR_POOLS),
    _s("cache_remote", "model", str, "none", "The host store's remote tier, shared by hosts: a Redis 7 or Valkey 8 "
       "address, redis://[USER@]HOST:PORT/DB (rediss:// for TLS), never with a password (cache_remote_password_file "
       "or MPSERVE_CACHE_REMOTE_PASSWORD); entries computed here are written there in the background and restored "
       "by the other hosts' instances of the same model (unset: no remote tier)", commands=_FOR_POOLS),
    _s("cache_remote_ttl", "model", int, "3600", "Seconds an entry stays in the remote tier after it was written",
       cli_type=int, range=(1, 30 * 86400), commands=_FOR_POOLS),
    _s("cache_remote_size", "model", (str, int), "256MiB", "The largest entry written to or read from the remote "
       "tier, e.g. 64MiB (Redis's own maxmemory bounds the whole)", commands=_FOR_POOLS),
    _s("cache_remote_password_file", "model", str, "none", "File holding the remote tier's password (this user's "
       "alone, or root's: a mounted secret); unset: MPSERVE_CACHE_REMOTE_PASSWORD if set, else no password",
       commands=_FOR_POOLS),
    _s("reuse", "model", str, "any", "Which computed KV cells a prompt starts from: any reuses the longest prefix "
       "it shares with a slot's cells (its own or another's, generated tokens included) or the host store, at any "
       "length, as llama-server does; exact reuses whole 512-token prompt chunks only, so output equals a fresh "
       "computation of the prompt (the reproducibility mode)", choices=("any", "exact"), commands=_FOR_POOLS),
    _s("slot_save_path", "model", str, "none", "Folder of KV files: mpserve slots save|restore and POST "
       "/slots/ID?action=save|restore write and read an idle slot's KV cells there (none: off)",
       commands=_FOR_POOLS),
    _s("chat_template", "model", str, "the GGUF's, else its architecture's family (ChatML for others)",
       "Chat template: a family's name (chatml, llama3, gemma, mistral, phi, qwen, qwen3, deepseek) or a Jinja2 file, "
       "as llama-server's --chat-template and --chat-template-file; it also decides how tool calls are read and "
       "whether replies think (docs/reasoning.md)",
       commands=_FOR_POOLS),
    _s("adapters", "model", (dict, list), "none", "LoRA adapters served with the model, {NAME: PATH, ...} (a GGUF "
       "adapter file, or a Hub source as for path), each checked against the model at start and loaded once per "
       "host; a request picks one with the model BASE:NAME or llama-server's lora list (ids in this order); the "
       "flag, NAME=PATH and repeatable, declares them for the model given with --model",
       flag="--lora", env=None, cli_type=list[str], commands=_SIZING),
    _s("adapter_dir", "model", str, "the folders of the model file and of its declared adapters",
       "Folder that an adapter loaded while the server runs (POST /admin/adapters, the admin socket's ADAPTER_ACTION) "
       "must be in, links and .. resolved; a path elsewhere is refused with bad_request", commands=_FOR_POOLS),
    _s("mmproj", "model", str, "none", "The model's image projector GGUF (llama.cpp's mmproj file, as llama-server's "
       "--mmproj), checked against the model at start and loaded by each instance: chat requests may then send "
       "images (docs/images.md); auto: for a model on the Hub or in Ollama's store, the projector its source ships "
       "beside it", commands=_SIZING),
    _s("reasoning", "model", dict, "low 1024, medium 4096, high 16384, no close", "Thinking budgets in tokens for each "
       "reasoning effort (medium when a request names none), and close: a text written before the end tag when a "
       "budget forces it, e.g. {low: 512, medium: 2048, high: 8192, close: \"Time to answer.\"}; for a model whose "
       "chat template thinks (docs/reasoning.md)", flag=None, env=None),
    _s("devices", "model", list, "any GPU", "Pin the model's instances to these GPU indices, e.g. [1]", flag=None,
       env=None),
    _s("requires", "model", dict, "estimated from the GGUF", "Declared needs per instance: {memory: 7GiB, gpus: 1}",
       flag=None, env=None),
    _s("embedding", "model", bool, "false", "An embedding model: it serves /v1/embeddings (Client.embed), not "
       "completions", flag=None, env=None),
    _s("pooling", "model", str, "the GGUF's", "An embedding model's pooling of its token vectors into one per input: "
       "mean, cls or last; rank: a reranker (its GGUF has a rank head), served at /v1/rerank",
       flag=None, env=None, choices=("mean", "cls", "last", "rank")),
    _s("models_dir", "server", str, "none", "A folder of GGUF files served as models too, each named by its file's "
       "stem, listed by GET /v1/models and loaded when a request names it (instances {min: 0, max: 1} unless "
       "the flags say otherwise), as LocalAI and llama-swap serve a folder; read at start",
       commands=("start", "plan")),
    # --- the server -----------------------------------------------------------------------------------
    _s("server_name", "server", str, "default", "Which local server (several may run side by side)",
       commands=_FOR_HTTP, own_in=("worker",)),
    _s("bind", "server", str, "ipc://$RUNTIME/NAME.sock", "Client address, e.g. tcp://127.0.0.1:5555"),
    _s("workers_bind", "server", str, "ipc://$RUNTIME/NAME.workers.sock",
       "Worker socket address; tcp://0.0.0.0:5556 for remote pools (mpserve worker --connect)"),
    _s("admin_bind", "server", str, "ipc://$RUNTIME/NAME.admin.sock", "Operator address: the only socket that "
       "takes control calls and slot actions (mpserve models/load/unload/scale/add/slots, the gateway's /admin/); "
       "ipc is open to this user alone, tcp needs CURVE admin keys (--curve-admins)"),
    _s("spare_slots", "server", int, "0", "Slot-table rows kept for models added at run time (mpserve add); a "
       "model takes max instances × parallel", cli_type=int, range=(0, 4096)),
    _s("max_queue", "server", int, "256", "Waiting requests per model", cli_type=int, range=(1, 1_000_000)),
    _s("max_queue_total", "server", int, "4096", "Waiting requests, all models", cli_type=int,
       range=(1, 10_000_000)),
    _s("max_pending_per_client", "server", int, "128", "Requests one client may have queued or running",
       cli_type=int, range=(1, 10_000_000)),
    _s("grace", "server", float, "30", "Seconds to finish requests on shutdown", cli_type=float, range=(0, 3600)),
    _s("stall_timeout", "server", float, "60", "Seconds a busy worker may generate nothing before it is replaced",
       cli_type=float, range=(0.1, 86400), commands=_FOR_POOLS),
    _s("start_method", "server", str, "fork", "How instances start: fork forks a CPU model's instances from a "
       "zygote, a process that loaded its weights once, so they share them (a GPU model's instances, and any "
       "under single_active_backend or idle_timeout, start as with spawn; mpserve doctor says which each model "
       "gets); spawn starts every instance from a fresh interpreter that loads the model itself",
       choices=("fork", "spawn"), commands=("start", "worker", "plan")),
    _s("idle_timeout", "server", float, "0, never", "Unload an instance idle this long, in s; reloaded on demand",
       cli_type=float, range=(0, 86400 * 365)),
    _s("client_timeout", "server", float, "5", "Cancel the requests of a client silent this long, in s",
       cli_type=float, range=(1, 3600)),
    _s("adopt_wait", "server", float, "30", "Seconds the instances of a server that died hold their requests for "
       "the next server of the same name to adopt them (their model stays loaded, their streams go on); 0: they "
       "exit with it", cli_type=float, range=(0, 3600)),
    _s("no_instance_timeout", "server", float, "60", "Seconds a request waits while no instance of its model is "
       "registered or loading (none started here, its pool gone, its last instance lost and not restarted); past "
       "it: ERROR no_instance (HTTP 503) saying why, a stream after the text it had. While an instance loads, "
       "requests wait for it", cli_type=float, range=(0.1, 86400)),
    _s("stream_interval", "server", float, "0.02", "Seconds between a streamed request's chunks after its first; "
       "the tokens in between go together (0: a chunk per token)", cli_type=float, range=(0, 1),
       commands=_FOR_POOLS),
    _s("kv_events", "server", str, "none", "Publish each instance's KV-cache events (blocks stored and removed, in "
       "vLLM's format, for llm-d's KV indexer or Dynamo's KV router) on ZeroMQ: tcp://*:PORT binds instance i on "
       "PORT+2i with its replay socket on PORT+2i+1, ipc://PATH on PATH-wI, tcp://HOST:PORT connects to a "
       "subscriber that binds (docs/concepts/kv-events.md; unset: none)", commands=_FOR_POOLS),
    _s("busy_poll_us", "server", float, "250", "Microseconds the broker keeps polling after a message before it "
       "sleeps, while the server has CPU to spare and messages come that close together: lower latency for some "
       "CPU (0: sleep at once)", cli_type=float,
       range=(0, 100_000)),
    _s("curve_secret", "server", str, "none", "Server secret key file (mpserve keygen)", own_in=("worker",)),
    _s("curve_clients", "server", str, "none", "Folder of allowed clients' public .key files"),
    _s("curve_workers", "server", str, "none", "Folder of allowed remote pools' public .key files"),
    _s("worker_models", "server", dict, "none: any served model",
       "The models a remote pool's key may serve, {KEY: [MODEL, ...]}, KEY the name of its public key file in "
       "curve_workers (KEY.key); a READY for another model is refused, naming the key and the model; a key not "
       "named may serve any model", flag=None, env=None),
    _s("tenants", "server", dict, "none: one share, no limits, priority up to 0 but the local user's",
       "Who the broker tells apart and each one's share and limits, {TENANT: {weight, max_priority, max_running, "
       "max_queued, tokens_per_minute, max_images, max_image_bytes, max_image_pixels, max_audio_seconds}}, TENANT "
       "an API key's digest (key: and the first 16 hex digits of its sha256), a CURVE client's public key, local, or "
       "default for every other (mpserve.config.tenants; the image and audio limits lower the gateway's, "
       "docs/images.md)",
       flag=None, env=None),
    _s("curve_admins", "server", str, "none", "Folder of operators' public .key files: the only keys a tcp "
       "--admin-bind accepts (client keys may generate, not administer)"),
    _s("insecure", "server", bool, "false", "Allow a network --bind without CURVE keys, or a network --http "
       "without an API key (anyone reaching the port may use it)", env=None, cli_type=bool, commands=_FOR_HTTP),
    _s("heartbeat_interval", "server", float, "1", "Seconds between heartbeats", cli_type=float,
       range=(0.05, 60), commands=_FOR_POOLS),
    _s("heartbeat_liveness", "server", int, "5", "Missed heartbeats before a remote worker (or, for a worker, "
       "the broker) is lost", cli_type=int, range=(2, 100), commands=_FOR_POOLS),
    _s("gpus", "server", (list, str), "every GPU found", "GPU indices to use, e.g. 0,2",
       commands=("start", "worker", "plan", "devices")),
    _s("simulate_gpus", "server", str, "none", "Pretend to have GPUs, e.g. 2x24GiB (no CUDA; tests and planning)",
       commands=("start", "worker", "plan", "devices")),
    _s("gpu_mode", "server", str, "shared", "exclusive: one computing request per GPU, host-wide",
       choices=("shared", "exclusive")),
    _s("max_active_per_gpu", "server", int, "unlimited", "Requests computing on one GPU at once, host-wide",
       cli_type=int, range=(1, 64)),
    _s("gpu_memory_budget", "server", (str, int), "the device's free memory", "GPU memory to plan with per device, "
       "e.g. 20GiB", commands=("start", "plan")),
    _s("ram_budget", "server", (str, int), "the host's available memory", "Host RAM to plan the CPU instances "
       "with, e.g. 16GiB (also capped by MemAvailable and the cgroup's limit)", commands=("start", "worker", "plan")),
    _s("single_active_backend", "server", bool, "false", "At most one model loaded per GPU; models take turns",
       cli_type=bool),
    _s("switch_batch", "server", int, "8", "Requests a resident model may serve while another waits (single "
       "active backend)", flag=None, env=None, range=(1, 100000)),
    _s("lock_dir", "server", str, "$MPSERVE_LOCK_DIR, else /dev/shm/mpserve-locks-UID (created)",
       "Folder of the host-wide permit locks; it must exist, be yours and closed to others (mode 0700)", env=None,
       commands=("start", "worker", "devices")),
    _s("permit_log", "server", str, "none", "A file that gets one line per permit hold (audits, tests)", flag=None,
       env=None),
    _s("log_level", "server", str, "info", "Log level", choices=("debug", "info", "warning", "error"),
       commands=(*_FOR_POOLS, "gateway")),
    # --- flags of `mpserve start --http` and `mpserve gateway` that are not in the file ---------------------
    _s("http", "cli", str, "none", "Also serve the OpenAI-compatible HTTP API on HOST:PORT (see mpserve gateway)",
       env=None),
    _s("gateway_http", "cli", str, "127.0.0.1:8000", "HOST:PORT to serve HTTP on", flag="--http",
       env="MPSERVE_HTTP", commands=_GATEWAY),
    _s("connect", "cli", str, "none", "The server's ZeroMQ address; none: the local server named by --server-name",
       env=None, commands=_GATEWAY, own_in=("worker",)),
    _s("admin_connect", "cli", str, "none", "The server's admin socket, for /admin/ and /slots; none: the local "
       "server's", commands=_GATEWAY),
    _s("curve_server_key", "cli", str, "none", "The server's public key file, for a server with CURVE keys",
       commands=_GATEWAY, own_in=("worker",)),
    _s("gateway_curve_secret", "cli", str, "none", "This gateway's secret key file, for a server with CURVE keys "
       "(its public half in the server's curve_clients)", flag="--curve-secret", env="MPSERVE_CURVE_CLIENT_SECRET",
       commands=_GATEWAY, own_in=("worker",)),
    _s("http_workers", "cli", int, "1", "Gateway processes serving HTTP on one port: each is started again when it "
       "dies, and a death cuts only the connections it held", cli_type=int, range=(1, 64), commands=_FOR_HTTP),
    _s("request_timeout", "cli", float, "none", "Seconds an HTTP request may take, queueing included (the gateway's "
       "bound): past it, 504; or 503 no_instance, saying why, while its model has no instance "
       "(no_instance_timeout bounds that wait without it)", cli_type=float, range=(0.1, 86400), commands=_FOR_HTTP),
    _s("reattach", "cli", float, "30", "Seconds the gateway's requests, in flight or arriving, wait for a server "
       "that stopped answering (killed, or upgraded, and started again) before they fail with connection; they "
       "reattach to its next start, and no text comes twice (0: fail at once; a server stopped, not killed, fails "
       "them at once)", cli_type=float, range=(0, 3600), commands=_FOR_HTTP),
    _s("api_key", "cli", str, "none", "Require 'Authorization: Bearer KEY' on HTTP requests (/health excepted)",
       commands=_FOR_HTTP),
    _s("admin_key", "cli", str, "none", "Open the HTTP control API (/admin/: models, load, unload, scale) to "
       "'Authorization: Bearer KEY'; a key apart from --api-key", commands=_FOR_HTTP),
    _s("api_key_file", "cli", str, "none", "HTTP API keys, one per line (# comments); any of them is accepted",
       commands=_FOR_HTTP),
    _s("allowed_origins", "cli", str, "none", "Other origins whose web pages may call the HTTP API, comma-separated "
       "(e.g. https://app.example; * for any): they get CORS headers; requests from other pages' origins get 403",
       commands=_FOR_HTTP),
    _s("allowed_hosts", "cli", str, "none", "More Host names the HTTP API answers, comma-separated (e.g. the name a "
       "reverse proxy passes on), beside the address it serves; other Host headers get 403", commands=_FOR_HTTP),
    _s("ssl_certfile", "cli", str, "none", "Serve HTTPS: the certificate chain (PEM), with --ssl-keyfile",
       commands=_FOR_HTTP),
    _s("ssl_keyfile", "cli", str, "none", "The private key (PEM) of --ssl-certfile", commands=_FOR_HTTP),
    _s("max_connections", "cli", int, "1024", "Open HTTP connections at most; past it, new ones get 503 with "
       "Retry-After, except a few kept for GET /health", env="MPSERVE_HTTP_MAX_CONNECTIONS", cli_type=int,
       range=(1, 1_000_000), commands=_GATEWAY),
    _s("max_connections_per_client", "cli", int, "256", "Open HTTP connections from one client address at most "
       "(behind a reverse proxy, every client's address is the proxy's: raise it to --max-connections); past it, "
       "503 with Retry-After", env="MPSERVE_HTTP_MAX_CONNECTIONS_PER_CLIENT", cli_type=int, range=(1, 1_000_000),
       commands=_GATEWAY),
    _s("read_timeout", "cli", float, "30", "Seconds a client has to send a request's headers, and again its body "
       "(408 past it)", env="MPSERVE_HTTP_READ_TIMEOUT", cli_type=float, range=(0.1, 86400), commands=_GATEWAY),
    _s("template_timeout", "cli", float, "2", "Seconds a chat template may take to render a request's messages (400 "
       "naming it past them)", env="MPSERVE_HTTP_TEMPLATE_TIMEOUT", cli_type=float, range=(0.01, 3600),
       commands=_GATEWAY),
    _s("template_max_chars", "cli", int, "1048576", "Characters a chat template may write, or build in any string "
       "or list (400 naming it past them)", env="MPSERVE_HTTP_TEMPLATE_MAX_CHARS", cli_type=int,
       range=(1, 1 << 30), commands=_GATEWAY),
    _s("max_images", "cli", int, str(_IMAGES.max_images), f"Images one request may carry, at most "
       f"{media.MAX_IMAGES} (what the wire carries); a tenant's max_images lowers it for that tenant (400 naming it "
       "past either)", env="MPSERVE_HTTP_MAX_IMAGES", cli_type=int, commands=_FOR_HTTP),
    _s("max_image_bytes", "cli", str, f"{_IMAGES.max_bytes >> 20}MiB", f"Bytes of one image, e.g. 1MiB, at most "
       f"{media.MAX_IMAGE_BYTES} (3MiB, what the wire carries); a tenant's max_image_bytes lowers it for that tenant",
       env="MPSERVE_HTTP_MAX_IMAGE_BYTES", commands=_FOR_HTTP),
    _s("max_image_pixels", "cli", int, str(_IMAGES.max_pixels), "Pixels of one image (width × height; the default "
       f"is 4096 × 4096), read from its header before anything decodes it, at most {media.MAX_IMAGE_PIXELS} (8192 × "
       "8192, what a worker decodes); a tenant's max_image_pixels lowers it for that tenant",
       env="MPSERVE_HTTP_MAX_IMAGE_PIXELS", cli_type=int, commands=_FOR_HTTP),
    _s("max_audio_seconds", "cli", int, str(_IMAGES.max_audio_seconds), "Seconds of audio one request may carry, "
       f"all its clips together, read from their headers before anything decodes them, at most "
       f"{media.MAX_AUDIO_SECONDS} (what a worker decodes); a tenant's max_audio_seconds lowers it for that tenant",
       env="MPSERVE_HTTP_MAX_AUDIO_SECONDS", cli_type=int, commands=_FOR_HTTP),
    _s("responses_store", "cli", str, "256MiB", "Memory for stored responses (/v1/responses with store) and ended "
       "resumable streams' events, all API keys together, e.g. 1GiB; past it, the oldest streams go first, then "
       "the oldest responses", env="MPSERVE_HTTP_RESPONSES_STORE", commands=_GATEWAY),
    _s("responses_store_per_key", "cli", str, "32MiB", "Memory for one API key's stored responses and ended "
       "resumable streams' events; past it, that key's oldest streams go first, then its oldest responses (a "
       "larger response is not kept)", env="MPSERVE_HTTP_RESPONSES_STORE_PER_KEY", commands=_GATEWAY),
)

BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


def scoped(scope: Scope) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.scope == scope)


def for_command(command: Command) -> tuple[Setting, ...]:
    return tuple(s for s in SETTINGS if s.flag and command in s.commands)


def markdown_table() -> str:
    """Every setting in one table (the docs give each its own section: docs/configuration.md)."""
    lines = ["| flag | commands | environment | YAML | default | meaning |", "|---|---|---|---|---|---|"]
    for s in SETTINGS:
        choices = " " + "\\|".join(s.choices) if s.choices else ""  # a | in a table cell is escaped
        flag = f"`{s.flag}{choices}`" if s.flag else ""
        commands = ", ".join((*s.commands, *s.own_in)) if s.flag else ""
        env = f"`{s.env}`" if s.env else ""
        yaml = f"`{s.yaml}`" if s.yaml else ""
        lines.append(f"| {flag} | {commands} | {env} | {yaml} | {s.default} | {s.help} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
