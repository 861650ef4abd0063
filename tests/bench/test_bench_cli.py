"""`hybridserve bench NAME` and the bench package's shape: every registered name imports and shows its own
help, an unknown name is refused with the list, and no benchmark edits sys.path (but the few named below) or
passes 400 lines."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(cli.BENCHMARKS))
def test_every_registered_benchmark_shows_its_own_help(name, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # cli.main sets it for the benchmark's argparse
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hybridserve bench {name}") and "-h, --help" in out


def test_an_unknown_name_is_refused_with_the_list(capsys):
    assert cli.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "serve " in err and "cross-host" in err


def test_the_console_script_runs_the_registry_from_outside_the_checkout(tmp_path):
    """services/launcher/cli.py execs `python -m bench` with the checkout on PYTHONPATH: it works from any folder."""
    done = subprocess.run([sys.executable, "-m", "services.launcher.cli", "bench", "serve", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--start-stack" in done.stdout
    listing = subprocess.run([sys.executable, "-m", "services.launcher.cli", "bench", "--help"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and all(name in listing.stdout for name in cli.BENCHMARKS)



# (the A/B scripts that run another checkout's `services` set their children's PYTHONPATH: _common.checkout_env)
SYS_PATH_ALLOWED: set[str] = set()


def test_no_benchmark_edits_sys_path_or_passes_400_lines():
    files = [f for f in (ROOT / "bench").rglob("*.py") if "__pycache__" not in f.parts]
    assert len(files) > 20 and (ROOT / "bench" / "micro" / "engine_torch.py") in files
    editing = {f.name for f in files if re.search(r"sys\.path\.(insert|append)|sys\.path\[", f.read_text())}
    assert editing <= SYS_PATH_ALLOWED, sorted(editing - SYS_PATH_ALLOWED)
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > 400}
    assert not long, long
