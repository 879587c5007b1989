# The GPU step executor (ext/gpu/engine_gpu.h) for ext/python/_native.pyx to include, after
# _model_config, _check_range, _check_slots, _f16_rows and _f32_states are defined:
#
#     include "../gpu/engine_binding.pxi"
#
# GpuEngine has the Python interface of Engine (step, reset_slot, allocated_bytes) plus
# device_name. Testing hooks (added to _testing): gpu_export_slot_state (the GPU twin of
# export_slot_state), gpu_sync_slot (a CPU Engine slot's state copied into a GpuEngine slot) and
# gpu_qat (the step kernels' FP8 / FP4 / Hadamard / f16 round trips on host rows). Without a GPU
# backend the C++ constructor throws, so the class exists in every build and raises RuntimeError.

cdef extern from "../gpu/engine_gpu.h" nogil:
    cdef cppclass CGpuEngine "ds4::gpu::GpuEngine":
        CGpuEngine(const ModelConfig& cfg, const string& gguf_path, const vector[WeightEntry]& weights,
                   const EngineOptions& opts) except +
        void step(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                  const int32_t* lane_logits, int n_tables, const int32_t* table_slot,
                  const int32_t* block_table, int max_blocks, float* logits_out, int32_t* argmax_out) except +
        void reset_slot(int slot) except +
        SlotStateExport export_slot_state(int slot, const int32_t* block_table, int max_blocks,
                                          int64_t n_tokens) except +
        void import_slot_state(int slot, const int32_t* block_table, int max_blocks, int64_t n_tokens,
                               const SlotStateExport& state) except +
        vector[pair[string, uint64_t]] allocated_bytes() except +
        string device_name() except +
        void set_graphs(cbool on) except +
        cbool graphs()
        int graphs_captured()
        vector[double] host_phases_us()
        void set_matvec_tall(cbool on) except +
        cbool matvec_tall()
        void set_matvec_staged(cbool on) except +
        cbool matvec_staged()
        void set_matvec_staged_min(int cols) except +
        int matvec_staged_min()
        void set_l2_prefetch(cbool on) except +
        cbool l2_prefetch()
        void set_branches(cbool on) except +
        cbool branches()
        void set_hc_fused(cbool on) except +
        cbool hc_fused()
        void set_route_fused(cbool on) except +
        cbool route_fused()
        void set_attn_q_fused(cbool on) except +
        cbool attn_q_fused()
        void set_parallel_compressor(cbool on) except +
        cbool parallel_compressor()
        vector[int64_t] l2_prefetch_log() except +
        uint64_t l2_prefetch_window_bytes()

cdef extern from "../gpu/ds4_gpu.h" namespace "ds4::gpu::testing" nogil:
    void gpu_qat_rows "ds4::gpu::testing::qat_rows"(int kind, float* X, int n_rows, int n) except +


# GpuEngine.host_phases: the host phases of a step, in GpuEngine::host_phases_us order.
HOST_PHASES = ("prepare", "upload", "launch", "download", "wait")


cdef class GpuEngine:
    """One loaded DS4 model with its paged state on the GPU (ds4::gpu::GpuEngine).

    Same arguments and methods as Engine (no n_threads): the weights are uploaded to device memory
    once, the rings, compressor states and pages live there, and step() returns the logits on the
    host. RuntimeError when this build has no GPU backend or no device is visible.
    """

    cdef CGpuEngine* _eng
    cdef readonly int n_vocab, max_slots, max_ctx, n_pages, max_rows
    cdef readonly object config, device_name

    def __cinit__(self):
        self._eng = NULL

    def __init__(self, config, gguf_path, tensors, *, int max_slots, int max_ctx, int n_pages, int max_rows=16):
        if self._eng != NULL:
            raise RuntimeError("GpuEngine is already initialised")
        if max_slots < 1 or max_ctx < 1 or n_pages < 0 or max_rows < 1:
            raise ValueError(f"GpuEngine options out of range: max_slots={max_slots} max_ctx={max_ctx} "
                             f"n_pages={n_pages} max_rows={max_rows}")
        cdef ModelConfig cfg = _model_config(config)
        cdef vector[WeightEntry] weights
        cdef WeightEntry w
        cdef int i
        for name, ggml_type, ne, offset in tensors:
            ne = tuple(int(x) for x in ne)
            if not 1 <= len(ne) <= 4:
                raise ValueError(f"tensor {name}: {len(ne)} dims, expected 1 to 4")
            w.name = name.encode()
            w.type = int(ggml_type)
            for i in range(4):
                w.ne[i] = ne[i] if i < len(ne) else 1
            w.offset = int(offset)
            weights.push_back(w)
        cdef EngineOptions opts
        opts.max_slots = max_slots
        opts.max_ctx = max_ctx
        opts.n_pages = n_pages
        opts.max_rows = max_rows
        opts.n_threads = 1
        cdef string path = os.fsencode(os.fspath(gguf_path))
        cdef CGpuEngine* eng
        with nogil:
            eng = new CGpuEngine(cfg, path, weights, opts)
        self._eng = eng
        self.config = config
        self.n_vocab = cfg.n_vocab
        self.max_slots = max_slots
        self.max_ctx = max_ctx
        self.n_pages = n_pages
        self.max_rows = max_rows
        self.device_name = bytes(eng.device_name()).decode()

    def __dealloc__(self):
        if self._eng != NULL:
            del self._eng
            self._eng = NULL

    cdef CGpuEngine* _get(self) except NULL:
        if self._eng == NULL:
            raise RuntimeError("GpuEngine is not initialised")
        return self._eng

    def step(self, plan):
        """Run one step of a StepPlan; returns float32 logits [plan.n_logits, n_vocab] in lane order."""
        return self._step(plan, False)

    def step_argmax(self, plan):
        """Run one step of a StepPlan; returns int32 [plan.n_logits]: each logit lane's argmax token
        (numpy's rule: the lowest id among ties, the first NaN), taken on the device, so only the
        tokens are copied back. Equal to step(plan).argmax(axis=1)."""
        return self._step(plan, True)

    def _step(self, plan, bint argmax):
        cdef CGpuEngine* eng = self._get()
        lane_slot = np.ascontiguousarray(plan.lane_slot, dtype=np.int32)
        lane_token = np.ascontiguousarray(plan.lane_token, dtype=np.int32)
        lane_pos = np.ascontiguousarray(plan.lane_pos, dtype=np.int32)
        lane_logits = np.ascontiguousarray(plan.lane_logits, dtype=np.int32)
        table_slot = np.ascontiguousarray(plan.table_slot, dtype=np.int32)
        block_table = np.ascontiguousarray(plan.block_table, dtype=np.int32)
        _validate_plan(lane_slot, lane_token, lane_pos, lane_logits, table_slot, block_table, self.max_rows,
                       self.max_slots, self.n_vocab, self.max_ctx, self.n_pages)
        cdef int n_lanes = lane_slot.shape[0]
        cdef int n_tables = table_slot.shape[0]
        cdef int max_blocks = block_table.shape[1]
        cdef int n_out = int(lane_logits.sum())
        out = np.empty(n_out, dtype=np.int32) if argmax else np.empty((n_out, self.n_vocab), dtype=np.float32)
        if n_lanes == 0:
            return out
        cdef const int32_t[::1] ls = lane_slot
        cdef const int32_t[::1] lt = lane_token
        cdef const int32_t[::1] lp = lane_pos
        cdef const int32_t[::1] ll = lane_logits
        cdef const int32_t[::1] ts = table_slot
        cdef const int32_t[::1] bt = block_table.reshape(-1)
        cdef float[:, ::1] o
        cdef int32_t[::1] a
        cdef int32_t empty_table = -1
        cdef const int32_t* bt_ptr = &bt[0] if bt.shape[0] > 0 else &empty_table
        cdef float dummy_out = 0
        cdef int32_t dummy_token = 0
        cdef float* o_ptr = &dummy_out
        cdef int32_t* a_ptr = NULL
        if argmax:
            a = out
            a_ptr = &a[0] if n_out > 0 else &dummy_token
        else:
            o = out
            if n_out > 0:
                o_ptr = &o[0, 0]
        with nogil:
            eng.step(n_lanes, &ls[0], &lt[0], &lp[0], &ll[0], n_tables, &ts[0], bt_ptr, max_blocks, o_ptr, a_ptr)
        return out

    def reset_slot(self, int slot):
        """Forget everything a slot held, so a new sequence starts clean in it."""
        cdef CGpuEngine* eng = self._get()
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is out of range 0..{self.max_slots - 1}")
        with nogil:
            eng.reset_slot(slot)

    @property
    def use_graphs(self):
        """Whether steps replay a CUDA graph per shape bucket (default: max_ctx <= 4096; DS4_GPU_GRAPHS=1/0)."""
        return bool(self._get().graphs())

    @use_graphs.setter
    def use_graphs(self, on):
        self._get().set_graphs(bool(on))

    @property
    def use_tall_matvec(self):
        """Whether q_b and the LM head take matvec's tall variant (same bits; default on, DS4_GPU_MV_TALL=0 off)."""
        return bool(self._get().matvec_tall())

    @use_tall_matvec.setter
    def use_tall_matvec(self, on):
        self._get().set_matvec_tall(bool(on))

    @property
    def use_staged_matvec(self):
        """Whether products of 2+ columns take matvec's staged kernel (same bits; default on, DS4_GPU_MV_STAGED=0 off)."""
        return bool(self._get().matvec_staged())

    @use_staged_matvec.setter
    def use_staged_matvec(self, on):
        self._get().set_matvec_staged(bool(on))

    @property
    def staged_min_cols(self):
        """The fewest columns a product takes the staged kernel from (with use_staged_matvec on; same
        bits; default 2, DS4_GPU_MV_STAGED_MIN=N at construction)."""
        return int(self._get().matvec_staged_min())

    @staged_min_cols.setter
    def staged_min_cols(self, int cols):
        self._get().set_matvec_staged_min(cols)

    @property
    def use_l2_prefetch(self):
        """Whether each step asks L2 for the weights that follow its latency-bound stretches (same
        bits; default off, DS4_GPU_L2_PREFETCH=1 on where the device can: CUDA compute capability 9.0+).
        Setting it on where the device cannot prefetch leaves it off."""
        return bool(self._get().l2_prefetch())

    @use_l2_prefetch.setter
    def use_l2_prefetch(self, on):
        self._get().set_l2_prefetch(bool(on))

    @property
    def use_branches(self):
        """Whether each layer's KV side and shared expert run on a second stream beside the rest (same
        bits; default on, DS4_GPU_BRANCHES=0 off; taken with the producer-built planes on and the
        tensor cores off)."""
        return bool(self._get().branches())

    @use_branches.setter
    def use_branches(self, on):
        self._get().set_branches(bool(on))

    @property
    def use_hc_fused(self):
        """Whether each mHC site (the post before it, its projection, its pre) runs fused, in two
        kernels instead of three (default on, DS4_GPU_HC_FUSED=0 off). Changes bits: the projection and rho add in another
        fixed order; each setting is exact and batch invariant on its own."""
        return bool(self._get().hc_fused())

    @use_hc_fused.setter
    def use_hc_fused(self, on):
        self._get().set_hc_fused(bool(on))

    @property
    def use_route_fused(self):
        """Whether the router's product, the route and the expert parts run as one launch where the
        fused router takes them (default on, DS4_GPU_ROUTE_FUSED=0 off). The same bits."""
        return bool(self._get().route_fused())

    @use_route_fused.setter
    def use_route_fused(self, on):
        self._get().set_route_fused(bool(on))

    @property
    def use_attn_q_fused(self):
        """Whether the attention's split kernel applies q's per-head RMSNorm and RoPE itself instead
        of a q_heads launch before it (default on, DS4_GPU_ATTN_Q_FUSED=0 off). The same bits."""
        return bool(self._get().attn_q_fused())

    @use_attn_q_fused.setter
    def use_attn_q_fused(self, on):
        self._get().set_attn_q_fused(bool(on))

    @property
    def use_parallel_compressor(self):
        """Whether the compressors of a prompt step run a block per finished compressed block (then
        the state in a second launch) instead of a block per slot over its lanes in order (default
        on, DS4_GPU_COMP_PARALLEL=0 off). Decode steps always take the serial kernel. The same bits."""
        return bool(self._get().parallel_compressor())

    @use_parallel_compressor.setter
    def use_parallel_compressor(self, on):
        self._get().set_parallel_compressor(bool(on))

    @property
    def l2_prefetch_window_bytes(self):
        """The most one prefetch window asks for: half the L2, or DS4_GPU_L2_PREFETCH_BYTES."""
        return int(self._get().l2_prefetch_window_bytes())

    def l2_prefetch_log(self):
        """What the last step that launched its kernels (eagerly, or capturing a graph) asked L2 for:
        a list of (window, layer, file offset, bytes); window 0 = a layer's attention prologue, 1 =
        its attention, 2 = its FFN prologue, 3 = the head (layer n_layer). Empty with the prefetch off."""
        cdef vector[int64_t] v = self._get().l2_prefetch_log()
        return [(int(v[i]), int(v[i + 1]), int(v[i + 2]), int(v[i + 3])) for i in range(0, v.size(), 4)]

    @property
    def graphs_captured(self):
        """CUDA graphs built so far (one per new shape bucket)."""
        return int(self._get().graphs_captured())

    def host_phases(self):
        """The host's time in the last step by phase, in microseconds: {"prepare", "upload", "launch",
        "download", "wait"} (GpuEngine::host_phases_us); empty before the first step."""
        cdef vector[double] v = self._get().host_phases_us()
        return dict(zip(HOST_PHASES, (float(x) for x in v))) if any(v) else {}

    def allocated_bytes(self):
        """Device bytes by section (see ds4::gpu::GpuEngine::allocated_bytes)."""
        cdef CGpuEngine* eng = self._get()
        cdef vector[pair[string, uint64_t]] items = eng.allocated_bytes()
        return {bytes(k).decode(): int(v) for k, v in items}


def _validate_plan(lane_slot, lane_token, lane_pos, lane_logits, table_slot, block_table, int max_rows,
                   int max_slots, int n_vocab, int max_ctx, int n_pages):
    """Engine._validate for engines other than Engine: one-line ValueErrors before native code runs."""
    n = lane_slot.shape[0]
    if lane_slot.ndim != 1 or any(a.ndim != 1 or a.shape[0] != n for a in (lane_token, lane_pos, lane_logits)):
        raise ValueError("StepPlan lane arrays must be 1-D of one length")
    if n > max_rows:
        raise ValueError(f"StepPlan has {n} lanes; this engine takes at most max_rows={max_rows}")
    if table_slot.ndim != 1 or block_table.ndim != 2 or block_table.shape[0] != table_slot.shape[0]:
        raise ValueError("StepPlan.block_table must have one row per table_slot")
    _check_range("lane_slot", lane_slot, 0, max_slots)
    _check_range("table_slot", table_slot, 0, max_slots)
    _check_range("lane_token", lane_token, 0, n_vocab)
    _check_range("lane_pos", lane_pos, 0, max_ctx)
    _check_range("lane_logits", lane_logits, 0, 2)
    _check_range("block_table", block_table.reshape(-1), -1, n_pages)
    _check_slots(lane_slot, lane_pos, table_slot, max_slots)


def _t_gpu_export_slot_state(GpuEngine engine, int slot, block_table, int64_t n_tokens):
    """_t_export_slot_state for a GpuEngine: the same dict, read back from device memory."""
    cdef CGpuEngine* eng = engine._get()
    cfg = engine.config
    table = np.ascontiguousarray(block_table, dtype=np.int32).reshape(-1)
    cdef const int32_t[::1] bt = table
    cdef int32_t empty_table = -1
    cdef const int32_t* bt_ptr = &bt[0] if bt.shape[0] > 0 else &empty_table
    cdef int max_blocks = bt.shape[0]
    cdef SlotStateExport ex
    with nogil:
        ex = eng.export_slot_state(slot, bt_ptr, max_blocks, n_tokens)
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    attn_shapes = [(8, 2 * hd) if r == 4 else (128, hd) for r in cfg.compress_ratios]
    idx_shapes = [(8, 2 * ihd)] * cfg.n_layer
    return {
        "ring": _f16_rows(ex.ring, hd),
        "comp": _f16_rows(ex.comp, hd),
        "idx_keys": _f16_rows(ex.index, ihd),
        "kv_state": _f32_states(ex.attn_kv, attn_shapes),
        "score_state": _f32_states(ex.attn_score, attn_shapes),
        "idx_kv_state": _f32_states(ex.index_kv, idx_shapes),
        "idx_score_state": _f32_states(ex.index_score, idx_shapes),
    }


def _t_gpu_sync_slot(Engine cpu, GpuEngine gpu, int slot, block_table, int64_t n_tokens):
    """Copy a CPU Engine slot's state after n_tokens tokens into the same slot of a GpuEngine."""
    cdef CEngine* src = cpu._get()
    cdef CGpuEngine* dst = gpu._get()
    table = np.ascontiguousarray(block_table, dtype=np.int32).reshape(-1)
    cdef const int32_t[::1] bt = table
    cdef int32_t empty_table = -1
    cdef const int32_t* bt_ptr = &bt[0] if bt.shape[0] > 0 else &empty_table
    cdef int max_blocks = bt.shape[0]
    cdef SlotStateExport ex
    with nogil:
        ex = src.export_slot_state(slot, bt_ptr, max_blocks, n_tokens)
        dst.import_slot_state(slot, bt_ptr, max_blocks, n_tokens, ex)


_QAT_KINDS = {"fp8": 0, "fp4": 1, "hadamard": 2, "f16": 3}


def _t_gpu_qat(str kind, X):
    """The GPU step kernels' round trip `kind` (fp8, fp4, hadamard, f16) on each row of X [rows, n]."""
    if kind not in _QAT_KINDS:
        raise ValueError(f"unknown round trip {kind!r}; choose from {', '.join(_QAT_KINDS)}")
    x = np.array(X, dtype=np.float32, order="C", copy=True)
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError("X must be [rows, n] with n > 0")
    if x.shape[0] == 0:
        return x
    cdef float[:, ::1] xv = x
    cdef int k = _QAT_KINDS[kind], rows = x.shape[0], n = x.shape[1]
    with nogil:
        gpu_qat_rows(k, &xv[0, 0], rows, n)
    return x


_GPU_TESTING.update(gpu_export_slot_state=_t_gpu_export_slot_state, gpu_sync_slot=_t_gpu_sync_slot,
                    gpu_qat=_t_gpu_qat)
