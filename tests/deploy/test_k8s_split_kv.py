"""The split overlay hands hybrid mode's KV over TCP: decode_fpga binds its KV port to the Pod's IP (from
the downward API), declares the port, its settings accept what the manifest sets, and the network
policy lets prefill_gpu Pods, and only them, reach it. Rendered offline with `kubectl kustomize`."""
from __future__ import annotations

import pytest

from services.decode_fpga.settings import DecodeSettings
from tests.deploy import k8s
from tests.deploy.test_k8s_manifests import admits, kubectl, pod_labels  # noqa: F401  (kubectl: a fixture)


@pytest.fixture(scope="module")
def split(kubectl):  # noqa: F811
    return k8s.render(kubectl, k8s.K8S / "overlays" / "split")


def decode_container(objects):
    ((workload, container),) = k8s.container_running(objects, "decode-fpga")
    return workload, container


def test_decode_listens_for_kv_on_its_pod_ip_on_a_declared_port(split):
    _, decode = decode_container(split)
    env = decode["env"]
    names = [e["name"] for e in env]
    by_name = {e["name"]: e for e in env}
    assert by_name["HYBRIDSERVE_DECODE_KV_TRANSPORT"]["value"] == "tcp"
    assert by_name["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    listen = by_name["HYBRIDSERVE_DECODE_KV_LISTEN"]["value"]
    host, port = listen.rsplit(":", 1)
    assert host == "$(POD_IP)" and names.index("POD_IP") < names.index("HYBRIDSERVE_DECODE_KV_LISTEN")
    assert {"name": "decode-kv", "containerPort": int(port)} in decode["ports"]
    assert "HYBRIDSERVE_DECODE_KV_ADVERTISE" not in by_name  # the bound Pod IP is what prefill_gpu is told
    # what the Pod's environment becomes once Kubernetes put its IP in
    pod_env = {e["name"]: e["value"].replace("$(POD_IP)", "10.42.0.7") for e in env
               if e["name"].startswith("HYBRIDSERVE_DECODE_KV_")}
    settings = DecodeSettings.from_environ(pod_env)
    assert (settings.kv_transport, settings.kv_listen) == ("tcp", f"10.42.0.7:{port}")


def test_only_prefill_pods_reach_decodes_kv_port(split):
    (policy,) = [o for o in split if o["kind"] == "NetworkPolicy"]
    decode, _ = decode_container(split)
    ((prefill, _),) = k8s.container_running(split, "prefill-gpu")
    gateway = k8s.named(split, "Deployment", "hybridserve-gateway")
    assert k8s.selects(policy["spec"]["podSelector"], pod_labels(decode))
    assert admits(policy, pod_labels(prefill), "decode-kv")
    assert not admits(policy, pod_labels(gateway), "decode-kv")
    assert not admits(policy, {"app": "anything-else"}, "decode-kv")
