"""Host arrays packed into one device buffer, each also reachable as a sub-buffer of its own.

decode_layers.cl runs every layer of a decode step in one launch, so it cannot take each
layer's matrices as arguments (12 a layer): it takes one buffer holding them all and a table
of byte offsets. The launch-per-kernel paths keep taking one buffer per array, here
sub-buffers of the same memory, so the weights are on the device once. Offsets are aligned to
the device's CL_DEVICE_MEM_BASE_ADDR_ALIGN, as sub-buffers require.
"""
from __future__ import annotations

import numpy as np
import pyopencl as cl

from services.decode_fpga.device import DeviceContext


class PackedArrays:
    def __init__(self, dev: DeviceContext, arrays: list[np.ndarray]):
        align = max(dev.device.mem_base_addr_align // 8, 64)
        self.offsets: list[int] = []
        size = 0
        for a in arrays:
            size = -(-size // align) * align
            self.offsets.append(size)
            size += a.nbytes
        host = np.zeros(max(size, 1), np.uint8)
        for a, off in zip(arrays, self.offsets):
            host[off:off + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
        self.buffer = cl.Buffer(dev.context, cl.mem_flags.READ_ONLY | cl.mem_flags.COPY_HOST_PTR, hostbuf=host)
        self.nbytes = size
        self.views = [self.buffer.get_sub_region(off, max(a.nbytes, 1)) for a, off in zip(arrays, self.offsets)]
