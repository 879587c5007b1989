# cython: language_level=3, boundscheck=False
"""ds4_app.engine._native: the one crossing from Python into the C++ engine.

- ``Engine``: the DS4 step executor (ext/engine/engine.h). ``step(plan)`` is one call per engine
  step with the GIL released; inputs are validated here first so a bad plan is a one-line
  ValueError, never undefined behaviour in C++.
- ``physical_cores()``, ``simd_path()``, ``gpu_backend()``, ``gpu_available()``: what this build
  and machine run.
- ``_testing``: a private surface over the kernels (dequantizers, matmul on a chosen SIMD path,
  thread-pool chunking) for the tests; not an API.

C++ exceptions come through ``except +`` declarations (ds4.pxd): std::invalid_argument ->
ValueError, std::out_of_range -> IndexError, std::runtime_error -> RuntimeError.
"""

import os
import types

import numpy as np

from ds4_app.engine.plan import StepPlan

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector
from cython.operator cimport dereference as deref

from ds4 cimport (
    CEngine, DType, EngineOptions, ModelConfig, SimdPath, SlotStateExport, ThreadPool, TensorView, WeightEntry,
    active_path, block_bytes, block_elems, c_dtype_supported, c_physical_cores, decode, dtype_name, indexer_topk,
    matmul_on, path_name, path_supported,
)


cdef extern from *:
    """
    #include <algorithm>
    #include <atomic>
    #include <mutex>
    #include <stdexcept>
    #include <string>
    #include <utility>
    #include <vector>
    #include "ds4/kernels.h"

    #ifndef DS4_GPU_BACKEND
    #define DS4_GPU_BACKEND "off"
    #endif
    #if defined(DS4_GPU_CUDA) || defined(DS4_GPU_HIP)
    int ds4_gpu_device_count();  // defined by the GPU sources (ext/gpu)
    #else
    static int ds4_gpu_device_count() { return 0; }  // a CPU-only build sees no devices
    #endif

    // Testing hook: the chunks parallel_for hands out (sorted), to check static contiguous
    // chunking and that every index is covered exactly once.
    static std::vector<std::pair<int64_t, int64_t>> ds4_testing_pool_chunks(int n_threads, int64_t n,
                                                                         int64_t grain) {
      ds4::ThreadPool pool(n_threads);
      std::mutex mu;
      std::vector<std::pair<int64_t, int64_t>> chunks;
      pool.parallel_for(n, grain, [&](int64_t b, int64_t e) {
        std::lock_guard<std::mutex> lock(mu);
        chunks.emplace_back(b, e);
      });
      std::sort(chunks.begin(), chunks.end());
      return chunks;
    }

    // Testing hook: a chunk that throws. The pool must finish the other chunks, rethrow on the
    // calling thread, and stay usable; returns how many indices ran after the failed job.
    static int64_t ds4_testing_pool_throw(int n_threads, int64_t n, int64_t bad) {
      ds4::ThreadPool pool(n_threads);
      try {
        pool.parallel_for(n, 1, [&](int64_t b, int64_t e) {
          if (b <= bad && bad < e) throw std::runtime_error("chunk " + std::to_string(b) + " failed");
        });
      } catch (const std::runtime_error&) {
        std::atomic<int64_t> count{0};
        pool.parallel_for(n, 1, [&](int64_t b, int64_t e) { count += e - b; });
        throw std::runtime_error("rethrown after a second job covered " + std::to_string(count.load()));
      }
      return -1;
    }
    """
    const char* DS4_GPU_BACKEND
    int ds4_gpu_device_count() except + nogil
    vector[pair[int64_t, int64_t]] ds4_testing_pool_chunks(int n_threads, int64_t n, int64_t grain) except + nogil
    int64_t ds4_testing_pool_throw(int n_threads, int64_t n, int64_t bad) except + nogil


PAGE_TOKENS = 128


def physical_cores():
    """Physical CPU cores this process may use (the default thread count)."""
    return physical_cores_c()


cdef int physical_cores_c() noexcept nogil:
    return c_physical_cores()


def simd_path():
    """The CPU kernel path of this process: "avx2" or "scalar" (chosen once, DS4_SIMD overrides)."""
    return active_path_name()


cdef str active_path_name():
    return path_name(active_path()).decode()


def gpu_backend():
    """The GPU backend compiled into this module: "off", "cuda" or "hip"."""
    return (<bytes>DS4_GPU_BACKEND).decode()


def gpu_available():
    """Whether this module has a GPU backend and the machine has a device for it."""
    cdef int n
    with nogil:
        n = ds4_gpu_device_count()
    return n > 0


def dtype_supported(int ggml_type):
    """Whether the kernels execute tensors of this ggml type id."""
    return bool(c_dtype_supported(ggml_type))


# --- Engine --------------------------------------------------------------------------------------


cdef class Engine:
    """One loaded DS4 model with its paged multi-slot state (ds4::Engine).

    Args:
        config: the model's DS4Config.
        gguf_path: the GGUF file; the engine maps it read-only.
        tensors: (name, ggml_type, ne, offset) per tensor; ne has up to 4 dims, offset is the
            absolute byte offset in the file.
        max_slots, max_ctx, n_pages, max_rows, n_threads: see ds4::EngineOptions (n_threads 0:
            physical cores).
    """

    cdef CEngine* _eng
    cdef readonly int n_vocab, max_slots, max_ctx, n_pages, max_rows, n_threads
    cdef readonly object config

    def __cinit__(self):
        self._eng = NULL

    def __init__(self, config, gguf_path, tensors, *, int max_slots, int max_ctx, int n_pages,
                 int max_rows=16, int n_threads=0):
        if self._eng != NULL:
            raise RuntimeError("Engine is already initialised")
        if max_slots < 1 or max_ctx < 1 or n_pages < 0 or max_rows < 1 or n_threads < 0:
            raise ValueError(f"Engine options out of range: max_slots={max_slots} max_ctx={max_ctx} "
                             f"n_pages={n_pages} max_rows={max_rows} n_threads={n_threads}")
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
        opts.n_threads = n_threads
        cdef string path = os.fsencode(os.fspath(gguf_path))
        cdef CEngine* eng
        with nogil:
            eng = new CEngine(cfg, path, weights, opts)
        self._eng = eng
        self.config = config
        self.n_vocab = cfg.n_vocab
        self.max_slots = max_slots
        self.max_ctx = max_ctx
        self.n_pages = n_pages
        self.max_rows = max_rows
        self.n_threads = n_threads if n_threads > 0 else physical_cores_c()

    def __dealloc__(self):
        if self._eng != NULL:
            del self._eng
            self._eng = NULL

    cdef CEngine* _get(self) except NULL:
        if self._eng == NULL:
            raise RuntimeError("Engine is not initialised")
        return self._eng

    def step(self, plan):
        """Run one step of a StepPlan; returns float32 logits [plan.n_logits, n_vocab] in lane order."""
        cdef CEngine* eng = self._get()
        cdef object lane_slot, lane_token, lane_pos, lane_logits, table_slot, block_table
        if type(plan) is StepPlan:  # contiguous int32 arrays, checked when the plan was made
            lane_slot, lane_token, lane_pos = plan.lane_slot, plan.lane_token, plan.lane_pos
            lane_logits, table_slot, block_table = plan.lane_logits, plan.table_slot, plan.block_table
        else:
            lane_slot = np.ascontiguousarray(plan.lane_slot, dtype=np.int32)
            lane_token = np.ascontiguousarray(plan.lane_token, dtype=np.int32)
            lane_pos = np.ascontiguousarray(plan.lane_pos, dtype=np.int32)
            lane_logits = np.ascontiguousarray(plan.lane_logits, dtype=np.int32)
            table_slot = np.ascontiguousarray(plan.table_slot, dtype=np.int32)
            block_table = np.ascontiguousarray(plan.block_table, dtype=np.int32)
        n = lane_slot.shape[0]
        if (lane_slot.ndim != 1 or lane_token.ndim != 1 or lane_pos.ndim != 1 or lane_logits.ndim != 1
                or lane_token.shape[0] != n or lane_pos.shape[0] != n or lane_logits.shape[0] != n):
            raise ValueError("StepPlan lane arrays must be 1-D of one length")
        if n > self.max_rows:
            raise ValueError(f"StepPlan has {n} lanes; this engine takes at most max_rows={self.max_rows}")
        if table_slot.ndim != 1 or block_table.ndim != 2 or block_table.shape[0] != table_slot.shape[0]:
            raise ValueError("StepPlan.block_table must have one row per table_slot")

        cdef const int32_t[::1] ls = lane_slot
        cdef const int32_t[::1] lt = lane_token
        cdef const int32_t[::1] lp = lane_pos
        cdef const int32_t[::1] ll = lane_logits
        cdef const int32_t[::1] ts = table_slot
        cdef const int32_t[::1] bt = block_table.reshape(-1)
        _check_range("lane_slot", ls, 0, self.max_slots)
        _check_range("table_slot", ts, 0, self.max_slots)
        _check_range("lane_token", lt, 0, self.n_vocab)
        _check_range("lane_pos", lp, 0, self.max_ctx)
        _check_range("lane_logits", ll, 0, 2)
        _check_range("block_table", bt, -1, self.n_pages)
        _check_slots(ls, lp, ts, self.max_slots)

        cdef int n_lanes = ls.shape[0]
        cdef int n_tables = ts.shape[0]
        cdef int max_blocks = block_table.shape[1]
        cdef Py_ssize_t i
        cdef int n_out = 0
        for i in range(n_lanes):
            n_out += ll[i]
        out = np.empty((n_out, self.n_vocab), dtype=np.float32)
        if n_lanes == 0:
            return out
        cdef float[:, ::1] o = out
        cdef int32_t empty_table = -1
        cdef const int32_t* bt_ptr = &bt[0] if bt.shape[0] > 0 else &empty_table
        cdef float dummy_out = 0
        cdef float* o_ptr = &o[0, 0] if o.shape[0] > 0 else &dummy_out
        with nogil:
            eng.step(n_lanes, &ls[0], &lt[0], &lp[0], &ll[0], n_tables, &ts[0], bt_ptr, max_blocks, o_ptr)
        return out

    def reset_slot(self, int slot):
        """Forget everything a slot held, so a new sequence starts clean in it."""
        cdef CEngine* eng = self._get()
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is out of range 0..{self.max_slots - 1}")
        with nogil:
            eng.reset_slot(slot)

    def allocated_bytes(self):
        """Bytes the engine allocated, by section (see ds4::Engine::allocated_bytes)."""
        cdef CEngine* eng = self._get()
        cdef vector[pair[string, uint64_t]] items = eng.allocated_bytes()
        return {bytes(k).decode(): int(v) for k, v in items}


cdef ModelConfig _model_config(config) except *:
    cdef ModelConfig c
    c.n_vocab = config.n_vocab
    c.n_embd = config.n_embd
    c.n_layer = config.n_layer
    c.n_head = config.n_head
    c.head_dim = config.head_dim
    c.rope_dim = config.rope_dim
    c.q_lora_rank = config.q_lora_rank
    c.o_groups = config.o_groups
    c.o_lora_rank = config.o_lora_rank
    c.compress_ratios = [int(r) for r in config.compress_ratios]
    c.index_n_heads = config.index_n_heads
    c.index_head_dim = config.index_head_dim
    c.index_topk = config.index_topk
    c.n_expert = config.n_expert
    c.n_expert_used = config.n_expert_used
    c.n_expert_shared = config.n_expert_shared
    c.expert_ffn = config.expert_ffn
    c.expert_weights_scale = config.expert_weights_scale
    c.expert_weights_norm = bool(config.expert_weights_norm)
    c.n_hash_layers = config.n_hash_layers
    c.swiglu_clamp_exp = [float(x) for x in config.swiglu_clamp_exp]
    c.swiglu_clamp_shexp = [float(x) for x in config.swiglu_clamp_shexp]
    c.hc_mult = config.hc_mult
    c.hc_sinkhorn_iters = config.hc_sinkhorn_iters
    c.hc_eps = config.hc_eps
    c.norm_eps = config.norm_eps
    c.rope_inv_freqs = [list(config.rope(layer).inv_freqs(config.rope_dim)) for layer in range(config.n_layer)]
    c.sliding_window = config.sliding_window
    c.qat_numerics = bool(config.qat_numerics)
    return c


# Plan checks run as plain loops over at most max_rows lanes and a few table rows: a step's
# validation costs about a microsecond, not the tens a chain of numpy calls would.


cdef int _check_range(str name, const int32_t[::1] arr, int64_t lo, int64_t hi) except -1:
    cdef Py_ssize_t i
    for i in range(arr.shape[0]):
        if arr[i] < lo or arr[i] >= hi:
            raise ValueError(f"StepPlan.{name}[{i}] = {arr[i]} is out of range {lo}..{hi - 1}")
    return 0


cdef int _check_slots(const int32_t[::1] lane_slot, const int32_t[::1] lane_pos, const int32_t[::1] table_slot,
                      int max_slots) except -1:
    """Each table slot once, each lane's slot in the table, each slot's lanes at consecutive positions."""
    cdef vector[int32_t] in_table, next_pos
    in_table.assign(max_slots, 0)
    next_pos.assign(max_slots, -1)
    cdef Py_ssize_t i
    cdef int32_t s
    for i in range(table_slot.shape[0]):
        s = table_slot[i]
        if in_table[s]:
            raise ValueError(f"StepPlan.table_slot names a slot twice (slot {s})")
        in_table[s] = 1
    for i in range(lane_slot.shape[0]):
        s = lane_slot[i]
        if not in_table[s]:
            raise ValueError(f"StepPlan lane slot {s} has no block-table row")
        if next_pos[s] >= 0 and lane_pos[i] != next_pos[s]:
            raise ValueError(f"StepPlan lane {i}: slot {s} position {lane_pos[i]} does not follow its "
                             f"previous lane's position")
        next_pos[s] = lane_pos[i] + 1
    return 0


# --- private testing surface ---------------------------------------------------------------------


cdef SimdPath _path(path) except *:
    if path is None:
        return active_path()
    if path == "scalar":
        return SimdPath.Scalar
    if path == "avx2":
        if not path_supported(SimdPath.Avx2):
            raise ValueError("this CPU cannot run the avx2 path")
        return SimdPath.Avx2
    raise ValueError(f"unknown SIMD path {path!r}: expected 'scalar' or 'avx2'")


cdef DType _weight_type(int ggml_type) except *:
    if not c_dtype_supported(ggml_type) or ggml_type == <int>DType.I32:
        raise ValueError(f"ggml type {ggml_type} is not a weight type the kernels execute")
    return <DType>ggml_type


def _as_bytes(raw):
    if isinstance(raw, np.ndarray):
        return np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    return np.frombuffer(raw, dtype=np.uint8)


def _t_dequantize(int ggml_type, raw, int64_t n, path=None):
    """Dequantize n elements (whole blocks) of raw ggml data on a SIMD path (None: the active one)."""
    cdef DType t = _weight_type(ggml_type)
    cdef SimdPath p = _path(path)
    if n < 0 or n % block_elems(t):
        raise ValueError(f"{n} elements is not a whole number of {dtype_name(t).decode()} blocks")
    data = _as_bytes(raw)
    if data.shape[0] < n // block_elems(t) * block_bytes(t):
        raise ValueError("raw data is shorter than n elements")
    out = np.empty(n, dtype=np.float32)
    if n == 0:
        return out
    cdef const uint8_t[::1] src = data
    cdef float[::1] dst = out
    with nogil:
        decode(p, t, &src[0], &dst[0], n)
    return out


def _t_matmul(int ggml_type, raw, int64_t ne0, int64_t ne1, X, int n_threads=1, path=None):
    """Y[c, r] = sum_k W[r, k] X[c, k] for W given as raw ggml rows [ne1, ne0]; X is [ncols, ne0]."""
    cdef DType t = _weight_type(ggml_type)
    cdef SimdPath p = _path(path)
    if ne0 <= 0 or ne1 <= 0 or ne0 % block_elems(t):
        raise ValueError(f"bad weight shape ({ne0}, {ne1}) for {dtype_name(t).decode()}")
    data = _as_bytes(raw)
    if data.shape[0] < ne0 // block_elems(t) * block_bytes(t) * ne1:
        raise ValueError("raw data is shorter than the weight matrix")
    x = np.ascontiguousarray(X, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != ne0:
        raise ValueError(f"X must be [ncols, {ne0}]")
    cdef int ncols = x.shape[0]
    y = np.zeros((ncols, ne1), dtype=np.float32)
    if ncols == 0:
        return y
    cdef const uint8_t[::1] src = data
    cdef const float[:, ::1] xv = x
    cdef float[:, ::1] yv = y
    cdef TensorView W
    W.type = t
    W.ne[0] = ne0
    W.ne[1] = ne1
    W.ne[2] = 1
    W.ne[3] = 1
    W.data = &src[0]
    cdef ThreadPool* pool = new ThreadPool(n_threads)
    try:
        with nogil:
            matmul_on(p, W, &xv[0, 0], ncols, ne0, &yv[0, 0], ne1, deref(pool))
    finally:
        del pool
    return y


def _t_matmul_scalar(int ggml_type, raw, int64_t ne0, int64_t ne1, X, int n_threads=1):
    """_t_matmul forced onto the scalar path."""
    return _t_matmul(ggml_type, raw, ne0, ne1, X, n_threads, "scalar")


cdef list _f16_rows(vector[vector[uint16_t]]& rows, int64_t width):
    out = []
    cdef size_t l
    for l in range(rows.size()):
        a = np.array(<const uint16_t[:rows[l].size()]>rows[l].data(), dtype=np.uint16) if rows[l].size() else \
            np.zeros(0, np.uint16)
        # width 0 (index rows of a model with no CSA layer): reshape(-1, 0) cannot infer the row count
        out.append(a.view(np.float16).astype(np.float32).reshape(-1 if width else 0, width))
    return out


cdef list _f32_states(vector[vector[float]]& states, list shapes):
    out = []
    cdef size_t l
    for l in range(states.size()):
        if states[l].size() == 0:
            out.append(None)
        else:
            out.append(np.array(<const float[:states[l].size()]>states[l].data(), dtype=np.float32).reshape(shapes[l]))
    return out


def _t_export_slot_state(Engine engine, int slot, block_table, int64_t n_tokens):
    """A copy of one slot's state after n_tokens tokens (ds4::Engine::export_slot_state).

    Returns a dict of per-layer lists, f16 rows widened to float32 (exact): "ring" [128, head_dim];
    "comp" [n_tokens // ratio, head_dim] and "idx_keys" [n_tokens // 4, index_head_dim], read through
    block_table (the slot's logical -> physical pages); "kv_state"/"score_state" and
    "idx_kv_state"/"idx_score_state", the fp32 compressor states (CSA [8, 2 * head_dim] and
    [8, 2 * index_head_dim], HCA [128, head_dim]; None where a layer has none).
    """
    cdef CEngine* eng = engine._get()
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


def _t_path_supported(path):
    """Whether this CPU can run the named SIMD path."""
    if path == "scalar":
        return True
    if path == "avx2":
        return bool(path_supported(SimdPath.Avx2))
    raise ValueError(f"unknown SIMD path {path!r}")


def _t_pool_chunks(int n_threads, int64_t n, int64_t grain):
    """The (begin, end) chunks a ThreadPool of n_threads hands out for parallel_for(n, grain)."""
    cdef vector[pair[int64_t, int64_t]] chunks
    with nogil:
        chunks = ds4_testing_pool_chunks(n_threads, n, grain)
    return [(int(c.first), int(c.second)) for c in chunks]


def _t_pool_throw(int n_threads, int64_t n, int64_t bad):
    """Run a parallel_for whose chunk holding index bad throws (see ds4_testing_pool_throw)."""
    with nogil:
        ds4_testing_pool_throw(n_threads, n, bad)


def _t_indexer_topk(scores, int64_t k):
    """The indexer's top-k of a row of scores (ds4::indexer_topk): k entry indices, ascending."""
    cdef const float[::1] sc = np.ascontiguousarray(scores, dtype=np.float32)
    cdef int64_t n = sc.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"k must be in 1..{n}")
    order = np.empty(n, np.int32)
    sel = np.empty(k, np.int32)
    cdef int32_t[::1] o = order
    cdef int32_t[::1] s = sel
    with nogil:
        indexer_topk(&sc[0], n, k, &o[0], &s[0])
    return sel


cdef extern from *:
    """
    #include <algorithm>
    #include "expf_exact.h"
    #include "moe.h"
    namespace ds4 {
    // Defined in ext/engine/moe.cpp beside swiglu (not in moe.h: only swiglu and this hook call it).
    void swiglu_on(int path, float* g, const float* u, int64_t n, float limit);
    }

    // Testing hooks: the exp of ext/cpu/expf_exact.h (path 0: exp_exact per element; 1 and 2:
    // the AVX2 and AVX-512 array forms the engine's softmaxes call, with m = 0) and swiglu on a
    // path (-1: swiglu itself, with the process's dispatch).
    static void ds4_testing_expf(int path, const float* x, float* y, int64_t n) {
      if (path == 0) {
        for (int64_t i = 0; i < n; ++i) y[i] = ds4::exp_exact(x[i]);
        return;
      }
      std::copy(x, x + n, y);
      if (path == 2) ds4::exp_minus_avx512(y, n, 0.0f);
      else ds4::exp_minus_avx2(y, n, 0.0f);
    }
    static void ds4_testing_swiglu(int path, float* g, const float* u, int64_t n, float limit) {
      if (path < 0) ds4::swiglu(g, u, n, limit);
      else ds4::swiglu_on(path, g, u, n, limit);
    }
    static bool ds4_testing_cpu_has(int path) {
      __builtin_cpu_init();
      const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                        __builtin_cpu_supports("f16c");
      if (path == 1) return avx2;
      if (path == 2)
        return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
      return true;
    }
    """
    void ds4_testing_expf(int path, const float* x, float* y, int64_t n) nogil
    void ds4_testing_swiglu(int path, float* g, const float* u, int64_t n, float limit) nogil
    bint ds4_testing_cpu_has(int path) nogil


_EXP_PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}


cdef int _exp_path(path) except -1:
    if path not in _EXP_PATHS:
        raise ValueError(f"unknown exp path {path!r}: expected 'scalar', 'avx2' or 'avx512'")
    cdef int p = _EXP_PATHS[path]
    if not ds4_testing_cpu_has(p):
        raise ValueError(f"this CPU cannot run the {path} path")
    return p


def _t_expf_paths():
    """The paths of _t_expf and _t_swiglu this CPU runs, of 'scalar', 'avx2', 'avx512'."""
    return tuple(name for name, p in _EXP_PATHS.items() if ds4_testing_cpu_has(p))


def _t_expf(x, path="scalar"):
    """exp of a float32 array by ext/cpu/expf_exact.h on a path: glibc's expf bits, elementwise."""
    cdef int p = _exp_path(path)
    cdef const float[::1] xv = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(xv.shape[0], dtype=np.float32)
    cdef float[::1] yv = out
    cdef int64_t n = xv.shape[0]
    if n:
        with nogil:
            ds4_testing_expf(p, &xv[0], &yv[0], n)
    return out


def _t_swiglu(g, u, float limit, path=None):
    """The MoE's swiglu (ext/engine/moe.cpp) on copies of g and u: returns the new g. path None:
    the process's dispatch, as the engine calls it; else 'scalar', 'avx2' or 'avx512'."""
    cdef int p = -1 if path is None else _exp_path(path)
    out = np.array(g, dtype=np.float32, copy=True).reshape(-1)
    cdef const float[::1] uv = np.ascontiguousarray(u, dtype=np.float32).reshape(-1)
    cdef float[::1] gv = out
    cdef int64_t n = gv.shape[0]
    if uv.shape[0] != n:
        raise ValueError("g and u must have the same number of elements")
    if n:
        with nogil:
            ds4_testing_swiglu(p, &gv[0], &uv[0], n, limit)
    return out


include "../gpu/binding_hooks.pxi"
include "../gpu/engine_binding.pxi"


_testing = types.SimpleNamespace(
    dequantize=_t_dequantize,
    matmul=_t_matmul,
    matmul_scalar=_t_matmul_scalar,
    simd_path=simd_path,
    path_supported=_t_path_supported,
    pool_chunks=_t_pool_chunks,
    pool_throw=_t_pool_throw,
    indexer_topk=_t_indexer_topk,
    export_slot_state=_t_export_slot_state,
    expf=_t_expf,
    expf_paths=_t_expf_paths,
    swiglu=_t_swiglu,
)
vars(_testing).update(_GPU_TESTING)
