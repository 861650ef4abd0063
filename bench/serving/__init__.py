"""The serving benchmarks' parts (bench/serve.py, bench/prefix_cache.py): workload, client, statistics,
process and gauge sampling, servers, output. Imported as `bench.serving.*`."""
