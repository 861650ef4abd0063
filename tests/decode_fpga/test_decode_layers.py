"""Every layer of a one-row decode step in one launch (decode_layers.cl's paged_decode_layers), on
PoCL's CPU device: one copy of the weights, and its setting. (Its bits equal to the launch-by-launch
step's, and its way back when its work-groups cannot all run at once, are in test_paged_step.py.)"""
from __future__ import annotations

import pyopencl as cl


def test_weights_are_on_the_device_once(ocl_gguf_engine):
    """The layer matrices the launch-by-launch kernels read are sub-buffers of the packed buffer."""
    eng = ocl_gguf_engine
    packed, layers = eng.weights.packed.arrays, eng.weights.layers
    layer_bytes = sum(m.nbytes for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    norms = 2 * eng.cfg.n_layers * eng.cfg.hidden * 4
    assert layer_bytes + norms <= packed.nbytes < 1.05 * (layer_bytes + norms)
    d, m, q = layers[3].qkv.device_arrays
    assert d.int_ptr != q.int_ptr
    assert all(b.get_info(cl.mem_info.ASSOCIATED_MEMOBJECT) == packed.buffer for b in (d, m, q))


def test_setting(monkeypatch):
    from services.decode_fpga.settings import DecodeSettings

    assert DecodeSettings().opencl_layer_kernels is True
    monkeypatch.setenv("HYBRIDSERVE_OPENCL_LAYER_KERNELS", "false")
    assert DecodeSettings().opencl_layer_kernels is False
