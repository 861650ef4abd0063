"""The mode policy: which mode (gpu, fpga, hybrid) serves a request, and what it learns from the ones it
routed. The dispatcher and the serving loop see only this; a new policy is one file that subclasses
`ModePolicy` and implements `choose` (and `observe` if it learns).

`auto` is the router (router.py): a cost model fitted to the engines' profiles and corrected online.

The calls, in a request's order:

* `choose(n_in, n_out, forced, available)` -> `Decision`: the dispatcher, for each attempt. `available`
  are the modes whose engines are up and whose context windows hold the request; `forced` a mode the
  client named (the policy says why and what it estimated, but the mode is that one).
* `started(mode, prefill_s)` / `finished(mode, seconds, prefill_s)`: a request entered or left a mode
  (the dispatcher while it waits for the first message, then the serving loop while it streams): the
  load a policy may weigh. A request that migrates leaves one mode and enters another.
* `observe_first_token(...)`: the seconds to its first token against the decision's estimate.
* `observe(samples)`: a finished request's stage timings (router.py's `samples_from_timings`), with the
  company it had over its life (`lifetime_company`).

Every call but `choose` has a default that does nothing, so a policy that does not learn is a few lines.
Calls come from the event loop's thread and, for `observe`, possibly others: a policy that keeps state
guards it (the router holds one lock).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from services.modes import MODE_NAMES

if TYPE_CHECKING:
    from services.gateway.fleet.prefix_routing import Placement


@dataclass(frozen=True)
class Decision:
    mode: str
    reason: str  # "auto" | "forced" | "fallback" | "explore" (and the dispatcher's "migration")
    estimates: dict[str, float]  # seconds per mode; only the modes considered ({} for a policy without)
    pair: int = 0  # the engine pair that serves it (the dispatcher's choice, after the mode)
    company: dict[str, int] | None = None  # per engine, the requests this one shares it with when sent
    placement: "Placement | None" = None  # prefix_routing.py: why that pair (set by the dispatcher)
    # per mode, seconds to the first token as estimated (prefill, hand-off, queueing and `missed`), and
    # what of that was the missed-waits term
    first_token: dict[str, float] | None = None
    missed: dict[str, float] | None = None
    # per mode, the seconds its decode would cost the requests already decoding (shared processor only);
    # the choice is the least estimate + crowding
    crowding: dict[str, float] | None = None
    # the chosen mode's prefill and hand-off estimate: ahead of the next requests until its first token
    prefill_s: float = 0.0


class ModePolicy(ABC):
    """Picks a mode per request (`choose`); learns from finished ones (`observe`). See the module docstring."""

    @abstractmethod
    def choose(self, n_in: int, n_out: int, forced: str | None = None,
               available: Sequence[str] = MODE_NAMES) -> Decision:
        """The mode to run a request of `n_in` prompt tokens and up to `n_out` new ones in; LookupError
        when `available` is empty and nothing is forced."""

    def observe(self, samples: list[dict]) -> None:
        """The stage timings of one finished request."""

    def observe_first_token(self, mode: str, estimated: float, missed_then: float, seconds: float) -> None:
        """A request's seconds to its first token, against `estimated` (its Decision's `first_token`)."""

    def started(self, mode: str, prefill_s: float = 0.0) -> None:
        """A request entered `mode`; `prefill_s`: its Decision's prefill estimate while it waits for a token."""

    def finished(self, mode: str, seconds: float | None = None, prefill_s: float = 0.0) -> None:
        """A request `started` in `mode` left it after `seconds` (None: no time worth learning)."""

    def lifetime_company(self, at_dispatch: dict[str, int] | None) -> dict[str, float] | None:
        """The company a finished request had over its life, for the samples `observe` gets (None: none kept)."""
        return None
