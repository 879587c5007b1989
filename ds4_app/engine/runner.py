"""The runner: executes one StepPlan per engine step on a backend and returns the logits.

``Runner`` is all the scheduler and service see of a backend. ``step(plan)`` is exactly one call
into native code per step (with the GIL released there); the runner owns no policy.

Backends:
- ``cpu``: the native C++ engine (``_native.Engine``) over the memory-mapped GGUF.
- ``reference``: the numpy oracle (``reference.Reference``), one ``SeqState`` per slot, honouring
  the same plans (lanes in order, logits where asked). It keeps each sequence's own history, so
  block tables are ignored; it is for tests and tiny models.
- ``cuda`` / ``hip``: the GPU engine (``_native.GpuEngine``: weights and paged state in device memory),
  available in a module built with ``DS4_GPU=cuda|hip`` on a machine with a device.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .config import DS4Config
from .memory import MemoryPlan, plan_device_memory, plan_memory, tensor_cores_requested
from .plan import StepLimits, StepPlan

if TYPE_CHECKING:
    from .gguf_file import ModelFile

BACKENDS = ("cpu", "reference", "cuda", "hip")


class BackendUnavailable(RuntimeError):
    """The requested backend is not in this build (or not on this machine); one line says why."""


GPU_BACKENDS = ("cuda", "hip")

# A GPU prefills faster the more rows a step carries (one H200, docs/performance.md "GPU pass 19":
# 3843 / 6104 / 9757 tok/s at 8 / 64 / 512 rows a step), so it takes 512 and a lone prompt gets
# them all: time to first token.
GPU_MAX_ROWS = 512
# A prompt beside decoders gets at most this many rows a step, so they are not stalled for long:
# a 64-row step is ~10 ms on the H200 against ~2 ms for a decode step at 8 lanes.
GPU_ROWS_PER_PROMPT = 64


def default_max_rows(backend: str) -> int:
    """The rows one step carries when none are asked for: 512 on a GPU, upstream's 16 on the CPU."""
    return GPU_MAX_ROWS if backend in GPU_BACKENDS else StepLimits().max_rows


def default_limits(max_rows: int, backend: str = "cpu", max_slots: int = 6) -> StepLimits:
    """The backend's step policy for an engine that takes ``max_rows`` rows a step.

    Every backend: a lone prompt (no decoder) takes all the rows, as upstream's takes all 16.
    cpu / reference: upstream's 6 sequences and 4 rows a concurrent prompt, fitted to max_rows
    (at the default 16 this is exactly ``StepLimits()``). cuda / hip: a prompt beside others gets
    at most GPU_ROWS_PER_PROMPT rows, and every resident slot can decode in the same step
    (upstream's 6 sequences, or max_slots if more).
    """
    base = StepLimits()
    if backend in GPU_BACKENDS:
        return StepLimits(max_seqs=min(max_rows, max(base.max_seqs, max_slots)), max_rows=max_rows,
                          rows_per_prompt=min(GPU_ROWS_PER_PROMPT, max_rows), lone_prompt_rows=max_rows)
    return StepLimits(max_seqs=min(base.max_seqs, max_rows), max_rows=max_rows,
                      rows_per_prompt=min(base.rows_per_prompt, max_rows), lone_prompt_rows=max_rows)


class Runner:
    """Runs StepPlans for one loaded model on one backend.

    Args:
        model: an opened ModelFile.
        backend: "cpu", "reference", "cuda" or "hip".
        max_slots: resident sequences (slots 0..max_slots-1).
        max_ctx: the longest sequence, in tokens.
        kv_pool_tokens: size of the shared page pool in tokens (default ceil(max_ctx/128) pages
            per slot).
        max_rows: the most lanes one step carries (the engine's capacity); default
            ``limits.max_rows`` if limits are given, else the backend's (``default_max_rows``:
            16 on cpu / reference, 512 on cuda / hip).
        n_threads: CPU threads; 0 means one per physical core.
        limits: the step policy for the scheduler; default the backend's (``default_limits``),
            fitted to max_rows.
        qat_numerics: force the spec §7 quantization round trips on or off; None follows the file.
    """

    def __init__(self, model: "ModelFile", *, backend: str = "cpu", max_slots: int = 6, max_ctx: int = 4096,
                 kv_pool_tokens: int | None = None, max_rows: int | None = None, n_threads: int = 0,
                 limits: StepLimits | None = None, qat_numerics: bool | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if max_rows is None:
            max_rows = limits.max_rows if limits is not None else default_max_rows(backend)
        if max_slots < 1 or max_ctx < 1 or max_rows < 1 or n_threads < 0:
            raise ValueError(f"bad runner options: max_slots={max_slots} max_ctx={max_ctx} "
                             f"max_rows={max_rows} n_threads={n_threads}")
        if limits is None:
            limits = default_limits(max_rows, backend, max_slots)
        elif limits.max_rows != max_rows:
            raise ValueError(f"limits.max_rows = {limits.max_rows} but max_rows = {max_rows}; they must agree")
        config = model.config
        if qat_numerics is not None and qat_numerics != config.qat_numerics:
            config = dataclasses.replace(config, qat_numerics=bool(qat_numerics))  # re-validated there

        self.model = model
        self.config: DS4Config = config
        self.backend = backend
        self.max_slots = max_slots
        self.max_ctx = max_ctx
        self.max_rows = max_rows
        self.limits = limits
        if backend in GPU_BACKENDS:
            # The tensor-core products (DS4_GPU_MMA, CUDA only) add one scratch buffer.
            tc = ([(t.name, t.ggml_type, tuple(t.ne)) for t in model.tensors.values()]
                  if backend == "cuda" and tensor_cores_requested() else None)
            self.memory_plan: MemoryPlan = plan_device_memory(
                config, max_slots=max_slots, max_ctx=max_ctx, kv_pool_tokens=kv_pool_tokens, max_rows=max_rows,
                weights_bytes=model.file_size, tensor_core_weights=tc)
        else:
            self.memory_plan = plan_memory(config, max_slots=max_slots, max_ctx=max_ctx,
                                           kv_pool_tokens=kv_pool_tokens, max_rows=max_rows,
                                           weights_bytes=model.file_size)
        self.n_pages = self.memory_plan.n_pages
        self.kv_pool_tokens = kv_pool_tokens

        if backend == "reference":
            self._impl: Any = _ReferenceBackend(config, model, max_slots=max_slots, max_ctx=max_ctx,
                                                max_rows=max_rows)
            self.n_threads = 1
            self.device = "cpu (numpy reference)"
            return
        from . import _native

        if backend in GPU_BACKENDS:
            built = _native.gpu_backend()
            if built != backend:
                raise BackendUnavailable(
                    f"backend {backend!r} is not available: ds4_app.engine._native was built with "
                    f"DS4_GPU={built}; rebuild with DS4_GPU={backend}")
            if not _native.gpu_available():
                raise BackendUnavailable(f"backend {backend!r} is not available: no {backend} device is visible "
                                         f"to this process")
        tensors = [(t.name, t.ggml_type, t.ne, t.offset) for t in model.tensors.values()]
        if backend in GPU_BACKENDS:
            self._impl = _native.GpuEngine(config, str(model.path), tensors, max_slots=max_slots, max_ctx=max_ctx,
                                           n_pages=self.n_pages, max_rows=max_rows)
            self.n_threads = 1
            self.device = f"{backend} ({self._impl.device_name})"
            return
        self._impl = _native.Engine(config, str(model.path), tensors, max_slots=max_slots, max_ctx=max_ctx,
                                    n_pages=self.n_pages, max_rows=max_rows, n_threads=n_threads)
        self.n_threads = self._impl.n_threads
        self.device = f"cpu ({self.n_threads} threads, {_native.simd_path()})"

    def step(self, plan: StepPlan) -> np.ndarray:
        """Run one step; float32 logits [plan.n_logits, n_vocab] for the lanes that asked, in lane order."""
        return self._impl.step(plan)

    def step_argmax(self, plan: StepPlan) -> np.ndarray:
        """Run one step; int32 [plan.n_logits]: each logit lane's greedy token (np.argmax's rule:
        the lowest id among ties, the first NaN). A GPU backend takes it on the device, so only
        the tokens are copied back, not [n_logits, n_vocab] floats; the others take it from the
        logits. Either way the tokens are exactly ``step(plan).argmax(axis=1)``."""
        if self.backend in GPU_BACKENDS:
            return self._impl.step_argmax(plan)
        return self._impl.step(plan).argmax(axis=1).astype(np.int32)

    def reset_slot(self, slot: int) -> None:
        """Forget a slot's state so that a new sequence can start in it."""
        self._impl.reset_slot(slot)

    def allocated_bytes(self) -> dict[str, int]:
        """What the backend allocated, by memory-plan section (the reference: nothing it plans)."""
        return self._impl.allocated_bytes()

    def __repr__(self) -> str:
        return (f"Runner(backend={self.backend!r}, device={self.device!r}, max_slots={self.max_slots}, "
                f"max_ctx={self.max_ctx}, n_pages={self.n_pages}, max_rows={self.max_rows})")


class _ReferenceBackend:
    """The numpy oracle behind the Runner interface: one SeqState per slot, lanes run in order."""

    def __init__(self, config: DS4Config, model: "ModelFile", *, max_slots: int, max_ctx: int,
                 max_rows: int) -> None:
        from .reference import Reference

        self.ref = Reference(config, model.weights_f32(), qat=config.qat_numerics)
        self.n_vocab = config.n_vocab
        self.max_slots = max_slots
        self.max_ctx = max_ctx
        self.max_rows = max_rows
        self.states: list[Any] = [None] * max_slots

    def step(self, plan: StepPlan) -> np.ndarray:
        if plan.n_lanes > self.max_rows:
            raise ValueError(f"StepPlan has {plan.n_lanes} lanes; this runner takes at most max_rows={self.max_rows}")
        lanes = list(zip(plan.lane_slot.tolist(), plan.lane_token.tolist(), plan.lane_pos.tolist(),
                         plan.lane_logits.tolist()))
        # Check the whole plan before any state moves, so a bad plan leaves every slot as it was.
        next_pos: dict[int, int] = {}
        for i, (slot, token, pos, _) in enumerate(lanes):
            if not 0 <= slot < self.max_slots:
                raise ValueError(f"StepPlan.lane_slot[{i}] = {slot} is out of range 0..{self.max_slots - 1}")
            if not 0 <= token < self.n_vocab:
                raise ValueError(f"StepPlan.lane_token[{i}] = {token} is out of range 0..{self.n_vocab - 1}")
            if not 0 <= pos < self.max_ctx:
                raise ValueError(f"StepPlan.lane_pos[{i}] = {pos} is out of range 0..{self.max_ctx - 1}")
            state = self.states[slot]
            expect = next_pos.get(slot, state.pos if state is not None else 0)
            if pos != expect:
                # The reference cannot rewind: the scheduler resets a slot before reusing it.
                raise ValueError(f"StepPlan lane {i}: slot {slot} is at position {expect}, the plan feeds {pos}")
            next_pos[slot] = pos + 1
        out = np.empty((plan.n_logits, self.n_vocab), dtype=np.float32)
        k = 0
        for slot, token, _, want in lanes:
            if self.states[slot] is None:
                self.states[slot] = self.ref.new_state()
            logits = self.ref.step(self.states[slot], token)
            if want:
                out[k] = logits
                k += 1
        return out

    def reset_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is out of range 0..{self.max_slots - 1}")
        self.states[slot] = None

    def allocated_bytes(self) -> dict[str, int]:
        return {}
