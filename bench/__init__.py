"""The benchmarks: product benchmarks at the top (`hybridserve bench NAME`, or `python -m bench.MODULE`),
engine and kernel micro-benchmarks in micro/ (`python -m bench.micro.MODULE`), the load generator,
servers and reports they share in serving/, and their cited results in results/. Run from the
repository root (or through `hybridserve`, which puts the checkout on the path)."""
