"""Settings of the gateway: HYBRIDSERVE_GATEWAY_* variables, plus the shared ones."""
from __future__ import annotations

from typing import ClassVar

from pydantic import Field, SecretStr, field_validator, model_validator

from services.gateway.fleet.pairs import parse_pairs, parse_pool
from services.gateway.fleet.planner import Targets
from services.gateway.fleet.prefix_routing import PrefixPolicy
from services.settings import CommonSettings, empty_is_none


class GatewaySettings(CommonSettings):
    service: ClassVar[str] = "gateway"
    own_prefix: ClassVar[str] = "HYBRIDSERVE_GATEWAY_"
    old_field_names: ClassVar[dict[str, str]] = {"port": "gateway_port",  # HYBRIDSERVE_GATEWAY_PORT either way
                                                  # newer than the per-process prefixes: no bare name
                                                  **{f: "gateway_" + f for f in ("pairs", "pairs_dns",
                                                                                 "pairs_dns_refresh_s",
                                                                                 "prefill_pool", "decode_pool",
                                                                                 "pool_admin", "cpu_nice")}}

    host: str = "127.0.0.1"
    port: int = 8000
    prefill_address: str = "127.0.0.1:50061"
    decode_address: str = "127.0.0.1:50062"
    # several pairs: "prefill1:port,decode1:port;prefill2:port,decode2:port" (then the two addresses
    # above are not used); unset: the one pair above
    pairs: str | None = None
    # in Kubernetes: a headless Service's DNS name, one pod = one pair, each engine on the port of the
    # address above; resolved again every pairs_dns_refresh_s (pods come and go). Overrides `pairs`
    pairs_dns: str | None = None
    pairs_dns_refresh_s: float = Field(10.0, gt=0)
    # pools instead of pairs: "host:port,host:port" each, any sizes. Every (prefill, decode) combination
    # is a pair to the router, and a hybrid request names its prefill engine to the decode engine, which
    # must list it (HYBRIDSERVE_DECODE_PREFILL_ADDRESSES, spelled alike)
    prefill_pool: str | None = None
    decode_pool: str | None = None
    api_key: SecretStr | None = None  # when set, all but /health need `Authorization: Bearer <key>`
    metrics_open: bool = False  # /metrics without the key, for a scraper on a private network
    served_model_name: str | None = None  # default: the engines' model id
    max_body_bytes: int = Field(1 << 20, gt=0)
    body_read_timeout_s: float = Field(30.0, gt=0)  # a request's whole body must arrive within it, else 408
    limit_concurrency: int = Field(256, gt=0)  # connections + requests at once; past it uvicorn answers 503
    keep_alive_timeout_s: float = Field(5.0, gt=0)  # an idle keep-alive connection is closed after it
    # on SIGTERM, how long requests in flight may run on while new ones get 503 (compose's
    # stop_grace_period must be longer, or the container is killed mid-drain)
    drain_grace_s: float = Field(60.0, gt=0)
    # the nice value of every thread (and of its autogroup where it leads its session, as under `up`), taken at
    # start where the system allows it (below 0: CAP_SYS_NICE or ulimit -e): the gateway reads each token
    # without waiting for a core behind prefill and decode work on the same cores (cpu_priority.py,
    # docs/readiness.md); None (the variable set empty): left alone
    cpu_nice: int | None = Field(-10, ge=-20, le=19)
    request_timeout_s: float = 600.0  # upper bound of any request; a request's own `timeout` may be shorter
    chat_default_max_tokens: int = 1024  # chat requests without max_tokens
    # JSON output (response_format json_object/json_schema, guided_json) may come in a markdown fence,
    # which the client's text goes without (protocol/structured.py says why); False: the JSON alone
    json_fence: bool = True
    # a completions request with several prompts has at most this many engine calls open at once
    prompts_in_flight: int = Field(8, ge=1)
    calibration_file: str | None = None  # extra router samples (JSON list), on top of the engines' Profile
    health_interval_s: float = 1.0
    # share of auto requests the router may spend re-measuring a mode it has not run lately (0 = never)
    router_explore_share: float = Field(0.05, ge=0.0, le=0.5)
    # add to each mode's estimate what its first tokens lately came later than its stages said (router.py)
    router_first_token_waits: bool = True
    # on a shared processor, choose by estimate + what the mode's decode costs the requests decoding (router.py)
    router_crowding: bool = True
    # add to each mode's first-token estimate the prefill of the requests sent ahead, awaiting theirs (router.py)
    router_prefill_ahead: bool = True
    # whether both engines compute on the same processor (then queued work delays every mode alike);
    # unset: detected from the engines' devices (torch on the CPU and an OpenCL CPU device)
    engines_share_cpu: bool | None = None
    # with several pairs: prefer the pair whose engines hold the prompt's prefix (prefix_routing.py);
    # a whole prompt cached is worth prefix_weight requests of queue; when the pairs' queues differ by
    # more than prefix_balance_guard requests, the least loaded serves whatever it holds
    prefix_routing: bool = True
    prefix_weight: float = Field(2.0, ge=0.0)
    prefix_balance_guard: float = Field(4.0, ge=0.0)

    # the planner (planner.py): the targets it sizes the prefill and decode pools for, on /metrics
    planner_ttft_s: float = Field(2.0, gt=0)
    planner_itl_s: float = Field(0.1, gt=0)
    planner_max_replicas: int = Field(16, ge=1)
    planner_window_s: float = Field(60.0, gt=0)
    # the observed latencies' floor (planner_latency.py): samples a pool's p50 needs, and the share of a
    # target a pool must stay within at its smaller size before the floor lets it shrink
    planner_min_samples: int = Field(5, ge=1)
    planner_headroom: float = Field(0.8, gt=0, lt=1)
    # /admin/pools: engines added to and removed from the pools at run time, from loopback only (with the
    # API key when one is set); `hybridserve up --autoscale` sets it for its gateway (pool_admin.py)
    pool_admin: bool = False

    def planner_targets(self) -> Targets:
        return Targets(self.planner_ttft_s, self.planner_itl_s, self.planner_max_replicas, self.planner_window_s,
                       self.planner_min_samples, self.planner_headroom)

    def prefix_policy(self) -> PrefixPolicy:
        return PrefixPolicy(self.prefix_routing, self.prefix_weight, self.prefix_balance_guard)

    @field_validator("pairs")
    @classmethod
    def _pairs_parse(cls, v):
        if v not in (None, ""):
            parse_pairs(v)  # a malformed list stops the gateway at start, with what is wrong
        return v or None

    @field_validator("prefill_pool", "decode_pool")
    @classmethod
    def _pool_parse(cls, v):
        if v in (None, ""):
            return None
        parse_pool(v)
        return v

    @model_validator(mode="after")
    def _pools_alone(self):
        if (self.prefill_pool is None) != (self.decode_pool is None):
            raise ValueError("pools need both prefill_pool and decode_pool")
        if self.prefill_pool is not None and (self.pairs or self.pairs_dns):
            raise ValueError("give pairs (pairs or pairs_dns) or pools (prefill_pool, decode_pool), not both")
        return self

    @property
    def pools(self) -> bool:
        return self.prefill_pool is not None

    def pair_addresses(self) -> list[tuple[str, str]]:
        """(prefill, decode) address of each pair the settings name (not the discovered ones); with
        pools, every combination, prefill-major (1P:2D is (p0, d0), (p0, d1))."""
        if self.pools:
            return [(p, d) for p in parse_pool(self.prefill_pool) for d in parse_pool(self.decode_pool)]
        return parse_pairs(self.pairs) if self.pairs else [(self.prefill_address, self.decode_address)]

    @field_validator("api_key", "cpu_nice", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        # HYBRIDSERVE_GATEWAY_API_KEY= means "no key", not "the empty key"; HYBRIDSERVE_GATEWAY_CPU_NICE= "leave
        # the priority alone"
        return empty_is_none(v)
