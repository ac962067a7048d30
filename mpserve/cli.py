"""The ``mpserve`` command line: one typer command per verb, each a thin layer over the package that does the work.

    serving     start (a server; --http adds a gateway), worker (a pool for a broker elsewhere), gateway (HTTP)
    requests    generate (one request, printed)
    looking     status (the slot table), models (a server's models), devices (GPUs and their permits), plan (where
                instances would run), doctor (this host, and what to fix)
    changing    load, unload, scale, add (a server's models at run time), reload (its configuration read again),
                upgrade (the mpserve installed now takes over, adopting the instances),
                slots (a slot's KV file: save, restore, erase), adapters (a model's LoRA adapters: list, load, unload)
    files       pull (models from the Hub, ahead of time), make-model (a random-weight GGUF), keygen (a CURVE key pair)

Server settings come from ``mpserve.config.settings`` (``with_settings``: one declaration gives a command its flags);
the benchmarks are not a command but ``python -m bench`` from a checkout.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import typer

from mpserve import __version__, children, help_labels
from mpserve.config import loader as cfg
from mpserve.config import settings
from mpserve.errors import BadRequest, ConfigError, ConnectionFailed, InternalError, MpserveError
from mpserve.runtime import ServerInfo, ServerPaths
from mpserve.status_text import extra_lines, format_models, format_table, no_server
from mpserve.wire.protocol import MAX_PROMPT_CHARS, Stats
from mpserve.wire.slots import SlotRow, SlotTable, locate

if TYPE_CHECKING:
    from mpserve.client import Client

LISTEN_AFTER_DEATH_S = 10.0  # how long start --http waits for the gateways of a server that died to let its port go

help_labels.drop_flag_labels()
app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run several llama.cpp instances behind one ZeroMQ broker.")

def _version(value: bool) -> None:
    if value:
        typer.echo(f"mpserve {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """The options before a command: --version."""


ConfigOption = Annotated[Path | None, typer.Option("--config", "-c", envvar="MPSERVE_CONFIG",
                                                   help="YAML file (see docs/configuration.md).")]


@dataclass(frozen=True)
class _Curve:
    """The CURVE keys an operator command talks to a tcp server with (files; None: not given)."""

    server_key: str | None
    secret: str | None


CurveServerKeyOption = Annotated[str | None, typer.Option(
    "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY",
    help="The server's public key file, for a server on tcp:// with CURVE keys.")]
CurveSecretOption = Annotated[str | None, typer.Option(
    "--curve-secret", envvar="MPSERVE_CURVE_CLIENT_SECRET",
    help="Your secret key file, for a server on tcp:// with CURVE keys (its public half in the server's allowed "
         "keys).")]


@dataclass(frozen=True)
class Given:
    """The values of a command's setting flags (or their variables), by scope; None where not given."""

    server: dict[str, Any]
    model: dict[str, Any]
    cli: dict[str, Any]

    def with_server(self, **values: Any) -> Given:
        return replace(self, server={**self.server, **values})


def with_settings(command: settings.Command) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command a flag for each setting declared for it (``mpserve.config.settings``); the command gets
    their values as ``given``."""

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        declared = settings.for_command(command)
        signature = inspect.signature(fn, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "given"]
        flags = [inspect.Parameter(s.param, inspect.Parameter.KEYWORD_ONLY, annotation=_option(s),
                                   default=False if s.cli_type is bool else None) for s in declared]

        @functools.wraps(fn)
        def run(**kwargs: Any) -> None:
            values: dict[str, dict[str, Any]] = {"server": {}, "model": {}, "cli": {}}
            for s in declared:
                value = kwargs.pop(s.param)
                if s.cli_type is bool:  # an unset switch is unset; a --no-… switch sets its setting false
                    value = (not s.negated) if value else None
                elif isinstance(value, (list, tuple)) and not value:  # a repeatable flag not given
                    value = None
                values[s.scope][s.key] = value
            fn(given=Given(**values), **kwargs)

        run.__signature__ = signature.replace(parameters=[*own, *flags])  # type: ignore[attr-defined]
        return run

    return decorate


def _option(s: settings.Setting) -> Any:
    assert s.flag is not None  # for_command() gives flags only
    names = [s.flag, s.short] if s.short else [s.flag]
    option = typer.Option(*names, envvar=s.env, help=s.help_text(),
                          metavar="|".join(s.choices) if s.choices else None)
    return Annotated[bool, option] if s.cli_type is bool else Annotated[s.cli_type | None, option]


def _config(given: Given, config_file: Path | None) -> cfg.ServerConfig:
    """Flags and variables over the file (``--config``) over the defaults."""
    return cfg.build(cfg.load_file(config_file) if config_file else {}, server=given.server, model=given.model,
                     source=str(config_file or "command line"), base_dir=config_file.parent if config_file else None)

@app.command()
@with_settings("start")
def start(given: Given, config_file: ConfigOption = None) -> None:
    """Start the server in the foreground; Ctrl-C (or SIGTERM) stops it gracefully.

    Every address, folder and model file is checked first: a problem ends the command with exit status 1 and
    one line naming it and the fix, before anything starts. With --http, if the gateway exits while the server
    runs, the server stops too and the command ends with exit status 1 (a service manager restarts both)."""
    from mpserve.gateway import fleet
    from mpserve.gateway.app import parse_http
    from mpserve.server.adoption import died_before
    from mpserve.server.loop import serve
    from mpserve.server.preflight import check_start
    from mpserve.server.roles import gateway_keys

    with _errors():
        config = _config(given, config_file)
        http = given.cli["http"]
        # the port is checked unless an upgrade hands it over, or the gateways of a server that died still hold it
        checked = http and fleet.HANDED_FD not in os.environ and not died_before(config.server_name)
        check_start(config, parse_http(http) if checked else None)
        paths = ServerPaths.for_name(config.server_name, config.bind, config.workers_bind, config.admin_bind)
        gateway_key = gateway_keys(paths) if http and config.curve_secret else None  # for a CURVE front
        with _Gateway(http, config, given.cli, gateway_key) if http else contextlib.nullcontext() as gateways:
            _pull(config)  # with the gateway up: /backend/monitor and the console show the downloads
            upgrading = serve(config, gateway_key, reread=lambda: _config(given, config_file),
                              reloaded=(lambda: gateways.fleet.signal(signal.SIGHUP)) if gateways is not None else None)
            if upgrading and gateways is not None:
                gateways.hand_over()
    if upgrading:  # the mpserve installed now, in this process (its pid stays, for the service manager)
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, children.python("-m", "mpserve", *sys.argv[1:]))


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="The prompt.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help="Model name; optional with one model.")]
    = None,
    stream: Annotated[bool, typer.Option("--stream", help="Print text as it is generated.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 128,
    temperature: Annotated[float, typer.Option("--temperature")] = 0.8,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.95,
    top_k: Annotated[int, typer.Option("--top-k")] = 40,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds, queueing included.")] = None,
    address: Annotated[str | None, typer.Option("--address", envvar="MPSERVE_ADDRESS")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    json_schema: Annotated[Path | None, typer.Option(
        "--json-schema", help="A JSON Schema file: the completion is JSON that validates against it.")] = None,
    grammar: Annotated[Path | None, typer.Option(
        "--grammar", help="A GBNF grammar file (llama.cpp's format) the completion follows.")] = None,
    curve_server_key: Annotated[str | None, typer.Option(
        "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY", help="The server's public key file.")] = None,
    curve_secret: Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_CLIENT_SECRET", help="This client's secret key file.")] = None,
    server_name: Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                             help=settings.BY_KEY["server_name"].help_text())] = "default",
) -> None:
    """Send one request to a running server and print the completion."""
    from mpserve.client import Client

    params: dict[str, Any] = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  stop=tuple(stop or ()))
    with _errors():
        params.update(_structured(json_schema, grammar))
        if address is None and ((info := ServerInfo.read(server_name)) is None or not info.alive()):
            raise no_server(server_name)  # naming the servers that run here, as status does
    with _errors(), Client(address, server_name=server_name, timeout=timeout, curve_server_key=curve_server_key,
                           curve_secret=curve_secret) as client:
        if stream:
            s = client.stream(prompt, model=model, **params)
            for text in s:
                sys.stdout.write(text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            result = s.result
        else:
            result = client.generate(prompt, model=model, **params)
            if not as_json:
                print(result.text)
        assert result is not None
        if as_json:
            print(json.dumps({"text": result.text, "finish_reason": result.finish_reason,
                              "usage": msgspec.structs.asdict(result.usage), "timings": vars(result.timings),
                              "worker": result.worker}))
        else:
            t = result.timings
            tps = result.usage.completion_tokens / (t.generate_ms / 1000) if t.generate_ms else 0.0
            typer.echo(f"[{result.finish_reason}; {result.usage.prompt_tokens} prompt + "
                       f"{result.usage.completion_tokens} generated tokens; queued {t.queue_ms:.0f} ms, "
                       f"first token {t.prompt_ms:.0f} ms, {tps:.1f} tokens/s; {result.worker}]", err=True)


@app.command()
@with_settings("worker")
def worker(
    given: Given,
    connect: Annotated[str, typer.Option("--connect", envvar="MPSERVE_CONNECT",
                                         help="The broker's worker socket, e.g. tcp://broker-host:5556.")],
    curve_server_key: Annotated[str | None, typer.Option(
        "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY", help="The broker's public key file.")] = None,
    curve_secret: Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_WORKER_SECRET", help="This pool's secret key file.")] = None,
    config_file: ConfigOption = None,
    server_name: Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                             help="Name of this pool on this host (for `mpserve status`).")]
    = "pool",
) -> None:
    """Run a pool of workers on this host for a broker elsewhere (`mpserve start --workers-bind ...`)."""
    from mpserve.server.pool import run_pool

    with _errors():
        config = _config(given.with_server(server_name=server_name), config_file)
        _pull(config)
        run_pool(config, connect, curve_server_key, curve_secret)


@app.command()
def pull(
    names: Annotated[list[str] | None, typer.Argument(help="Models: hf://OWNER/REPO/FILE.gguf, OWNER/REPO:QUANT "
                                                            "(@REVISION after the repo), ollama://NAME[:TAG].")]
    = None,
    config_file: ConfigOption = None,
) -> None:
    """Download models from the Hugging Face Hub into its cache ahead of time (a file already there is not
    downloaded again), and print each model's local file. With --config, the file's models.

    `mpserve start` pulls what is missing itself; HF_TOKEN authorises private and gated repos, HF_ENDPOINT
    names another Hub, HF_HUB_OFFLINE=1 uses the cache only."""
    from mpserve.models import sources

    with _errors():
        entries = [{"path": name, "name": f"m{i}"} for i, name in enumerate(names or [])]
        for name in names or []:
            if not sources.is_source(name):  # said without asking the Hub: pull may be offline
                why = (f"{name!r} is a file here" if os.path.exists(name) else sources.not_a_file(name)
                       if "/" in name else f"{name!r} is no Hub or Ollama name")
                raise ConfigError(f"{why}; pull takes {sources.FORMS} (a local file or builtin: needs no pull)")
        if not entries and config_file is None:
            raise ConfigError("name the models to pull, or give --config FILE")
        config = cfg.build({"models": entries}) if entries else _config(Given({}, {}, {}), config_file)
        _pull(config)
        for model in config.models:
            typer.echo(model.resolved_path())


def _pull(config: cfg.ServerConfig) -> None:
    """The models named on the Hub downloaded unless cached, with progress on stderr (``mpserve.models``)."""
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    cfg.pull_sources(config)


@app.command()
def gateway(
    http: Annotated[str, typer.Option("--http", envvar="MPSERVE_HTTP", help="HOST:PORT to serve HTTP on.")]
    = "127.0.0.1:8000",
    connect: Annotated[str | None, typer.Option(
        "--connect", help="The server's ZeroMQ address (default: the local server named by --server-name).")] = None,
    admin_connect: Annotated[str | None, typer.Option(
        "--admin-connect", envvar="MPSERVE_ADMIN_CONNECT",
        help="The server's admin socket, for /admin/ and /slots (default: the local server's).")] = None,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="MPSERVE_API_KEY", help=settings.BY_KEY["api_key"].help_text())] = None,
    admin_key: Annotated[str | None, typer.Option(
        "--admin-key", envvar="MPSERVE_ADMIN_KEY", help=settings.BY_KEY["admin_key"].help_text())] = None,
    request_timeout: Annotated[float | None, typer.Option(
        "--request-timeout", envvar="MPSERVE_REQUEST_TIMEOUT", min=0.1,
        help=settings.BY_KEY["request_timeout"].help_text())] = None,
    reattach: Annotated[float, typer.Option(
        "--reattach", envvar="MPSERVE_REATTACH", min=0, max=3600, help=settings.BY_KEY["reattach"].help_text())]
    = float(settings.BY_KEY["reattach"].default),
    curve_server_key: Annotated[str | None, typer.Option(
        "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY", help="The server's public key file.")] = None,
    curve_secret: Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_CLIENT_SECRET", help="This gateway's secret key file.")] = None,
    api_key_file: Annotated[str | None, typer.Option(
        "--api-key-file", envvar="MPSERVE_API_KEY_FILE", help=settings.BY_KEY["api_key_file"].help_text())] = None,
    ssl_certfile: Annotated[str | None, typer.Option(
        "--ssl-certfile", envvar="MPSERVE_SSL_CERTFILE", help=settings.BY_KEY["ssl_certfile"].help_text())] = None,
    ssl_keyfile: Annotated[str | None, typer.Option(
        "--ssl-keyfile", envvar="MPSERVE_SSL_KEYFILE", help=settings.BY_KEY["ssl_keyfile"].help_text())] = None,
    insecure: Annotated[bool, typer.Option("--insecure", help="Allow a network --http without an API key.")] = False,
    allowed_origins: Annotated[str | None, typer.Option(
        "--allowed-origins", envvar="MPSERVE_ALLOWED_ORIGINS",
        help=settings.BY_KEY["allowed_origins"].help_text())] = None,
    allowed_hosts: Annotated[str | None, typer.Option(
        "--allowed-hosts", envvar="MPSERVE_ALLOWED_HOSTS", help=settings.BY_KEY["allowed_hosts"].help_text())] = None,
    max_connections: Annotated[int, typer.Option(
        "--max-connections", envvar="MPSERVE_HTTP_MAX_CONNECTIONS", min=1,
        help="Open HTTP connections at most; past it, new ones get 503 with Retry-After, except a few kept for "
             "GET /health.")] = 1024,
    max_connections_per_client: Annotated[int, typer.Option(
        "--max-connections-per-client", envvar="MPSERVE_HTTP_MAX_CONNECTIONS_PER_CLIENT", min=1,
        help="Open HTTP connections from one client address at most (behind a reverse proxy, every client's "
             "address is the proxy's: raise it to --max-connections); past it, 503 with Retry-After.")] = 256,
    read_timeout: Annotated[float, typer.Option(
        "--read-timeout", envvar="MPSERVE_HTTP_READ_TIMEOUT", min=0.1,
        help="Seconds a client has to send a request's headers, and again its body (408 past it).")] = 30.0,
    template_timeout: Annotated[float, typer.Option(
        "--template-timeout", envvar="MPSERVE_HTTP_TEMPLATE_TIMEOUT", min=0.01,
        help="Seconds a chat template may take to render a request's messages (400 naming it past them).")] = 2.0,
    template_max_chars: Annotated[int, typer.Option(
        "--template-max-chars", envvar="MPSERVE_HTTP_TEMPLATE_MAX_CHARS", min=1,
        help="Characters a chat template may write, or build in any string or list (400 naming it past them).")]
    = MAX_PROMPT_CHARS,
    responses_store: Annotated[str, typer.Option(
        "--responses-store", envvar="MPSERVE_HTTP_RESPONSES_STORE",
        help="Memory for stored responses (/v1/responses with store) and ended resumable streams' events, all API "
             "keys together, e.g. 1GiB; past it, the oldest streams go first, then the oldest responses.")] = "256MiB",
    responses_store_per_key: Annotated[str, typer.Option(
        "--responses-store-per-key", envvar="MPSERVE_HTTP_RESPONSES_STORE_PER_KEY",
        help="Memory for one API key's stored responses and ended resumable streams' events; past it, that key's "
             "oldest streams go first, then its oldest responses (a larger response is not kept).")] = "32MiB",
    log_level: Annotated[str, typer.Option("--log-level", envvar="MPSERVE_LOG_LEVEL")] = "info",
    http_workers: Annotated[int, typer.Option(
        "--http-workers", envvar="MPSERVE_HTTP_WORKERS", min=1, max=64,
        help=settings.BY_KEY["http_workers"].help_text())] = 1,
    fd: Annotated[int | None, typer.Option("--fd", hidden=True)] = None,
    exit_with_parent: Annotated[bool, typer.Option("--exit-with-parent", hidden=True)] = False,
    server_name: Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                             help=settings.BY_KEY["server_name"].help_text())] = "default",
) -> None:
    """Serve an OpenAI-compatible HTTP API for a server; it may start before the server (503 until ready).
    Generation: /v1/completions, /v1/chat/completions, /v1/responses (stored: /v1/responses/{id},
    /v1/responses/{id}/cancel), /v1/messages (Anthropic's). Models, vectors, tokens: /v1/models, /v1/embeddings,
    /v1/rerank, /rerank, /tokenize, /detokenize. Operations: /health, /metrics (Prometheus), /backend/monitor,
    /openapi.json, the web console at / and /console (/console/state, /static/{name}, /favicon.ico). With the
    admin key: /admin/models, /admin/models/{name}/{op}, /admin/adapters, /admin/adapters/{model}/{name},
    /slots/{slot}."""
    from mpserve.config.sizes import parse_memory
    from mpserve.gateway import run as gateway_run
    from mpserve.gateway.api.chat import TemplateBudget
    from mpserve.gateway.api.response_store import StoreBudget
    from mpserve.gateway.app import GatewayConfig, parse_http
    from mpserve.gateway.http.access import load_keys
    from mpserve.gateway.http.guard import ConnectionLimits

    with _errors():
        host, port = parse_http(http)
        config = GatewayConfig(host=host, port=port, connect=connect, admin_connect=admin_connect,
                       server_name=server_name, api_key=api_key,
                       request_timeout=request_timeout, reattach=reattach, curve_server_key=curve_server_key,
                       curve_secret=curve_secret, log_level=log_level,
                       exit_with_parent=exit_with_parent, api_keys=load_keys(None, api_key_file),
                       api_key_file=api_key_file,
                       ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile, insecure=insecure,
                       connections=ConnectionLimits(max_connections, max_connections_per_client,
                                                   read_timeout),
                       templates=TemplateBudget(template_timeout, template_max_chars),
                       responses=StoreBudget(parse_memory(responses_store),
                                             parse_memory(responses_store_per_key)),
                       admin_key=admin_key, allowed_origins=_names(allowed_origins),
                       allowed_hosts=_names(allowed_hosts))
        gateway_run.serve(config, http_workers, fd)


def _names(given: str | None) -> tuple[str, ...]:
    """A comma-separated list, as --allowed-origins and --allowed-hosts take it."""
    return tuple(name.strip() for name in (given or "").split(",") if name.strip())


class _Gateway:
    """The gateway processes that ``start --http`` runs (``--http-workers``, on one port: ``gateway.fleet``), each
    started again when it dies; the port stays served by the others meanwhile. If they keep dying as they start,
    the fleet gives up: it interrupts the server (SIGINT, as Ctrl-C: a graceful stop), and leaving the ``with``
    raises ``InternalError`` (exit status 1), for the service manager to see one failed unit instead of a server
    that runs on without its HTTP API."""

    def __init__(self, http: str, config: cfg.ServerConfig, flags: dict[str, Any], key: Path | None) -> None:
        from mpserve.gateway import fleet
        from mpserve.gateway.api import response_store
        from mpserve.gateway.app import parse_http
        from mpserve.server.adoption import died_before

        host, port = parse_http(http)
        handed = fleet.handed_over(host, port)  # an upgrade: the socket of the start before this one, and its gateways
        command, env = _gateway_command(http, config, flags, key)
        if handed is not None:
            sock = handed[0]
        else:  # the gateways of the server before this one, if it died, let the port go as they notice
            sock = fleet.listen(host, port, LISTEN_AFTER_DEATH_S if died_before(config.server_name) else 0.0)
        self.fleet = fleet.Fleet(sock, flags["http_workers"] or 1, command, env, self._give_up,
                                 response_store.path_for(config.server_name, port))
        fleet.drain(handed[1] if handed is not None else [])
        self._handed_over = False

    def hand_over(self) -> None:
        """An upgrade: the port and the gateways go on to the start that follows in this process."""
        self.fleet.hand_over()
        self._handed_over = True

    def _give_up(self, reason: str) -> None:
        os.kill(os.getpid(), signal.SIGINT)

    def __enter__(self) -> _Gateway:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if not self._handed_over:
            self.fleet.stop()
        if self.fleet.gave_up is not None:
            raise InternalError(f"{self.fleet.gave_up}, so the server stopped (its log above says why); fix that and "
                                "start again")


def _gateway_command(http: str, config: cfg.ServerConfig, flags: dict[str, Any],
                     key: Path | None) -> tuple[Callable[[int], list[str]], dict[str, str]]:
    """How to run one ``mpserve gateway`` child on an inherited socket, and its environment. Each child runs in
    its own session: Ctrl-C reaches only the server, which drains its requests while the gateways keep streaming
    them (and answer 503 to new ones); they are stopped after that. If the server dies outright, they let the port
    go for its next start's gateways, and finish their streams on that start (reattached) before they exit. The
    keys travel in the environment, not in the command line that any user can read; ``key``, a key pair the server
    accepts, lets them through a CURVE front (the server's public key is read from its secret key file).
    Processes apart from the server's: in the broker's, the gateway would compete with the broker loop for the
    GIL, and a fault in it could not touch the broker."""
    from mpserve.gateway import fleet
    from mpserve.gateway.app import parse_http
    from mpserve.gateway.http import access

    host, _ = parse_http(http)  # refuse a bad value, a network port without a key, before anything starts
    access.check_exposure(host, access.load_keys(flags["api_key"], flags["api_key_file"]), config.insecure)
    access.check_tls(flags["ssl_certfile"], flags["ssl_keyfile"])
    keys = {"MPSERVE_API_KEY": flags["api_key"], "MPSERVE_ADMIN_KEY": flags["admin_key"],
            "MPSERVE_CURVE_SERVER_KEY": config.curve_secret if key else None,
            "MPSERVE_CURVE_CLIENT_SECRET": str(key) if key else None,
            "MPSERVE_ALLOWED_ORIGINS": flags["allowed_origins"], "MPSERVE_ALLOWED_HOSTS": flags["allowed_hosts"]}
    env = {**os.environ, **{name: key for name, key in keys.items() if key}}
    passed = [arg for key in ("api_key_file", "ssl_certfile", "ssl_keyfile", "request_timeout", "reattach")
              if flags[key] is not None
              for arg in (settings.BY_KEY[key].flag or "", str(flags[key]))]
    argv = [*children.python("-m", "mpserve", "gateway", "--http", http, "--server-name", config.server_name),
            "--log-level", config.log_level, *passed, *(["--insecure"] if config.insecure else [])]
    return functools.partial(fleet.child_command, argv), env


@app.command()
def status(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print rows as JSON.")] = False,
    remote: Annotated[bool, typer.Option(
        "--remote/--no-remote", help="Also ask the broker for the instances of remote pools.")] = True,
    server_name: Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                             help=settings.BY_KEY["server_name"].help_text())] = "default",
    curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None,
) -> None:
    """Show the slot table of a running server (read from shared memory, no request needed), the instances that
    remote pools registered with it, and each tenant's figures (its busiest by name, the rest as other)."""
    with _errors():
        info = ServerInfo.read(server_name)
        if info is None or not info.alive():
            raise no_server(server_name)
        table = SlotTable.attach(Path(info.slots), writable=False)
        curve = _Curve(curve_server_key, curve_secret)
        try:
            while True:
                rows = table.read_all()
                stats = _broker_stats(info, curve) if remote and info.role == "broker" else None
                pools = [w for w in stats.workers if w.host] if stats is not None else []
                scaled = {name: m.scaling for name, m in stats.models.items()} if stats is not None else {}
                tenants = stats.tenants if stats is not None else {}
                if as_json:
                    print(json.dumps({"server": info.name, "pid": info.pid, "address": info.front,
                                      "slots": [_row_json(r) for r in rows],
                                      "remote": [msgspec.structs.asdict(w) for w in pools],
                                      "scaling": {name: vars(sc) for name, sc in scaled.items()},
                                      "tenants": {name: asdict(t) for name, t in tenants.items()}}))
                else:
                    if watch:
                        sys.stdout.write("\033[H\033[2J")
                    print(format_table(info, rows))
                    for line in extra_lines(scaled, pools, tenants):
                        print(line)
                if not watch:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
        finally:
            table.close()


@app.command()
@with_settings("devices")
def devices(
    given: Given, config_file: ConfigOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print devices as JSON.")] = False,
) -> None:
    """List the GPUs found (NVML, nvidia-smi, or simulated) and who holds or waits for their permits; with NVML
    (mpserve\\[nvml]), also the memory used and the processes holding it.

    Give the --config (or the --simulate-gpus, --gpus, --lock-dir) a server was started with to see its GPUs,
    simulated ones included, and its permits."""
    from mpserve.gpu.devices import discover, format_memory
    from mpserve.gpu.memory import read_usage
    from mpserve.gpu.permits import inspect

    with _errors():
        config = _config(given, config_file)
        found = discover(config.gpus, config.simulate_gpus)
        live = {u.uuid: u for u in read_usage() or []} if any(not d.simulated for d in found) else {}
        rows: list[dict[str, Any]] = []
        for d in found:
            state = inspect(d.key, Path(config.lock_dir) if config.lock_dir else None)
            usage = live.get(d.uuid)
            rows.append({"index": d.index, "name": d.name, "uuid": d.uuid, "memory_total": d.memory_total,
                         "memory_free": d.memory_free, "simulated": d.simulated,
                         "permit_capacity": state.capacity if state else None,
                         "holders": [h.pid for h in state.holders] if state else [],
                         "waiters": [w.pid for w in state.waiters] if state else [],
                         "memory_used": usage.used if usage else None,
                         "processes": [{"pid": p.pid, "memory": p.used} for p in usage.processes] if usage else []})
        if as_json:
            print(json.dumps(rows))
            return
        if not rows:
            print("no GPU found (no NVML, no nvidia-smi): instances run on the CPU")
            return
        for r in rows:
            permits = ("no permits in use" if r["permit_capacity"] is None else
                       f"permits {len(r['holders'])}/{r['permit_capacity']} held by {r['holders'] or '-'}, "
                       f"waiting: {r['waiters'] or '-'}")
            print(f"gpu{r['index']}  {r['name']}{' (simulated)' if r['simulated'] else ''}  "
                  f"{format_memory(int(r['memory_free']))} free of {format_memory(int(r['memory_total']))}  {permits}")
            if (usage := live.get(str(r["uuid"]))) is not None:
                held = ", ".join(f"{p.pid} {'?' if p.used is None else format_memory(p.used)}" for p in usage.processes)
                print(f"      {format_memory(usage.used)} used; processes: {held or '-'}")


@app.command()
@with_settings("plan")
def doctor(
    given: Given, config_file: ConfigOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
) -> None:
    """Check this host: the llama.cpp build (can it use a GPU?), the GPUs found, whether llama.cpp's repacked CPU
    kernels run here (a probe; mpserve serves without them where they crash), the runtime and lock directories,
    and how the instances of each model of the configuration (the file and flags, as for plan) would start;
    print each problem with its fix. Exit status 1 when there is a problem."""
    from mpserve.doctor import collect, format_report

    with _errors():
        report = collect(config=_config(given, config_file))
        print(json.dumps(report.to_json()) if as_json else format_report(report))
        if report.problems:
            raise typer.Exit(1)


@app.command()
@with_settings("plan")
def plan(given: Given, config_file: ConfigOption = None) -> None:
    """Print where each instance would run and check that it fits, without starting anything."""
    from mpserve.gpu.placement import format_plan
    from mpserve.server.layout import build_layout, check_host_ram, format_host_ram

    with _errors():
        config = _config(given, config_file)
        for model in config.models:
            cfg.check_adapters(model, pulled=False)
        layout = build_layout(config)
        warnings = check_host_ram(config, layout)
        print("\n\n".join(part for part in (format_plan(layout.placements, layout.devices,
                                                          config.single_active_backend),
                                              format_host_ram(config, layout)) if part))
        for warning in warnings:
            typer.echo(f"warning: {warning}", err=True)


@app.command("make-model")
def make_model(
    path: Annotated[Path, typer.Argument(help="Where to write the .gguf file.")],
    size: Annotated[str, typer.Option("--size", help="tiny (under 1 MB), bench (about 85M parameters), "
                                      "tiny-embed, tiny-rerank (a reranker: pooling rank), or tiny-draft (a "
                                      "draft model for tiny).")]
    = "tiny",
    lora_for: Annotated[Path | None, typer.Option("--lora-for", help="Write a random LoRA adapter for this base "
                                                  "GGUF instead of a model (--size is then ignored).")] = None,
    seed: Annotated[int, typer.Option("--seed", help="The adapter's random seed (with --lora-for).")] = 0,
    rank: Annotated[int, typer.Option("--rank", help="The adapter's rank, 1 to 256 (with --lora-for).")] = 8,
    mmproj: Annotated[Path | None, typer.Option("--mmproj", help="Also write a random image projector for the "
                                                "model here: a vision pair, served with --mmproj.")] = None,
) -> None:
    """Write a deterministic random-weight llama GGUF, or with --lora-for a random LoRA adapter GGUF for a base
    model (same arguments, same bytes); with --mmproj, the model's image projector too."""
    from mpserve.models.lora_maker import write_lora
    from mpserve.models.maker import write_model
    from mpserve.models.mmproj_maker import write_projector

    with _errors():
        out = write_lora(path, lora_for, seed, rank) if lora_for is not None else write_model(path, size)
        typer.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
        if mmproj is not None:
            projector = write_projector(mmproj, size)
            typer.echo(f"wrote {projector} ({projector.stat().st_size / 1e6:.1f} MB)")


@app.command()
def keygen(
    directory: Annotated[Path, typer.Argument(help="Folder for the key files (created, mode 0700).")],
    name: Annotated[str, typer.Argument(help="Key pair name: writes NAME.key and NAME.key_secret.")] = "server",
) -> None:
    """Write a CURVE key pair for `--curve-secret` (servers) or `curve_secret` (clients).

    Give clients the server's NAME.key; put each allowed client's NAME.key in the server's
    --curve-clients folder. Keep .key_secret files private."""
    import zmq.auth

    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if (directory / f"{name}.key_secret").exists():
        typer.echo(f"error: {directory / name}.key_secret exists; not overwriting it", err=True)
        raise typer.Exit(1)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    Path(secret).chmod(0o600)
    typer.echo(f"wrote {public} (public) and {secret} (secret)")


# --- the control API: models, load, unload, scale ------------------------------------------------------

ServerNameOption = Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                               help=settings.BY_KEY["server_name"].help_text())]
ModelArgument = Annotated[str, typer.Argument(help="The model's name (see mpserve models).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the models as JSON.")]


@app.command()
def models(server_name: ServerNameOption = "default", as_json: JsonOption = False,
           curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None) -> None:
    """List a running server's models: instances taking requests, starting and draining; bounds; state."""
    _control(server_name, _Curve(curve_server_key, curve_secret), as_json, "models")


@app.command()
def load(model: ModelArgument, server_name: ServerNameOption = "default", as_json: JsonOption = False,
         curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None) -> None:
    """Start a model's instances now (its min becomes at least 1)."""
    _control(server_name, _Curve(curve_server_key, curve_secret), as_json, "load", model)


@app.command()
def unload(model: ModelArgument, server_name: ServerNameOption = "default", as_json: JsonOption = False,
           curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None) -> None:
    """Drain every instance of a model (running requests finish); min becomes 0, so the next request loads it."""
    _control(server_name, _Curve(curve_server_key, curve_secret), as_json, "unload", model)


@app.command()
def scale(
    model: ModelArgument,
    low: Annotated[int | None, typer.Option("--min", help="Fewest instances (0: none while idle).")] = None,
    high: Annotated[int | None, typer.Option("--max", help="Most instances, up to the max it started with.")] = None,
    server_name: ServerNameOption = "default", as_json: JsonOption = False,
    curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None,
) -> None:
    """Change a model's instance bounds at run time."""
    _control(server_name, _Curve(curve_server_key, curve_secret), as_json, "scale", model, low, high)


@app.command()
def add(
    path: Annotated[Path, typer.Argument(help="A GGUF file (or builtin:tiny, builtin:bench, echo).")],
    name: Annotated[str | None, typer.Option("--name", help="Name clients use (default: the file's stem).")] = None,
    low: Annotated[int | None, typer.Option("--min", help="Fewest instances (default: 1).")] = None,
    high: Annotated[int | None, typer.Option("--max", help="Most instances (default: min).")] = None,
    server_name: ServerNameOption = "default", as_json: JsonOption = False,
    curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None,
) -> None:
    """Serve another model at run time, refused as at start when it is not a GGUF or does not fit (the server
    needs --spare-slots for its rows)."""
    given = str(path)
    where = given if given == cfg.ECHO_MODEL or given.startswith(cfg.BUILTIN_PREFIX) else str(path.resolve())
    _control(server_name, _Curve(curve_server_key, curve_secret), as_json, "add", name, low, high, where)


@app.command()
def reload(server_name: ServerNameOption = "default", as_json: JsonOption = False,
           curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None) -> None:
    """Make a running server read its configuration again (as SIGHUP does) and apply what changed: queue bounds,
    timeouts, tenants and log level at once, models added, removed (drained) or scaled, and a model whose file,
    n_ctx, parallel, KV types or draft changed rolled onto them, one instance at a time; what needs a restart is
    named and keeps its running value. A configuration that does not validate is refused whole: nothing changes."""
    _control(server_name, _Curve(curve_server_key, curve_secret), as_json, "reload")


@app.command()
def upgrade(server_name: ServerNameOption = "default",
            wait: Annotated[float, typer.Option("--wait", help="Seconds to wait for the new start to answer.")] = 120.0,
            curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None) -> None:
    """Hand a running server over to the mpserve installed now, without an outage (as SIGUSR2 does): its instances
    hold their requests, the server starts again in its own process (its pid stays) and adopts them, and the
    clients reattach. Prints the new start's version once it answers (on its admin socket, as `mpserve models`
    asks: a tcp one with an operator's CURVE keys)."""
    with _errors():
        info = ServerInfo.read(server_name)
        if info is None or not info.alive() or info.role != "broker":
            raise no_server(server_name)
        os.kill(info.pid, signal.SIGUSR2)
        deadline = time.monotonic() + wait
        while True:
            new = ServerInfo.read(server_name)
            if new is not None and new.started != info.started and new.alive():
                try:
                    with _admin_client(new, _Curve(curve_server_key, curve_secret), connect_timeout=2.0) as client:
                        client.stats()
                    break
                except MpserveError:
                    pass
            if time.monotonic() > deadline:
                raise ConnectionFailed(f"server {server_name!r} (pid {info.pid}) did not come back within {wait:g} s "
                                       "after the hand-off; see its log")
            time.sleep(0.2)
        print(f"upgraded {server_name}: mpserve {new.version or 'unknown'} (was {info.version or 'unknown'}), "
              f"pid {new.pid}")


@app.command()
def slots(
    action: Annotated[str, typer.Argument(help="save, restore or erase.")],
    slot: Annotated[int, typer.Argument(help="The slot: SLOT in mpserve status.")],
    filename: Annotated[str, typer.Argument(help="A file name in the model's slot_save_path (save, restore).")] = "",
    server_name: ServerNameOption = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None,
) -> None:
    """Save an idle slot's KV cells to a file of its model's slot_save_path, restore them from one, or erase
    them: a long conversation survives a restart."""
    from mpserve.gpu.devices import format_memory

    with _errors():
        info = ServerInfo.read(server_name)
        if info is None or not info.alive() or info.role != "broker":
            raise no_server(server_name)
        table = SlotTable.attach(Path(info.slots), writable=False)
        try:
            worker, local = locate(table.read_all(), slot)
        finally:
            table.close()
        with _admin_client(info, _Curve(curve_server_key, curve_secret)) as client:
            reply = client.slot(action, worker, local, filename)
        if as_json:
            print(json.dumps({"slot": slot, "worker": worker, **msgspec.structs.asdict(reply)}))
            return
        done = {"save": "saved", "restore": "restored", "erase": "erased"}[reply.action]
        where = f" ({format_memory(reply.bytes)}, {filename})" if reply.action != "erase" else ""
        print(f"{done} slot {slot} ({worker} slot {local}): {reply.tokens} tokens{where} in {reply.ms:.0f} ms")


@app.command()
def adapters(
    action: Annotated[str, typer.Argument(help="list, load or unload.")],
    model: Annotated[str | None, typer.Argument(help="The model (load, unload).")] = None,
    name: Annotated[str | None, typer.Argument(help="The adapter's name (load, unload).")] = None,
    path: Annotated[str | None, typer.Argument(help="The adapter's GGUF file on the server's host (load).")] = None,
    server_name: ServerNameOption = "default", as_json: JsonOption = False,
    curve_server_key: CurveServerKeyOption = None, curve_secret: CurveSecretOption = None,
) -> None:
    """List each model's LoRA adapters, load one into every instance of a model, or unload one once the requests
    using it have finished, without a restart."""
    with _errors():
        if action not in ("list", "load", "unload"):
            raise BadRequest(f"no adapters action {action!r}; give list, load MODEL NAME PATH or unload MODEL NAME")
        if action != "list" and (model is None or name is None or (action == "load") != (path is not None)):
            raise BadRequest("give load MODEL NAME PATH (a GGUF on the server's host) or unload MODEL NAME")
        info = ServerInfo.read(server_name)
        if info is None or not info.alive() or info.role != "broker":
            raise no_server(server_name)
        with _admin_client(info, _Curve(curve_server_key, curve_secret)) as client:
            if action == "list":
                served = {m: s.served_adapters() for m, s in client.stats().models.items()}
                print(json.dumps({m: list(ids) for m, ids in served.items()}) if as_json else "\n".join(
                    f"{m}:{a} (id {i})" for m, ids in served.items() for a, i in ids.items()))
                return
            assert model is not None and name is not None
            path = str(Path(path).resolve()) if path is not None else ""  # the server's host is this one, or says so
            reply = client.adapter(action, model, name, path)
        if as_json:
            print(json.dumps(msgspec.structs.asdict(reply)))
            return
        print(f"{action}ed adapter {name!r} of model {model!r} ({reply.ms:.0f} ms); its adapters now: "
              f"{', '.join(reply.adapters) or 'none'}")


def _control(server_name: str, curve: _Curve, as_json: bool, op: str, model: str | None = None,
             low: int | None = None, high: int | None = None, path: str | None = None) -> None:

    with _errors():
        info = ServerInfo.read(server_name)
        if info is None or not info.alive() or info.role != "broker":
            raise no_server(server_name)
        with _admin_client(info, curve) as client:
            reply = client.control(op, model, min=low, max=high, path=path)
        if as_json:
            print(json.dumps({"message": reply.message, "models": [vars(m) for m in reply.models]}))
            return
        if op == "reload":
            print(reply.message)
        elif op != "models":
            typer.echo(reply.message, err=True)
        print(format_models(reply.models))


def _admin_client(info: ServerInfo, curve: _Curve, connect_timeout: float | None = None
                  ) -> contextlib.AbstractContextManager[Client]:
    """A client on the server's admin socket: ipc (this user alone) needs no keys; a tcp one takes an operator's
    CURVE keys (--curve-server-key, --curve-secret or their variables), as `generate` takes a client's."""
    address = info.admin or info.front  # a server older than the admin socket takes operator's calls on its front
    return _client(address, curve if address.startswith("tcp://") else _Curve(None, None), connect_timeout)


@contextlib.contextmanager
def _client(address: str, curve: _Curve, connect_timeout: float | None = None) -> Iterator[Client]:
    """A client of ``address``, connected; a server that does not answer gets an error naming the CURVE keys'
    flags and variables (a CURVE server drops a client without the right keys, silently)."""
    from mpserve.client import CONNECT_TIMEOUT_S, Client

    try:
        client = Client(address, curve_server_key=curve.server_key, curve_secret=curve.secret,
                        connect_timeout=connect_timeout or CONNECT_TIMEOUT_S)
    except ConnectionFailed as exc:
        if address.startswith("tcp://") or os.path.exists(address.removeprefix("ipc://")):  # it did not answer
            given = "the keys given" if curve.server_key and curve.secret else "no keys"
            raise ConnectionFailed(f"{exc.message}; a server with CURVE keys drops a client without its keys "
                                   f"({given} here): give --curve-server-key (MPSERVE_CURVE_SERVER_KEY), the "
                                   "server's public key file, and --curve-secret (MPSERVE_CURVE_CLIENT_SECRET), "
                                   "your secret key file, whose public half the server allows") from None
        raise
    with client:
        yield client



def _broker_stats(info: ServerInfo, curve: _Curve) -> Stats | None:
    """The broker's STATS (its remote workers, its models' scaling), or None, said on stderr, if it does not
    answer within a second. A broker with CURVE keys is asked with ``curve``, as `generate` asks it."""
    try:
        with _client(info.front, curve, connect_timeout=1.0) as client:
            return client.stats(timeout=1.0)
    except MpserveError as exc:
        typer.echo(f"note: remote pools and scaling not shown: {exc.message}", err=True)
        return None


def _row_json(r: SlotRow) -> dict[str, object]:
    d = asdict(r)
    d["state"] = r.state.name.lower()
    return d


def _structured(json_schema: Path | None, grammar: Path | None) -> dict[str, Any]:
    """``json_schema`` and ``grammar`` keyword arguments from the files given (checked by the client)."""
    out: dict[str, Any] = {}
    for key, path in (("json_schema", json_schema), ("grammar", grammar)):
        if path is not None:
            try:
                out[key] = path.read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise BadRequest(f"--{key.replace('_', '-')} {path}: {exc}") from None
    if "json_schema" in out:
        try:
            out["json_schema"] = json.loads(out["json_schema"])
        except ValueError as exc:
            raise BadRequest(f"--json-schema {json_schema}: not valid JSON: {exc}") from None
    return out


class _errors:
    """Print an MpserveError as one line naming its code, and exit 1; no traceback for users."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if isinstance(exc, MpserveError):
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1)
        return None


def main() -> None:
    app()
