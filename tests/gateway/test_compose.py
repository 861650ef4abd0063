"""docker-compose.yml validates against the Compose specification (no docker engine needed)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check_jsonschema() -> Path:
    return Path(sys.executable).with_name("check-jsonschema")


def test_docker_compose_validates_against_the_compose_spec():
    out = subprocess.run([str(_check_jsonschema()), "--builtin-schema", "vendor.compose-spec", "docker-compose.yml"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_broken_compose_file_fails_validation(tmp_path):
    # the check can fail: an unknown top-level key is rejected by the spec
    bad = tmp_path / "docker-compose.yml"
    bad.write_text((ROOT / "docker-compose.yml").read_text() + "\nnot_a_compose_key: 1\n")
    out = subprocess.run([str(_check_jsonschema()), "--builtin-schema", "vendor.compose-spec", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0


def test_compose_gives_the_gateway_longer_than_its_drain_to_stop():
    """Past stop_grace_period docker SIGKILLs the container: a drain cut short drops requests in flight."""
    import re

    import yaml

    from services.gateway.settings import GatewaySettings

    gateway = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["gateway"]
    grace = re.fullmatch(r"(\d+)s", gateway["stop_grace_period"])
    drain = float(gateway.get("environment", {}).get("HYBRIDSERVE_GATEWAY_DRAIN_GRACE_S")
                  or GatewaySettings().drain_grace_s)
    assert grace and int(grace.group(1)) > drain
