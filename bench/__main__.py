"""`python -m bench NAME [ARGS...]`: the product benchmarks by name (bench/cli.py)."""
import sys

from bench.cli import main

sys.exit(main(prog="python -m bench"))
