"""The KV transports by name: what decode_fpga opens for one (`open_inbox`), the receiver it gives each
hybrid request (`receiver`), and the sender prefill_gpu makes for a Prefill call (`sender`).

    shm   the shared-memory arena (shm.py): one host, one Pod; the default. No address: decode maps
          prefill's arena by the name Info gives.
    tcp   a TCP stream of our own (tcp.py): decode's KV inbox listens, the Prefill call names its
          address ("host:port"), prefill connects and streams the KV.
    nixl  NIXL (nixl.py): prefill registers the KV's host memory and offers it over a control
          connection to the same kind of inbox ("nixl://host:port"); decode READs it through UCX.
          An optional install (`pip install 'hybridserve[nixl]'`).

decode_fpga's settings name one (HYBRIDSERVE_DECODE_KV_TRANSPORT); the Prefill call's `kv_address`
tells prefill_gpu which (no scheme: tcp; `nixl://`: nixl; empty: shm), so prefill_gpu serves any
decode_fpga. prefill_gpu's own HYBRIDSERVE_PREFILL_KV_TRANSPORT says which it prepares at start (nixl:
its agent, and a missing extra is a start-up error there). Importing this module imports no transport:
settings check names against `NAMES`.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from typing import Callable

from services.kv.address import parse_address

NAMES = ("shm", "tcp", "nixl")
DEFAULT = "shm"
NIXL_SCHEME = "nixl://"


@dataclass(frozen=True)
class Transport:
    name: str
    summary: str
    # decode: (settings, engine token) -> the inbox its receivers take connections from; None for shm
    open_inbox: Callable | None
    # decode: (inbox, engine, seq, expected header, io timeout) -> a KVReceiver
    receiver: Callable | None
    # prefill: (runtime, (host, port), header, cancellation) -> a KVSender; None for shm (the arena's)
    sender: Callable | None
    # prefill: what to prepare at start (e.g. the agent); raises with a clear reason where it cannot
    prepare: Callable[[], None] = lambda: None


def _deadline_s(cancel) -> float:
    """How long a network sender's waits may last: the call's remaining deadline, else tcp's default."""
    from services.kv.tcp_frames import DEFAULT_TIMEOUT_S

    return DEFAULT_TIMEOUT_S if cancel.deadline is None else max(1.0, cancel.deadline - time.monotonic())


def _token(settings) -> str | None:
    return settings.engine_token.get_secret_value() if settings.engine_token else None


def _tcp_inbox(settings, token):
    from services.kv.tcp_inbox import KVInbox

    host, port = parse_address(settings.kv_listen)
    return KVInbox(host, port, settings.kv_advertise, token=token)  # with a token, only its holders' KV


def _tcp_receiver(inbox, engine, seq, expected, timeout_s):
    from services.kv.tcp_inbox import InboxReceiver

    return InboxReceiver(inbox, engine, seq, expected, timeout_s)


def _tcp_sender(runtime, address, header, cancel):
    return runtime.tcp_sender(address, header, cancel)


def _nixl_inbox(settings, token):
    from services.kv.nixl import NixlInbox
    from services.kv.nixl_agent import shared_agent

    host, port = parse_address(settings.kv_listen)
    return NixlInbox(shared_agent("decode"), host, port, settings.kv_advertise, token=token)


def _nixl_receiver(inbox, engine, seq, expected, timeout_s):
    from services.kv.nixl import NixlReceiver

    return NixlReceiver(inbox, engine, seq, expected, timeout_s)


def _nixl_sender(runtime, address, header, cancel):
    from services.kv.nixl import NixlSender
    from services.kv.nixl_agent import shared_agent

    return NixlSender(address, header, shared_agent("prefill"), _deadline_s(cancel), _token(runtime.settings))


def _nixl_prepare() -> None:
    from services.kv.nixl_agent import shared_agent

    shared_agent("prefill")


TRANSPORTS: dict[str, Transport] = {
    "shm": Transport("shm", "shared memory on one host (the arena)", None, None, None),
    "tcp": Transport("tcp", "our own TCP stream to decode's KV inbox", _tcp_inbox, _tcp_receiver, _tcp_sender),
    "nixl": Transport("nixl", "NIXL READs over UCX, offered through decode's KV inbox", _nixl_inbox,
                      _nixl_receiver, _nixl_sender, _nixl_prepare),
}
assert tuple(TRANSPORTS) == NAMES


def get(name: str) -> Transport:
    """The transport called `name`; ValueError listing the known ones."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown KV transport {name!r}: one of {', '.join(NAMES)}") from None


def check_name(name: str) -> str:
    """For settings validators: `name` if it is a transport's and installed here; ValueError otherwise
    (for nixl without its extra, naming the extra: a start-up error, not a request's)."""
    get(name)
    if name == "nixl" and not any(importlib.util.find_spec(m) for m in ("nixl_cu12", "nixl")):
        raise ValueError("the nixl KV transport needs the optional NIXL install, which is missing here: "
                         "pip install 'hybridserve[nixl]'")
    return name


def parse_kv_address(text: str) -> tuple[Transport, tuple[str, int]] | None:
    """A Prefill call's `kv_address`: None (empty: the arena), else its transport and (host, port).
    ValueError naming what is wrong."""
    if not text:
        return None
    name = "tcp"
    if "://" in text:
        scheme, _, text = text.partition("://")
        name = scheme.lower()
        if name not in TRANSPORTS or TRANSPORTS[name].sender is None:
            raise ValueError(f"the scheme {scheme!r}:// names no network KV transport (nixl:// or none for tcp)")
    return get(name), parse_address(text)

