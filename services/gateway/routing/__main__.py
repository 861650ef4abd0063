"""`python -m services.gateway.routing --calibration FILE --n-in N --n-out M`: which mode the router
picks for one request from a file of stage-timing samples, and its estimates (JSON)."""
from __future__ import annotations

import argparse
import json
import sys

from services.gateway.routing.router import Router


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m services.gateway.routing",
                                 description="Which mode the router picks for one request, and why.")
    ap.add_argument("--calibration", required=True, help="JSON list of stage-timing samples")
    ap.add_argument("--n-in", type=int, required=True)
    ap.add_argument("--n-out", type=int, required=True)
    args = ap.parse_args(argv)
    try:
        with open(args.calibration) as f:
            samples = json.load(f)
        if not isinstance(samples, list):
            raise ValueError("the calibration file must hold a JSON list of samples")
        router = Router(samples, explore_share=0.0)  # one question, answered from the estimates alone
        d = router.choose(args.n_in, args.n_out)
    except (OSError, ValueError, KeyError, LookupError) as exc:
        print(f"router: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"mode": d.mode, "estimates": d.estimates}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
