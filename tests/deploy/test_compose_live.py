"""The compose stack for real: build the images, bring them up, serve every mode, heal a killed engine.

Long (minutes even with a warm build cache) and it needs root for Docker, so it runs only under
`make test-compose` (HYBRIDSERVE_TEST_COMPOSE=1), never in `make test`. What it needs it sets up:
Debian's docker.io, docker-compose and debootstrap when missing, dockerd when not running (stopped
again afterwards), a Debian bookworm base image made with debootstrap (no registry is reachable here;
reused when present), deploy/local/ filled from the host (pip's find-links wheels, the CA bundle) and
Grafana's admin password. Only the three hybridserve services start: Prometheus' and Grafana's images
come from a registry. Every step prints how long it took.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "hybridserve-test"
BASE_IMAGE = "hybridserve-base:bookworm"
SERVICES = ("prefill-gpu", "decode-fpga", "gateway")
MODES = ("gpu", "fpga", "hybrid", "auto")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# bounds, not expectations: a cold start on two busy cores loads the model and builds OpenCL kernels
UP_TIMEOUT_S = 1500
HEAL_TIMEOUT_S = 900

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(os.environ.get("HYBRIDSERVE_TEST_COMPOSE") != "1",
                       reason="the live compose test runs under `make test-compose` (HYBRIDSERVE_TEST_COMPOSE=1)"),
]


def _step(what: str, started: float) -> None:
    print(f"[compose] {what}: {time.monotonic() - started:.0f} s", flush=True)


def _run(*cmd: str, timeout: float = 600, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def _install_tools() -> None:
    packages = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}
    missing = [tool for tool in packages if shutil.which(tool) is None]
    if not missing:
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *(packages[m] for m in missing)]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        if out.returncode != 0:
            pytest.skip(f"cannot install {missing}: {out.stderr.strip()[-300:]}")


def _docker_works() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def _start_dockerd(log: Path) -> subprocess.Popen | None:
    """None when dockerd already runs; else the one started here (skips when it will not come up)."""
    if _docker_works():
        return None
    proc = subprocess.Popen(["dockerd"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.skip(f"dockerd exited {proc.returncode}; its log: {log.read_text()[-500:]}")
        if _docker_works():
            return proc
        time.sleep(2)
    proc.terminate()
    pytest.skip(f"dockerd did not answer within 90 s; its log: {log.read_text()[-500:]}")


def _base_image() -> None:
    if subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True).returncode == 0:
        print(f"[compose] base image {BASE_IMAGE}: reused", flush=True)
        return
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hybridserve-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run("debootstrap", "--variant=minbase", "bookworm", str(rootfs), timeout=1200)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout, capture_output=True,
                                  text=True, timeout=600)
        tar.wait()
        if imported.returncode != 0:
            raise AssertionError(f"docker import failed: {imported.stderr}")
    _step(f"base image {BASE_IMAGE} (debootstrap + import)", started)


def _pip_find_links() -> list[Path]:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    folders = []
    for line in out.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith("find-links"):
            folders += [Path(v) for v in value.strip().strip("'\"").split() if Path(v).is_dir()]
    return folders


def _fill_build_context() -> None:
    """deploy/local/: the host's torch wheel(s) and CA bundle, which the image build takes from there."""
    local = ROOT / "deploy" / "local"
    local.mkdir(exist_ok=True)
    for folder in _pip_find_links():
        for wheel in folder.glob("torch-*.whl"):
            target = local / wheel.name
            if not target.exists() or target.stat().st_size != wheel.stat().st_size:
                shutil.copyfile(wheel, target)
    if HOST_CA.is_file():
        shutil.copyfile(HOST_CA, local / "ca-certificates.crt")


def _grafana_secret() -> None:
    """A random admin password when none is there: the stack never has a default one."""
    path = ROOT / "deploy" / "grafana" / "admin_password"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(24) + "\n")
        # readable by Grafana's container user (uid 472) and nobody else
        path.chmod(0o600)
        os.chown(path, 472, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return 0, b""


def _wait_health(base: str, bound_s: float) -> dict:
    deadline = time.monotonic() + bound_s
    status, body = 0, b""
    while time.monotonic() < deadline:
        status, body = _get(f"{base}/health")
        if status == 200:
            return json.loads(body)
        time.sleep(5)
    raise AssertionError(f"/health not 200 within {bound_s} s: last {status} {body[:300]!r}")


def _complete(base: str, model: str, mode: str) -> tuple[str, str]:
    """(the mode the gateway says it used, the text) of a short greedy completion."""
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 8,
                       "temperature": 0, "mode": mode}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=body, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        used = resp.headers["x-hybridserve-mode"]
        payload = json.loads(resp.read())
    return used, payload["choices"][0]["text"]


def _wait_healthy(stack: "Stack", service: str, bound_s: float) -> None:
    """Until docker's own healthcheck of the service's container says healthy (it runs every 10 s)."""
    deadline = time.monotonic() + bound_s
    health = {}
    while time.monotonic() < deadline:
        health = stack.inspect(stack.container(service))["State"].get("Health", {})
        if health.get("Status") == "healthy":
            return
        time.sleep(2)
    raise AssertionError(f"{service} not healthy within {bound_s} s: {health}")


class Stack:
    def __init__(self, env: dict, base: str):
        self.env, self.base = env, base

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        return _run("docker-compose", "-p", PROJECT, *args, timeout=timeout, env=self.env, check=check)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def inspect(self, container: str) -> dict:
        return json.loads(_run("docker", "inspect", container).stdout)[0]

    def logs(self) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", *SERVICES, check=False).stdout


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("Docker needs root here (dockerd, apt-get); run `sudo make test-compose`")
    _install_tools()
    dockerd = _start_dockerd(tmp_path_factory.mktemp("dockerd") / "dockerd.log")
    env = {**os.environ, "HYBRIDSERVE_GATEWAY_HOST_PORT": str(_free_port())}
    stack = Stack(env, f"http://127.0.0.1:{env['HYBRIDSERVE_GATEWAY_HOST_PORT']}")
    try:
        _base_image()
        # the base pinned by content: its image id (sha256 of its config), not the movable tag
        env["HYBRIDSERVE_BASE_IMAGE"] = _run("docker", "image", "inspect", "-f", "{{.Id}}", BASE_IMAGE).stdout.strip()
        print(f"[compose] base image {BASE_IMAGE} = {env['HYBRIDSERVE_BASE_IMAGE']}", flush=True)
        _fill_build_context()
        _grafana_secret()
        started = time.monotonic()
        stack.compose("build", *SERVICES, timeout=3600)
        _step("docker-compose build", started)
        started = time.monotonic()
        up = stack.compose("up", "-d", *SERVICES, timeout=UP_TIMEOUT_S, check=False)
        if up.returncode != 0:
            raise AssertionError(f"up failed:\n{up.stderr[-3000:]}\n{stack.logs()}")
        health = _wait_health(stack.base, UP_TIMEOUT_S)
        _step("docker-compose up until the gateway's /health is 200", started)
        for service in SERVICES:
            _wait_healthy(stack, service, UP_TIMEOUT_S)
        _step("docker-compose up until every container's healthcheck passes", started)
        print(f"[compose] /health: {health}", flush=True)
        yield stack
    finally:
        print(stack.logs()[-6000:], flush=True)
        stack.compose("down", "-v", "--remove-orphans", timeout=600, check=False)
        if dockerd is not None:
            dockerd.terminate()
            dockerd.wait(timeout=120)


def test_containers_run_hardened(stack):
    for service in SERVICES:
        info = stack.inspect(stack.container(service))
        host = info["HostConfig"]
        assert info["Config"]["User"] == "10001:10001"
        assert host["CapDrop"] == ["ALL"] and "no-new-privileges:true" in host["SecurityOpt"]
        assert host["ReadonlyRootfs"] is True
        assert info["State"]["Health"]["Status"] == "healthy", (service, info["State"]["Health"])
        # what the process itself has: no capabilities at all
        status = _run("docker", "exec", info["Id"], "cat", "/proc/1/status").stdout
        assert "CapEff:\t0000000000000000" in status, status
    ports = stack.inspect(stack.container("gateway"))["HostConfig"]["PortBindings"]
    assert all(b["HostIp"] == "127.0.0.1" for bindings in ports.values() for b in bindings)


def _model(stack) -> str:
    status, body = _get(f"{stack.base}/v1/models")
    assert status == 200, body
    return json.loads(body)["data"][0]["id"]


def test_every_mode_completes_through_the_gateway(stack):
    model = _model(stack)
    for mode in MODES:
        used, text = _complete(stack.base, model, mode)
        print(f"[compose] mode {mode}: served as {used}: {text!r}", flush=True)
        assert text.strip()
        assert used == mode if mode != "auto" else used in ("gpu", "fpga", "hybrid")


def _kill_and_heal(stack, service: str, needs_mode: str, restarted_with: tuple[str, ...] = ()) -> None:
    container = stack.container(service)
    before = stack.inspect(container)
    restarts = before["RestartCount"]
    others = {other: stack.inspect(stack.container(other))["RestartCount"] for other in restarted_with}
    started = time.monotonic()
    # SIGKILL to the engine's process from the host, as a crash would end it: `docker kill` counts as an
    # operator's stop, after which no restart policy brings a container back
    os.kill(before["State"]["Pid"], signal.SIGKILL)
    deadline = time.monotonic() + HEAL_TIMEOUT_S
    # the restart policy brings the same container back; /health says 200 once both engines answer again
    while time.monotonic() < deadline:
        info = stack.inspect(container)
        if info["RestartCount"] > restarts and info["State"]["Running"]:
            break
        time.sleep(2)
    else:
        raise AssertionError(f"{service} was not restarted within {HEAL_TIMEOUT_S} s:\n{stack.logs()}")
    _wait_health(stack.base, HEAL_TIMEOUT_S)
    # a mode that needs the killed engine (and, for hybrid, the shared arena) works again; the gateway's
    # health loop may need a moment to see the engine back, so a few bounded tries
    model = _model(stack)
    last = None
    while time.monotonic() < deadline:
        try:
            used, text = _complete(stack.base, model, needs_mode)
            if used == needs_mode and text.strip():
                break
            last = (used, text)
        except urllib.error.HTTPError as exc:
            last = (exc.code, exc.read()[:300])
        except (urllib.error.URLError, OSError) as exc:
            last = repr(exc)
        time.sleep(5)
    else:
        raise AssertionError(f"{needs_mode} did not work again after {service} was killed: {last}\n{stack.logs()}")
    _step(f"{service} SIGKILLed until a {needs_mode} completion worked again", started)
    for other, count in others.items():
        assert stack.inspect(stack.container(other))["RestartCount"] > count, f"{other} did not restart with {service}"


def test_a_killed_decode_engine_heals(stack):
    _kill_and_heal(stack, "decode-fpga", "fpga")


def test_a_killed_prefill_engine_heals_and_decode_rejoins_its_arena(stack):
    # prefill-gpu comes back in a new IPC namespace: hybrid works only once decode-fpga has rejoined it
    # (decode-fpga's healthcheck ends it once prefill-gpu's new arena is not in its /dev/shm)
    _kill_and_heal(stack, "prefill-gpu", "hybrid", restarted_with=("decode-fpga",))
