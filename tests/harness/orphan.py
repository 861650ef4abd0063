"""`python -m tests.harness.orphan [stop_after_s] [ignore]`: a stand-in for a service, without a model.

It watches HYBRIDSERVE_PARENT_PID as every service does (services/lifetime.py), says so on stdout when
SIGTERM comes, and exits; with `ignore` it shrugs SIGTERM off, as a hung shutdown would.
"""
from __future__ import annotations

import signal
import sys
import time

from services.lifetime import exit_with_parent
from services.settings import CommonSettings


def main() -> None:
    stop_after_s = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    ignore = "ignore" in sys.argv[2:]

    def on_term(sig, frame):
        print("SIGTERM" + (" ignored" if ignore else ""), flush=True)
        if not ignore:
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_term)
    exit_with_parent(CommonSettings().parent_pid, "orphan", interval_s=0.1, stop_after_s=stop_after_s)
    print("watching", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
