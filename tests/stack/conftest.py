"""One prefill_gpu + decode_fpga pair for the integration tests of this folder."""
from __future__ import annotations

import grpc
import pytest

from services.rpc.hybridserve.v1 import engine_pb2_grpc as pb_grpc
from tests.services_harness import engine_pair

# a 32 MiB arena holds one 512-token fp32 prompt (23.6 MB) but not two: the full-arena test uses that
PREFILL_ENV = {"HYBRIDSERVE_ARENA_BYTES": str(32 << 20), "HYBRIDSERVE_ARENA_WAIT_S": "1.0",
               "HYBRIDSERVE_PREFILL_MAX_NUM_SEQS": "1", "HYBRIDSERVE_QUEUE_DEPTH": "1",
               "HYBRIDSERVE_PREFILL_KV_CACHE_MB": "256",
               "HYBRIDSERVE_PREFILL_MAX_CONCURRENCY": "2", "HYBRIDSERVE_PREFILL_QUEUE_DEPTH": "64",
               "HYBRIDSERVE_SLOT_HOLD_S": "5", "HYBRIDSERVE_ENGINE_REFLECTION": "true"}
DECODE_ENV = {"HYBRIDSERVE_MAX_CONTEXT": "1024", "HYBRIDSERVE_MAX_SEQUENCES": "4",
              "HYBRIDSERVE_DECODE_KV_CACHE_MB": "256", "HYBRIDSERVE_QUEUE_DEPTH": "64",
              "HYBRIDSERVE_ENGINE_REFLECTION": "true"}  # reflection is off unless asked for


@pytest.fixture(scope="package")
def services(tmp_path_factory, profile_cache):
    prefill, decode = engine_pair(tmp_path_factory.mktemp("engines"), PREFILL_ENV, DECODE_ENV, profile_cache)
    try:
        prefill.wait_healthy()
        decode.wait_healthy()
        yield prefill, decode
    finally:
        decode.stop()
        prefill.stop()


@pytest.fixture(scope="package")
def stubs(services):
    prefill, decode = services
    with grpc.insecure_channel(prefill.address) as a, grpc.insecure_channel(decode.address) as b:
        yield pb_grpc.EngineStub(a), pb_grpc.EngineStub(b)


@pytest.fixture(scope="package")
def ocl_engine(loaded_model):
    """The OpenCL engine in this process (fp32 weights), for the in-process tests here."""
    from services.decode_fpga.device import select_device
    from tests.decode_fpga.conftest import make_engine

    return make_engine(loaded_model, select_device(), max_context=1024)
