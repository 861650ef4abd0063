"""Prometheus metrics of the gateway (names fixed by the gateway issue)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 30, 60, 120)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)

TTFT = Histogram("hybridserve_time_to_first_token_seconds", "Time to first token", ["mode"], buckets=LATENCY_BUCKETS)
ITL = Histogram("hybridserve_inter_token_latency_seconds", "Time between streamed tokens", ["mode"],
                buckets=TOKEN_BUCKETS)
E2E = Histogram("hybridserve_e2e_request_latency_seconds", "End-to-end request latency", ["mode"],
                buckets=LATENCY_BUCKETS)
REQUESTS = Counter("hybridserve_requests", "Requests by mode and outcome", ["mode", "status"])
DECISIONS = Counter("hybridserve_router_decisions", "Router decisions", ["mode", "reason"])
ESTIMATE_ERROR = Histogram("hybridserve_router_estimate_error_ratio", "|predicted - actual| / actual end-to-end time",
                           ["mode"], buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 5, 10))
PROMPT_TOKENS = Counter("hybridserve_prompt_tokens", "Prompt tokens processed")
GENERATION_TOKENS = Counter("hybridserve_generation_tokens", "Tokens generated")
# a request whose engine was lost mid-stream, re-submitted to another mode (dispatch/dispatcher.py); by mode
MIGRATIONS = Counter("hybridserve_request_migrations", "Requests moved to another mode after their engine was lost",
                     ["from", "to"])
# engine calls opened on each pair (pairs.py; the label is the pair's index, so bounded by the pairs
# at once): a migrated request counts once on each pair it ran on
PLANNER_DESIRED = Gauge("hybridserve_planner_desired_replicas", "Engines each pool needs for the TTFT and ITL "
                        "targets at the last window's load (services/gateway/fleet/planner.py)", ["pool"])
PLANNER_DEMAND = Gauge("hybridserve_planner_demand_requests_per_second", "Requests admitted per second over the "
                       "planner's window")
# the planner's parts (planner.py, planner_latency.py): the capacity model's counts, the floor the observed
# latencies set, their p50 (since the pool's last size change, within the window) and ratio to the target,
# and the model's error (observed p50 over its prediction: prefill on TTFT, decode on ITL); NaN: no evidence
PLANNER_MODEL = Gauge("hybridserve_planner_model_replicas", "Engines each pool needs by the capacity model alone",
                      ["pool"])
PLANNER_FLOOR = Gauge("hybridserve_planner_latency_floor_replicas", "Engines each pool needs by its observed TTFT "
                      "and ITL against the targets (0: no floor)", ["pool"])
PLANNER_OBSERVED = Gauge("hybridserve_planner_observed_p50_seconds", "Observed p50 TTFT and ITL charged to each "
                         "pool since its last size change, within the planner's window", ["pool", "latency"])
PLANNER_RATIO = Gauge("hybridserve_planner_slo_ratio", "Each pool's worst observed p50 over its target "
                      "(above 1: missed)", ["pool"])
PLANNER_CORRECTION = Gauge("hybridserve_planner_correction_ratio", "Observed p50 over the capacity model's "
                           "prediction at the pool's size (prefill: TTFT, decode: ITL)", ["pool"])
PLANNER_TARGET = Gauge("hybridserve_planner_target_seconds", "The planner's TTFT and ITL targets", ["latency"])
CALIBRATION_CHECKS = Counter("hybridserve_calibration_checks", "The gateway's calibration-check requests by mode and "
                             "outcome: ran, or yielded (cancelled because a request arrived)", ["mode", "outcome"])
PAIR_PLACEMENTS = Counter("hybridserve_pair_placements", "Pair choices with several pairs, by what decided: "
                          "prefix (cached prefix and load), load (no hit anywhere), balance (the balance guard "
                          "overrode prefix affinity), only (one pair could serve)", ["reason"])
PREFIX_HIT_TOKENS = Counter("hybridserve_prefix_routing_hit_tokens", "Prompt tokens the chosen pair held cached, "
                            "by the gateway's KV index (several pairs)")
PREFIX_QUERY_TOKENS = Counter("hybridserve_prefix_routing_query_tokens", "Prompt tokens routed among several pairs")
PAIR_CALLS = Counter("hybridserve_pair_calls", "Engine calls opened per engine pair and mode", ["pair", "mode"])
PAIR_ENGINE_UP = Gauge("hybridserve_pair_engine_up", "1 while the engine of the pair answers its health check",
                       ["pair", "engine"])
