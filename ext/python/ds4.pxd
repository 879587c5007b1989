# C++ declarations bound by _native.pyx (which cimports them from here): ds4/kernels.h (the
# CPU kernels), ext/cpu/dispatch.h (SIMD path choice, for the testing surface) and
# ext/engine/engine.h (the step executor). Declarations only: no runtime module of this name.
# Every call that can throw is declared `except +`, so C++ exceptions become Python ones
# (std::invalid_argument -> ValueError, std::runtime_error -> RuntimeError, ...).

from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from libcpp.utility cimport pair
from libcpp.vector cimport vector


cdef extern from "ds4/kernels.h" namespace "ds4" nogil:
    cdef enum class DType(int32_t):
        F32
        F16
        Q8_0
        Q4_K
        I32
        BF16
        MXFP4

    int64_t block_elems(DType t) except +
    int64_t block_bytes(DType t) except +
    const char* dtype_name(DType t)
    cbool c_dtype_supported "ds4::dtype_supported"(int32_t ggml_type)

    cdef cppclass TensorView:
        DType type
        int64_t ne[4]
        const uint8_t* data
        int64_t row_bytes() except +
        int64_t nbytes() except +

    cdef cppclass ThreadPool:
        ThreadPool(int n_threads) except +
        int size()

    void dequantize_row(DType t, const uint8_t* src, float* dst, int64_t n) except +


cdef extern from "dispatch.h" namespace "ds4::cpu" nogil:
    cdef enum class SimdPath(int):
        Scalar
        Avx2

    SimdPath active_path() except +
    const char* path_name(SimdPath p)
    cbool path_supported(SimdPath p)
    int c_physical_cores "ds4::cpu::physical_cores"()
    void decode(SimdPath p, DType t, const uint8_t* src, float* dst, int64_t n) except +
    void matmul_on(SimdPath p, const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y,
                   int64_t ldy, ThreadPool& pool) except +


cdef extern from "attention.h" namespace "ds4" nogil:
    void indexer_topk(const float* scores, int64_t n, int64_t k, int32_t* order, int32_t* sel) except +


cdef extern from "engine.h" nogil:
    cdef cppclass ModelConfig "ds4::ModelConfig":
        int n_vocab, n_embd, n_layer, n_head, head_dim, rope_dim
        int q_lora_rank, o_groups, o_lora_rank
        vector[int] compress_ratios
        int index_n_heads, index_head_dim, index_topk
        int n_expert, n_expert_used, n_expert_shared, expert_ffn
        float expert_weights_scale
        cbool expert_weights_norm
        int n_hash_layers
        vector[float] swiglu_clamp_exp, swiglu_clamp_shexp
        int hc_mult, hc_sinkhorn_iters
        float hc_eps, norm_eps
        vector[vector[double]] rope_inv_freqs
        int sliding_window
        cbool qat_numerics

    cdef cppclass WeightEntry "ds4::WeightEntry":
        string name
        int32_t type
        int64_t ne[4]
        uint64_t offset

    cdef cppclass SlotStateExport "ds4::SlotStateExport":
        vector[vector[uint16_t]] ring, comp, index
        vector[vector[float]] attn_kv, attn_score, index_kv, index_score

    cdef cppclass EngineOptions "ds4::EngineOptions":
        int max_slots, max_ctx, n_pages, max_rows, n_threads

    cdef cppclass CEngine "ds4::Engine":
        CEngine(const ModelConfig& cfg, const string& gguf_path, const vector[WeightEntry]& weights,
               const EngineOptions& opts) except +
        void step(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                  const int32_t* lane_logits, int n_tables, const int32_t* table_slot,
                  const int32_t* block_table, int max_blocks, float* logits_out) except +
        void reset_slot(int slot) except +
        SlotStateExport export_slot_state(int slot, const int32_t* block_table, int max_blocks,
                                          int64_t n_tokens) except +
        vector[pair[string, uint64_t]] allocated_bytes() except +
