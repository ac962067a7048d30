"""The server's log says a thing once, where it is news (issue 58): a LoRA adapter loaded in a process adds no line
per tensor from llama.cpp, an operator's adapter call refused by every instance is one WARNING (not an ERROR per
instance: the operator is told), and a broker of no local instance (``--instances 0``, remote pools serve it)
logs no skipped scale-up for its queue."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import RealModel, ServerProcess
from engines import adapters_for
from helpers import wait_for

from mpserve import Client
from mpserve.errors import MpserveError


def lines(server: ServerProcess, words: str) -> list[str]:
    return [line for line in server.log if words in line]


@pytest.mark.real
@pytest.mark.timeout(180)
def test_adapters_loaded_in_each_instance_add_no_llama_cpp_line_per_tensor(start_server: type[ServerProcess],
                                                                            real_model: RealModel,
                                                                            tmp_path: Path) -> None:
    """A quantized model's weights are repacked where the CPU has the kernels; an adapter's tensors are not, and
    llama.cpp said so for each of them in each process that loaded it (the zygote, each instance for a load at run
    time)."""
    files = adapters_for(real_model.path, tmp_path, ("a0", "a1"))
    server = start_server("--model", real_model.path, "--instances", "2", "--threads", "1",
                          "--lora", f"a0={files['a0']}").wait_ready()
    with Client(server.admin) as admin:
        admin.adapter("load", None, "a1", files["a1"])  # the one model served
    server.stop()
    assert lines(server, "cannot use buft") == []


@pytest.mark.timeout(120)
def test_an_adapter_call_every_instance_refuses_is_logged_once_as_a_warning(start_server: type[ServerProcess],
                                                                             tmp_path: Path) -> None:
    server = start_server("--model", "builtin:tiny", "--instances", "3", "--threads", "1").wait_ready()
    with Client(server.admin) as admin:
        for name in ("first", "second"):  # the second's lines, once read, come after all of the first's
            with pytest.raises(MpserveError):
                admin.adapter("load", "tiny", name, str(tmp_path / f"{name}-missing.gguf"))
    wait_for(lambda: lines(server, "second-missing"), what="the second refusal's line")
    first = lines(server, "first-missing")
    assert len(first) == 1 and " WARNING " in first[0], "\n".join(first)


@pytest.mark.timeout(120)
def test_a_broker_of_no_local_instance_logs_no_skipped_scale_up(start_server: type[ServerProcess]) -> None:
    server = start_server("--model", "builtin:tiny", "--instances", "0").wait_ready()
    with Client(server.address) as client:
        with pytest.raises(MpserveError):
            client.generate("hello", max_tokens=2, timeout=1.0)
    server.stop()
    assert lines(server, "scale-up") == []
