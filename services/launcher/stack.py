"""`hybridserve up`: the whole local stack (prefill_gpu, decode_fpga, gateway) from one command.

(Past 300 lines on purpose: the children's layout (pairs or pools, fixed or autoscaled), their settings
and the start/heal/stop sequence are one command's; the supervision itself is supervisor.py, the
autoscaling stack_autoscale.py.)

Starts the three processes, relays their start-up progress (model load, kernel
build, profiling), waits until the gateway's /health says both engines answer,
and prints where to send requests. From then on it keeps them running
(supervisor.py): a process that exits is started again with backoff, decode_fpga
with prefill_gpu (it maps prefill_gpu's KV arena), each restart logged and counted
on `up`'s metrics port. Only Ctrl-C or SIGTERM stops the stack, all three processes.

`up --pairs N` (or HYBRIDSERVE_UP_PAIRS) starts N (prefill_gpu, decode_fpga) pairs behind the one
gateway, for tests and benchmarks of many pairs on one machine: pair i's engines listen on their
ports + i x `port_stride` (metrics ports too), each prefill_gpu owns its own KV arena (named per
process), the profile cache is the one all engines share, and each pair is healed on its own
(its processes are named prefill_gpu.i and decode_fpga.i).

`up --prefill N --decode M` (any sizes) starts pools instead: N prefill_gpu and M decode_fpga engines;
each decode engine may pull its hybrid KV from any prefill engine (through that engine's arena: one
host), its own being prefill_gpu.(j mod N), which it is restarted with. The gateway gets the two pools
(HYBRIDSERVE_GATEWAY_PREFILL_POOL, _DECODE_POOL), sees every combination as a pair and names a hybrid
request's prefill engine to the decode engine: prefill and decode engines are chosen separately.

`up --prefill N --decode M --autoscale --max-prefill P --max-decode D` also starts and stops engines of
the pools, between N and P and between M and D, as the gateway's planner asks (stack_autoscale.py; the
decision's holds and cooldown: autoscale.py); every decode engine may pull from any of the P prefill
engines' addresses, and one the scaler starts follows one of the N.

A process that exits before the stack first comes up (the gateway's /health says every
engine answers) stops it (a setting or a model that is wrong would only fail again); from then
on every exit is healed, also while `up` waits for the router's calibration to say the stack
is up (it says so once the gateway, the first or one started again, is calibrated and answers).

The children end with `up`: each is told `up`'s pid (HYBRIDSERVE_PARENT_PID) and stops once `up`
is gone, even SIGKILLed (lifetime.py); `up` itself ends with the process named by the
HYBRIDSERVE_PARENT_PID it was given, if any (the test harness gives one).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, ClassVar

from prometheus_client import start_http_server
from pydantic import Field, model_validator

from services.decode_fpga.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.lifetime import exit_with_parent, launch_env
from services.prefill_gpu.settings import PrefillSettings
from services.settings import CommonSettings
from services.launcher.supervisor import ChildSpec, Supervisor

# the fields `up` always chooses per child itself; their old shared names (HYBRIDSERVE_PORT, ...)
# never reached a child from `up`, so they do not count here either
_CHOSEN_PER_CHILD = ("port", "metrics_port", "prefill_address", "decode_address")


class UpSettings(CommonSettings):
    """`hybridserve up`'s own settings; the children's ports are their own (HYBRIDSERVE_PREFILL_PORT, ...)."""

    service: ClassVar[str] = "hybridserve up"
    own_prefix: ClassVar[str] = "HYBRIDSERVE_UP_"
    # fields newer than the per-process prefixes: no deprecated bare name
    old_field_names: ClassVar[dict[str, str]] = {f: "up_" + f for f in (
        "metrics_port", "restart_backoff_s", "restart_backoff_max_s", "pairs", "port_stride", "prefill_engines",
        "decode_engines", "autoscale", "max_prefill_engines", "max_decode_engines", "autoscale_interval_s",
        "scale_up_hold_s", "scale_down_hold_s", "scale_cooldown_s", "drain_timeout_s")}

    host: str = "127.0.0.1"
    startup_timeout_s: float = 900.0
    metrics_port: int = 9103  # hybridserve_engine_restarts_total; 0: none
    restart_backoff_s: float = 1.0  # before the first restart of a process; doubles while it keeps exiting
    restart_backoff_max_s: float = 30.0
    pairs: int = Field(1, ge=1, le=64)  # (prefill_gpu, decode_fpga) pairs behind the gateway
    port_stride: int = Field(10, ge=1)  # pair i's ports: the engines' ports + i x port_stride
    # pools instead of pairs (either set): N prefill and M decode engines, any sizes
    prefill_engines: int | None = Field(None, ge=1, le=64)
    decode_engines: int | None = Field(None, ge=1, le=64)
    # the pools follow the gateway's planner (stack_autoscale.py): engines started and stopped between the
    # pools' sizes above (the minimums) and these maxima (unset: that pool's minimum, it does not scale)
    autoscale: bool = False
    max_prefill_engines: int | None = Field(None, ge=1, le=64)
    max_decode_engines: int | None = Field(None, ge=1, le=64)
    autoscale_interval_s: float = Field(5.0, gt=0)  # how often the planner is read
    scale_up_hold_s: float = Field(30.0, ge=0)  # the planner above the size this long before a start
    scale_down_hold_s: float = Field(120.0, ge=0)  # below it this long before a drain
    scale_cooldown_s: float = Field(60.0, ge=0)  # no step this long after one
    drain_timeout_s: float = Field(600.0, gt=0)  # a draining engine's calls then migrate, and it stops

    @model_validator(mode="after")
    def _pools(self):
        if (self.prefill_engines is not None or self.decode_engines is not None) and self.pairs != 1:
            raise ValueError("give pairs or pools (prefill_engines, decode_engines), not both")
        if self.autoscale and self.pairs != 1:
            raise ValueError("autoscale scales pools (prefill_engines, decode_engines), not pairs")
        if not self.autoscale and (self.max_prefill_engines or self.max_decode_engines):
            raise ValueError("max_prefill_engines and max_decode_engines bound autoscale, which is off")
        for pool, (lo, hi) in self.bounds().items():
            if hi < lo:
                raise ValueError(f"max_{pool}_engines ({hi}) is below the {pool} pool's size ({lo})")
        return self

    def bounds(self) -> dict[str, tuple[int, int]]:
        """Each pool's (minimum, maximum) engines; with autoscale off, fixed at its size."""
        lo = {"prefill": self.prefill_engines or 1, "decode": self.decode_engines or 1}
        hi = {"prefill": self.max_prefill_engines, "decode": self.max_decode_engines}
        return {pool: (lo[pool], hi[pool] or lo[pool]) for pool in lo}


def _children_environment() -> dict[str, str]:
    """The environment every child starts from: ours, less the old names `up` overrides per child."""
    overridden = {old for cls in (PrefillSettings, DecodeSettings, GatewaySettings)
                  for old, field in cls.old_env_names().items() if field in _CHOSEN_PER_CHILD}
    return {k: v for k, v in os.environ.items() if k.upper() not in overridden}


def _relay(name: str, proc: subprocess.Popen, quiet_after: threading.Event) -> None:
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        # the access log of a running stack is noise here; errors always show
        if '"GET /health' in line:
            continue  # our own readiness polling
        if not quiet_after.is_set() or "WARNING" in line or "ERROR" in line or "Traceback" in line:
            print(f"[{name}] {line}", flush=True)


def _healthy(url: str) -> bool:
    """Every engine of every pair up (with several pairs, a 200 only says that one pair is), whether or not
    the gateway is ready yet: its /health is a 503 while the router calibrates, with the engines in the body."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            body = json.load(r)
    except urllib.error.HTTPError as exc:  # 503: not ready (yet); the body still names each engine's state
        try:
            body = json.loads(exc.read())
        except ValueError:
            return False
    except (urllib.error.URLError, OSError, ValueError):
        return False
    engines = body.get("engines") if isinstance(body, dict) else None
    return bool(engines) and all(state == "up" for state in engines.values())


def _grpc_serving(address: str) -> Callable[[], bool]:
    def probe() -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(address) as ch:  # health needs no engine token
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    return probe


def _serve_metrics(host: str, port: int) -> None:
    if not port:
        return
    try:
        start_http_server(port, addr=host)
    except OSError as exc:  # the stack serves without it
        print(f"hybridserve up: no metrics on {host}:{port} ({exc.strerror})", file=sys.stderr, flush=True)


def _pin(cls, **values) -> dict:
    return {cls.env_name(k): v for k, v in values.items()}


def _offset(port: int, by: int) -> int:
    return port + by if port else 0  # 0: no metrics server, for every pair


def _prefill_spec(i: int, named: bool, s: UpSettings, prefill: PrefillSettings, base: dict[str, str]
                  ) -> tuple[ChildSpec, str]:
    """Prefill engine i's child (ports a stride further per index) and its address."""
    by, port = i * s.port_stride, prefill.port + i * s.port_stride
    env = {**base, UpSettings.env_name("host"): s.host,
           **{k: str(v) for k, v in _pin(PrefillSettings, port=port,
                                         metrics_port=_offset(prefill.metrics_port, by)).items()}}
    name = "prefill_gpu" + (f".{i}" if named else "")
    return ChildSpec(name, [sys.executable, "-m", "services.prefill_gpu"], env,
                     ready=_grpc_serving(f"{s.host}:{port}")), f"{s.host}:{port}"


def _decode_spec(j: int, named: bool, prefill_spec: ChildSpec, prefill_address: str, s: UpSettings,
                 decode: DecodeSettings, base: dict[str, str], pool: tuple[str, ...] = ()) -> tuple[ChildSpec, str]:
    """Decode engine j's child, pulling hybrid KV from (and restarted with) the given prefill engine, or
    from any engine of `pool` a request names."""
    by, port = j * s.port_stride, decode.port + j * s.port_stride
    env = {**base, UpSettings.env_name("host"): s.host,
           **{k: str(v) for k, v in _pin(DecodeSettings, port=port, metrics_port=_offset(decode.metrics_port, by),
                                         prefill_address=prefill_address,
                                         **({"prefill_addresses": ",".join(pool)} if pool else {})).items()}}
    name = "decode_fpga" + (f".{j}" if named else "")
    return ChildSpec(name, [sys.executable, "-m", "services.decode_fpga"], env,
                     follows=prefill_spec.name), f"{s.host}:{port}"


def _pair_specs(i: int, s: UpSettings, prefill: PrefillSettings, decode: DecodeSettings,
                base: dict[str, str]) -> tuple[list[ChildSpec], str]:
    """Pair i's two children, and its engines' addresses as the gateway's pairs setting spells a pair."""
    p, p_address = _prefill_spec(i, s.pairs > 1, s, prefill, base)
    d, d_address = _decode_spec(i, s.pairs > 1, p, p_address, s, decode, base)
    return [p, d], f"{p_address},{d_address}"


def _layout_specs(s: UpSettings, prefill: PrefillSettings, decode: DecodeSettings,
                  base: dict[str, str]) -> tuple[list[ChildSpec], list[str], dict[str, str]]:
    """Every engine child, the gateway's pairs and its settings for them: `pairs` pairs, or pools of
    `prefill_engines` and `decode_engines`: every decode engine may pull from every prefill engine (its
    own by default: j mod N, which it restarts with), the gateway sees every combination as a pair and
    names a hybrid request's prefill engine, so it picks prefill and decode engines separately."""
    if s.prefill_engines is None and s.decode_engines is None and not s.autoscale:
        specs, addresses = [], []
        for i in range(s.pairs):
            pair, address = _pair_specs(i, s, prefill, decode, base)
            specs += pair
            addresses.append(address)
        return specs, addresses, ({"pairs": ";".join(addresses)} if len(addresses) > 1 else {})
    n, m = s.bounds()["prefill"][0], s.bounds()["decode"][0]
    prefills = [_prefill_spec(i, True, s, prefill, base) for i in range(n)]
    pool = _prefill_addresses(s, prefill, base)
    decodes = [_decode_spec(j, True, prefills[j % n][0], prefills[j % n][1], s, decode, base, pool)
               for j in range(m)]
    gateway = {"prefill_pool": ",".join(a for _, a in prefills), "decode_pool": ",".join(a for _, a in decodes),
               **({"pool_admin": "true"} if s.autoscale else {})}  # the autoscaler adds engines through it
    return ([spec for spec, _ in prefills + decodes],
            [f"{p},{d}" for _, p in prefills for _, d in decodes], gateway)


def _prefill_addresses(s: UpSettings, prefill: PrefillSettings, base: dict[str, str]) -> tuple[str, ...]:
    """Every address a prefill engine of the pool may have (with autoscale, up to the most): the addresses
    a decode engine may be named, and so lists."""
    return tuple(_prefill_spec(i, True, s, prefill, base)[1] for i in range(s.bounds()["prefill"][1]))


def _scaled_spec(s: UpSettings, prefill: PrefillSettings, decode: DecodeSettings, base: dict[str, str]):
    """(pool, index) → (child, address, readiness) of an engine the autoscaler starts: a prefill engine, or
    a decode engine following prefill engine (index mod the prefill pool's minimum: one never stopped)."""
    n, pool = s.bounds()["prefill"][0], _prefill_addresses(s, prefill, base)

    def spec_of(kind: str, index: int):
        if kind == "prefill":
            spec, address = _prefill_spec(index, True, s, prefill, base)
        else:
            leader, leader_address = _prefill_spec(index % n, True, s, prefill, base)
            spec, address = _decode_spec(index, True, leader, leader_address, s, decode, base, pool)
        return spec, address, _grpc_serving(address)
    return spec_of


def up(pairs: int | None = None, prefill_engines: int | None = None, decode_engines: int | None = None,
       autoscale: bool | None = None, max_prefill: int | None = None, max_decode: int | None = None) -> int:
    """`pairs`: from `up --pairs`; None: the settings' (HYBRIDSERVE_UP_PAIRS, 1 by default). The pools'
    sizes: from `up --prefill N --decode M` (HYBRIDSERVE_UP_PREFILL_ENGINES, ..._DECODE_ENGINES); their
    autoscaling: from `--autoscale --max-prefill P --max-decode D` (HYBRIDSERVE_UP_AUTOSCALE, ...)."""
    base = _children_environment()
    # read here as each child will, so a typo stops `up` before anything starts
    s, prefill, decode, gateway = (cls.from_environ(base) for cls in (UpSettings, PrefillSettings, DecodeSettings,
                                                                    GatewaySettings))
    if pairs is not None:
        s = s.model_copy(update={"pairs": pairs})
    given = {k: v for k, v in (("prefill_engines", prefill_engines), ("decode_engines", decode_engines),
                               ("autoscale", autoscale), ("max_prefill_engines", max_prefill),
                               ("max_decode_engines", max_decode)) if v is not None}
    if given:
        s = UpSettings.model_validate({**s.model_dump(), **given})
    base["PYTHONUNBUFFERED"] = "1"
    base.update(launch_env())  # every child stops once `up` is gone
    quiet = threading.Event()
    specs, addresses, layout = _layout_specs(s, prefill, decode, base)
    prefill_address, decode_address = addresses[0].split(",")
    gateway_env = _pin(GatewaySettings, port=gateway.port, prefill_address=prefill_address,
                       decode_address=decode_address, **layout)
    specs.append(ChildSpec("gateway", [sys.executable, "-m", "services.gateway"],
                           {**base, UpSettings.env_name("host"): s.host, **{k: str(v) for k, v in gateway_env.items()}}))

    def start(spec: ChildSpec) -> subprocess.Popen:
        proc = subprocess.Popen(spec.argv, env=spec.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        threading.Thread(target=_relay, args=(spec.name, proc, quiet), daemon=True).start()
        return proc

    say = lambda msg: print(f"hybridserve up: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    sup = Supervisor(specs, start, say=say, backoff_s=s.restart_backoff_s, backoff_max_s=s.restart_backoff_max_s)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    exit_with_parent(s.parent_pid, "hybridserve up")
    _serve_metrics(s.host, s.metrics_port)
    print(f"starting the stack on {s.host}: {'; '.join(_pair_text(a) for a in addresses)}, "
          f"gateway :{gateway.port} (first start profiles each engine; later starts use the cache)", flush=True)
    try:
        sup.start_all()
        url = f"http://{s.host}:{gateway.port}"
        deadline = time.monotonic() + s.startup_timeout_s
        while not _healthy(url + "/health"):
            dead = sup.exited()
            if dead or stop.is_set() or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else ("interrupted" if stop.is_set() else "timed out")
                print(f"hybridserve up: the stack did not come up ({why})", file=sys.stderr, flush=True)
                return 1
            time.sleep(0.5)
        # from here every exit is healed, also while the router calibrates: `up` says the stack is up
        # once its gateway (the first or one started again) is calibrated and answers
        ready = _Readiness(url, deadline)
        scaler = _autoscaler(s, prefill, decode, gateway, base, sup, url, say) if s.autoscale else None
        while not stop.is_set():
            sup.poll()
            if scaler is not None:
                scaler.round()
            if not quiet.is_set() and ready.due():
                text = _ready_text(url, gateway, s)
                if text is not None:
                    quiet.set()
                    print(text, flush=True)
            stop.wait(0.5)
        return 0
    finally:
        # the gateway first, so no new request reaches an engine that is going away
        names = list(sup.children)  # the autoscaler's engines too
        sup.stop_all(["gateway"] + [n for n in names if n.startswith("decode_fpga")]
                     + [n for n in names if n.startswith("prefill_gpu")])
        print("stopped", flush=True)


def _autoscaler(s: UpSettings, prefill: PrefillSettings, decode: DecodeSettings, gateway: GatewaySettings,
                base: dict[str, str], sup: Supervisor, url: str, say: Callable[[str], None]):
    from services.launcher.autoscale import Hysteresis
    from services.launcher.stack_autoscale import EngineAutoscaler, GatewayAdmin

    key = gateway.api_key.get_secret_value() if gateway.api_key else None
    return EngineAutoscaler(sup, _scaled_spec(s, prefill, decode, base), s.bounds(),
                            Hysteresis(s.scale_up_hold_s, s.scale_down_hold_s, s.scale_cooldown_s),
                            GatewayAdmin(url, key), say, s.autoscale_interval_s, s.drain_timeout_s)


class _Readiness:
    """When to say the stack is up: once the gateway's router has both engines' start-up profiles (a
    first start times each engine, in turn: requests sent meanwhile would share the cores with the
    sweeps and go to hybrid uncalibrated), or at the start-up deadline (the stack serves either way)."""

    def __init__(self, url: str, deadline: float):
        self.url, self.deadline, self._said, self._next = url, deadline, False, 0.0

    def due(self) -> bool:
        if time.monotonic() > self.deadline:
            return True
        if time.monotonic() < self._next:
            return False
        self._next = time.monotonic() + 1.0
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                if json.load(r).get("ready"):  # a 200: ready; a 503 (not yet) raises HTTPError, an OSError
                    return True
        except (OSError, ValueError):  # the gateway is away (being started again): ask again later
            pass
        if not self._said:
            print("hybridserve up: engines answer; calibrating the router (a first start times each engine)",
                  file=sys.stderr, flush=True)
            self._said = True
        return False


def _pair_text(address: str) -> str:
    prefill_address, decode_address = address.split(",")
    return f"prefill_gpu :{prefill_address.rpartition(':')[2]}, decode_fpga :{decode_address.rpartition(':')[2]}"


def _ready_text(url: str, gateway: GatewaySettings, s: UpSettings) -> str | None:
    """What `up` says once the stack is up; None while the gateway does not answer (it may have exited
    just now: the supervisor starts it again, and `up` asks again on its next round)."""
    key = gateway.api_key
    auth = {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=auth), timeout=5) as r:
            model = json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError):
        return None
    key_header = f"-H 'Authorization: Bearer ${GatewaySettings.env_name('api_key')}' " if key else ""
    metrics = f"; restarts on http://{s.host}:{s.metrics_port}/metrics" if s.metrics_port else ""
    return (f"\nhybridserve is up: {url}/v1  (OpenAI API; health {url}/health, metrics {url}/metrics{metrics})\n"
            f"try:\n  curl {url}/v1/chat/completions {key_header}-H 'Content-Type: application/json' \\\n"
            f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": "
            f"\"What is the capital of France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}'\n"
            f"A process that exits is started again; Ctrl-C stops them all.")
