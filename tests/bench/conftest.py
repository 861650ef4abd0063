"""The benchmark scripts import their parts as bench/ does when run (`python bench/serve.py`): put
bench/ on sys.path for the tests of those parts. And one stack for the benchmark scripts' tests."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


@pytest.fixture(scope="package")
def bench_stack(tmp_path_factory, profile_cache):
    """`hybridserve up` started as `bench/serve.py --start-stack` starts it (Servers.start_stack: its
    processes' PIDs and engines' metrics endpoints recorded), once for test_serve_quick.py and
    test_suite.py, which drive it with --url: a stack's start (model loads, kernel builds, the engines'
    profile sweeps, the router's calibration) took most of each test's minutes. Its profiles are cached
    where the other live stacks' are (tests/conftest.py)."""
    from bench.serving.servers import Servers

    servers = Servers()
    url = servers.start_stack(tmp_path_factory.mktemp("bench_stack") / "stack.log",
                              extra_env={"HYBRIDSERVE_PROFILE_CACHE": str(profile_cache)})
    try:
        yield url, servers
    finally:
        servers.stop()


def stack_arguments(servers) -> list[str]:
    """The --pid and --metrics arguments of bench/serve.py naming the shared stack's processes."""
    return ([f"--pid={name}={pid}" for name, pid in servers.pids.items()]
            + [f"--metrics={name}={url}" for name, url in servers.metrics.items()])
