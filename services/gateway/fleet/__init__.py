"""The engines behind the gateway: pairs and pools (which engines, which are up, their loads), where a
prompt's prefix is cached and which pair serves it (kv_index, prefix_routing), the engines' gRPC
clients, discovery, and the planner (pool sizes for SLOs). Knows nothing of modes' costs."""
