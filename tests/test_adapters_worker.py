"""LoRA adapters in a worker: its loop over a real link (an inproc broker socket) with the tiny model's engine,
loading, running and unloading adapters at runtime; and adapters loaded before a fork (a zygote's) serving in the
forked instance."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
import zmq
from engines import N_CTX, adapters_for

from mpserve.wire import protocol as wire
from mpserve.wire.slots import SlotTable
from mpserve.worker.loop import Worker
from mpserve.worker.main import build_engine
from mpserve.worker.spec import EngineSpec, WorkerSpec

PROMPT = "Once upon a time in the land of"


@pytest.fixture(scope="module")
def tiny(tiny_model_path: str) -> str:
    return tiny_model_path


@pytest.fixture(scope="module")
def lora(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return adapters_for(tiny, tmp_path_factory.mktemp("loras"), ("a0", "a1", "a2"))


def reference(tiny: str, adapter: str | None, max_tokens: int, scale: float = 1.0) -> str:
    lora = {"lora_path": adapter, "lora_scale": scale} if adapter else {}
    llm = llama_cpp.Llama(tiny, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False, **lora)
    try:
        return str(llm.create_completion(PROMPT, max_tokens=max_tokens, temperature=0.0)["choices"][0]["text"])
    finally:
        llm.close()


class Link:
    """The broker's end of one worker's link, and the worker's loop running in a thread."""

    def __init__(self, tmp_path: Path, tiny: str, adapters: dict[str, str]) -> None:
        self.ctx = zmq.Context()
        self.broker = self.ctx.socket(zmq.ROUTER)
        self.broker.bind("inproc://back")
        self.table = SlotTable.create(tmp_path / "slots", rows=2)
        engine = EngineSpec(tiny, n_ctx=N_CTX, threads=1, n_gpu_layers=0, parallel=2, reuse="exact",
                            adapters=adapters)
        self.spec = WorkerSpec(index=0, model="tiny", engine=engine, device=-1, backend="inproc://back",
                               slots_path=str(tmp_path / "slots"), parent_pid=os.getpid())
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.spec.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.spec.backend)
        self.worker = Worker(self.spec, sock, [self.table.writer(i) for i in self.spec.rows], build_engine)
        self.worker.load()
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def send(self, msg: Any) -> None:
        frames = wire.encode_assigns([wire.pack(msg)]) if isinstance(msg, wire.Assign) else wire.encode(msg)
        self.broker.send_multipart([self.spec.identity, *frames])

    def answers(self) -> Iterator[tuple[str, Any]]:
        """(ticket, message) of what the worker sends, heartbeats left out."""
        while self.broker.poll(30_000):
            frames = self.broker.recv_multipart()[1:]
            mtype = wire.parse_header(frames, len(frames))
            if mtype is wire.MsgType.STEP:
                for t, ticket, body, _ in wire.step_entries(frames[3]):
                    yield ticket, wire.decode_body(t, body)
            elif mtype is not wire.MsgType.HEARTBEAT:
                yield frames[2].decode(), wire.decode_body(mtype, frames[3])
        raise AssertionError("the worker went silent")

    def answer(self, ticket: str) -> Any:
        return next(msg for t, msg in self.answers() if t == ticket and not isinstance(msg, wire.Chunk))

    def close(self) -> None:
        self.send(wire.Stop("done"))
        self.thread.join(30)
        self.table.unlink()
        self.table.close()
        self.ctx.destroy(linger=0)


@pytest.mark.timeout(60)
def test_a_worker_loads_runs_and_unloads_adapters_over_its_link(tiny: str, lora: dict[str, str],
                                                                tmp_path: Path) -> None:
    link = Link(tmp_path, tiny, {"a0": lora["a0"]})
    try:
        ready = next(msg for _, msg in link.answers() if isinstance(msg, wire.Ready))
        assert ready.adapters == ("a0",)
        link.send(wire.AdapterAction("x1", "load", "a1", path=lora["a1"], ticket="k1"))
        loaded = link.answer("k1")
        assert (loaded.id, loaded.worker, loaded.op, loaded.adapters) == ("x1", "w0", "load", ("a0", "a1"))
        link.send(wire.AdapterAction("x2", "load", "bad", path=tiny, ticket="k2"))
        refused = link.answer("k2")
        assert refused.code == "bad_request" and "is a model GGUF, not a LoRA adapter" in refused.message

        greedy = wire.GenerateParams(max_tokens=24, temperature=0.0)
        link.send(wire.Assign("t1", wire.Request("r1", PROMPT, params=greedy, adapters=(("a1", 1.0),)), 0.0, 1))
        assert link.answer("t1").text == reference(tiny, lora["a1"], 24)
        assert link.table.read(0).adapters == "a1"
        link.send(wire.Assign("t2", wire.Request("r2", PROMPT, params=greedy, adapters=(("zz", 1.0),)), 0.0, 1))
        unknown = link.answer("t2")
        assert unknown.code == "unknown_model" and "adapters served: a0, a1" in unknown.message

        long = wire.GenerateParams(max_tokens=400, temperature=0.0)  # the tiny model never ends a text itself
        link.send(wire.Assign("t3", wire.Request("r3", PROMPT, params=long, adapters=(("a1", 0.5),)), 0.0, 1))
        link.send(wire.AdapterAction("x5", "load", "a2", path=lora["a2"], ticket="k5"))  # while t3 runs
        assert link.answer("k5").adapters == ("a0", "a1", "a2")
        link.send(wire.AdapterAction("x3", "unload", "a1", ticket="k3"))
        busy = link.answer("k3")
        assert busy.code == "bad_request" and "in use by 1 running request" in busy.message
        assert link.answer("t3").text == reference(tiny, lora["a1"], 400, 0.5)
        link.send(wire.AdapterAction("x4", "unload", "a1", ticket="k4"))
        assert link.answer("k4").adapters == ("a0", "a2")
        link.send(wire.Assign("t4", wire.Request("r4", PROMPT, params=greedy, adapters=(("a0", 1.0),)), 0.0, 1))
        assert link.answer("t4").text == reference(tiny, lora["a0"], 24)
    finally:
        link.close()


FORKED = """
import os, sys
import llama_cpp
from mpserve.engine.adapters import preload
from mpserve.engine.batch import BatchEngine
from mpserve.engine.model_info import load_model
from mpserve.engine.settings import EngineSettings
from mpserve.wire.protocol import GenerateParams

tiny, adapter, prompt = sys.argv[1:4]
llama_cpp.llama_backend_init()
model = load_model(llama_cpp, tiny, 0, True)
loaded = preload(llama_cpp, model, tiny, {"a0": adapter})
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # the instance: its engine takes the model and the adapter loaded before the fork
    engine = BatchEngine(EngineSettings(tiny, n_ctx=1024, parallel=2, threads=1, n_gpu_layers=0, flash_attn="on",
                                        reuse="exact", adapters=(("a0", adapter),)), model, loaded)
    engine.admit(0, prompt, GenerateParams(max_tokens=24, temperature=0.0), lambda t, n: True, adapters=(("a0", 1.0),))
    text = ""
    while engine.active:
        text += "".join(c.text for _, c in engine.step())
    os.write(write, text.encode())
    os._exit(0)
os.close(write)
_, status = os.waitpid(pid, 0)
print(os.read(read, 1 << 16).decode(), end="")
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.timeout(60)
def test_an_adapter_loaded_before_the_fork_serves_in_the_forked_instance(tiny: str, lora: dict[str, str]) -> None:
    """As a zygote does it: the model and its adapter loaded, then the fork; the child's engine applies the
    parent's adapter (its tensors shared copy-on-write) and gives llama.cpp's text."""
    done = subprocess.run([sys.executable, "-c", FORKED, tiny, lora["a0"], PROMPT], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == reference(tiny, lora["a0"], 24)
