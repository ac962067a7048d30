"""The ``mpserve`` command line: start, generate, status, make-model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from . import config as cfg
from .errors import ConnectionFailed, MpserveError
from .protocol import WorkerStats
from .runtime import ServerInfo, pid_alive
from .slots import SlotRow, SlotState, SlotTable

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Run several llama.cpp instances behind one ZeroMQ broker.")

ServerName = Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                         help="Which local server (several may run side by side).")]
GpusOption = Annotated[str | None, typer.Option("--gpus", envvar="MPSERVE_GPUS",
                                                help="GPU indices to use, e.g. 0,2 (default: all).")]
SimulateOption = Annotated[str | None, typer.Option(
    "--simulate-gpus", envvar="MPSERVE_SIMULATE_GPUS", help="Pretend to have GPUs, e.g. 2x24GiB (no CUDA).")]
ApiKey = Annotated[str | None, typer.Option(
    "--api-key", envvar="MPSERVE_API_KEY",
    help="Require 'Authorization: Bearer KEY' on HTTP requests (/health excepted).")]
FlashAttnOption = Annotated[str | None, typer.Option(
    "--flash-attn", envvar="MPSERVE_FLASH_ATTN", metavar="auto|on|off",
    help="llama.cpp flash attention (default: auto, on where llama.cpp supports it, as llama-server does).")]
NoRepackOption = Annotated[bool, typer.Option(
    "--no-repack", envvar="MPSERVE_NO_REPACK",
    help="Load weights as stored, without llama.cpp's repacked layouts for this CPU (llama-server's --no-repack).")]
ParallelOption = Annotated[int | None, typer.Option(
    "--parallel", "-p", envvar="MPSERVE_PARALLEL",
    help="Requests one instance decodes together in one batch (default: 1); --n-ctx is per request.")]
HeartbeatInterval = Annotated[float | None, typer.Option(
    "--heartbeat-interval", envvar="MPSERVE_HEARTBEAT_INTERVAL", help="Seconds between heartbeats (default: 1).")]
HeartbeatLiveness = Annotated[int | None, typer.Option(
    "--heartbeat-liveness", envvar="MPSERVE_HEARTBEAT_LIVENESS",
    help="Missed heartbeats before a remote worker (or the broker, for a worker) is lost (default: 5).")]
StallTimeout = Annotated[float | None, typer.Option(
    "--stall-timeout", envvar="MPSERVE_STALL_TIMEOUT",
    help="Replace a busy worker that generates nothing for this long, in s (default: 60).")]
StreamInterval = Annotated[float | None, typer.Option(
    "--stream-interval", envvar="MPSERVE_STREAM_INTERVAL",
    help="Seconds between a streamed request's chunks after its first; tokens in between go together "
         "(default: 0.02; 0 = a chunk per token).")]
ConfigOption = Annotated[Path | None, typer.Option("--config", "-c", envvar="MPSERVE_CONFIG",
                                                   help="YAML file (see README).")]


@app.command()
def start(
    model: Annotated[str | None, typer.Option(
        "--model", "-m", envvar="MPSERVE_MODEL",
        help="GGUF file, builtin:tiny (default), builtin:bench, or echo (no model).")] = None,
    name: Annotated[str | None, typer.Option("--name", envvar="MPSERVE_MODEL_NAME",
                                                help="Name clients use for the model.")] = None,
    instances: Annotated[int | None, typer.Option("--instances", "-n", envvar="MPSERVE_INSTANCES",
                                                     help="Worker processes per model (default: 1).")] = None,
    parallel: ParallelOption = None,
    flash_attn: FlashAttnOption = None,
    no_repack: NoRepackOption = False,
    threads: Annotated[int | None, typer.Option(
        "--threads", envvar="MPSERVE_THREADS", help="Threads per instance (default: cores ÷ instances).")] = None,
    n_ctx: Annotated[int | None, typer.Option("--n-ctx", envvar="MPSERVE_N_CTX",
                                                 help="Context size per instance (default: 2048).")] = None,
    n_gpu_layers: Annotated[int | None, typer.Option("--n-gpu-layers", envvar="MPSERVE_N_GPU_LAYERS")] = None,
    max_queue: Annotated[int | None, typer.Option(
        "--max-queue", envvar="MPSERVE_MAX_QUEUE", help="Waiting requests per model (default: 256).")] = None,
    bind: Annotated[str | None, typer.Option(
        "--bind", envvar="MPSERVE_BIND", help="Client address, e.g. tcp://127.0.0.1:5555 (default: ipc)")] = None,
    grace: Annotated[float | None, typer.Option(
        "--grace", envvar="MPSERVE_GRACE", help="Seconds to finish requests on shutdown (default: 30).")] = None,
    max_queue_total: Annotated[int | None, typer.Option(
        "--max-queue-total", envvar="MPSERVE_MAX_QUEUE_TOTAL", help="Waiting requests, all models (default: 4096).")
    ] = None,
    max_pending_per_client: Annotated[int | None, typer.Option(
        "--max-pending-per-client", envvar="MPSERVE_MAX_PENDING_PER_CLIENT",
        help="Requests one client may have queued or running (default: 128).")] = None,
    stall_timeout: StallTimeout = None,
    idle_timeout: Annotated[float | None, typer.Option(
        "--idle-timeout", envvar="MPSERVE_IDLE_TIMEOUT",
        help="Unload an instance idle this long, in s; reloaded on demand (default: 0 = never).")] = None,
    client_timeout: Annotated[float | None, typer.Option(
        "--client-timeout", envvar="MPSERVE_CLIENT_TIMEOUT",
        help="Cancel the requests of a client silent this long, in s (default: 5).")] = None,
    stream_interval: StreamInterval = None,
    curve_secret: Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_SECRET", help="Server secret key file (mpserve keygen).")] = None,
    curve_clients: Annotated[str | None, typer.Option(
        "--curve-clients", envvar="MPSERVE_CURVE_CLIENTS", help="Folder of allowed clients' public .key files.")
    ] = None,
    insecure: Annotated[bool, typer.Option(
        "--insecure", help="Allow a network --bind without CURVE keys (anyone reaching the port may use it).")] = False,
    gpus: GpusOption = None,
    simulate_gpus: SimulateOption = None,
    gpu_mode: Annotated[str | None, typer.Option(
        "--gpu-mode", envvar="MPSERVE_GPU_MODE", help="shared, or exclusive: one computing request per GPU, "
        "host-wide (default: shared).")] = None,
    max_active_per_gpu: Annotated[int | None, typer.Option(
        "--max-active-per-gpu", envvar="MPSERVE_MAX_ACTIVE_PER_GPU",
        help="Requests computing on one GPU at once, host-wide (default: unlimited).")] = None,
    gpu_memory_budget: Annotated[str | None, typer.Option(
        "--gpu-memory-budget", envvar="MPSERVE_GPU_MEMORY_BUDGET", help="Per GPU, e.g. 20GiB.")] = None,
    single_active_backend: Annotated[bool, typer.Option(
        "--single-active-backend", envvar="MPSERVE_SINGLE_ACTIVE_BACKEND",
        help="At most one model loaded per GPU; models take turns.")] = False,
    workers_bind: Annotated[str | None, typer.Option(
        "--workers-bind", envvar="MPSERVE_WORKERS_BIND",
        help="Worker socket address, e.g. tcp://0.0.0.0:5556 for remote pools (mpserve worker --connect).")] = None,
    curve_workers: Annotated[str | None, typer.Option(
        "--curve-workers", envvar="MPSERVE_CURVE_WORKERS", help="Folder of allowed remote pools' public .key files.")
    ] = None,
    heartbeat_interval: HeartbeatInterval = None,
    heartbeat_liveness: HeartbeatLiveness = None,
    http: Annotated[str | None, typer.Option(
        "--http", help="Also serve the OpenAI-compatible HTTP API on HOST:PORT (see `mpserve gateway`).")] = None,
    api_key: ApiKey = None,
    config_file: ConfigOption = None,
    log_level: Annotated[str | None, typer.Option("--log-level", envvar="MPSERVE_LOG_LEVEL")] = None,
    server_name: ServerName = "default",
) -> None:
    """Start the server in the foreground; Ctrl-C (or SIGTERM) stops it gracefully."""
    from .server import serve

    with _errors():
        file_data = cfg.load_file(config_file) if config_file else {}
        config = cfg.build(
            file_data,
            server={"server_name": server_name, "bind": bind, "max_queue": max_queue, "grace": grace,
                    "log_level": log_level, "max_queue_total": max_queue_total, "stall_timeout": stall_timeout,
                    "max_pending_per_client": max_pending_per_client,
                    "idle_timeout": idle_timeout, "client_timeout": client_timeout, "curve_secret": curve_secret,
                    "stream_interval": stream_interval,
                    "curve_clients": curve_clients, "insecure": insecure or None, "gpus": gpus,
                    "simulate_gpus": simulate_gpus, "gpu_mode": gpu_mode, "max_active_per_gpu": max_active_per_gpu,
                    "gpu_memory_budget": gpu_memory_budget, "single_active_backend": single_active_backend or None,
                    "workers_bind": workers_bind, "curve_workers": curve_workers,
                    "heartbeat_interval": heartbeat_interval, "heartbeat_liveness": heartbeat_liveness},
            model={"path": model, "name": name, "instances": instances, "parallel": parallel, "threads": threads,
                   "n_ctx": n_ctx, "n_gpu_layers": n_gpu_layers, "flash_attn": flash_attn,
                   "repack": False if no_repack else None},
            source=str(config_file or "command line"),
            base_dir=config_file.parent if config_file else None,
        )
        gateway_process = _start_gateway(http, config.server_name, api_key, config.log_level) if http else None
        try:
            serve(config)
        finally:
            if gateway_process is not None:
                _stop_gateway(gateway_process)


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
    curve_server_key: Annotated[str | None, typer.Option(
        "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY", help="The server's public key file.")] = None,
    curve_secret: Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_CLIENT_SECRET", help="This client's secret key file.")] = None,
    server_name: ServerName = "default",
) -> None:
    """Send one request to a running server and print the completion."""
    from .client import Client

    params = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  stop=tuple(stop or ()))
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
                              "usage": vars(result.usage), "timings": vars(result.timings),
                              "worker": result.worker}))
        else:
            t = result.timings
            tps = result.usage.completion_tokens / (t.generate_ms / 1000) if t.generate_ms else 0.0
            typer.echo(f"[{result.finish_reason}; {result.usage.prompt_tokens} prompt + "
                       f"{result.usage.completion_tokens} generated tokens; queued {t.queue_ms:.0f} ms, "
                       f"first token {t.prompt_ms:.0f} ms, {tps:.1f} tokens/s; {result.worker}]", err=True)


@app.command()
def worker(
    connect: Annotated[str, typer.Option("--connect", envvar="MPSERVE_CONNECT",
                                         help="The broker's worker socket, e.g. tcp://broker-host:5556.")],
    model: Annotated[str | None, typer.Option("--model", "-m", envvar="MPSERVE_MODEL",
                                              help="GGUF file, builtin:tiny (default), builtin:bench or echo.")] = None,
    name: Annotated[str | None, typer.Option("--name", envvar="MPSERVE_MODEL_NAME",
                                             help="The model's name at the broker.")] = None,
    instances: Annotated[int | None, typer.Option("--instances", "-n", envvar="MPSERVE_INSTANCES")] = None,
    parallel: ParallelOption = None,
    flash_attn: FlashAttnOption = None,
    no_repack: NoRepackOption = False,
    threads: Annotated[int | None, typer.Option("--threads", envvar="MPSERVE_THREADS")] = None,
    n_ctx: Annotated[int | None, typer.Option("--n-ctx", envvar="MPSERVE_N_CTX")] = None,
    n_gpu_layers: Annotated[int | None, typer.Option("--n-gpu-layers", envvar="MPSERVE_N_GPU_LAYERS")] = None,
    gpus: GpusOption = None,
    simulate_gpus: SimulateOption = None,
    curve_server_key: Annotated[str | None, typer.Option(
        "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY", help="The broker's public key file.")] = None,
    curve_secret: Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_WORKER_SECRET", help="This pool's secret key file.")] = None,
    heartbeat_interval: HeartbeatInterval = None,
    heartbeat_liveness: HeartbeatLiveness = None,
    stream_interval: StreamInterval = None,
    stall_timeout: StallTimeout = None,
    config_file: ConfigOption = None,
    log_level: Annotated[str | None, typer.Option("--log-level", envvar="MPSERVE_LOG_LEVEL")] = None,
    server_name: Annotated[str, typer.Option("--server-name", envvar="MPSERVE_SERVER_NAME",
                                             help="Name of this pool on this host (for `mpserve status`).")]
    = "pool",
) -> None:
    """Run a pool of workers on this host for a broker elsewhere (`mpserve start --workers-bind ...`)."""
    from .pool import run_pool

    with _errors():
        config = cfg.build(
            cfg.load_file(config_file) if config_file else {},
            server={"server_name": server_name, "gpus": gpus, "simulate_gpus": simulate_gpus, "log_level": log_level,
                    "heartbeat_interval": heartbeat_interval, "heartbeat_liveness": heartbeat_liveness,
                    "stream_interval": stream_interval, "stall_timeout": stall_timeout},
            model={"path": model, "name": name, "instances": instances, "parallel": parallel, "threads": threads,
                   "n_ctx": n_ctx, "n_gpu_layers": n_gpu_layers, "flash_attn": flash_attn,
                   "repack": False if no_repack else None},
            source=str(config_file or "command line"), base_dir=config_file.parent if config_file else None)
        run_pool(config, connect, curve_server_key, curve_secret)


@app.command()
def gateway(
    http: Annotated[str, typer.Option("--http", envvar="MPSERVE_HTTP", help="HOST:PORT to serve HTTP on.")]
    = "127.0.0.1:8000",
    connect: Annotated[str | None, typer.Option(
        "--connect", help="The server's ZeroMQ address (default: the local server named by --server-name).")] = None,
    api_key: ApiKey = None,
    request_timeout: Annotated[float | None, typer.Option(
        "--request-timeout", envvar="MPSERVE_REQUEST_TIMEOUT",
        help="Seconds per request, queueing included; past it: 504 (default: no limit).")] = None,
    curve_server_key: Annotated[str | None, typer.Option(
        "--curve-server-key", envvar="MPSERVE_CURVE_SERVER_KEY", help="The server's public key file.")] = None,
    curve_secret: Annotated[str | None, typer.Option(
        "--curve-secret", envvar="MPSERVE_CURVE_CLIENT_SECRET", help="This gateway's secret key file.")] = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="MPSERVE_LOG_LEVEL")] = "info",
    exit_with_parent: Annotated[bool, typer.Option("--exit-with-parent", hidden=True)] = False,
    server_name: ServerName = "default",
) -> None:
    """Serve an OpenAI-compatible HTTP API for a server: /v1/completions, /v1/chat/completions, /v1/models,
    /health, /metrics (Prometheus) and /backend/monitor. It may start before the server (503 until ready)."""
    from .gateway import GatewayConfig, parse_http
    from .gateway import serve as serve_gateway

    with _errors():
        host, port = parse_http(http)
        serve_gateway(GatewayConfig(host=host, port=port, connect=connect, server_name=server_name, api_key=api_key,
                                    request_timeout=request_timeout, curve_server_key=curve_server_key,
                                    curve_secret=curve_secret, log_level=log_level,
                                    exit_with_parent=exit_with_parent))


def _start_gateway(http: str, server_name: str, api_key: str | None, log_level: str) -> subprocess.Popen[bytes]:
    """``mpserve gateway`` as a child process, in its own session: Ctrl-C reaches only the server, which
    drains its requests while the gateway keeps streaming them (and answers 503 to new ones); the gateway is
    stopped after that, or stops by itself if the server dies outright. The key travels in the environment,
    not in the command line that any user can read. A separate process: in the broker's it would compete
    with the broker loop for the GIL, and a fault in it could not touch the broker."""
    from .gateway import parse_http

    parse_http(http)  # refuse a bad value before anything starts
    env = {**os.environ, **({"MPSERVE_API_KEY": api_key} if api_key else {})}
    return subprocess.Popen([sys.executable, "-m", "mpserve", "gateway", "--http", http, "--server-name", server_name,
                             "--log-level", log_level, "--exit-with-parent"], env=env, start_new_session=True)


def _stop_gateway(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@app.command()
def status(
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Refresh until Ctrl-C.")] = False,
    interval: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 1.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print rows as JSON.")] = False,
    remote: Annotated[bool, typer.Option(
        "--remote/--no-remote", help="Also ask the broker for the instances of remote pools.")] = True,
    server_name: ServerName = "default",
) -> None:
    """Show the slot table of a running server (read from shared memory, no request needed), and the
    instances that remote pools registered with it."""
    with _errors():
        info = ServerInfo.read(server_name)
        if info is None or not info.alive():
            raise ConnectionFailed(f"no server named {server_name!r} is running; start one with `mpserve start`")
        table = SlotTable.attach(Path(info.slots), writable=False)
        try:
            while True:
                rows = table.read_all()
                pools = _remote_workers(info) if remote and info.role == "broker" else []
                if as_json:
                    print(json.dumps({"server": info.name, "pid": info.pid, "address": info.front,
                                      "slots": [_row_json(r) for r in rows], "remote": [vars(w) for w in pools]}))
                else:
                    if watch:
                        sys.stdout.write("\033[H\033[2J")
                    print(format_table(info, rows))
                    for w in pools:
                        print(f"remote  {w.worker}  host {w.host}  pid {w.pid}  {w.model}  "
                              f"{'cpu' if w.device < 0 else f'gpu{w.device}'}  running {w.running}/{w.capacity}")
                if not watch:
                    return
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
        finally:
            table.close()


@app.command()
def devices(
    gpus: GpusOption = None,
    simulate_gpus: SimulateOption = None,
    lock_dir: Annotated[str | None, typer.Option("--lock-dir", envvar="MPSERVE_LOCK_DIR")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print devices as JSON.")] = False,
) -> None:
    """List the GPUs found (NVML, nvidia-smi, or simulated) and who holds or waits for their permits."""
    from .devices import discover, format_memory
    from .permits import inspect

    with _errors():
        found = discover(cfg.build(server={"gpus": gpus}).gpus, simulate_gpus)
        rows = []
        for d in found:
            state = inspect(d.key, Path(lock_dir) if lock_dir else None)
            rows.append({"index": d.index, "name": d.name, "uuid": d.uuid, "memory_total": d.memory_total,
                         "memory_free": d.memory_free, "simulated": d.simulated,
                         "permit_capacity": state.capacity if state else None,
                         "holders": [h.pid for h in state.holders] if state else [],
                         "waiters": [w.pid for w in state.waiters] if state else []})
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


@app.command()
def plan(
    config_file: ConfigOption = None,
    model: Annotated[str | None, typer.Option("--model", "-m", envvar="MPSERVE_MODEL")] = None,
    instances: Annotated[int | None, typer.Option("--instances", "-n", envvar="MPSERVE_INSTANCES")] = None,
    gpus: GpusOption = None,
    simulate_gpus: SimulateOption = None,
    gpu_memory_budget: Annotated[str | None, typer.Option("--gpu-memory-budget", envvar="MPSERVE_GPU_MEMORY_BUDGET")]
    = None,
) -> None:
    """Print where each instance would run and check that it fits, without starting anything."""
    from .layout import build_layout
    from .placement import format_plan

    with _errors():
        config = cfg.build(cfg.load_file(config_file) if config_file else {},
                           server={"gpus": gpus, "simulate_gpus": simulate_gpus,
                                   "gpu_memory_budget": gpu_memory_budget},
                           model={"path": model, "instances": instances}, source=str(config_file or "command line"),
                           base_dir=config_file.parent if config_file else None)
        layout = build_layout(config)
        print(format_plan(layout.placements, layout.devices))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []})
def bench(ctx: typer.Context) -> None:
    """Run the benchmarks (`python -m bench`, from a checkout): every argument is passed on; see --help."""
    sys.path.insert(0, os.getcwd())
    try:
        from bench.cli import main as bench_main
    except ImportError:
        typer.echo("error: the benchmarks live in the source checkout's bench/ folder; run mpserve bench from "
                   "there (cd to the checkout), or python -m bench", err=True)
        raise typer.Exit(1) from None
    raise typer.Exit(bench_main(ctx.args))


@app.command("make-model")
def make_model(
    path: Annotated[Path, typer.Argument(help="Where to write the .gguf file.")],
    size: Annotated[str, typer.Option("--size", help="tiny (under 1 MB) or bench (about 85M parameters).")]
    = "tiny",
) -> None:
    """Write a deterministic random-weight llama GGUF (same arguments, same bytes)."""
    from .modelfile import write_model

    with _errors():
        out = write_model(path, size)
        typer.echo(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")


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


def _remote_workers(info: ServerInfo) -> list[WorkerStats]:
    """The broker's remote workers, or [] if it does not answer within a second."""
    from .client import Client

    try:
        with Client(info.front, connect_timeout=1.0) as client:
            return [w for w in client.stats(timeout=1.0).workers if w.host]
    except MpserveError:
        return []


def format_table(info: ServerInfo, rows: list[SlotRow]) -> str:
    now = time.time()
    head = ["SLOT", "WORKER", "PID", "STATE", "MODEL", "DEVICE", "REQUEST", "TOKENS", "IDLE/BUSY FOR",
            "LOAD", "SERVED"]
    lines = [head]
    for r in rows:
        alive = r.pid > 0 and pid_alive(r.pid)
        state = r.state.name.lower() if alive or r.state in (SlotState.DEAD, SlotState.FAILED) else "dead"
        lines.append([str(r.index), str(r.worker), str(r.pid or "-"), state, r.model,
                      "cpu" if r.device < 0 else f"gpu{r.device}", r.request or "-", str(r.tokens),
                      f"{now - r.progress:.1f}s" if r.progress else "-", f"{r.load_s:.2f}s", str(r.served)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    body = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines)
    return f"server {info.name!r} pid {info.pid} at {info.front}\n{body}"


def _row_json(r: SlotRow) -> dict[str, object]:
    d = dict(vars(r))
    d["state"] = r.state.name.lower()
    return d


class _errors:
    """Print an MpserveError as one line naming its code, and exit 1; no traceback for users."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> bool:
        if isinstance(exc, MpserveError):
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1)
        return False


def main() -> None:
    app()
