"""The serving benchmarks' parts (bench/serve.py, bench/prefix_cache.py): workload, client, statistics,
process and gauge sampling, servers, output. Imported with bench/ on sys.path, as the scripts run."""
