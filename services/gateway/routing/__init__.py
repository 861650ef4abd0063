"""Which mode serves a request: the mode policy protocol (policy.py), `auto` (the router and its cost
model), and what keeps the router's picture fresh (engine_watch, calibration_check). Reads fleet/."""
