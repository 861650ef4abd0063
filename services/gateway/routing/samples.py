"""A finished request's timings as the router's calibration samples (the same shape as the engines'
start-up profile samples: stage, device, n_in, n_out, seconds)."""
from __future__ import annotations

from services.modes import MODES


def samples_from_timings(mode: str, n_in: int, t: dict, company: dict[str, float] | None = None) -> list[dict]:
    """A finished request's timings as calibration samples; `company`: its `lifetime_company`, which the
    decode sample carries so the router learns what a batch adds. Prefill and hand-off are of the
    prompt's positions the prefix cache did not hold (a hit is not what a fresh prompt costs);
    decode's context is the whole prompt, and its sample says how many of its tokens were accepted drafts
    (the router learns their gain apart: draft_gain.py)."""
    computed = max(1, n_in - int(t.get("cached_tokens") or 0))
    out = [{"stage": "prefill", "device": MODES[mode].prefill_engine, "n_in": computed, "seconds": t["prefill_s"]}]
    if t.get("decode_tokens"):
        decode = {"stage": "decode", "device": MODES[mode].decode_engine, "n_in": n_in, "n_out": t["decode_tokens"],
                  "seconds": t["decode_s"], "accepted": int(t.get("accepted_draft_tokens") or 0)}
        if company is not None:
            decode["company"] = company[MODES[mode].decode_engine]
        out.append(decode)
    if mode == "hybrid":
        out.append({"stage": "handoff", "n_in": computed, "seconds": t["handoff_exposed_s"]})
    return out
