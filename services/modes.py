"""The one definition of a serving mode: which engine prefills, which decodes, whose Generate
serves it, its wire enum. Everything else (router, gateway, engine services) imports it.

    mode     prefill      decode       Generate served by
    gpu      prefill_gpu  prefill_gpu  prefill_gpu
    fpga     decode_fpga  decode_fpga  decode_fpga
    hybrid   prefill_gpu  decode_fpga  decode_fpga (it pulls the KV from prefill_gpu)

Engines are named by the device kind they stand for ("gpu", "fpga"); the process names
("prefill_gpu", "decode_fpga") are for people and logs.

A new mode is one more `Mode` in `MODES` (and its enum value in proto/).
"""
from __future__ import annotations

from dataclasses import dataclass

from services.rpc.hybridserve.v1 import engine_pb2 as pb

ENGINE_NAMES = {"gpu": "prefill_gpu", "fpga": "decode_fpga"}  # engine key → process name
ENGINES = tuple(ENGINE_NAMES)


@dataclass(frozen=True)
class Mode:
    name: str
    prefill_engine: str  # "gpu" | "fpga"
    decode_engine: str
    proto: int  # pb.Mode value on the wire

    @property
    def served_by(self) -> str:
        """The engine whose Generate runs the request: the decoding one orchestrates."""
        return self.decode_engine

    @property
    def engines(self) -> tuple[str, ...]:
        """Every engine the mode needs up, prefill first, no repeats."""
        return tuple(dict.fromkeys((self.prefill_engine, self.decode_engine)))


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("gpu", "gpu", "gpu", pb.MODE_GPU),
    Mode("fpga", "fpga", "fpga", pb.MODE_FPGA),
    Mode("hybrid", "gpu", "fpga", pb.MODE_HYBRID),
)}
MODE_NAMES = tuple(MODES)  # ("gpu", "fpga", "hybrid"): the order the router considers them in
AUTO = "auto"  # what a request says to let the router choose
BY_PROTO: dict[int, Mode] = {m.proto: m for m in MODES.values()}


def mode_name_of_proto(value: int) -> str:
    """A wire enum value's mode name, or the number itself for an unknown value (for messages)."""
    mode = BY_PROTO.get(value)
    return mode.name if mode else str(value)
