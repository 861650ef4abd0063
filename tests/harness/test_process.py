"""The process harness itself, on stdlib children (no model): ports, readiness, exits, stopping."""
from __future__ import annotations

import signal
import socket

import pytest

import harness.process
from harness.process import Process, ephemeral_ports, free_port, free_strided_ports, http_ok
from harness.services import Service


def test_a_free_port_can_be_bound():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_ports_are_never_handed_out_twice_nor_taken_from_the_ephemeral_range():
    """Every outgoing connection takes its local port from the ephemeral range: a port chosen there
    can be a client's by the time the service binds it. And two calls must not give the same port
    (a service's gRPC and metrics ports)."""
    lo, hi = ephemeral_ports()
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(p < lo or p > hi for p in ports), [p for p in ports if lo <= p <= hi]


def test_a_strided_run_of_ports_is_handed_out_whole(monkeypatch):
    """`up --pairs 2` puts pair 1 a stride above pair 0's ports: those must never go to anything else
    (a gateway once got the port of pair 1's decode metrics, and the stack did not start). The random
    draws are scripted: the run's start, then its second port, then one past it."""
    lo, _ = ephemeral_ports()
    start = next(p for p in range(harness.process.LOWEST_PORT, lo - 40, 50)
                 if all(harness.process.port_is_free(p + k) and p + k not in harness.process._handed_out
                        for k in (0, 10, 20, 21)))
    draws = iter([start, start + 10, start + 21])

    class Scripted:
        def randrange(self, *_):
            return next(draws)

    monkeypatch.setattr(harness.process.random, "SystemRandom", Scripted)
    assert free_strided_ports(10, 3) == start
    assert free_port() == start + 21  # not start + 10, the run's, though nothing listens there yet


def test_wait_until_returns_once_the_probe_passes_and_stop_ends_the_process(tmp_path):
    port = free_port()
    server = Process("http.server", {}, tmp_path / "http.log", args=(str(port), "--bind", "127.0.0.1")).start()
    try:
        server.wait_until(http_ok(f"http://127.0.0.1:{port}/"), timeout=60, what="serving")
    finally:
        server.stop(signal.SIGTERM, timeout=10)
    assert server.proc.returncode is not None
    assert not http_ok(f"http://127.0.0.1:{port}/")()


def test_a_process_that_exits_while_waited_for_is_an_error_with_its_log(tmp_path):
    dead = Process("json.tool", {}, tmp_path / "dead.log", args=("/no/such/file.json",)).start()
    with pytest.raises(RuntimeError, match="json.tool exited with 2 before serving") as err:
        dead.wait_until(lambda: False, timeout=60, what="serving")
    assert "No such file" in str(err.value)


def test_a_service_is_given_its_own_port_variables(tmp_path):
    svc = Service("services.decode_fpga", {"HYBRIDSERVE_DECODE_KV_CHANNELS": "2"}, tmp_path / "d.log")
    env = svc.launch_env()
    assert env["HYBRIDSERVE_DECODE_PORT"] == str(svc.port) and svc.address == f"127.0.0.1:{svc.port}"
    assert env["HYBRIDSERVE_DECODE_METRICS_PORT"] == str(svc.metrics_port)
    assert env["HYBRIDSERVE_PROFILE_AT_START"] == "false"
    assert env["HYBRIDSERVE_DECODE_KV_CHANNELS"] == "2"
    gateway = Service("services.gateway", {}, tmp_path / "g.log").launch_env()
    assert gateway == {"HYBRIDSERVE_GATEWAY_PORT": gateway["HYBRIDSERVE_GATEWAY_PORT"]}  # it has no metrics port


def test_a_service_made_from_anothers_variables_listens_on_its_own_ports(tmp_path):
    first = Service("services.decode_fpga", {"HYBRIDSERVE_DECODE_KV_CHANNELS": "2"}, tmp_path / "d.log")
    first.env = first.launch_env()  # what start() leaves in .env
    again = Service("services.decode_fpga", dict(first.env), tmp_path / "d2.log")
    env = again.launch_env()
    assert again.port != first.port and env["HYBRIDSERVE_DECODE_PORT"] == str(again.port)
    assert env["HYBRIDSERVE_DECODE_METRICS_PORT"] == str(again.metrics_port)
    assert env["HYBRIDSERVE_DECODE_KV_CHANNELS"] == "2"
