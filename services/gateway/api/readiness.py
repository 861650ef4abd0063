"""Liveness and readiness, as Kubernetes and load balancers read them.

* `/livez`: 200 while the gateway's process answers at all: a liveness probe restarts the process
  only when this fails, never because an engine is down or the router is still calibrating.
* `/health` (and `/readyz`, its Kubernetes-style name): 200 only once the stack serves at its speed:
  some pair has both engines up, and the router has been calibrated once (the engines' start-up
  profiles are in, and a check of an unquiet profile is over). Until then a 503 whose body says what
  it waits on, so a script, a readiness probe or a load balancer sends no traffic that would share
  the cores with calibration work and be routed on guesses.

Once ready, a later re-check (an engine started again) does not take readiness away: the check yields
to requests (calibration_check.py), and taking the only gateway out of its Service for it would turn
a restart into an outage. An engine down still does, as before, when no pair has both engines up.
"""
from __future__ import annotations

from services.gateway.protocol.openai_format import Health
from services.modes import ENGINE_NAMES


class Readiness:
    """Whether the gateway has been ready once (latched: see the module's docstring)."""

    def __init__(self):
        self.ever_ready = False

    def health(self, up: dict[int, dict[str, bool]], calibrated: bool, draining: bool,
               one_pair: bool) -> tuple[Health, int]:
        """The body and status code of /health from each pair's engines (`up`: pair -> engine -> up), the
        router's calibration right now and the drain state."""
        every = bool(up) and all(all(engines.values()) for engines in up.values())
        serving = any(all(engines.values()) for engines in up.values())  # some pair serves every mode
        engines = {ENGINE_NAMES[e] if one_pair else f"{ENGINE_NAMES[e]}@{p}": "up" if ok else "down"
                   for p, engines in up.items() for e, ok in engines.items()}
        if serving and calibrated:
            self.ever_ready = True
        ready = serving and self.ever_ready and not draining
        waiting = [name for name, state in engines.items() if state == "down"] if not serving else []
        if not self.ever_ready and not calibrated:
            waiting.append("calibration")
        if draining:
            waiting.append("drain")
        status = ("draining" if draining else "starting" if not self.ever_ready
                  else "ok" if every else "degraded")
        body = Health(status=status, ready=ready, waiting_for=waiting, engines=engines, calibrated=calibrated)
        return body, 200 if ready else 503
