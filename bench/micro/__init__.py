"""Engine and kernel micro-benchmarks, in process: `python -m bench.micro.MODULE` from the repository root
(bench/README.md lists what each measures). Each prints a table and writes its JSON under bench/results/."""
