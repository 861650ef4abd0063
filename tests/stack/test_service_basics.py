"""gRPC conventions: health and reflection answer, and the generated stubs are current."""
from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_are_current(tmp_path):
    """Fails when proto/ changed without `make proto`."""
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iservices/rpc=proto", f"--python_out={tmp_path}",
                    f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}", "proto/hybridserve/v1/engine.proto"],
                   cwd=ROOT, check=True)
    gen = tmp_path / "services/rpc/hybridserve/v1"
    for name in ("engine_pb2.py", "engine_pb2_grpc.py", "engine_pb2.pyi"):
        assert filecmp.cmp(gen / name, ROOT / "services/rpc/hybridserve/v1" / name, shallow=False), \
            f"{name} is stale: run `make proto`"


def test_health_and_reflection(services):
    for svc in services:
        with grpc.insecure_channel(svc.address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="hybridserve.v1.Engine"), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
            names = {s.name for s in reply.list_services_response.service}
            assert {"hybridserve.v1.Engine", "grpc.health.v1.Health"} <= names
