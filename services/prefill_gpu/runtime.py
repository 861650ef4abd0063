"""prefill_gpu's request handling in plain Python: gpu-mode Generate, and Prefill into a hand-off.

`PrefillRuntime.prefill(request, wire_dtype, cancel)` computes a prompt's KV into
a hand-off sender (the shared-memory arena by default; a TCP connection to the
reader when it gave an address: `tcp_sender`) and yields the seam's
messages: the SlotGrant, one LayerReady per layer as soon as that layer is there
(while the next computes), then PrefillDone with the first sampled token. The
prompt runs through the engine loop like any request (batched, chunked, its prefix
cached), with one sampled token and an export hook that copies each layer out of
the pool during the step that completes the prompt. The sender's memory is freed
when the caller stops iterating (closing the generator: the reader ends the call) or
when the call's deadline passes, never earlier (`slot_hold_s` after PrefillDone only for
a call without a deadline).
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Iterator

from services.engine import metrics as m
from services.engine.requests import Cancellation, EngineRequest
from services.engine.runtime import EngineRuntime
from services.engine.sampling import SamplingParams
from services.errors import Cancelled, InvalidRequest, PromptTooLong, QueueFull
from services.kv.arena import Arena, ArenaFull
from services.kv.handoff import HandoffEvent, KVSender, PrefillDone, SlotGrant
from services.kv.header import SlotHeader
from services.kv.layout import WIRE_DTYPES
from services.kv.shm import ShmSender
from services.kv.tcp import TcpSender
from services.kv.tcp_frames import DEFAULT_TIMEOUT_S
from services.prefill_gpu import cpu_priority
from services.prefill_gpu.handoff_admission import HandoffAdmission
from services.prefill_gpu.kv_export import LayerExporter


log = logging.getLogger(__name__)


def speculation_caveat(device_type: str, speculative_k: int) -> str | None:
    """What to say at start when drafts are asked for where they were measured to cost more than they give."""
    if device_type == "cuda" and speculative_k > 0:
        # decode steps replay captured CUDA graphs; a verify step (every row's logits) has no graph bucket and
        # runs eagerly (cuda_graphs.py): on an H200, 4 and 16 sequences with drafts made 0.21-0.56x the tokens/s
        return (f"speculative_k={speculative_k} on CUDA: verify steps run eagerly (no CUDA graph); on an H200 "
                "drafts gave 0.21-0.56x the tokens/s without them at 4 and 16 sequences (docs/speculation.md). "
                "HYBRIDSERVE_PREFILL_SPECULATIVE_K=0 is faster there")
    return None


class PrefillRuntime(EngineRuntime):
    device_label = "gpu"
    engine_name = "torch"
    default_mode = "gpu"

    def __init__(self, engine, loaded, settings, arena: Arena):
        super().__init__(engine, loaded, settings, loaded.config.max_context)
        self.arena = arena
        self.modes = {"gpu": self.local_generation}
        # hand-offs get their own admission, sized from the memory they hold (handoff_admission.py): a
        # hybrid decode must never wait behind gpu-mode generations for its prefill
        self.handoff_admission = HandoffAdmission(arena.size, settings.handoff_max_running,
                                                  settings.prefill_queue_depth)
        caveat = speculation_caveat(engine.device.type, settings.speculative_k)
        if caveat:
            log.warning(caveat)

    cpu_class: str | None = None  # the CPU scheduling class taken for serving (cpu_priority.py); None: not yet
    # called once profile_samples has the engine's timings: the service's start-up (server.build) takes its
    # serving CPU class there; in-process users (tests) leave their own process's class alone
    after_profile: Callable[[], object] | None = None

    def take_serving_priority(self) -> str:
        """Put the whole process in its serving CPU class (settings.cpu_priority), once: "idle" or "normal";
        and its scheduling group at settings.cpu_group_nice, on the CPU."""
        if self.cpu_class is None:
            self.cpu_class = cpu_priority.apply(self.settings.cpu_priority, self.engine.device.type)
            cpu_priority.apply_group_nice(self.settings.cpu_group_nice, self.engine.device.type)
        return self.cpu_class

    def profile_samples(self, refresh: bool = False):
        profile = super().profile_samples(refresh)
        if self.after_profile is not None:
            self.after_profile()
        return profile

    def info_fields(self) -> dict:
        return {**super().info_fields(), "kv_dtype": self.settings.wire_dtype, "arena_name": self.arena.name,
                "arena_size": self.arena.size}

    def shm_sender(self, header: SlotHeader) -> KVSender:
        return ShmSender(self.arena, header, self.settings.arena_wait_s)

    def tcp_sender(self, address: tuple[str, int], header: SlotHeader, cancel: Cancellation) -> KVSender:
        """The KV over a connection to the reader at `address` (its own memory, not an arena slot). Its
        socket waits as long as the call may last: the reader imports only once it reserved blocks. With
        the engine token the header carries a tag that proves it (the reader refuses KV without one)."""
        wait_s = DEFAULT_TIMEOUT_S if cancel.deadline is None else max(1.0, cancel.deadline - time.monotonic())
        token = self.settings.engine_token.get_secret_value() if self.settings.engine_token else None
        return TcpSender(address, header, timeout_s=wait_s, token=token)

    def _update_arena_gauges(self) -> None:
        m.ARENA_USED_BYTES.set(self.arena.used_bytes)
        m.ARENA_SLOTS_IN_USE.set(self.arena.slots_in_use)

    def prefill(self, request: EngineRequest, wire_dtype: str, cancel: Cancellation,
                new_sender: Callable[[SlotHeader], KVSender] | None = None,
                skip_tokens: int = 0) -> Iterator[HandoffEvent]:
        """Hand `request`'s prompt KV over through `new_sender(header)` (default: the arena), from
        position `skip_tokens` on (the reader holds the ones before), once the admission reserved its
        memory. Raises InvalidRequest, PromptTooLong (HandoffTooLarge: larger than all the hand-off
        memory), QueueFull, Cancelled or HandoffTimedOut (while queued)."""
        cfg = self.loaded.config
        prompt = list(request.prompt_ids)
        if not prompt or len(prompt) >= self.max_context or max(prompt) >= cfg.vocab_size:
            raise InvalidRequest(f"prompt must have 1..{self.max_context - 1} token ids below {cfg.vocab_size}")
        wire = wire_dtype or self.settings.wire_dtype
        if wire not in WIRE_DTYPES:
            raise InvalidRequest(f"wire_dtype must be {' or '.join(WIRE_DTYPES)}, not {wire!r}")
        if not 0 <= skip_tokens < len(prompt):
            raise InvalidRequest(f"skip_tokens must be below the prompt's {len(prompt)} tokens, got {skip_tokens}")
        header = SlotHeader(wire, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, len(prompt) - skip_tokens,
                            cfg.model_id)
        pool = self.loop.scheduler
        if pool.block_manager.blocks_needed(len(prompt)) > pool.config.num_blocks:  # before it holds anything
            raise PromptTooLong(f"a prompt of {len(prompt)} tokens needs more KV blocks than prefill_gpu's "
                                f"{pool.config.num_blocks}-block cache holds")
        sender = (new_sender or self.shm_sender)(header)
        try:
            with self.handoff_admission.admit(sender.memory_bytes, sender.reserve_now, cancel) as queue_s:
                try:
                    grant = sender.open()  # the memory is reserved already: no wait here
                    self._update_arena_gauges()
                    yield from self._prefill_into(sender, grant, prompt, request.params, queue_s, cancel,
                                                  skip_tokens)
                finally:
                    sender.close()  # before the admission lets the next one in: its memory is free now
                    self._update_arena_gauges()
        except (QueueFull, ArenaFull):
            m.REQUESTS.labels(status="rejected").inc()
            raise
        except Cancelled:
            m.REQUESTS.labels(status="cancelled").inc()
            raise
        finally:
            sender.close()  # idempotent: also what reserve_now took if the admission failed after it

    def _prefill_into(self, sender: KVSender, grant: SlotGrant, prompt: list[int], params: SamplingParams,
                      queue_s: float, cancel: Cancellation, skip_tokens: int = 0) -> Iterator[HandoffEvent]:
        yield grant
        exporter = LayerExporter(self.engine, sender, skip_tokens)
        events: queue.Queue = queue.Queue()
        stop = threading.Event()  # this generator is done: nothing may write into the sender any more

        def export(layer: int, block_table, n_tokens: int) -> None:  # on the engine loop's thread
            if stop.is_set() or cancel.is_cancelled():
                raise Cancelled("the hand-off's reader went away")
            exporter.write_layer(layer, block_table, n_tokens)
            events.put(("layer", layer))

        stream = self.loop.submit(prompt, dataclasses.replace(params, max_tokens=1), export,
                                  bounded_elsewhere=True)  # by handoff_admission

        def follow() -> None:  # the stream's one token (or its error) into the same queue
            try:
                for ev in stream.events(cancelled=cancel.is_cancelled):
                    events.put(("done", ev))
            except Exception as exc:
                events.put(("error", exc))

        follower = threading.Thread(target=follow, name="prefill-follow", daemon=True)
        follower.start()
        try:
            while True:
                try:
                    ev = events.get(timeout=0.05)
                except queue.Empty:
                    if cancel.is_cancelled():
                        return
                    continue
                if ev[0] == "layer":
                    yield exporter.wait_layer(ev[1])
                elif ev[0] == "done":
                    t = stream.timings
                    m.STAGE_SECONDS.labels(stage="prefill", device="gpu").observe(t.prefill_s)
                    first = ev[1]
                    done = PrefillDone(first.token, t.prefill_s, queue_s + t.queue_s, time.time(),
                                       first.logprob, first.prompt_logprobs)
                    sender.finish()  # over TCP: until the reader said every byte is imported
                    yield done
                    m.REQUESTS.labels(status="ok").inc()
                    # keep the memory until the reader ends the call (its layers are on its device) or
                    # the call's deadline passes; slot_hold_s bounds only a call that has no deadline
                    cancel.wait(None if cancel.deadline is not None else self.settings.slot_hold_s)
                    return
                elif isinstance(ev[1], Cancelled):
                    return
                else:
                    raise ev[1]
        finally:
            stop.set()  # the loop's next export for this request raises and drops it
            stream.cancel()
            follower.join()  # the memory may be freed only once nothing writes into it
