"""Writes deploy/grafana/dashboards/hybridserve.json: one source for the panels and their PromQL.

Run after changing a panel: python deploy/grafana/make_dashboard.py
"""
import json
from pathlib import Path


def quantiles(metric: str, by: str = "mode", window: str = "5m") -> list[dict]:
    return [{"refId": f"p{q}", "legendFormat": f"p{q} {{{{{by}}}}}",
             "expr": f"histogram_quantile(0.{q}, sum by (le, {by}) (rate({metric}_bucket[{window}])))"}
            for q in (50, 95, 99)]


PANELS = [
    ("Time to first token by mode (s)", quantiles("hybridserve_time_to_first_token_seconds"), "s"),
    ("Inter-token latency by mode (s)", quantiles("hybridserve_inter_token_latency_seconds"), "s"),
    ("End-to-end latency by mode (s)", quantiles("hybridserve_e2e_request_latency_seconds"), "s"),
    ("Mode mix (router decisions per second)",
     [{"refId": "A", "legendFormat": "{{mode}} ({{reason}})",
       "expr": "sum by (mode, reason) (rate(hybridserve_router_decisions_total[5m]))"}], "reqps"),
    ("KV hand-off: exposed vs total (p95, s)",
     [{"refId": "A", "legendFormat": "exposed",
       "expr": "histogram_quantile(0.95, sum by (le) (rate(hybridserve_kv_handoff_exposed_seconds_bucket[5m])))"},
      {"refId": "B", "legendFormat": "total",
       "expr": "histogram_quantile(0.95, sum by (le) (rate(hybridserve_kv_handoff_seconds_bucket[5m])))"}], "s"),
    ("KV arena use",
     [{"refId": "A", "legendFormat": "bytes", "expr": "hybridserve_kv_arena_used_bytes"},
      {"refId": "B", "legendFormat": "slots", "expr": "hybridserve_kv_arena_slots_in_use"}], "short"),
    ("Engine batch: requests running and waiting",
     [{"refId": "A", "legendFormat": "{{job}} running", "expr": "hybridserve_engine_num_requests_running"},
      {"refId": "B", "legendFormat": "{{job}} waiting", "expr": "hybridserve_engine_num_requests_waiting"}], "short"),
    ("Engine KV cache usage",
     [{"refId": "A", "legendFormat": "{{job}}", "expr": "hybridserve_engine_kv_cache_usage_ratio"}], "percentunit"),
    ("Engine step: sequences and tokens per step (median)",
     [{"refId": "A", "legendFormat": "{{job}} sequences",
       "expr": "histogram_quantile(0.5, sum by (le, job) (rate(hybridserve_engine_step_batch_size_bucket[5m])))"},
      {"refId": "B", "legendFormat": "{{job}} tokens",
       "expr": "histogram_quantile(0.5, sum by (le, job) (rate(hybridserve_engine_step_tokens_bucket[5m])))"}],
     "short"),
    ("Prefix cache hit ratio and preemptions",
     [{"refId": "A", "legendFormat": "{{job}} hit ratio",
       "expr": "rate(hybridserve_engine_prefix_cache_hits_total[5m]) / "
               "rate(hybridserve_engine_prefix_cache_queries_total[5m])"},
      {"refId": "B", "legendFormat": "{{job}} preemptions/s",
       "expr": "rate(hybridserve_engine_num_preemptions_total[5m])"}], "short"),
    ("Hand-off prefills waiting for an arena slot",
     [{"refId": "A", "legendFormat": "{{job}}", "expr": "hybridserve_engine_queue_depth"}], "short"),
    # the planner (services/gateway/fleet/planner.py): desired = max(capacity model, observed-latency floor)
    ("Planner: engines each pool needs for the TTFT and ITL targets (desired = max(model, latency floor))",
     [{"refId": "A", "legendFormat": "{{pool}} desired", "expr": "hybridserve_planner_desired_replicas"},
      {"refId": "B", "legendFormat": "{{pool}} model", "expr": "hybridserve_planner_model_replicas"},
      {"refId": "C", "legendFormat": "{{pool}} latency floor", "expr": "hybridserve_planner_latency_floor_replicas"},
      {"refId": "D", "legendFormat": "requests/s", "expr": "hybridserve_planner_demand_requests_per_second"}],
     "short"),
    ("Planner: observed p50 TTFT and ITL per pool against the targets (s)",
     [{"refId": "A", "legendFormat": "{{pool}} {{latency}} p50", "expr": "hybridserve_planner_observed_p50_seconds"},
      {"refId": "B", "legendFormat": "{{latency}} target", "expr": "hybridserve_planner_target_seconds"}], "s"),
    ("Planner: observed p50 over target (above 1: missed) and over the model's prediction (correction)",
     [{"refId": "A", "legendFormat": "{{pool}} over target", "expr": "hybridserve_planner_slo_ratio"},
      {"refId": "B", "legendFormat": "{{pool}} correction", "expr": "hybridserve_planner_correction_ratio"}],
     "short"),
    ("Router estimate error |predicted - actual| / actual (median)",
     [{"refId": "A", "legendFormat": "{{mode}}",
       "expr": "histogram_quantile(0.5, sum by (le, mode) (rate(hybridserve_router_estimate_error_ratio_bucket[5m])))"}],
     "percentunit"),
]


def dashboard() -> dict:
    panels = []
    for i, (title, targets, unit) in enumerate(PANELS):
        panels.append({"id": i + 1, "type": "timeseries", "title": title,
                       "datasource": {"type": "prometheus", "uid": "prometheus"},
                       "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                       "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                       "targets": [{**t, "datasource": {"type": "prometheus", "uid": "prometheus"}} for t in targets]})
    return {"uid": "hybridserve", "title": "hybridserve", "schemaVersion": 39, "version": 1, "refresh": "5s",
            "time": {"from": "now-30m", "to": "now"}, "tags": ["hybridserve"], "panels": panels}


if __name__ == "__main__":
    out = Path(__file__).parent / "dashboards" / "hybridserve.json"
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
