"""What a worker process is started with, and how it is started: the one part of ``mpserve.worker`` the
server imports.

    server (layout) --WorkerSpec--> supervisor --forkserver(run, spec)--> forked from the fork server,
                                                                          which imported preload(gpus)
                                               --forkserver(zygote_run, engine, pipe)--> a model's zygote
                                               --spec over the pipe--> forked from the zygote, which loaded
                                                                       the model (``mpserve.worker.zygote``)
                                               (the next start adopts a zygote whose server died: ``Adoptable``)

``start_mode`` says which of the two starts a model's instances get: a zygote for a model that keeps its
weights on the CPU for the instance's whole life, the fork server otherwise.

``run`` names the worker's entry module instead of importing it: the worker's code is loaded in the fork
server (a fresh interpreter the supervisor starts once), never in the server. ``preload`` is what the fork
server imports before it forks workers, so that their pages of imported code are shared: the worker's
modules always, and the engines (llama_cpp) only on a host without GPUs. Where a worker may use a GPU,
llama_cpp is imported in each worker after it sets CUDA_VISIBLE_DEVICES, as the CUDA runtime wants it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import socket
import struct
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

from mpserve.config.reasoning import Reasoning
from mpserve.config.remote_tier import RemoteTier
from mpserve.config.speculative import Speculative

WORKER_MAIN = "mpserve.worker.main"
ZYGOTE_MAIN = "mpserve.worker.zygote"
ENGINE_MODULES = ("mpserve.engine.batch", "mpserve.engine.embed")  # these import llama_cpp
EXIT_LOAD_FAILED = 3  # the worker's exit status when its model cannot be loaded


@dataclass(frozen=True)
class EngineSpec:
    """What a worker needs to build its engine. ``path`` "echo" selects the echo backend."""

    path: str
    n_ctx: int  # per sequence
    threads: int
    n_gpu_layers: int
    seed: int = 0
    parallel: int = 1  # sequences the engine decodes together
    flash_attn: str = "auto"  # auto, on or off
    repack: bool = True  # llama.cpp's extra (repacked) weight buffer types
    echo_tick_s: float = 0.0  # the echo backend's time per step (0: at once)
    embedding: bool = False  # an embedding model (mpserve.engine.embed)
    pooling: str | None = None  # its pooling; None: the GGUF's
    speculative: Speculative | None = None  # speculative decoding; None: off
    reasoning: Reasoning = Reasoning()  # thinking budgets and close message (mpserve.engine.thinking)
    cache_type_k: str = "f16"  # KV cache types (mpserve.config.kv_types)
    cache_type_v: str = "f16"
    cache_ram: int = 0  # bytes of the host store's RAM tier (for the whole host); 0: no store
    cache_shm: str | None = None  # the RAM tier's folder (a tmpfs)
    cache_disk: str | None = None  # the disk tier's folder; None: none
    cache_disk_size: int = 0  # its bytes
    cache_remote: RemoteTier | None = None  # the remote tier shared by hosts (Redis, Valkey); None: none
    chat_template: str | None = None  # Jinja2 served instead of the GGUF's ("": the ChatML default); None: the GGUF's
    reuse: str = "any"  # any shared prefix, or exact: whole prompt chunks only (mpserve.engine.batch)
    adapters: dict[str, str] = field(default_factory=dict)  # LoRA adapters: name -> local GGUF path, loaded after
    # the model (by a zygote before it forks, so that its instances share them: mpserve.engine.adapters)
    mmproj: str | None = None  # the model's image projector GGUF, loaded with the model (by a zygote: shared)

    @property
    def is_echo(self) -> bool:
        return self.path == "echo"

    def digest(self) -> str:
        """A short digest of every field: a server tells an instance it adopted that runs other settings than it
        would start it with (READY's ``engine``) from one that runs the same."""
        text = json.dumps(asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def weights(self) -> dict[str, object]:
        """What a zygote loaded for this engine (``WEIGHT_FIELDS``): an instance of another engine with the same
        weights may be forked from it (another context size, batch, KV types or draft model)."""
        return weights_of(asdict(self))


WEIGHT_FIELDS = ("path", "n_gpu_layers", "repack", "adapters", "mmproj")
"""The EngineSpec fields a zygote's weights depend on: the file, the layers offloaded, the repacked layouts, the
LoRA adapters applied onto them and the image projector beside them."""


def weights_of(engine: dict[str, object]) -> dict[str, object]:
    """``WEIGHT_FIELDS`` of an EngineSpec given as a dict (as a zygote tells an adopting server its own)."""
    return {key: engine.get(key) for key in WEIGHT_FIELDS}


@dataclass(frozen=True)
class PermitSpec:
    """The GPU permit a worker holds while it computes: host-wide, ``capacity`` holders at once."""

    device_key: str
    capacity: int
    lock_dir: str | None = None
    hold_log: str | None = None  # append each hold interval here


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    model: str
    engine: EngineSpec
    device: int  # -1: CPU
    backend: str  # the broker's worker-socket address
    slots_path: str
    parent_pid: int
    idle_timeout: float = 0.0  # unload after this long without a request; 0: never
    lazy: bool = False  # start without loading the model (single active backend: the broker decides)
    permit: PermitSpec | None = None
    pool: str = ""  # a remote pool's name ("host-pid"); "" for the broker's own workers
    curve_server_key: str | None = None  # remote pools: the broker's public key file ...
    curve_secret: str | None = None  # ... and this pool's secret key file
    heartbeat_interval: float = 1.0
    heartbeat_liveness: int = 5
    first_row: int = 0  # its slot-table rows: first_row .. first_row + engine.parallel - 1
    log_level: str = "info"
    stream_interval: float = 0.0  # seconds between a streamed request's CHUNKs after its first; 0: every token
    slot_save_path: str | None = None  # the folder of KV files; None: slot save and restore are off
    adapter_dir: str | None = None  # the folder adapters loaded at runtime must be in (``adapter_actions.folders``)
    proof: str = ""  # the broker's per-start secret its own workers show in READY (mpserve.server.link)
    adopt_wait: float = 0.0  # its server died: how long it holds its requests, parked, for a new server to adopt it
    # (``mpserve.server.adoption``); 0: it leaves at once
    kv_events: str = ""  # where it publishes its KV events (``mpserve.worker.kv_publisher``); "": it does not

    @property
    def rows(self) -> range:
        return range(self.first_row, self.first_row + self.engine.parallel)

    @property
    def identity(self) -> bytes:
        return f"{self.pool}-w{self.index}".encode() if self.pool else f"w{self.index}".encode()

    @property
    def host(self) -> str:
        return self.pool.rsplit("-", 1)[0] if self.pool else ""


def preload(gpus: bool) -> list[str]:
    """The modules the fork server imports before it forks workers; ``gpus``: a worker may use a GPU."""
    return [WORKER_MAIN] if gpus else [WORKER_MAIN, *ENGINE_MODULES]


def run(spec: WorkerSpec) -> None:
    """The worker process's entry point (multiprocessing pickles this function by name)."""
    importlib.import_module(WORKER_MAIN).worker_main(spec)


@dataclass(frozen=True)
class Adoptable:
    """How a zygote whose server died waits for the next start of it (``mpserve.worker.zygote``): listening at
    ``path`` (a socket in the runtime folder) for ``wait`` seconds for a server of this user's that proves it
    knows ``secret`` (its server's link secret), as the server proves it knows the zygote's."""

    path: str
    secret: str
    wait: float

    @property
    def spare_path(self) -> str:
        """Where the zygote's spare waits (``mpserve.worker.zygote``)."""
        return spare_path(self.path)


def spare_path(path: str) -> str:
    """Where the spare of the zygote waiting at ``path`` waits."""
    return path.removesuffix(".sock") + ".spare.sock"


CHALLENGE_TIMEOUT_S = 5.0  # either side of an adoption refuses a peer that has not proven itself by then


def time_limit(sock: socket.socket, seconds: float) -> None:
    """Each read and write on ``sock``'s descriptor fails (EAGAIN) after ``seconds`` without progress (0: never):
    the adoption's challenge runs on the descriptor itself (``multiprocessing.connection``), which a socket's own
    timeout does not reach, so neither side waits for ever on a peer that went quiet in the middle of it."""
    limit = struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000))
    for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, option, limit)


def revision() -> str:
    """The code a zygote forks instances of: mpserve's version and its worker link's revision (a zygote adopted by a
    start of other code would fork instances of its own)."""
    from mpserve import __version__
    from mpserve.wire.messages import WORKER_LINK

    return f"{__version__} {WORKER_LINK}"


def zygote_run(engine: EngineSpec, model: str, conn: Connection, log_level: str,
               adoptable: Adoptable | None = None) -> None:
    """A zygote's entry point: load ``engine``'s model, then fork an instance for each WorkerSpec ``conn``
    brings (``mpserve.worker.zygote``)."""
    importlib.import_module(ZYGOTE_MAIN).zygote_main(engine, model, conn, log_level, adoptable)


@dataclass(frozen=True)
class StartMode:
    """How a model's instances start: ``zygote`` (forked from a process holding the model's weights) or not
    (forked from the fork server, each loads the model itself), and why."""

    zygote: bool
    why: str

    def __str__(self) -> str:
        return f"{'zygote' if self.zygote else 'fork server'} ({self.why})"


def start_mode(spec: WorkerSpec, start_method: str) -> StartMode:
    """The start ``spec``'s instances get under the ``start_method`` setting (fork or spawn)."""
    engine = spec.engine
    if start_method == "spawn":
        return StartMode(False, "start_method: spawn; each instance loads the model")
    if engine.is_echo:
        return StartMode(False, "the echo backend has no weights to share")
    if spec.device >= 0 or engine.n_gpu_layers != 0:
        return StartMode(False, "GPU layers: CUDA cannot be used across a fork, so the fork server holds only "
                                "modules and each instance loads and offloads the model after setting its device")
    if spec.lazy:
        return StartMode(False, "single active backend: instances load and unload the model as the broker asks, "
                                "which weights held by a zygote would defeat")
    if spec.idle_timeout:
        return StartMode(False, "idle_timeout: an idle instance unloads the model, which weights held by a zygote "
                                "would defeat")
    return StartMode(True, "the model is loaded once and its instances share its weights copy-on-write")
