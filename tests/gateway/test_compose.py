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
