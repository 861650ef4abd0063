"""The OpenCL engine: the paged step (BatchEngine, services/engine/api.py) over the parts it composes.

    config.py          EngineConfig (what is asked for) and DeviceFit (what it comes to here)
    device_weights.py  DeviceWeights: the weights on the device, one builder per storage format
    scratch.py         the forward's working buffers
    paged_kv_store.py  PagedKVStore: the paged KV pool, KV handed off by prefill_gpu imported into its blocks
    paged_step_rows.py a step's rows from the scheduler's chunks, checked, and their upload
    paged_plans.py     PagedStepPlans: the bound launches of a step, for any rows
    device_logprobs.py a step's logprobs and top k on the device (kernels/logprobs.cl)
    step_gate.py       a one-launch step let go and read back with the GIL released

Every request reaches the engine as chunks of a step, which the engine loop
(services/engine/engine_loop.py) schedules: a server's, or a tool's own (services/engine/one_request.py).
One forward serves prefill and decode: it runs the step's rows (token, sequence, position) through
every layer, K and V read and written through the sequences' block tables. The whole step is
enqueued on one in-order queue and the host waits once, when it reads back the sampled tokens or
logits (on PoCL a waited launch costs ~48 µs, an enqueue ~2.4 µs).

A step of one decode row, or of 2-4 rows, on a CPU device runs either as one launch (paged_plans.py's
one_launch and one_launch_rows, decode_layers.cl, enqueued whole behind a user event before it starts) or
launch by launch, whichever has been faster lately (one_launch_choice.py, a choice per row count: the one
launch stalls when another process takes one of its cores). If its work-groups fail to run at once, the
step is redone launch by launch and counts as a failure.
"""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pyopencl as cl

from services.decode_fpga.config import DeviceFit, EngineConfig
from services.decode_fpga.cpu_wake import CpuWakeLatency
from services.decode_fpga.device import DeviceContext, select_device
from services.decode_fpga.device_weights import DeviceWeights, build_device_weights
from services.decode_fpga.one_launch_choice import OneLaunchChoice
from services.decode_fpga.paged_kv_store import PagedKVStore
from services.decode_fpga.paged_plans import ONE_LAUNCH_ROWS, PagedStepPlans
from services.decode_fpga.paged_step_rows import PagedStepInputs
from services.decode_fpga.scratch import Scratch
from services.decode_fpga.settings import DecodeSettings
from services.decode_fpga.step_gate import Read, StepGate
from services.engine.logprobs import LogprobsAsked, StepLogprobs
from services.model.config import ModelConfig
from services.model.gguf_blocks import read_block_tensors
from services.model.loading import LoadedModel
from services.model.weights import ModelWeights

log = logging.getLogger(__name__)

PROMPT_LOGIT_ROWS = 64  # a step's logit rows for prompt logprobs (SchedulerConfig.prompt_logit_rows)


class OpenCLEngine:
    """BatchEngine (services/engine/api.py) on an OpenCL device."""

    def __init__(self, cfg: ModelConfig, dev: DeviceContext, config: EngineConfig, weights: DeviceWeights):
        if weights.fmt != config.weights_dtype or len(weights.layers) != cfg.n_layers:
            raise ValueError(f"device weights of {len(weights.layers)} {weights.fmt} layers do not fit a "
                             f"{cfg.n_layers}-layer model stored as {config.weights_dtype}")
        self.cfg, self.dev, self.config, self.weights = cfg, dev, config, weights
        self.device_name = dev.name
        self.fit = DeviceFit.of(config, cfg, dev)
        self.scratch = Scratch.allocate(dev, cfg, self.fit.max_rows, self.fit.max_context)
        # the paged pool, a step's int inputs and its launches
        self.paged = PagedKVStore.from_budget(dev, cfg, config.kv_cache_mb, config.block_size, self.fit.max_context)
        # the RoPE angles' cos | sin of every position, once (paged_attention.cl's rope_table)
        self.paged.kernels.bind_rope_table(self.fit.max_context, weights.inv_freq, self.scratch.rope_cs).enqueue(
            dev.queue)
        # logit rows: one per sequence, and PROMPT_LOGIT_ROWS more for prompts that want every row's
        self.prompt_logit_rows = PROMPT_LOGIT_ROWS
        self.max_logit_rows = config.max_num_seqs + PROMPT_LOGIT_ROWS
        self.step_inputs = PagedStepInputs(dev, self.paged.layout, cfg.vocab_size, config.max_num_batched_tokens,
                                           config.max_num_seqs, self.paged.max_blocks, self.fit.max_context,
                                           self.max_logit_rows)
        self.paged_plans = PagedStepPlans(dev, cfg, weights, self.paged, self.scratch, self.step_inputs,
                                          self.max_logit_rows, self.fit.one_launch_layers, self.fit.layer_groups)
        dev.queue.finish()
        self._lock = threading.RLock()  # one step at a time on the one queue
        self.one_launch_choice = OneLaunchChoice(dev.name)  # one launch or launch by launch, a one-row step
        self._gate = StepGate()
        # the same for steps of 2 to ONE_LAUNCH_ROWS rows, a choice for each row count
        self.rows_launch_choices = {n: OneLaunchChoice(dev.name, rows=n) for n in range(2, ONE_LAUNCH_ROWS + 1)}
        # greedy rows' logprobs by the device's kernel (the engine loop asks, step(logprobs=...)); False:
        # the loop reads their logits rows and computes them on the host (the A/B of bench/micro/logprobs_cost.py)
        self.logprobs_on_device = config.device_logprobs
        # on a CPU device, cores that halt between kernels wake late for the next one (cpu_wake.py)
        self._wake = CpuWakeLatency() if self.fit.keep_cores_awake else None

    @classmethod
    def create(cls, cfg: ModelConfig, host_weights: ModelWeights, dev: DeviceContext,
               config: EngineConfig = EngineConfig(), blocks: dict | None = None) -> "OpenCLEngine":
        """Upload the weights in config's storage format (gguf needs the checkpoint's blocks,
        gguf_blocks.read_block_tensors) and build the engine on them."""
        start = time.perf_counter()
        pack = DeviceFit.of(config, cfg, dev).one_launch_layers  # the layers in one buffer for decode_layers
        weights = build_device_weights(dev, cfg, host_weights, config.weights_dtype, blocks, pack_layers=pack,
                                       allow_dense_fallback=config.allow_dense_fallback)
        engine = cls(cfg, dev, config, weights)
        log.info("OpenCL engine weights by type (in the file → on the device): %s", weights.storage_summary())
        log.info("OpenCL engine on %s: %.1f MB of %s weights resident, a paged KV pool of %.1f MB "
                 "(%d blocks of %d tokens), uploaded in %.2fs", dev.name, weights.nbytes / 1e6, weights.fmt,
                 engine.paged.nbytes / 1e6, engine.num_blocks, engine.block_size, time.perf_counter() - start)
        return engine

    @classmethod
    def from_settings(cls, loaded: LoadedModel, settings: DecodeSettings) -> "OpenCLEngine":
        dev = select_device(settings.opencl_platform, settings.opencl_device, settings.opencl_binary_dir,
                            settings.opencl_lanes, settings.opencl_gemv_tile, settings.activations)
        config = EngineConfig.from_settings(settings, loaded.checkpoint.kind)
        blocks = (read_block_tensors(loaded.checkpoint, loaded.config, config.allow_dense_fallback)
                  if config.weights_dtype == "gguf" else None)
        return cls.create(loaded.config, loaded.weights, dev, config, blocks)

    # ---- what services, benchmarks and tests read ----------------------------------------
    @property
    def weights_dtype(self) -> str:
        return self.config.weights_dtype

    @property
    def stored_weight_types(self) -> dict[str, int]:
        """Weight matrices per storage format on the device (Info's stored_weight_types)."""
        return self.weights.stored_types()

    @property
    def weights_nbytes(self) -> int:
        """Bytes of weights a decode step reads."""
        return self.weights.nbytes

    @property
    def max_context(self) -> int:
        return self.fit.max_context

    # ---- BatchEngine: what the engine loop reads -------------------------------------
    @property
    def block_size(self) -> int:
        return self.paged.layout.block_size

    @property
    def num_blocks(self) -> int:
        return self.paged.layout.num_blocks

    @property
    def max_num_batched_tokens(self) -> int:
        return self.config.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        return self.config.max_num_seqs

    # ---- BatchEngine API -----------------------------------------------------------------
    def step(self, chunks, greedy: bool, on_layer=None,
             logprobs: LogprobsAsked | None = None) -> list[int] | np.ndarray | StepLogprobs:
        """One forward over every row of every chunk (services/engine/api.py's BatchEngine.step): the
        sampling chunks' argmax tokens (greedy) or their logits [n_sampling, vocab]; with `logprobs`
        (greedy only), each logit row's argmax, its target's logprob and k best, computed on the device
        (StepLogprobs). One wait, when the results are read back (and one a layer while on_layer is given)."""
        if logprobs is not None and not greedy:
            raise ValueError("logprobs on the device come with the device's argmax (greedy steps)")
        with self._lock:
            rows = self.step_inputs.rows(chunks)
            targets = None if logprobs is None else self.paged_plans.logprobs.check(logprobs, rows.n_samples)
            k = None if logprobs is None else logprobs.k
            if on_layer is not None or not self.paged_plans.can_run_as_one_launch(rows):
                return self._paged_step(rows, greedy, on_layer, one_launch=False, targets=targets, k=k)
            choice = self.one_launch_choice if rows.n_rows == 1 else self.rows_launch_choices[rows.n_rows]
            return choice.run(lambda one_launch: self._paged_step(rows, greedy, None, one_launch, targets=targets, k=k))

    def _paged_step(self, rows, greedy: bool, on_layer, one_launch: bool, targets=None, k: int | None = None):
        """A step over the rows, uploaded first; None when its one launch gave up (nothing to read)."""
        self._keep_awake()
        q, plans, keep = self.dev.queue, self.paged_plans, []
        self.step_inputs.upload(rows, keep)
        if k is not None:
            plans.logprobs.upload(targets, keep)
        if k is not None:
            out = plans.logprobs.host_words(rows.n_samples, k)
            result = Read(out, plans.logprobs.words)
        else:
            out = (np.empty(rows.n_samples, np.int32) if greedy
                   else np.empty((rows.n_samples, self.cfg.vocab_size), np.float32))
            result = Read(out, plans.picks if greedy else plans.logits)
        reads = [result] if rows.n_samples else []
        if one_launch:
            # decode_layers' work-groups spin at their barriers and hold every core: a host thread enqueuing
            # while they run waits for a core, and the device for its next command. So the whole step is
            # enqueued behind a gate first, which opens when nothing but OpenCL calls are left: a thread that
            # loses its core to the work-groups must not be holding the GIL then (step_gate.py)
            gate = cl.UserEvent(self.dev.context)
            try:
                failed = self._enqueue_one_launch(rows, greedy, gate, k)
            except BaseException:
                StepGate.open(gate)  # what was enqueued behind it drains; the step is not read
                q.finish()
                raise
            self._gate.open_and_read(q, gate, [Read(failed, self.scratch.sync), *reads])  # the one wait
            if failed[0]:
                return None
        else:
            self._enqueue_launches(rows, greedy, on_layer, k)
            if reads:
                cl.enqueue_copy(q, result.host, result.buffer, is_blocking=True)  # the one wait
            else:
                q.finish()
        if k is not None:
            return StepLogprobs.from_words(out, k)
        return out.tolist() if greedy else out

    def _enqueue_one_launch(self, rows, greedy: bool, gate: cl.UserEvent, logprobs_k: int | None) -> np.ndarray:
        """Enqueue the embedding, every layer as one launch and the head of a paged step behind `gate`;
        returns the host array its failure flag is to be read into (decode_layers.cl's sync[0])."""
        q, plans = self.dev.queue, self.paged_plans
        embed = plans.embed
        cl.enqueue_nd_range_kernel(q, embed.kernel, (rows.n_rows, *embed.global_size[1:]), embed.local_size,
                                   wait_for=[gate])
        for launch in plans.one_launch_for(rows):
            launch.enqueue(q, 0, 1)
        plans.enqueue_head(q, rows, greedy, logprobs_k)
        return np.zeros(1, np.int32)

    def _enqueue_launches(self, rows, greedy: bool, on_layer, logprobs_k: int | None) -> None:
        """Enqueue the embedding, every layer and the head of a paged step launch by launch (waiting after
        each layer while on_layer is given)."""
        q, plans = self.dev.queue, self.paged_plans
        plans.embed.enqueue(q, *rows.span("all"))
        for li in range(self.cfg.n_layers):
            plans.enqueue_layer(q, li, rows)
            if on_layer is not None:
                q.finish()  # layer li's K and V of every chunk are in the pool
                on_layer(li)
        plans.enqueue_head(q, rows, greedy, logprobs_k)

    def import_kv_blocks(self, block_table, layer: int, kv: np.ndarray) -> None:
        """Hybrid, receiving side: one layer of wire-layout KV [2, n_kv_heads, n, head_dim] (fp32 or fp16)
        into positions [0, n) of the blocks; only enqueued (finish_import_blocks waits). Not under the
        engine's lock, nor behind its steps: the blocks are reserved for the hand-off and no step reads
        them until the request joins the batch (PagedKVStore.import_layer)."""
        self.paged.import_layer(block_table, layer, kv)

    def finish_import_blocks(self) -> None:
        self.paged.finish_import()

    def read_kv_blocks(self, block_table, n_tokens: int) -> np.ndarray:
        """Positions [0, n) in wire layout, [n_layers, 2, n_kv_heads, n, head_dim] float32."""
        with self._lock:
            return self.paged.read(block_table, n_tokens)

    def _keep_awake(self) -> None:
        if self._wake is not None:
            self._wake.touch()
