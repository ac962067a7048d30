"""The Node.js client (clients/node/, written from docs/protocol.md) against a real server: whole and streamed
generation equal to the Python client's greedy text, a caller's request id, a cancel, a bad request, an unknown
model, tokenize and detokenize, embeddings; its error classes are the protocol's error table."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ServerProcess
from helpers import wait_for

from mpserve import Client
from mpserve.errors import CODES

NODE_CLIENT = Path(__file__).parents[1] / "clients" / "node"


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        pytest.fail("Node.js is not installed: tests/run installs it (apt-get install nodejs npm) and the client's "
                    "packages (npm ci --prefix clients/node)")
    if not (NODE_CLIENT / "node_modules" / "zeromq").is_dir():
        pytest.fail("the Node.js client's packages are not installed: tests/run installs them "
                    "(npm ci --prefix clients/node)")
    return node


def run_script(script: str, address: str) -> dict[str, Any]:
    """What ``clients/node/test/SCRIPT`` saw against the server at ``address``: the JSON of its last line."""
    run = subprocess.run([_node(), f"test/{script}", address], cwd=NODE_CLIENT, capture_output=True, text=True,
                         timeout=100)
    assert run.returncode == 0, run.stderr
    seen: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return seen


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "models.yaml"
        config.write_text(yaml.safe_dump({"models": [
            {"name": "tiny", "path": "builtin:tiny", "instances": 2},
            {"name": "emb", "path": "builtin:tiny-embed", "embedding": True}]}))
        server = ServerProcess("--config", str(config)).wait_ready()
        yield server
        server.stop()


@pytest.mark.timeout(120)
def test_the_node_client_against_a_real_server(server: ServerProcess) -> None:
    seen = run_script("against_server.mjs", server.address)
    with Client(server.address) as python:
        expected = python.generate("The quick brown fox", model="tiny", max_tokens=24, temperature=0)
        expected_tokens = python.tokenize("The quick brown fox", model="tiny").tokens

    assert sorted(seen["models"]) == ["emb", "tiny"]
    assert seen["whole"]["text"] == expected.text and seen["whole"]["finishReason"] == "length"
    assert seen["whole"]["usage"] == {"promptTokens": expected.usage.prompt_tokens, "completionTokens": 24}
    assert len(seen["streamed"]["pieces"]) > 1 and "".join(seen["streamed"]["pieces"]) == expected.text
    assert seen["streamed"]["text"] == expected.text
    prefix, _, count = seen["whole"]["id"].partition(".")
    assert len(prefix) == 16 and seen["streamed"]["id"] == f"{prefix}.{int(count, 16) + 1:x}"
    assert seen["tracedId"] == "node-trace-1"

    assert seen["badRequest"] == {"name": "BadRequest", "code": "bad_request", "retryable": False,
                                  "message": seen["badRequest"]["message"], "isMpserveError": True,
                                  "isBadRequest": True, "isUnknownModel": False}
    assert "'max_tokens' must be between 1" in seen["badRequest"]["message"]
    assert seen["unknownModel"]["code"] == "unknown_model" and seen["unknownModel"]["isUnknownModel"]
    assert "served models: " in seen["unknownModel"]["message"]
    assert seen["cancelled"]["name"] == "Cancelled" and seen["cancelled"]["code"] == "cancelled"

    assert seen["tokens"] == expected_tokens and seen["detokenized"].strip() == "The quick brown fox"
    assert seen["embeddings"]["rows"] == 2 and seen["embeddings"]["dim"] == 64
    assert all(abs(n - 1.0) < 1e-4 for n in seen["embeddings"]["norms"])
    assert seen["embedRefused"]["code"] == "bad_request"
    # the cancel frees the slot: its instance hears of it after the script's calls were answered, in its next step
    wait_for(lambda: {s.state.name for s in server.slots() if s.model == "tiny"} <= {"IDLE", "READY"}, 10,
             "the cancelled stream's slot to be free")


@pytest.mark.timeout(30)
def test_the_node_error_classes_are_the_protocol_s_error_table() -> None:
    script = "import('./index.js').then(m => console.log(JSON.stringify(m.CODES)))"
    run = subprocess.run([_node(), "-e", script], cwd=NODE_CLIENT, capture_output=True, text=True, timeout=20)
    assert run.returncode == 0, run.stderr
    table = json.loads(run.stdout)
    assert {code: retryable for code, (_, retryable) in table.items()} == {
        code.value: info.retryable for code, info in CODES.items()}
