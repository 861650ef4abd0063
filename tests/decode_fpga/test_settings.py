"""decode_fpga's settings come from HYBRIDSERVE_* variables, including the issue's name for the weight storage."""
from __future__ import annotations

import pydantic
import pytest

from services.decode_fpga.settings import DecodeSettings


@pytest.mark.parametrize("var", ["HYBRIDSERVE_DECODE_WEIGHTS_DTYPE", "HYBRIDSERVE_WEIGHTS_DTYPE"])
def test_weights_dtype_from_either_variable(monkeypatch, var):
    monkeypatch.setenv(var, "fp16")
    assert DecodeSettings().weights_dtype == "fp16"


def test_defaults_and_bad_values(monkeypatch):
    monkeypatch.delenv("HYBRIDSERVE_DECODE_WEIGHTS_DTYPE", raising=False)
    monkeypatch.delenv("HYBRIDSERVE_WEIGHTS_DTYPE", raising=False)
    s = DecodeSettings()
    assert (s.weights_dtype, s.kv_channels, s.host, s.port) == ("auto", 1, "127.0.0.1", 50062)
    monkeypatch.setenv("HYBRIDSERVE_DECODE_WEIGHTS_DTYPE", "int3")
    with pytest.raises(pydantic.ValidationError):
        DecodeSettings()


def test_gemv_tile_setting(monkeypatch):
    monkeypatch.delenv("HYBRIDSERVE_DECODE_OPENCL_GEMV_TILE", raising=False)
    assert DecodeSettings().opencl_gemv_tile == 2
    monkeypatch.setenv("HYBRIDSERVE_DECODE_OPENCL_GEMV_TILE", "0")
    assert DecodeSettings().opencl_gemv_tile == 0
    monkeypatch.setenv("HYBRIDSERVE_DECODE_OPENCL_GEMV_TILE", "3")  # no kernel for 3 outputs a work-item
    with pytest.raises(pydantic.ValidationError):
        DecodeSettings()
