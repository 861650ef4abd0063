"""The engines' gRPC server edge (services/engine/service.py's build_server) on real gRPC over loopback: it
refuses a port another server already serves, where grpcio's default (SO_REUSEPORT) would share it."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from services.engine.service import EngineServicer, build_server


def test_an_engine_server_does_not_share_a_port_another_process_serves():
    """gRPC binds with SO_REUSEPORT unless told not to: a second engine on a taken port would start and take
    a share of the first one's connections. build_server refuses the port instead."""
    other = grpc.server(ThreadPoolExecutor(1))  # grpcio's defaults, as another process's server would have
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        servicer = EngineServicer(None, "decode_fpga")  # nothing is called: the server is only bound
        settings = SimpleNamespace(engine_token=None, engine_reflection=False, host="127.0.0.1", port=port,
                                   max_num_seqs=1, queue_depth=1)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            build_server(servicer, settings)
    finally:
        other.stop(0)
