// The DS4 step executor on a GPU: the same interface and the same function as ds4::Engine
// (ext/engine/engine.h), with the weights and the paged state in device memory.
//
// Ownership: the engine maps the GGUF file, validates its tensors exactly as the CPU engine does,
// uploads the file's bytes to the device once and keeps device views of every tensor; it owns the
// device state (per slot the f16 rings and the fp32 compressor states, the shared page pool of
// f16 compressed rows) and a host mirror of the block tables. step() uploads the step's small
// int arrays (lanes, positions, slot groups, block-table rows) in one copy, runs phases A/B/C of
// every layer and the head on one stream (or replays the step's CUDA graph), and copies the
// logits back.
//
// Numerics are the CPU executor's (fp32 activations, f16 rows, the optional QAT round trips,
// indexer ties to the lower entry, router ties to the lower expert, each lane summing its experts
// in its own selection order); results differ from the CPU's only by summation order inside
// dot products and reductions. Every per-lane computation has a fixed order that does not depend
// on the other lanes, so a sequence's logits are bit-identical whatever shares its step and
// however its prompt is split into rows.
//
// With the tensor-core switch on (DS4_GPU_MMA=1 or set_matvec_mma, matvec_fused.h; CUDA only,
// default off) the products of Q8_0/Q4_K/F16/BF16 weights with K % 256 == 0 run on TF32 tensor
// cores with hi/lo-split activations (ext/gpu/MMA.md): within ~1e-7 relative of the exact sums,
// still one fixed arithmetic per column (the same batch invariance), but not the bits of the
// switch-off run. The step's CUDA graphs are keyed by the switch.
//
// Built without a GPU backend this header still compiles: the constructor throws.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../engine/engine.h"

namespace ds4::gpu {

#if defined(DS4_GPU_CUDA) || defined(DS4_GPU_HIP) || defined(__CUDACC__) || defined(__HIPCC__) || defined(__HIP__)

class GpuEngine {
 public:
  // Throws std::runtime_error without a device or when the model does not fit the kernels'
  // limits (head_dim <= 512, index_head_dim a power of two 32..512, hc_mult <= 16,
  // n_expert_used <= 32), std::invalid_argument for a bad config or options.
  GpuEngine(const ModelConfig& cfg, const std::string& gguf_path, const std::vector<WeightEntry>& weights,
            const EngineOptions& opts);
  ~GpuEngine();
  GpuEngine(const GpuEngine&) = delete;
  GpuEngine& operator=(const GpuEngine&) = delete;

  // ds4::Engine::step: the same plan checks and messages, logits_out on the host. With
  // argmax_out, each logit lane's greedy token (argmax_rows: numpy's rule) goes there instead and
  // the logits stay on the device (logits_out is not written and may be null).
  void step(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
            const int32_t* lane_logits, int n_tables, const int32_t* table_slot, const int32_t* block_table,
            int max_blocks, float* logits_out, int32_t* argmax_out = nullptr);
  void reset_slot(int slot);
  SlotStateExport export_slot_state(int slot, const int32_t* block_table, int max_blocks, int64_t n_tokens) const;
  // Testing hook, the inverse of export_slot_state: make a slot hold exactly `state` (an export of
  // this or another engine after n_tokens tokens, same model): rings, the compressed and indexer
  // rows through block_table, the compressor states. Lets a test start every step of the GPU from
  // the CPU engine's state (teacher forcing with state), so a comparison measures one step alone.
  void import_slot_state(int slot, const int32_t* block_table, int max_blocks, int64_t n_tokens,
                         const SlotStateExport& state);
  // Device bytes by section: "rings", "compressor_state", "pages", "step_inputs", "scratch",
  // "weights_device" (ds4_app/engine/memory.py plan_device_memory computes the same). "scratch"
  // includes the tensor-core products' scratch once the switch has been seen on (at construction
  // or at a step); with the switch off it is the activations alone.
  std::vector<std::pair<std::string, uint64_t>> allocated_bytes() const;
  std::string device_name() const;
  // Replay one CUDA graph per shape bucket (lanes, slots in the step, logit lanes) instead of
  // launching each kernel: the same kernels with the same arguments, so the same bits. Default:
  // on when max_ctx <= 4096 (launch sizes in a graph are bounds from max_ctx); the environment
  // variable DS4_GPU_GRAPHS=1 or 0 overrides it.
  void set_graphs(bool on);
  bool graphs() const;
  int graphs_captured() const;  // graphs built so far (new buckets)
  // The host's time in the last step by phase, in microseconds, in this order: checking and
  // grouping the plan; the inputs' upload (the pinned buffer filled, the copy's call); the launch (the
  // graph's replay, or its capture, or every kernel eagerly); the download's calls (argmax, the
  // copies); the wait for the stream. Six clock reads a step, always taken.
  std::vector<double> host_phases_us() const;
  // Tall matrices (q_b, the LM head) through matvec's tall variant: the same bits, a different
  // speed. Default: on; the environment variable DS4_GPU_MV_TALL=0 turns it off.
  void set_matvec_tall(bool on);
  bool matvec_tall() const;
  // Products of 2 or more columns through matvec's staged kernel (activations in shared memory):
  // the same bits, a different speed. Default: on; DS4_GPU_MV_STAGED=0 turns it off.
  void set_matvec_staged(bool on);
  bool matvec_staged() const;
  // The fewest columns a product takes the staged kernel from (with it on): 2 by default,
  // DS4_GPU_MV_STAGED_MIN=N at construction; narrower products take the direct kernel. The same
  // bits. Part of the graph key.
  void set_matvec_staged_min(int cols);
  int matvec_staged_min() const;
  // L2 prefetch (l2_prefetch.h; ext/gpu/README.md "Pass 9"): before each latency-bound stretch of
  // the step (attention, the FFN prologue, the mHC/norm prologue of the next layer or the head) a
  // small kernel asks L2 for the first bytes of the weights the next weight kernels read, at most
  // half the L2 a stretch (DS4_GPU_L2_PREFETCH_BYTES overrides that cap, read at construction).
  // Only the cache state changes, never a result bit. Default: off (measured 1-3% slower,
  // ext/gpu/README.md "Pass 9: outcome"; on a side branch of the step 2% slower too, pass 16);
  // DS4_GPU_L2_PREFETCH=1 turns it on where l2_prefetch_supported() (CUDA, compute capability
  // 9.0+). Setting it on where it is unsupported leaves it off (the getter tells). Part of the
  // graph key.
  void set_l2_prefetch(bool on);
  bool l2_prefetch() const;
  // Step branches: a layer's KV side (the raw row's norm and RoPE, the compressors' updates) and
  // its shared expert run on a second stream beside the q path and the routing and routed experts
  // (parallel branches in a graph). The same kernels on the same values: the same bits. Taken only
  // with the producer-built planes on and the tensor cores off (the branches then share no
  // scratch). Default: on; DS4_GPU_BRANCHES=0 turns it off. Part of the graph key.
  void set_branches(bool on);
  bool branches() const;
  // The fused mHC sites (pass 17, step_ops.h hc_site): the post of the sublayer that ends at a site,
  // the site's projection and its mHC pre in two kernels instead of three (and the Sinkhorn in a
  // third, on the step's side branch). Changes
  // bits (the projection and rho add in another fixed order; each setting exact and batch
  // invariant, within fp32 rounding of the other). Default: on; DS4_GPU_HC_FUSED=0 turns it off.
  // Part of the graph key.
  void set_hc_fused(bool on);
  bool hc_fused() const;
  // The fused router (pass 18, ds4_gpu.h router_route): the router's product, the route and the
  // expert parts in one launch instead of three where it takes them (1..8 lanes, F16/BF16/F32
  // router, at most 256 experts, the tensor cores off for it). The same bits. Default: on;
  // DS4_GPU_ROUTE_FUSED=0 turns it off. Part of the graph key.
  void set_route_fused(bool on);
  bool route_fused() const;
  // q_heads inside the attention (pass 18, step_ops.h AttentionLaunch::q_raw): each split block
  // applies the per-head RMSNorm and RoPE to its heads of q in shared memory, instead of a q_heads
  // launch before the attention. The same bits. Default: on; DS4_GPU_ATTN_Q_FUSED=0 turns it off.
  // Part of the graph key.
  void set_attn_q_fused(bool on);
  bool attn_q_fused() const;
  // The compressors' parallel path for prompt steps (step_ops.h compressor_update): a block per
  // finished compressed block, then the state in a second launch, instead of a block per slot that
  // runs the slot's lanes in order. Taken where a slot has several lanes in the step; the same bits.
  // Default: on; DS4_GPU_COMP_PARALLEL=0 turns it off. Part of the graph key.
  void set_parallel_compressor(bool on);
  bool parallel_compressor() const;
  // What the last step that launched its kernels (eager, or a graph capture) asked L2 for: four
  // numbers a range, (window, layer, file offset, bytes); windows 0 = the attention prologue of
  // `layer` (its mHC weights, the u products, q_b), 1 = its attention (wo_a, wo_b), 2 = its FFN
  // prologue (mHC, router, shared expert), 3 = the head (layer = n_layer). Offsets are the weight
  // bytes' offsets in the GGUF file. Empty with the prefetch off.
  std::vector<int64_t> l2_prefetch_log() const;
  uint64_t l2_prefetch_window_bytes() const;  // the cap a window asks for at most

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

#else  // no GPU backend in this build

class GpuEngine {
 public:
  GpuEngine(const ModelConfig&, const std::string&, const std::vector<WeightEntry>&, const EngineOptions&) {
    throw std::runtime_error("this _native build has no GPU backend; rebuild with DS4_GPU=cuda or DS4_GPU=hip");
  }
  void step(int, const int32_t*, const int32_t*, const int32_t*, const int32_t*, int, const int32_t*, const int32_t*,
            int, float*, int32_t* = nullptr) {
    throw std::runtime_error("no GPU backend");
  }
  void reset_slot(int) { throw std::runtime_error("no GPU backend"); }
  SlotStateExport export_slot_state(int, const int32_t*, int, int64_t) const {
    throw std::runtime_error("no GPU backend");
  }
  void import_slot_state(int, const int32_t*, int, int64_t, const SlotStateExport&) {
    throw std::runtime_error("no GPU backend");
  }
  std::vector<std::pair<std::string, uint64_t>> allocated_bytes() const { throw std::runtime_error("no GPU backend"); }
  std::string device_name() const { return std::string(); }
  void set_graphs(bool) { throw std::runtime_error("no GPU backend"); }
  bool graphs() const { return false; }
  int graphs_captured() const { return 0; }
  std::vector<double> host_phases_us() const { return {}; }
  void set_matvec_tall(bool) { throw std::runtime_error("no GPU backend"); }
  bool matvec_tall() const { return false; }
  void set_matvec_staged(bool) { throw std::runtime_error("no GPU backend"); }
  bool matvec_staged() const { return false; }
  void set_matvec_staged_min(int) { throw std::runtime_error("no GPU backend"); }
  int matvec_staged_min() const { return 0; }
  void set_l2_prefetch(bool) { throw std::runtime_error("no GPU backend"); }
  bool l2_prefetch() const { return false; }
  void set_branches(bool) { throw std::runtime_error("no GPU backend"); }
  bool branches() const { return false; }
  void set_hc_fused(bool) { throw std::runtime_error("no GPU backend"); }
  bool hc_fused() const { return false; }
  void set_route_fused(bool) { throw std::runtime_error("no GPU backend"); }
  bool route_fused() const { return false; }
  void set_attn_q_fused(bool) { throw std::runtime_error("no GPU backend"); }
  bool attn_q_fused() const { return false; }
  void set_parallel_compressor(bool) { throw std::runtime_error("no GPU backend"); }
  bool parallel_compressor() const { return false; }
  std::vector<int64_t> l2_prefetch_log() const { return {}; }
  uint64_t l2_prefetch_window_bytes() const { return 0; }
};

#endif

}  // namespace ds4::gpu
