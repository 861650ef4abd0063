"""Prometheus metrics of the engine processes (names fixed by the hybrid-mode issue)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

STAGE_SECONDS = Histogram("hybridserve_stage_seconds", "Seconds spent per request stage",
                          ["stage", "device"], buckets=STAGE_BUCKETS)
QUEUE_DEPTH = Gauge("hybridserve_engine_queue_depth", "Requests waiting for the engine")
REQUESTS = Counter("hybridserve_engine_requests", "Requests finished by the engine, by status", ["status"])

# prefill_gpu
ARENA_USED_BYTES = Gauge("hybridserve_kv_arena_used_bytes", "Bytes of the KV arena held by slots")
ARENA_SLOTS_IN_USE = Gauge("hybridserve_kv_arena_slots_in_use", "KV arena slots held by requests")
HANDOFFS_ADMITTED = Gauge("hybridserve_handoffs_admitted",
                          "Hybrid hand-offs admitted and not yet let go (handoff_admission.py)")
HANDOFF_BYTES_HELD = Gauge("hybridserve_handoff_bytes_held", "Hand-off memory those admitted hand-offs hold")

# decode_fpga
HANDOFF_SECONDS = Histogram("hybridserve_kv_handoff_seconds",
                            "KV hand-off, first layer written to last layer on the device", buckets=STAGE_BUCKETS)
HANDOFF_EXPOSED_SECONDS = Histogram("hybridserve_kv_handoff_exposed_seconds",
                                    "KV hand-off not hidden behind prefill compute", buckets=STAGE_BUCKETS)
HANDOFF_BYTES = Counter("hybridserve_kv_handoff_bytes", "Bytes of KV handed over")
ONE_ROW_STEPS = Counter("hybridserve_decode_one_row_steps",
                        "One-sequence decode steps, by the way they ran (one_launch_choice.py)", ["way"])
FEW_ROW_STEPS = Counter("hybridserve_decode_few_row_steps",
                        "Decode steps of 2-4 rows that may run as one launch, by the way they ran and their rows",
                        ["way", "rows"])
ONE_LAUNCH_GAVE_UP = Counter("hybridserve_decode_one_launch_gave_up",
                             "One-launch decode steps whose work-groups did not all run at once (redone by launches)")

# continuous batching (engine_loop.py), after vLLM's names where one exists
NUM_REQUESTS_RUNNING = Gauge("hybridserve_engine_num_requests_running", "Requests in the running batch")
NUM_REQUESTS_WAITING = Gauge("hybridserve_engine_num_requests_waiting",
                             "Requests waiting for KV blocks or a place in the batch")
STEP_TARGET = Gauge("hybridserve_engine_step_target_seconds",
                    "The step pacer's target for a step beside decodes (stretched while prompts queue)")
STEP_PROMPT_CAP = Gauge("hybridserve_engine_step_prompt_token_cap",
                        "Prompt tokens the step pacer let the last step beside decodes take")
KV_CACHE_USAGE = Gauge("hybridserve_engine_kv_cache_usage_ratio",
                       "Fraction of KV blocks held by requests (cached, unreferenced blocks count as free)")
NUM_PREEMPTIONS = Counter("hybridserve_engine_num_preemptions", "Requests preempted (blocks freed, recomputed later)")
PREFIX_CACHE_QUERIES = Counter("hybridserve_engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
PREFIX_CACHE_HITS = Counter("hybridserve_engine_prefix_cache_hits", "Prompt tokens whose KV the prefix cache held")
HOST_KV_HITS = Counter("hybridserve_engine_host_kv_hits", "Prompt tokens loaded back from the host-memory KV tier "
                       "(also counted in the prefix-cache hits)")
HOST_KV_BYTES = Counter("hybridserve_engine_host_kv_bytes", "KV bytes moved between the device pool and the host "
                        "tier", ["direction"])
HOST_KV_SECONDS = Histogram("hybridserve_engine_host_kv_seconds", "Seconds to save an evicted block to the host "
                            "tier or load one back", ["direction"],
                            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1))
HOST_KV_USED_BYTES = Gauge("hybridserve_engine_host_kv_used_bytes", "Bytes the host-memory KV tier holds")
STEP_SEQUENCES = Histogram("hybridserve_engine_step_batch_size", "Sequences computed per engine step",
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128))
STEP_TOKENS = Histogram("hybridserve_engine_step_tokens", "Tokens computed per engine step",
                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048))
LOGPROB_ROWS = Counter("hybridserve_engine_logprob_rows", "Positions given logprobs, by where they were computed: "
                       "device (a log-softmax and top-k kernel, 2 + 2k words read back) or host (the fp32 logits "
                       "row read back)", ["where"])
# speculative decoding (speculation.py), named after vLLM's spec_decode counters
SPEC_DRAFTS = Counter("hybridserve_spec_decode_num_drafts", "Verify chunks: a sequence's drafts checked in one step")
SPEC_DRAFT_TOKENS = Counter("hybridserve_spec_decode_num_draft_tokens", "Draft tokens proposed and verified")
SPEC_ACCEPTED_TOKENS = Counter("hybridserve_spec_decode_num_accepted_tokens", "Draft tokens the target accepted")
SPEC_ACCEPTED_LENGTH = Histogram("hybridserve_spec_decode_acceptance_length", "Tokens a verify chunk emitted "
                                 "(accepted drafts + the target's own)", buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16))
SPEC_STEPS = Counter("hybridserve_spec_decode_steps", "Engine steps with at least one verify chunk")
STEP_SECONDS = Histogram("hybridserve_engine_step_seconds", "Seconds per engine step", buckets=STAGE_BUCKETS)
