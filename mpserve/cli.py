"""The ``mpserve`` command line: one typer command per verb, each a thin layer over the package that does the work.

    serving     start (a server; --http adds a gateway), worker (a pool for a broker elsewhere), gateway (HTTP)
    requests    generate (one request, printed)
    looking     status (the slot table), models (a server's models), devices (GPUs and their permits), plan (where
                instances would run), doctor (this host, and what to fix)
    changing    load, unload, scale, add (a server's models at run time), reload (its configuration read again),
                upgrade (the mpserve installed now takes over, adopting the instances),
                slots (a slot's KV file: save, restore, erase), adapters (a model's LoRA adapters: list, load, unload)
    files       pull (models from the Hub, ahead of time), make-model (a random-weight GGUF), keygen (a CURVE key pair)

Options are declared once: the settings in ``mpserve.config.settings`` (``with_settings`` gives `start`, `worker`,
`plan`, `devices` and `gateway` their flags), and the options every operator command shares, which server and its
CURVE keys, in ``operator_options`` (``mpserve.operator_link``: how they reach it). What `start` runs, the gateway
fleet of --http and the upgrade's exec, is ``mpserve.start``; what the commands print is ``mpserve.status_text``. The
benchmarks are not a command but ``python -m bench`` from a checkout.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from mpserve import __version__, help_labels
from mpserve.config import loader as cfg
from mpserve.config import settings
from mpserve.errors import BadRequest, ConfigError, MpserveError
from mpserve.operator_link import Curve, Operator, admin_client, broker_stats
from mpserve.runtime import ServerInfo
from mpserve.status_text import (
    extra_lines,
    format_devices,
    format_models,
    format_result,
    format_slot_reply,
    format_table,
    no_server,
    status_json,
)
from mpserve.wire.slots import SlotTable, locate

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
class Given:
    """The values of a command's setting flags (or their variables), by scope; None where not given."""

    server: dict[str, Any]
    model: dict[str, Any]
    cli: dict[str, Any]

    def with_server(self, **values: Any) -> Given:
        return replace(self, server={**self.server, **values})


Command = Callable[..., None]


def _bundle(name: str, options: dict[str, tuple[Any, Any]], make: Callable[..., Any]) -> Callable[[Command], Command]:
    """Give a command the options ``options`` (parameter: its annotation and default), declared once for every command
    that takes them; the command gets ``make(**their values)`` as its parameter ``name``."""

    def decorate(fn: Command) -> Command:
        signature = inspect.signature(fn, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != name]
        added = [inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)
                 for param, (annotation, default) in options.items()]

        @functools.wraps(fn)
        def run(**kwargs: Any) -> None:
            fn(**{name: make(**{param: kwargs.pop(param) for param in options})}, **kwargs)

        run.__signature__ = signature.replace(parameters=[*own, *added])  # type: ignore[attr-defined]
        return run

    return decorate


def with_settings(command: settings.Command) -> Callable[[Command], Command]:
    """Give a command a flag for each setting declared for it (``mpserve.config.settings``); the command gets
    their values as ``given``."""
    declared = settings.for_command(command)

    def given(**values: Any) -> Given:
        scoped: dict[str, dict[str, Any]] = {"server": {}, "model": {}, "cli": {}}
        for s in declared:
            value = values[s.param]
            if s.cli_type is bool:  # an unset switch is unset; a --no-… switch sets its setting false
                value = (not s.negated) if value else None
            elif isinstance(value, (list, tuple)) and not value:  # a repeatable flag not given
                value = None
            scoped[s.scope][s.key] = value
        return Given(**scoped)

    return _bundle("given", {s.param: (_option(s), False if s.cli_type is bool else None) for s in declared}, given)


def _option(s: settings.Setting) -> Any:
    """A setting's typer option; a flag of no file (scope ``cli``) has its range checked here, the others where the
    configuration is built."""
    assert s.flag is not None  # for_command() gives flags only
    names = [s.flag, s.short] if s.short else [s.flag]
    lo, hi = s.range if s.range is not None and s.scope == "cli" else (None, None)
    option = typer.Option(*names, envvar=s.env, help=s.help_text(), min=lo, max=hi,
                          metavar="|".join(s.choices) if s.choices else None)
    return Annotated[bool, option] if s.cli_type is bool else Annotated[s.cli_type | None, option]


def _config(given: Given, config_file: Path | None) -> cfg.ServerConfig:
    """Flags and variables over the file (``--config``) over the defaults."""
    return cfg.build(cfg.load_file(config_file) if config_file else {}, server=given.server, model=given.model,
                     source=str(config_file or "command line"), base_dir=config_file.parent if config_file else None)

ServerNameOption = Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                               help=settings.BY_KEY["server_name"].help_text())]
operator_options = _bundle("target", {
    "server_name": (ServerNameOption, "default"),
    "curve_server_key": (Annotated[str | None, typer.Option(
        "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY",
        help="The server's public key file, for a server on tcp:// with CURVE keys.")], None),
    "curve_secret": (Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_CLIENT_SECRET",
        help="Your secret key file, for a server on tcp:// with CURVE keys (its public half in the server's allowed "
             "keys).")], None),
}, lambda server_name, curve_server_key, curve_secret: Operator(server_name, Curve(curve_server_key, curve_secret)))


@app.command()
@with_settings("start")
def start(given: Given, config_file: ConfigOption = None) -> None:
    """Start the server in the foreground; Ctrl-C (or SIGTERM) stops it gracefully.

    Every address, folder and model file is checked first: a problem ends the command with exit status 1 and
    one line naming it and the fix, before anything starts. With --http, if the gateway exits while the server
    runs, the server stops too and the command ends with exit status 1 (a service manager restarts both)."""
    from mpserve import start as starting

    with _errors():
        upgrading = starting.run(_config(given, config_file), given.cli, lambda: _config(given, config_file), _pull)
    if upgrading:  # the mpserve installed now, in this process (its pid stays, for the service manager)
        starting.exec_again()


@app.command()
@operator_options
def generate(
    target: Operator,
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
) -> None:
    """Send one request to a running server and print the completion."""
    from mpserve.client import Client

    params: dict[str, Any] = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  stop=tuple(stop or ()))
    with _errors():
        params.update(_structured(json_schema, grammar))
        if address is None and ((info := ServerInfo.read(target.server_name)) is None or not info.alive()):
            raise no_server(target.server_name)  # naming the servers that run here, as status does
    with _errors(), Client(address, server_name=target.server_name, timeout=timeout,
                           curve_server_key=target.curve.server_key, curve_secret=target.curve.secret) as client:
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
            typer.echo(format_result(result), err=True)


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
@with_settings("gateway")
def gateway(
    given: Given,
    fd: Annotated[int | None, typer.Option("--fd", hidden=True)] = None,
    exit_with_parent: Annotated[bool, typer.Option("--exit-with-parent", hidden=True)] = False,
) -> None:
    """Serve an OpenAI-compatible HTTP API for a server; it may start before the server (503 until ready).
    Generation: /v1/completions, /v1/chat/completions, /v1/responses (stored: /v1/responses/{id},
    /v1/responses/{id}/cancel), /v1/messages (Anthropic's). Models, vectors, tokens: /v1/models, /v1/embeddings,
    /v1/rerank, /rerank, /tokenize, /detokenize. Operations: /health, /metrics (Prometheus), /backend/monitor,
    /openapi.json, the web console at / and /console (/console/state, /static/{name}, /favicon.ico). With the
    admin key: /admin/models, /admin/models/{name}/{op}, /admin/adapters, /admin/adapters/{model}/{name},
    /slots/{slot}."""
    from mpserve.gateway import run as gateway_run

    with _errors():
        config = gateway_run.configure({**given.server, **given.cli}, exit_with_parent)
        gateway_run.serve(config, given.cli["http_workers"] or 1, fd)


@app.command()
@operator_options
def status(
    target: Operator,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print rows as JSON.")] = False,
    remote: Annotated[bool, typer.Option(
        "--remote/--no-remote", help="Also ask the broker for the instances of remote pools.")] = True,
) -> None:
    """Show the slot table of a running server (read from shared memory, no request needed), the instances that
    remote pools registered with it, and each tenant's figures (its busiest by name, the rest as other)."""
    with _errors():
        info = ServerInfo.read(target.server_name)
        if info is None or not info.alive():
            raise no_server(target.server_name)
        table = SlotTable.attach(Path(info.slots), writable=False)
        try:
            while True:
                rows = table.read_all()
                stats = broker_stats(info, target.curve) if remote and info.role == "broker" else None
                if as_json:
                    print(json.dumps(status_json(info, rows, stats)))
                else:
                    if watch:
                        sys.stdout.write("\033[H\033[2J")
                    print(format_table(info, rows))
                    for line in extra_lines(stats):
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
    from mpserve.gpu.devices import discover
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
        print(json.dumps(rows) if as_json else format_devices(rows, live))


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
    audio: Annotated[bool, typer.Option("--audio", help="With --mmproj: write an audio projector (a Whisper-style "
                                        "encoder) instead of an image projector.")] = False,
) -> None:
    """Write a deterministic random-weight llama GGUF, or with --lora-for a random LoRA adapter GGUF for a base
    model (same arguments, same bytes); with --mmproj, the model's image (or, with --audio, audio) projector too."""
    from mpserve.models import audio_maker, lora_maker, maker, mmproj_maker

    with _errors():
        out = lora_maker.write_lora(path, lora_for, seed, rank) if lora_for else maker.write_model(path, size)
        typer.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
        if mmproj is not None:
            projector = (audio_maker.write_audio_projector if audio else mmproj_maker.write_projector)(mmproj, size)
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

ModelArgument = Annotated[str, typer.Argument(help="The model's name (see mpserve models).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print the models as JSON.")]


@app.command()
@operator_options
def models(target: Operator, as_json: JsonOption = False) -> None:
    """List a running server's models: instances taking requests, starting and draining; bounds; state."""
    _control(target, as_json, "models")


@app.command()
@operator_options
def load(target: Operator, model: ModelArgument, as_json: JsonOption = False) -> None:
    """Start a model's instances now (its min becomes at least 1)."""
    _control(target, as_json, "load", model)


@app.command()
@operator_options
def unload(target: Operator, model: ModelArgument, as_json: JsonOption = False) -> None:
    """Drain every instance of a model (running requests finish); min becomes 0, so the next request loads it."""
    _control(target, as_json, "unload", model)


@app.command()
@operator_options
def scale(
    target: Operator, model: ModelArgument,
    low: Annotated[int | None, typer.Option("--min", help="Fewest instances (0: none while idle).")] = None,
    high: Annotated[int | None, typer.Option("--max", help="Most instances, up to the max it started with.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Change a model's instance bounds at run time."""
    _control(target, as_json, "scale", model, low, high)


@app.command()
@operator_options
def add(
    target: Operator,
    path: Annotated[Path, typer.Argument(help="A GGUF file (or builtin:tiny, builtin:bench, echo).")],
    name: Annotated[str | None, typer.Option("--name", help="Name clients use (default: the file's stem).")] = None,
    low: Annotated[int | None, typer.Option("--min", help="Fewest instances (default: 1).")] = None,
    high: Annotated[int | None, typer.Option("--max", help="Most instances (default: min).")] = None,
    as_json: JsonOption = False,
) -> None:
    """Serve another model at run time, refused as at start when it is not a GGUF or does not fit (the server
    needs --spare-slots for its rows)."""
    given = str(path)
    where = given if given == cfg.ECHO_MODEL or given.startswith(cfg.BUILTIN_PREFIX) else str(path.resolve())
    _control(target, as_json, "add", name, low, high, where)


@app.command()
@operator_options
def reload(target: Operator, as_json: JsonOption = False) -> None:
    """Make a running server read its configuration again (as SIGHUP does) and apply what changed: queue bounds,
    timeouts, tenants and log level at once, models added, removed (drained) or scaled, and a model whose file,
    n_ctx, parallel, KV types or draft changed rolled onto them, one instance at a time; what needs a restart is
    named and keeps its running value. A configuration that does not validate is refused whole: nothing changes."""
    _control(target, as_json, "reload")


@app.command()
@operator_options
def upgrade(target: Operator,
            wait: Annotated[float, typer.Option("--wait", help="Seconds to wait for the new start to answer.")] = 120.0,
            ) -> None:
    """Hand a running server over to the mpserve installed now, without an outage (as SIGUSR2 does): its instances
    hold their requests, the server starts again in its own process (its pid stays) and adopts them, and the
    clients reattach. Prints the new start's version once it answers (on its admin socket, as `mpserve models`
    asks: a tcp one with an operator's CURVE keys)."""
    with _errors():
        info = target.broker()
        os.kill(info.pid, signal.SIGUSR2)
        new = target.next_start(info, wait)
        print(f"upgraded {target.server_name}: mpserve {new.version or 'unknown'} (was {info.version or 'unknown'}), "
              f"pid {new.pid}")


@app.command()
@operator_options
def slots(
    target: Operator,
    action: Annotated[str, typer.Argument(help="save, restore or erase.")],
    slot: Annotated[int, typer.Argument(help="The slot: SLOT in mpserve status.")],
    filename: Annotated[str, typer.Argument(help="A file name in the model's slot_save_path (save, restore).")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Save an idle slot's KV cells to a file of its model's slot_save_path, restore them from one, or erase
    them: a long conversation survives a restart."""
    with _errors():
        info = target.broker()
        worker, local = locate(SlotTable.read_rows(Path(info.slots)), slot)
        with admin_client(info, target.curve) as client:
            reply = client.slot(action, worker, local, filename)
        if as_json:
            print(json.dumps({"slot": slot, "worker": worker, **msgspec.structs.asdict(reply)}))
            return
        print(format_slot_reply(reply, slot, worker, local, filename))


@app.command()
@operator_options
def adapters(
    target: Operator,
    action: Annotated[str, typer.Argument(help="list, load or unload.")],
    model: Annotated[str | None, typer.Argument(help="The model (load, unload).")] = None,
    name: Annotated[str | None, typer.Argument(help="The adapter's name (load, unload).")] = None,
    path: Annotated[str | None, typer.Argument(help="The adapter's GGUF file on the server's host (load).")] = None,
    as_json: JsonOption = False,
) -> None:
    """List each model's LoRA adapters, load one into every instance of a model, or unload one once the requests
    using it have finished, without a restart."""
    with _errors():
        if action not in ("list", "load", "unload"):
            raise BadRequest(f"no adapters action {action!r}; give list, load MODEL NAME PATH or unload MODEL NAME")
        if action != "list" and (model is None or name is None or (action == "load") != (path is not None)):
            raise BadRequest("give load MODEL NAME PATH (a GGUF on the server's host) or unload MODEL NAME")
        with admin_client(target.broker(), target.curve) as client:
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


def _control(target: Operator, as_json: bool, op: str, model: str | None = None, low: int | None = None,
             high: int | None = None, path: str | None = None) -> None:
    with _errors():
        with admin_client(target.broker(), target.curve) as client:
            reply = client.control(op, model, min=low, max=high, path=path)
        if as_json:
            print(json.dumps({"message": reply.message, "models": [vars(m) for m in reply.models]}))
            return
        if op == "reload":
            print(reply.message)
        elif op != "models":
            typer.echo(reply.message, err=True)
        print(format_models(reply.models))


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
