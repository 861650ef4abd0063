"""The Prefill RPC's messages ↔ the hand-off seam's plain messages (services/kv/handoff.py).

prefill_gpu's servicer sends with `handoff_to_proto`; decode_fpga reads with `handoff_from_proto`. The fields match one for one.
"""
from __future__ import annotations

from services.engine.logprobs import TokenLogprob
from services.kv.handoff import HandoffEvent, LayerReady, PrefillDone, SlotGrant
from services.rpc.hybridserve.v1 import engine_pb2 as pb


def handoff_to_proto(ev: HandoffEvent) -> pb.PrefillResponse:
    if isinstance(ev, SlotGrant):
        return pb.PrefillResponse(slot=pb.SlotGranted(offset=ev.offset, size=ev.size, n_tokens=ev.n_tokens,
                                                      dtype=ev.dtype))
    if isinstance(ev, LayerReady):
        return pb.PrefillResponse(layer=pb.LayerReady(layer=ev.layer, offset=ev.offset, nbytes=ev.nbytes,
                                                      written_at=ev.written_at))
    done = pb.PrefillDone(first_token=ev.first_token, prefill_s=ev.prefill_s, queue_s=ev.queue_s,
                          compute_done_at=ev.compute_done_at)
    if ev.first_logprob is not None:
        done.first_logprob.CopyFrom(logprob_to_proto(ev.first_logprob))
    if ev.prompt_logprobs is not None:
        done.prompt_logprobs.extend(logprob_to_proto(lp) for lp in ev.prompt_logprobs)
    return pb.PrefillResponse(done=done)


def handoff_from_proto(msg: pb.PrefillResponse) -> HandoffEvent:
    kind = msg.WhichOneof("event")
    if kind == "slot":
        s = msg.slot
        return SlotGrant(s.offset, s.size, s.n_tokens, s.dtype)
    if kind == "layer":
        m = msg.layer
        return LayerReady(m.layer, m.offset, m.nbytes, m.written_at)
    if kind == "done":
        d = msg.done
        # prompt logprobs: an empty list is what a one-token prompt has; absent means not asked for, which
        # the receiver knows from its own request (it reads them only then)
        return PrefillDone(d.first_token, d.prefill_s, d.queue_s, d.compute_done_at,
                           logprob_from_proto(d.first_logprob) if d.HasField("first_logprob") else None,
                           tuple(logprob_from_proto(lp) for lp in d.prompt_logprobs))
    raise ValueError(f"a Prefill message with no event ({kind!r})")


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(logprob=lp.logprob, top_token_ids=[t for t, _ in lp.top],
                           top_logprobs=[v for _, v in lp.top])


def logprob_from_proto(lp: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.logprob, tuple(zip(lp.top_token_ids, lp.top_logprobs)))
