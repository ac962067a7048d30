"""Deployment files cannot drift: every Kubernetes manifest validates against the Kubernetes schemas (offline,
kubernetes-validate), every `mpserve ...` command line in the manifests, Dockerfiles and systemd units parses
with this CLI, file and key paths sit on mounted volumes; and the topology they describe (a broker with no
instance, a pool dialing it over TCP with CURVE keys, the gateway a CURVE client) runs and becomes healthy."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import kubernetes_validate
import pytest
import typer
import typer.main
import yaml
import zmq.auth
from conftest import _die_with_parent
from helpers import free_port, mpserve

from mpserve.cli import app

ROOT = Path(__file__).parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile*"))
UNITS = sorted((ROOT / "examples" / "systemd").glob("*.service"))
KUBERNETES_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
# what a command line that does not parse raises: click's errors, which recent typer releases vendor
PARSE_ERRORS: tuple[type[Exception], ...] = (click.ClickException, *([typer.TyperException]
                                                                       if hasattr(typer, "TyperException") else []))


def documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            yield f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc


def pod_specs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [doc["spec"]["template"]["spec"]] if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet") else []


def dockerfile_command(path: Path) -> list[str]:
    """ENTRYPOINT followed by CMD, both in exec (JSON) form."""
    text = path.read_text()
    parts = {k: json.loads(v) for k, v in re.findall(r"^(ENTRYPOINT|CMD) (\[.*\])$", text, re.MULTILINE)}
    return parts["ENTRYPOINT"] + parts.get("CMD", [])


def command_lines() -> Iterator[tuple[str, list[str]]]:
    """Every mpserve command line in the deployment files, with where it comes from."""
    image_entrypoint = dockerfile_command(ROOT / "deploy" / "docker" / "Dockerfile")[:2]
    for where, doc in documents():
        for spec in pod_specs(doc):
            for container in spec.get("initContainers", []) + spec["containers"]:
                argv = container.get("command", image_entrypoint) + container.get("args", [])
                yield f"{where}:{container['name']}", argv
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    if "exec" in container.get(probe, {}):
                        yield f"{where}:{container['name']}:{probe}", container[probe]["exec"]["command"]
    for path in DOCKERFILES:
        yield path.name, dockerfile_command(path)
    for path in UNITS:
        for line in re.findall(r"^ExecStart\w*=(.+)$", path.read_text(), re.MULTILINE):
            yield path.name, shlex.split(line)


def parse(argv: list[str]) -> Any:
    """Parse a command line with the installed CLI, running nothing; click errors on what does not parse."""
    assert Path(argv[0]).name == "mpserve", argv
    group = typer.main.get_command(app)
    parent = group.make_context("mpserve", [], resilient_parsing=True)  # the group alone would print its help
    command = group.get_command(parent, argv[1])
    assert command is not None, f"no command {argv[1]!r}"
    return command.make_context(argv[1], list(argv[2:]), parent=parent)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_against_the_kubernetes_schemas(version: str) -> None:
    kinds = []
    for where, doc in documents():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} on Kubernetes {version}: {exc.message} at {list(exc.path)}")
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["DaemonSet", "Deployment", "Service", "Service"]


@pytest.mark.timeout(30)
def test_the_validation_refuses_an_unknown_field() -> None:
    _, doc = next(documents())
    pod_specs(doc)[0]["containers"][0]["comand"] = ["mpserve"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.timeout(30)
def test_every_mpserve_command_line_parses_with_the_cli() -> None:
    found = list(command_lines())
    sources = {where.split(":")[0] for where, _ in found}
    assert sources == {p.name for p in MANIFESTS + DOCKERFILES + UNITS}, "a file without an mpserve command line"
    for where, argv in found:
        try:
            ctx = parse(argv)
        except PARSE_ERRORS as exc:
            pytest.fail(f"{where}: {shlex.join(argv)}: {exc}")
        assert ctx.command.name == argv[1]
    with pytest.raises(PARSE_ERRORS, match="--instnces"):
        parse(["mpserve", "start", "--instnces", "2"])  # the check can fail
    with pytest.raises(PARSE_ERRORS):  # a value of the wrong type
        parse(["mpserve", "worker", "--instances", "two"])


@pytest.mark.timeout(30)
def test_paths_given_to_containers_are_on_their_volumes_and_probes_on_their_ports() -> None:
    for where, doc in documents():
        for spec in pod_specs(doc):
            volumes = {v["name"]: v for v in spec["volumes"]}
            for container in spec["containers"]:
                mounts = container["volumeMounts"]
                assert {m["name"] for m in mounts} <= set(volumes), where
                argv = container["command"] + [e["value"] for e in container.get("env", []) if "value" in e]
                for path in [a for a in argv if a.startswith(("/keys/", "/models/"))]:
                    mount = next((m for m in mounts if f"{path}/".startswith(m["mountPath"] + "/")), None)
                    assert mount is not None, f"{where}: {path} is on no volume"
                    file = path[len(mount["mountPath"]) + 1:]  # "": the folder itself
                    items = volumes[mount["name"]].get("secret", {}).get("items")
                    assert not file or items is None or file in {i["path"] for i in items}, \
                        f"{where}: {path} is not among the secret's items"
                ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
                if "--http" in argv:
                    assert argv[argv.index("--http") + 1].endswith(f":{ports['http']}"), where
                    http = container["readinessProbe"]["httpGet"]
                    assert http["path"] == "/health" and http["port"] == "http", where


@pytest.mark.timeout(30)
def test_images_run_mpserve_start_as_a_non_root_user_and_check_health() -> None:
    for path in DOCKERFILES:
        text = path.read_text()
        argv = dockerfile_command(path)
        assert argv[:2] == ["mpserve", "start"], path.name
        port = argv[argv.index("--http") + 1].rsplit(":", 1)[1]
        assert f"http://127.0.0.1:{port}/health" in re.search(r"^HEALTHCHECK .*\n.*$", text, re.MULTILINE)[0]
        users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
        assert users and users[-1].split(":")[0] not in ("0", "root"), path.name



def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except urllib.error.URLError:
        return 0


@pytest.mark.timeout(120)
def test_a_broker_without_instances_is_healthy_once_a_curve_pool_registers(start_server, tmp_path: Path) -> None:
    """server.yaml and pool.yaml on one host: keys as their Secrets hold them, /health as the readiness probe."""
    keys = {name: tmp_path / name for name in ("server", "clients", "workers")}
    for name, folder in keys.items():
        folder.mkdir()
        zmq.auth.create_certificates(str(folder), {"server": "server", "clients": "gateway", "workers": "pool"}[name])
    http, workers = free_port(), free_port()
    env = {"MPSERVE_CURVE_SERVER_KEY": str(keys["server"] / "server.key"),
           "MPSERVE_CURVE_CLIENT_SECRET": str(keys["clients"] / "gateway.key_secret")}
    server = start_server("--model", "echo", "--name", "tiny", "--instances", "0", "--http", f"127.0.0.1:{http}",
                          "--workers-bind", f"tcp://127.0.0.1:{workers}",
                          "--curve-secret", str(keys["server"] / "server.key_secret"),
                          "--curve-clients", str(keys["clients"]), "--curve-workers", str(keys["workers"]),
                          env=env).wait_ready()
    deadline = time.monotonic() + 30
    while health(http) == 0:  # the gateway is starting
        assert time.monotonic() < deadline, "the gateway never answered"
        time.sleep(0.1)
    assert health(http) == 503  # not ready: no instance anywhere
    pool = subprocess.Popen(
        [sys.executable, "-m", "mpserve", "worker", "--connect", f"tcp://127.0.0.1:{workers}", "--name", "tiny",
         "--instances", "1", "--server-name", f"pool{os.getpid()}", "--curve-server-key",
         str(keys["server"] / "server.key"), "--curve-secret", str(keys["workers"] / "pool.key_secret")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    try:
        deadline = time.monotonic() + 60
        while health(http) != 200:
            assert pool.poll() is None, "the pool exited"
            assert time.monotonic() < deadline, "the broker never became healthy"
            time.sleep(0.2)
        body = json.dumps({"model": "tiny", "prompt": "Once", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 4
        status = mpserve("status", "--json", "--server-name", server.name, timeout=30, env=env)
        assert [w["model"] for w in json.loads(status.stdout)["remote"]] == ["tiny"], status.stderr
    finally:
        pool.terminate()
        pool.wait(30)
