"""Real hybridserve processes on loopback, for tests/ and bench/: free ports, start, wait, stop.

Not part of the product (pyproject installs only `services`): the one place where tests and
benchmarks start processes, so both do it the same way.

    process.py   free_port, a `python -m` child with its output in a log file, readiness probes
    services.py  one service (prefill_gpu, decode_fpga, gateway) on free ports; an engine pair; a gateway
    stack.py     the whole stack through `hybridserve up` on free ports
"""
