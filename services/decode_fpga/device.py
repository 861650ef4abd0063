"""Choosing the OpenCL device and building programs for it.

Every candidate device must build a tiny probe kernel before it is chosen: the
PoCL in the `pocl-binary-distribution` wheel (LLVM 14) lists this machine's CPU
but fails every build ("unknown target CPU"), while Debian's PoCL 3.1 works.
Platforms that cannot compile from source (FPGAs) load prebuilt binaries.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyopencl as cl

from services.decode_fpga.int8_gemv import check_activations
from services.decode_fpga.settings import GEMV_TILE, check_lanes

log = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).parent / "kernels"
_INCLUDE = re.compile(r'^#include "(\w+\.h)"$', re.M)
_PROBE = "__kernel void probe(__global float *x) { x[get_global_id(0)] *= 2.0f; }"
# work-items per output row of a block GEMV / per head of decode attention on a GPU (kernels/*_wg.cl);
# on an H100 the GEMVs were fastest at 32 (64 and 128: the same or slower), attention at 128
# (30 -> 17 us a layer at 64 positions, 148 -> 64 us at 512)
GPU_LANES = 32


class DeviceSelectionError(RuntimeError):
    """No OpenCL device matches the settings and can build kernels."""


@dataclass
class DeviceContext:
    """The chosen device, its context and in-order queue, and a cache of built programs."""

    device: cl.Device
    context: cl.Context
    queue: cl.CommandQueue
    binary_dir: Path | None = None
    lanes: int = 0  # work-items per output row; 0: by device type (lanes_per_row)
    gemv_tile: int = GEMV_TILE  # output rows per work-item of the batched block GEMV (settings.GEMV_TILES)
    # the paged step's block GEMVs: "fp32" (exact) or "int8" activations (int8_gemv.py, opt-in)
    activations: str = "fp32"
    _programs: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.device.platform.name.strip()} / {self.device.name.strip()}"

    @property
    def lanes_per_row(self) -> int:
        """Work-items per output row of a block GEMV: the setting, else GPU_LANES on a GPU, which wants
        many threads per row (gemv_quant_wg.cl), and 1 on a CPU or an FPGA, where one work-item walks a
        row through one core's caches."""
        return self._lanes(GPU_LANES)

    def _lanes(self, gpu_default: int) -> int:
        return check_lanes(self.lanes) or (gpu_default if self.device.type & cl.device_type.GPU else 1)

    def build(self, kernel_file: str, defines: dict[str, object] | None = None) -> cl.Program:
        """Build `kernels/<kernel_file>` (or load its prebuilt binary) with -D defines, cached."""
        opts = tuple(f"-D{k}={v}" for k, v in sorted((defines or {}).items()))
        key = (kernel_file, opts)
        if key not in self._programs:
            self._programs[key] = self._build(kernel_file, opts)
        return self._programs[key]

    def _build(self, kernel_file: str, opts: tuple[str, ...]) -> cl.Program:
        if self.binary_dir is not None:
            binary = self.binary_dir / (Path(kernel_file).stem + "".join(o[2:].replace("=", "_") for o in opts) + ".bin")
            if not binary.is_file():
                raise DeviceSelectionError(f"prebuilt program {binary} is missing (opencl_binary_dir is set)")
            return cl.Program(self.context, [self.device], [binary.read_bytes()]).build()
        return cl.Program(self.context, kernel_source(kernel_file)).build(options=list(opts))


def kernel_source(kernel_file: str) -> str:
    """`kernels/<kernel_file>` with its `#include "<name>.h"` lines replaced by those files from
    kernels/: the program is built from one string, so no compiler needs an include path and a
    compiler's cache keyed on the source sees a changed header."""
    return _INCLUDE.sub(lambda mt: (KERNEL_DIR / mt.group(1)).read_text(), (KERNEL_DIR / kernel_file).read_text())


def _probe(device: cl.Device) -> str | None:
    """None when the device builds and runs the probe kernel, else why not."""
    try:
        ctx = cl.Context([device])
        cl.Program(ctx, _PROBE).build()
        return None
    except Exception as exc:  # pyopencl raises RuntimeError/LogicError subclasses with build logs
        return str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__


def select_device(platform: str | None = None, device: str | None = None,
                  binary_dir: str | None = None, lanes: int = 0, gemv_tile: int = GEMV_TILE,
                  activations: str = "fp32") -> DeviceContext:
    check_activations(activations)
    try:
        platforms = cl.get_platforms()
    except cl.Error as exc:
        raise DeviceSelectionError(
            f"no OpenCL platform found ({exc}); install one, e.g. `apt-get install -y pocl-opencl-icd`"
        ) from exc
    seen = []
    for plat in platforms:
        for dev in plat.get_devices():
            label = f"{plat.name.strip()} / {dev.name.strip()}"
            seen.append(label)
            if platform and platform.lower() not in plat.name.lower():
                continue
            if device and device.lower() not in dev.name.lower():
                continue
            if binary_dir is None:
                why = _probe(dev)
                if why is not None:
                    log.warning("skipping OpenCL device %s: cannot build kernels: %s", label, why)
                    continue
            ctx = cl.Context([dev])
            log.info("OpenCL device: %s", label)
            return DeviceContext(dev, ctx, cl.CommandQueue(ctx), Path(binary_dir) if binary_dir else None,
                                 lanes, gemv_tile, activations)
    wanted = f"platform~{platform!r} device~{device!r}"
    raise DeviceSelectionError(f"no usable OpenCL device matches {wanted}; present: {seen or 'none'}")
