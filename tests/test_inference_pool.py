"""The inference gateway recipe (deploy/kubernetes/inference-gateway/) cannot drift, offline: its InferencePool
validates against the published CRD's schema (tests/data, with unknown fields refused as a strict apply does), its
Kubernetes objects against Kubernetes' schemas, the pool selects the servers' pods on their HTTP port and names the
picker's Service, the picker's metric flags name the metrics the gateway publishes, and the servers' command line
parses with this CLI."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_deploy import KUBERNETES_VERSIONS, parse

from mpserve.gateway.ops import picker_metrics

ROOT = Path(__file__).parent.parent
RECIPE = ROOT / "deploy" / "kubernetes" / "inference-gateway"
CRD = Path(__file__).parent / "data" / "inferencepool-crd-v1.3.1.yaml"
POOL_API = "inference.networking.k8s.io/v1"
FLAGS = {"--total-queued-requests-metric": picker_metrics.WAITING,
         "--total-running-requests-metric": picker_metrics.RUNNING,
         "--kv-cache-usage-percentage-metric": picker_metrics.KV_USAGE,
         "--lora-info-metric": picker_metrics.LORA_INFO,
         "--cache-info-metric": picker_metrics.CACHE_INFO}


def recipe() -> dict[tuple[str, str], dict[str, Any]]:
    """Every object of the recipe by (kind, name)."""
    return {(doc["kind"], doc["metadata"]["name"]): doc
            for path in sorted(RECIPE.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text())}


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """The CRD's schema with unknown fields refused: every object that lists its properties and says nothing of
    others gets ``additionalProperties: false`` (the API server prunes them, and a strict apply refuses them)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        stack.extend(v for v in node.get("properties", {}).values())
        stack.extend(v for key in ("items", "additionalProperties") if isinstance(v := node.get(key), dict))
    return schema


def pool_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if f"{crd['spec']['group']}/{v['name']}" == POOL_API]
    return strict(version["schema"]["openAPIV3Schema"])


def validate_pool(doc: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(pool_schema()).validate(doc)


@pytest.mark.timeout(60)
def test_the_pool_validates_against_the_published_crd_and_a_wrong_field_does_not() -> None:
    pool = recipe()[("InferencePool", "mpserve")]
    assert pool["apiVersion"] == POOL_API
    validate_pool(pool)
    for change in ({"targetPort": 8000}, {"targetPorts": []}, {"endpointPickerRef": {"port": {"number": 9002}}},
                   {"selector": {"matchLabels": {}}}):
        wrong = copy.deepcopy(pool)
        wrong["spec"].update(change)
        with pytest.raises(jsonschema.ValidationError):
            validate_pool(wrong)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_recipe_s_kubernetes_objects_validate(version: str) -> None:
    for (kind, name), doc in recipe().items():
        if kind == "InferencePool":
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{kind}/{name} on Kubernetes {version}: {exc.message} at {list(exc.path)}")


@pytest.mark.timeout(30)
def test_the_pool_selects_the_servers_and_names_the_picker_which_reads_mpserve_s_metrics() -> None:
    docs = recipe()
    pool = docs[("InferencePool", "mpserve")]["spec"]
    servers = docs[("DaemonSet", "mpserve-node")]["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= servers["metadata"]["labels"].items()
    (container,) = servers["spec"]["containers"]
    http = container["command"][container["command"].index("--http") + 1]
    assert [p["number"] for p in pool["targetPorts"]] == [int(http.rsplit(":", 1)[1])] == \
        [p["containerPort"] for p in container["ports"] if p["name"] == "http"]
    assert parse(container["command"]).command.name == "start"
    picker = pool["endpointPickerRef"]
    service = docs[("Service", picker["name"])]["spec"]
    assert picker["port"]["number"] in [p["port"] for p in service["ports"]]
    (epp,) = docs[("Deployment", picker["name"])]["spec"]["template"]["spec"]["containers"]
    args = epp["args"]
    assert args[args.index("--pool-name") + 1] == "mpserve"
    assert {flag: args[args.index(flag) + 1] for flag in FLAGS} == FLAGS
    assert docs[("RoleBinding", "mpserve-epp")]["subjects"][0]["name"] == \
        docs[("Deployment", picker["name"])]["spec"]["template"]["spec"]["serviceAccountName"]
