"""The Kubernetes manifests parse, validate against the API schemas, and keep the contracts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUSTOMIZATIONS = {"kustomization.yaml"}
# The oldest Kubernetes with native gRPC probes enabled by default (GA in 1.27).
OLDEST_VERSION = "1.27.0"


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _resources() -> dict[str, dict[str, Any]]:
    """kind -> resource (or kind/name where a kind repeats) from the base folder."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name in KUSTOMIZATIONS:
            continue
        for doc in _documents(path):
            key = (
                doc["kind"]
                if doc["kind"] not in found
                else f"{doc['kind']}/{doc['metadata']['name']}"
            )
            found[key] = doc
    return found


def _container() -> dict[str, Any]:
    return _resources()["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_every_yaml_file_parses() -> None:
    paths = sorted(DEPLOY.rglob("*.yaml"))
    assert len(paths) >= 8
    for path in paths:
        assert _documents(path), path


def test_kustomization_lists_every_manifest() -> None:
    listed = set(_documents(DEPLOY / "kustomization.yaml")[0]["resources"])
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - KUSTOMIZATIONS
    assert listed == on_disk


@pytest.mark.parametrize("version", [OLDEST_VERSION, "latest"])
def test_manifests_validate_against_kubernetes_schemas(version: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    target = kubernetes_validate.latest_version() if version == "latest" else version
    for key, resource in _resources().items():
        kubernetes_validate.validate(resource, target, strict=True)  # raises on any error
        assert key


def test_grpc_probes_gpu_request_and_drain() -> None:
    container = _container()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 50051, probe
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {p["containerPort"] for p in container["ports"]} == {50051, 9464}
    pod = _resources()["Deployment"]["spec"]["template"]["spec"]
    config = _resources()["ConfigMap"]["data"]
    pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain_s = float(config["RISKSERVE_SHUTDOWN_GRACE_S"])
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_settings_use_the_fixed_names() -> None:
    config = _resources()["ConfigMap"]["data"]
    assert config["RISKSERVE_PORT"] == "50051"
    assert config["RISKSERVE_METRICS_PORT"] == "9464"
    assert all(k.startswith(("RISKSERVE_", "OTEL_")) for k in config)


def test_headless_grpc_service_and_metrics_service() -> None:
    resources = _resources()
    services = {r["metadata"]["name"]: r for k, r in resources.items() if k.startswith("Service")}
    assert services["riskserve-grpc"]["spec"]["clusterIP"] == "None"
    assert services["riskserve-grpc"]["spec"]["ports"][0]["port"] == 50051
    assert services["riskserve-metrics"]["spec"]["ports"][0]["port"] == 9464
    assert resources["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2
    assert resources["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1


def test_cpu_overlay_patches_paths_that_exist() -> None:
    overlay = _documents(DEPLOY / "overlays" / "cpu" / "kustomization.yaml")[0]
    deployment = _resources()["Deployment"]
    for patch in overlay["patches"]:
        for op in yaml.safe_load(patch["patch"]):
            node: Any = deployment
            for part in op["path"].strip("/").split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                node = node[int(part)] if isinstance(node, list) else node[part]
