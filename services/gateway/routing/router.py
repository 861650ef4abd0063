"""The router, the `auto` mode policy (policy.py): pick gpu, fpga or hybrid per request from a cost model
that learns online.

(Past 300 lines on purpose: the choice and the corrections it learns share one lock; every part that can
stand alone - queues, first-token waits, the drafts' gain, exploration, samples - already does, beside it.)

Pure Python and numpy, no torch or OpenCL, so it is unit-tested in milliseconds. The estimate and the
corrections it learns share one lock here; the fit, the batch term, the queues, the first-token waits
and exploration's rule live beside it (cost_model.py, batch_slowdown.py, queues.py, first_token_waits.py,
draft_gain.py, exploration.py), the start-up check in calibration_check.py.

    T(mode) = sum over the mode's stages of  base(stage, n_in, n_out) x correction(stage)  + queueing

* base: the physical, non-negative fit of the engines' start-up profiles (cost_model.py);
* correction: per (stage, device), the smallest measured / base ratio among the stage's last
  `recent` finished requests: online samples dominate as soon as they exist, so a profile 50x
  off is corrected by the first request that runs the stage (a hybrid request teaches gpu
  prefill, the hand-off and fpga decode). The smallest, because interference (a compile
  beside the first start, a neighbour's burst) only ever adds time: one request timed on a
  busy machine must not pin a stage as slow once a quiet one has been seen, and a real
  slowdown still wins once it holds for `recent` requests in a row;
* exploration: an auto request may run a mode that is not the cheapest, to confirm or refresh a
  stage (exploration.py); the Decision says "explore";
* batching: a decode that joins a running batch costs more per token: estimate x (1 + beta x s),
  s the requests it shares its decode engine with (all of both engines' when they share one
  processor, and then every mode's decode slowed by the larger engine's factor: the cores are
  one), beta per engine learned from the requests' own decode times and the s each was
  sent with (batch_slowdown.py); corrections are learned on times divided by that factor, so a
  busy batch is not mistaken for a slow engine;
* what the stages miss before the first token, per mode (first_token_waits.py);
* crowding (the choice, not the estimate): when the engines share one processor, each mode's
  decode is charged what it would cost the requests already decoding (`_crowding_seconds`), and the
  least estimate + crowding wins: a second busy engine halves the first one's share of the cores,
  one more row in its batch costs it only beta;
* prefill ahead and queueing: what waits on each engine (queues.py).

    python -m services.gateway.routing --calibration FILE --n-in N --n-out M       (__main__.py)
"""
from __future__ import annotations

import math
import threading
from collections import deque
from typing import NamedTuple

from prometheus_client import Histogram

from services.gateway.routing.batch_slowdown import BatchSlowdown
from services.gateway.routing.cost_model import CostModel, StageKey, stage_key
from services.gateway.routing.draft_gain import DraftGain, plain_seconds
from services.gateway.routing.exploration import exploration, most_unconfirmed
from services.gateway.routing.first_token_waits import FirstTokenWaits
from services.gateway.routing.policy import Decision, ModePolicy
from services.gateway.routing.queues import EngineQueues
from services.modes import ENGINES, MODE_NAMES, MODES

# measured / estimated seconds of each stage of each finished request (1 = a perfect estimate)
ESTIMATE_RATIO = Histogram("hybridserve_router_estimate_ratio", "Measured / estimated stage seconds",
                           ["stage", "device"],
                           buckets=(0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2, 4, 10))
RATIO_CLAMP = 100.0  # one sample moves a correction by at most this factor either way
CONFIRMING = 2  # requests that must have measured a stage before its estimate is trusted
DISAGREE = 2.0  # a first request this many times slower than a quiet profile is checked by a second
ALONE_COMPANY = 2  # on one processor, decodes beside at most this many others teach the decode correction
RECENT_DECISIONS = 64  # auto decisions /debug/router shows, newest last
BESIDE_SHARE = 0.5  # the share of a processor a batch loses to one more busy process beside it


class EstimateParts(NamedTuple):
    first: float  # seconds to its first token: the stages before decode, queueing, prefill ahead, missed waits
    decode: float  # seconds of its decode
    before_decode: float  # of `first`, the stages alone (prefill, hand-off): Decision.prefill_s
    missed: float  # of `first`, what the stages lately missed (_missed_seconds): Decision.missed


class Router(ModePolicy):
    """Thread-safe: samples arrive from finished requests while others are routed."""

    def __init__(self, samples: list[dict] | None = None, window: int = 64, refit_every: int = 8,
                 recent: int = 3, explore_share: float = 0.05, explore_limit: float = 3.0,
                 stale_after: int = 100, shared_compute: bool = False, first_token_waits: bool = True,
                 crowding: bool = True, prefill_ahead: bool = True):
        self._lock = threading.Lock()
        self._base = list(samples or [])
        self._online: dict[StageKey, deque] = {}  # recent online samples per stage
        self._window, self._refit_every, self._since_fit, self._recent = window, refit_every, 0, recent
        self.shared_compute, self.first_token_waits, self.crowding = shared_compute, first_token_waits, crowding
        self.prefill_ahead = prefill_ahead
        self._log_corr: dict[StageKey, float] = {}
        self.model = CostModel()
        self._refit()
        self._queues = EngineQueues()
        self.concurrency = self._queues.concurrency  # per engine kind, the sequences a batch holds
        self.engines_up = self._queues.engines_up  # engines of each kind this gateway reaches (pairs, pools)
        self._share, self._limit, self._stale_after = explore_share, explore_limit, stale_after
        self._credit = 0.0  # for refreshing stale stages; confirming a never-measured stage needs none
        self._auto, self._explored = 0, 0
        self._last_seen: dict[StageKey, int] = {}  # auto-decision count when a stage was last measured
        self._slowdown = {e: BatchSlowdown(window) for e in ENGINES}  # decode per token with company
        self._gain = {e: DraftGain() for e in ENGINES}  # what speculative decoding gives a decode (draft_gain.py)
        self._waits = FirstTokenWaits(recent, stale_after)
        self.checking = False  # a calibration check is confirming an unquiet profile
        self._recent_decisions: deque[dict] = deque(maxlen=RECENT_DECISIONS)  # auto choices, for /debug/router

    # ---- calibration --------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        """Every mode has an estimate (both engines' profiles are in, the hand-off's too) and no
        check of an unquiet profile is running (calibration_check.py)."""
        return all(self.model.can_estimate(m) for m in MODE_NAMES) and not self.checking

    def mode_to_confirm(self, n_out: int) -> str | None:
        """A mode whose request of `n_out` tokens would measure a stage not yet confirmed (the one that
        would measure most), or None once every stage a mode runs is confirmed."""
        with self._lock:
            return most_unconfirmed([m for m in MODE_NAMES if self.model.can_estimate(m)], n_out, self._confirmed)

    def set_base_samples(self, samples: list[dict]) -> None:
        """The engines' start-up profiles (replacing earlier ones); corrections are re-derived."""
        with self._lock:
            self._base = list(samples)
            self._refit()

    def observe(self, samples: list[dict]) -> None:
        """The stage timings of one finished request (`samples_from_timings`)."""
        with self._lock:
            per_engine: dict[str, float] = {}
            for s in samples:
                key = stage_key(s)
                if key is None:
                    continue
                if key in self.model.stages:
                    company = s.get("company")
                    predicted = self._stage_estimate(key, s["n_in"], s.get("n_out") or 0, company or 0)
                    ESTIMATE_RATIO.labels(stage=key[0], device=key[1]).observe(max(s["seconds"], 0.0) / predicted)
                    if key[0] == "decode":  # measured against the estimate without drafts: their gain
                        self._gain[key[1]].add(float(s["seconds"]), predicted / self._gain[key[1]].factor())
                    if key[0] == "decode" and company is not None:
                        # against the uncorrected base: beta (c1 / c0 of the fit) is the same whatever constant
                        # error the base has, while the correction learns from these same samples. Measured
                        # against the corrected estimate, a load that held for `recent` requests was already
                        # in the correction, every ratio came out ~1 and beta 0 (39 decodes at 14-32
                        # company, live): a busy engine then looked slow alone
                        alone = self.model.stage_seconds(key, s["n_in"], s.get("n_out") or 0)
                        self._slowdown[key[1]].add(company, plain_seconds(s) / alone)
                self._online.setdefault(key, deque(maxlen=self._window)).append(s)
                self._last_seen[key] = self._auto
                if key[1] in ENGINES:
                    per_engine[key[1]] = per_engine.get(key[1], 0.0) + max(0.0, float(s["seconds"]))
                if key in self.model.stages:
                    self._log_corr[key] = self._recent_correction(key)
            self._queues.served(per_engine)
            # stages no profile measured are fitted from online samples: at once, then every few requests
            self._since_fit += 1
            unprofiled = [k for k in self._online if k not in self._profiled]
            if any(k not in self.model.stages for k in unprofiled) or \
                    (unprofiled and self._since_fit >= self._refit_every):
                self._refit()

    def observe_first_token(self, mode: str, estimated: float, missed_then: float, seconds: float) -> None:
        """A request's measured seconds to its first token against its mode's estimate at dispatch
        (`estimated`: Decision.first_token, which held `missed_then` of this term: Decision.missed)."""
        with self._lock:
            self._waits.add(mode, self._auto, seconds - (estimated - missed_then))

    def _missed_seconds(self, mode: str) -> float:
        """What the mode's stages, queueing and prefill ahead miss before its first token (first_token_waits.py)."""
        if not self.first_token_waits:
            return 0.0
        return self._waits.seconds(mode, self._auto, self.shared_compute)

    def _refit(self) -> None:
        """Base = the profiles, plus online samples for the stages no profile measured."""
        self._profiled = {stage_key(s) for s in self._base}
        by_key: dict[StageKey, list[bool]] = {}
        for s in self._base:
            by_key.setdefault(stage_key(s), []).append(bool(s.get("quiet")))
        self._quiet_profiled = {k for k, flags in by_key.items() if k is not None and all(flags)}
        extra = [s for key, q in self._online.items() if key not in self._profiled for s in q]
        self.model = CostModel.fit(self._base + extra)
        self._since_fit = 0
        self._log_corr = {}
        for key in self._online:
            if key in self.model.stages:
                self._log_corr[key] = self._recent_correction(key)

    def _recent_correction(self, key: StageKey) -> float:
        """log of the smallest measured / base ratio over the stage's last `recent` samples (a
        decode's time first divided by what its batch's company added). On one processor a decode's
        correction is learned from the decodes that ran nearly alone (company <= ALONE_COMPANY; none
        yet: no correction): what a load adds is the processor's, not the engine's, and the batch term
        carries it for every mode alike. Learned from a 64-client burst, decode_fpga's correction
        came out 24x while gpu mode's decode kept its quiet profile, so gpu mode looked 24x cheaper
        than it was and took the cores."""
        samples = list(self._online[key])
        if key[0] == "decode" and self.shared_compute:
            samples = [s for s in samples if (s.get("company") or 0) <= ALONE_COMPANY]
            if not samples:
                return 0.0
        ratios = []
        for s in samples[-self._recent:]:
            base = self.model.stage_seconds(key, s["n_in"], s.get("n_out") or 0)
            if key[0] == "decode":
                base *= self._slowdown[key[1]].factor(s.get("company") or 0)
            # a decode with accepted drafts counts its time without them (their gain is learned apart)
            ratios.append(min(RATIO_CLAMP, max(1.0 / RATIO_CLAMP, plain_seconds(s) / base)))
        return math.log(min(ratios))

    def _stage_estimate(self, key: StageKey, n_in: int, n_out: int, company: int = 0,
                        slowdown: float | None = None) -> float:
        """Seconds of one stage; a decode's as it runs beside `company` other requests (or slowed by
        `slowdown`, the processor's, when the engines share one)."""
        seconds = self.model.stage_seconds(key, n_in, n_out) * math.exp(self._log_corr.get(key, 0.0))
        if key[0] == "decode":
            seconds *= self._slowdown[key[1]].factor(company) if slowdown is None else slowdown
            seconds *= self._gain[key[1]].factor()
        return seconds

    def _shared_slowdown(self, company: dict[str, int]) -> float | None:
        """On one processor, the factor by which company slows any mode's decode: the largest engine's.
        A request sent to the engine whose batch grows less still takes its turn on the same cores,
        and its decode costs them more per token; judged by each engine's own factor, a busy batch on
        decode_fpga makes gpu mode look the cheaper (auto at 32 clients, sending work to gpu mode, gave
        0.70x forced fpga's tokens/s). With one factor for all, the choice follows each mode's own
        cost, as the shared queueing term already does."""
        if not self.shared_compute:
            return None
        return max(self._slowdown[e].factor(company.get(e, 0)) for e in ENGINES)

    def stage_seconds(self, stage: str, device: str, n_in: int, n_out: int, company: int = 0) -> float:
        """One stage's fitted seconds, corrections and batch slowdown included (the planner's costs)."""
        with self._lock:
            return self._stage_estimate((stage, device), n_in, n_out, company)

    # ---- queueing -------------------------------------------------------------------
    def started(self, mode: str, prefill_s: float = 0.0) -> None:
        """A request sent in `mode`; `prefill_s`: its prefill estimate while it waits for its first
        token (Decision.prefill_s), 0 once it streams."""
        with self._lock:
            self._queues.started(mode, prefill_s)

    def finished(self, mode: str, seconds: float | None = None, prefill_s: float = 0.0) -> None:
        """A request `started` in `mode` left it; `seconds`: how long it was there (None: it is
        counted on, elsewhere, or never ran: no end-to-end time to learn); `prefill_s`: what it was
        started with."""
        with self._lock:
            self._queues.finished(mode, seconds, prefill_s)

    def prefill_ahead_seconds(self, mode: str) -> float:
        """Prefill seconds a new request of `mode` waits behind (queues.py)."""
        return self._queues.prefill_ahead(mode, self.shared_compute) if self.prefill_ahead else 0.0

    def set_engine_load(self, engine: str, running: int, waiting: int, max_num_seqs: int,
                        engines: int = 1) -> None:
        """What the engines of a kind report of their batches, summed: running and waiting requests,
        how many they batch, and how many of them are up."""
        with self._lock:
            self._queues.set_load(engine, running, waiting, max_num_seqs, engines)

    def queued(self, engine: str) -> int:
        """Requests on `engine` that a new one shares it with (queues.py)."""
        return self._queues.queued(engine)

    def company(self) -> dict[str, int]:
        """Per engine, the requests a new one would share it with (queues.py)."""
        return self._queues.company(self.shared_compute)

    def lifetime_company(self, at_dispatch: dict[str, int] | None) -> dict[str, float] | None:
        """The company a request had over its life, for the sample it teaches: the mean of what it found
        when sent (`at_dispatch`, its Decision's) and what is left as it ends. Tagged with the company
        at dispatch alone, the requests of a burst taught nothing: the first one sent found none and ran
        beside all the rest, the last found them all, and their decodes took the same time."""
        if at_dispatch is None:
            return None
        with self._lock:
            now = self.company()
        return {e: (at_dispatch.get(e, 0) + now[e]) / 2 for e in ENGINES}

    def queueing(self, mode: str) -> float:
        """Seconds a new request waits behind the work already queued on the mode's engines."""
        return self._queues.queueing(mode, self.shared_compute)

    # ---- decisions ------------------------------------------------------------------
    def estimates(self, n_in: int, n_out: int, modes=MODE_NAMES) -> dict[str, float]:
        with self._lock:
            return self._estimates(n_in, n_out, modes)

    def _estimates(self, n_in: int, n_out: int, modes, company: dict[str, int] | None = None) -> dict[str, float]:
        return {m: p.first + p.decode for m, p in self._estimate_parts(n_in, n_out, modes, company).items()}

    def _estimate_parts(self, n_in: int, n_out: int, modes,
                        company: dict[str, int] | None = None) -> dict[str, EstimateParts]:
        """Per mode, its estimate in parts (EstimateParts)."""
        company = company if company is not None else self.company()
        shared = self._shared_slowdown(company)
        parts = {}
        for m in modes:
            if not self.model.can_estimate(m):
                continue
            missed = self._missed_seconds(m)
            waits = self.queueing(m) + self.prefill_ahead_seconds(m) + missed
            stages = decode = 0.0
            for k in CostModel.stage_keys(m):
                seconds = self._stage_estimate(k, n_in, n_out, company.get(k[1], 0), shared)
                if k[0] == "decode":
                    decode += seconds
                else:
                    stages += seconds
            parts[m] = EstimateParts(stages + waits, decode, stages, missed)
        return parts

    def _crowding_seconds(self, mode: str, n_in: int, n_out: int, decode: float) -> float:
        """Seconds the mode's decode (`decode`: its estimate) would add to the requests already decoding,
        summed over them; 0 unless the engines share one processor. Inside their batch it adds
        beta x its alone-time to each (what one more row costs a step); on the other engine it takes
        its turn on the same cores for its whole length, and the OS shares them per process, not per
        request: each of theirs runs at about half speed meanwhile. Judged on its own time alone, a
        lone gpu-mode decode beside 30 on decode_fpga looked cheap: at 32 clients auto gave 1.16x
        llama-server's tokens/s without this term and 1.50x with it, side by side
        (bench/results/serve_8_32_crowding.json). A prefill is not counted: in
        fpga mode its chunks lengthen the batch's steps, in gpu and hybrid mode it takes the cores
        from them: about alike."""
        if not (self.crowding and self.shared_compute):
            return 0.0
        engine = MODES[mode].decode_engine
        alone = self._stage_estimate(("decode", engine), n_in, n_out, 0, 1.0)
        inside = self.queued(engine) * alone * self._slowdown[engine].beta
        beside = sum(self.queued(e) for e in ENGINES if e != engine) * decode * BESIDE_SHARE
        return inside + beside

    def choose(self, n_in: int, n_out: int, forced: str | None = None, available=MODE_NAMES) -> Decision:
        """The mode to run. `available`: modes whose engines are up and can hold the request."""
        available = [m for m in MODE_NAMES if m in available]
        with self._lock:
            company = self.company()
            parts = self._estimate_parts(n_in, n_out, available, company)
            est = {m: p.first + p.decode for m, p in parts.items()}
            crowd = {m: self._crowding_seconds(m, n_in, n_out, p.decode) for m, p in parts.items()}
            kw = dict(company=company, first_token={m: p.first for m, p in parts.items()},
                      missed={m: p.missed for m, p in parts.items()}, crowding=crowd)
            prefill = lambda mode: parts[mode].before_decode if mode in parts else 0.0  # noqa: E731
            if forced is not None:
                return Decision(forced, "forced", est, prefill_s=prefill(forced), **kw)
            if not available:
                raise LookupError("no engine is able to serve this request")
            reason = "auto" if len(available) == len(MODE_NAMES) else "fallback"
            if not est:  # not calibrated yet: the one device that does both stages fastest by design
                return Decision("hybrid" if "hybrid" in available else available[0], reason, est, **kw)
            best = min(est, key=lambda m: est[m] + crowd[m])
            self._auto += 1
            explore = None
            if self._share > 0:
                self._credit = min(1.0, self._credit + self._share)
                explore = self._exploration(est, best, n_in, n_out, self._credit >= 1.0, company)
            if explore is None:
                return self._decided(Decision(best, reason, est, prefill_s=prefill(best), **kw), n_in, n_out)
            mode, confirms_new = explore
            if not confirms_new:
                self._credit -= 1.0
            self._explored += 1
            return self._decided(Decision(mode, "explore", est, prefill_s=prefill(mode), **kw), n_in, n_out)

    def _decided(self, d: Decision, n_in: int, n_out: int) -> Decision:
        """Keep the choice for /debug/router's `recent_decisions` (what was weighed, not only what won)."""
        r = lambda v: {m: round(x, 4) for m, x in (v or {}).items()}  # noqa: E731
        self._recent_decisions.append({"decision": self._auto, "n_in": n_in, "n_out": n_out, "mode": d.mode,
                                       "reason": d.reason, "estimates": r(d.estimates),
                                       "first_token": r(d.first_token), "crowding": r(d.crowding),
                                       "company": dict(d.company or {})})
        return d

    def _exploration(self, est: dict[str, float], best: str, n_in: int, n_out: int,
                     stale_ok: bool, company: dict[str, int]) -> tuple[str, bool] | None:
        """(mode, whether it measures a stage never measured) worth running instead of `best`, or None."""
        shared = self._shared_slowdown(company)
        return exploration(
            est, best, n_out, stale_ok, self._stale_after, self._limit, self._confirmed,
            lambda keys: max((self._auto - self._last_seen[k] for k in keys if k in self._last_seen), default=0),
            lambda keys: sum(self._stage_estimate(k, n_in, n_out, company.get(k[1], 0), shared) for k in keys))

    def _confirmed(self, key: StageKey) -> bool:
        """Measured by CONFIRMING requests (one alone may have run beside a compile at start-up), or
        timed by a quiet profile and not found over DISAGREE x slower by the one request that measured
        it since, which is then checked by a second. A serve benchmark's warm-up request, the first
        after two stacks started side by side, took 32x decode_fpga's quiet profile; the stage counted
        as confirmed, nothing measured it again, and auto sent every request of the 8- and 32-client
        rounds to gpu mode (42 and 57 tokens/s, the stack beside it 87 and 77)."""
        online = len(self._online.get(key, ()))
        if online >= CONFIRMING:
            return True
        return key in self._quiet_profiled and (online == 0 or self._log_corr.get(key, 0.0) <= math.log(DISAGREE))

    # ---- what the router believes, for /debug/router ----------------------------------
    def snapshot(self) -> dict:
        """The fitted coefficients, online corrections, queue state and exploration counts (JSON)."""
        with self._lock:
            corrections = {f"{st}/{dev}": {"factor": math.exp(c), "online_samples": len(self._online.get((st, dev), ())),
                                           "last_seen_decisions_ago": self._auto - self._last_seen[(st, dev)]
                                           if (st, dev) in self._last_seen else None}
                           for (st, dev), c in sorted(self._log_corr.items())}
            return {"base": self.model.as_json(), "corrections": corrections,
                    "missed_s": {m: self._missed_seconds(m) for m in MODE_NAMES},
                    "prefill_ahead_s": {e: round(self._queues.ahead[e], 4) for e in ENGINES},
                    "crowding": self.crowding and self.shared_compute,
                    "engines": {e: {**self._queues.snapshot(e), "batch_slowdown_beta": self._slowdown[e].beta,
                                    "batch_slowdown_samples": self._slowdown[e].samples,
                                    "draft_gain": self._gain[e].factor(), "draft_gain_samples": self._gain[e].samples}
                                for e in ENGINES},
                    "exploration": {"auto_decisions": self._auto, "explored": self._explored,
                                    "credit": self._credit, "share": self._share, "limit": self._limit},
                    "profile_samples": len(self._base),
                    "quiet_profiled": sorted(f"{st}/{dev}" for st, dev in self._quiet_profiled),
                    "recent_decisions": list(self._recent_decisions)}
