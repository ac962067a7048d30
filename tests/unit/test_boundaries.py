"""The process boundaries, checked at run time: each process's entry module, imported in a fresh
interpreter, loads nothing it must not (the import-linter contracts in pyproject.toml check the static
imports; this checks what really gets loaded, lazy imports included)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("entry, forbidden", [
    ("mpserve.server.loop", ["llama_cpp", "mpserve.engine", "mpserve.worker.main"]),
    ("mpserve.server.pool", ["llama_cpp", "mpserve.engine", "mpserve.worker.main"]),
    ("mpserve.gateway.app", ["llama_cpp", "mpserve.engine", "mpserve.server", "mpserve.worker"]),
    ("mpserve.cli", ["llama_cpp", "mpserve.engine"]),
    ("mpserve.engine.batch", ["zmq", "mpserve.server", "mpserve.gateway"]),
    # each start forks its workers from a process that loaded these; Redis's client only where a remote tier is set
    ("mpserve.worker.main", ["redis", "mpserve.gateway"]),
    # what `start` reads --http with: the HTTP app is the gateway processes' own
    ("mpserve.gateway.fleet", ["mpserve.gateway.app", "starlette", "uvicorn", "pydantic"]),
])
def test_a_process_entry_loads_nothing_across_its_boundary(entry: str, forbidden: list[str]) -> None:
    code = f"import json, sys, {entry}; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       timeout=60).stdout)
    crossing = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert crossing == [], f"{entry} loads {crossing}"


@pytest.mark.parametrize("entry", ["mpserve.server.loop", "mpserve.gateway.app", "mpserve.cli",
                                   "mpserve.models.gguf_header"])
def test_the_server_gateway_and_cli_start_without_numpy_and_gguf(entry: str) -> None:
    """Only writing a model (a built-in one, an adapter, a projector) needs them; importing them costs every start a
    good part of its time, and a start reads GGUF headers (its estimate, the chat template) with a reader of its own
    (mpserve.models.builtin imports them late)."""
    code = f"import sys, {entry}; print(sorted(m for m in ('numpy', 'gguf') if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout
    assert loaded.strip() == "[]", f"{entry} loads {loaded.strip()}"


def test_the_package_never_reaches_into_a_checkout() -> None:
    """The benchmarks are a checkout's scripts (``python -m bench``): no module of mpserve imports them, nor edits
    sys.path to find them."""
    package = Path(__file__).resolve().parents[2] / "mpserve"
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "bench"]
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys"):
                found.append(f"{path.name}:{node.lineno} uses sys.path")
    assert found == []
