"""OpenCL fixtures: the device and engines, built once per session (kernels + upload take seconds)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cl_dev():
    from services.decode_fpga.device import select_device

    return select_device()


@pytest.fixture
def cpu_device(cl_dev):
    """For tests of the CPU's one-launch steps (decode_layers.cl): a GPU device keeps its launches (a work-group
    per row), so there the tests are skipped, not failed (they ran that way on a lent H200)."""
    import pyopencl as cl

    if not cl_dev.device.type & cl.device_type.CPU:
        pytest.skip(f"the one-launch step is a CPU device's; this one is {cl_dev.device.name.strip()}")
    return cl_dev


def make_engine(loaded_model, cl_dev, blocks=None, **config):
    """An engine on the test model; config: EngineConfig's fields, blocks: the checkpoint's (gguf storage).
    The paged pool is 64 MiB unless asked (the default budget is for serving, not for tests)."""
    from services.decode_fpga.config import EngineConfig
    from services.decode_fpga.engine import OpenCLEngine

    config.setdefault("kv_cache_mb", 64)
    return OpenCLEngine.create(loaded_model.config, loaded_model.weights, cl_dev, EngineConfig(**config), blocks)


@pytest.fixture(scope="session")
def ocl_engine(loaded_model, cl_dev):
    """fp32 weights: the default configuration."""
    return make_engine(loaded_model, cl_dev, max_context=1024)


@pytest.fixture(scope="session")
def ocl_gguf_engine(loaded_model, cl_dev):
    """The checkpoint's own Q4_1/Q8_0 blocks on the device: the default for GGUF checkpoints."""
    from services.model.gguf_blocks import read_block_tensors

    blocks = read_block_tensors(loaded_model.checkpoint, loaded_model.config)
    return make_engine(loaded_model, cl_dev, weights_dtype="gguf", blocks=blocks, max_context=1024)


@pytest.fixture(scope="session")
def ocl_gguf_launches_engine(loaded_model, cl_dev):
    """gguf storage with every decode step launch by launch (no decode_layers.cl): the reference the
    one-launch layers are held to, bit for bit."""
    from services.model.gguf_blocks import read_block_tensors

    blocks = read_block_tensors(loaded_model.checkpoint, loaded_model.config)
    return make_engine(loaded_model, cl_dev, weights_dtype="gguf", blocks=blocks, max_context=1024,
                       layer_kernels=False)
