"""One stack for the benchmark scripts' tests (they import bench.* as the package it is)."""
from __future__ import annotations

import pytest


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
