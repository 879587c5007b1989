// The DS4 step executor on a GPU (engine_gpu.h): device weights, device paged state, and the
// step as a chain of kernels on one stream (each layer's KV side and shared expert on a second
// stream beside it: on_side / join_side). Host code only; the kernels are matvec.cu (weight
// products), ops.cu (RMSNorm, embedding), lane_ops.cu and paged_ops.cu (step_ops.h).
//
// Per layer, as ext/engine/engine.cpp:
//   (A) batched over lanes: mHC pre, attn_norm, q_a -> q_norm -> q_b, per-head norm + RoPE,
//       kv -> kv_norm -> RoPE (-> FP8) -> f16 rows, compressor and indexer projections (+ ape);
//   (B) per slot: compressors (each slot's lanes in order, emitting finished rows into pages),
//       indexer scores and top-k, gathered attention (window rows of this step from the step's
//       f16 rows, older ones from the ring), then the ring rows;
//   (C) batched: grouped output projection, mHC post, then the FFN site (mHC pre, ffn_norm,
//       router, shared expert, expert-grouped gate/up/down, mHC post).
// Then hc_head, output_norm and the LM head for the lanes that asked for logits.
//
// L2 prefetch (l2_prefetch.h, README "Pass 9"; switch DS4_GPU_L2_PREFETCH / set_l2_prefetch):
// before each latency-bound stretch, one small kernel asks L2 for the first bytes (at most half
// the L2) of the weights the next weight kernels read: at the step's start and after each routed
// down product, the next layer's mHC weights, u products and q_b (or, after the last layer, the
// head's mHC weights and the LM head); after q_b, wo_a and wo_b; after wo_b, the FFN's mHC weights,
// router and shared expert. The shared expert runs before the routed experts (the same bits: its
// buffers are its own), so no large read comes between that prefetch and the kernels it serves.
//
// Device memory, by section (ds4_app/engine/memory.py plan_device_memory mirrors every formula):
//   rings, compressor_state, pages: the CPU engine's layout (paged_state.h), byte for byte;
//   step_inputs: one int32 buffer refreshed by one host-to-device copy per step: 10 arrays (lane
//     slot, token, position, group, group start position; lane order by slot; group first, length,
//     slot; logit lanes) then the groups' block-table rows of max_blocks. It is sized for max_rows
//     lanes; a step packs its arrays at a stride of its own lanes rounded up to 32 (input_stride),
//     so a decode step copies ~1 KB instead of 40 x max_rows bytes;
//   scratch: the activations and the integer products' planes of X (carve_scratch below, each
//     buffer rounded up to 256 bytes), then,
//     with the tensor-core switch on (DS4_GPU_MMA=1), the tensor-core products' scratch
//     (mma_scratch_need below: the largest any product wants at max_rows columns, the grouped
//     experts sized for at most kMmaGroupedScratchParts parts; rounded up to 256 bytes);
//   weights_device: the GGUF file's bytes (tensor views point into it at their file offsets).
#include "engine_gpu.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <tuple>

#include "../engine/paged_state.h"
#include "../engine/plan_check.h"
#include "../engine/weights.h"
#include "common.cuh"
#include "ds4_gpu.h"
#include "imma.h"
#include "l2_prefetch.h"
#include "matvec_fused.h"
#include "mma_matvec.cuh"
#include "step_ops.h"

namespace ds4::gpu {

namespace {

// A device allocation that frees itself.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(uint64_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) DS4_GPU_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  ~DeviceMemory() {
    if (ptr_) (void)cudaFree(ptr_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  uint64_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

// Pinned host memory (the per-step upload buffer, the logits staging buffer).
class PinnedMemory {
 public:
  PinnedMemory() = default;
  explicit PinnedMemory(uint64_t bytes) : bytes_(bytes) {
    if (bytes > 0) DS4_GPU_CHECK(cudaMallocHost(&ptr_, bytes));
  }
  ~PinnedMemory() {
    if (ptr_) (void)cudaFreeHost(ptr_);
  }
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;
  PinnedMemory& operator=(PinnedMemory&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  int32_t* ints() const { return static_cast<int32_t*>(ptr_); }
  uint8_t* bytes() const { return static_cast<uint8_t*>(ptr_); }
  uint64_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

// The logits leave the device through a pinned buffer in pieces of this size: piece i+1 is in
// flight while the host copies piece i into the caller's array (a D2H copy into pageable memory
// ran at 4.4 GB/s on the H200: 0.94 ms for 8 lanes of a 129280-token vocabulary).
constexpr uint64_t kLogitsPiece = 1ull << 20;

constexpr uint64_t kScratchAlign = 256;
constexpr int kGraphsDefaultMaxCtx = 4096;  // graph replay is on by default up to this max_ctx
constexpr int kExpertPart = 8;  // pairs per part of the grouped expert products (matvec.cuh's kMaxPartCols)
// The grouped experts' tensor-core scratch is sized for at most this many parts. The partial sums
// of K-slices on separate blocks pay only while a launch is short of blocks: the launcher splits K
// while row blocks x parts x slice groups stay within about 8 blocks an SM (mma_matvec.cu's
// slice_groups), which on an H200 (132 SMs) means at most 16 parts for flash-l4's gate/up (32 row
// blocks of 64) and 8 for its down (64). A call with more parts than the scratch covers folds its
// slices in the block, as the launcher would choose for it anyway: the same bits.
constexpr int kMmaGroupedScratchParts = 16;

void check_config(const ModelConfig& c, const EngineOptions& o) {
  // The CPU engine's checks (ext/engine/plan_check.h), same messages.
  check_config_layers(c);
  check_config_shapes(c, o);
  const bool csa = std::count(c.compress_ratios.begin(), c.compress_ratios.end(), 4) > 0;
  // The GPU kernels' own limits.
  auto gpu = [](bool ok, const std::string& msg) {
    if (!ok) throw std::runtime_error("GPU engine: " + msg);
  };
  gpu(c.head_dim % 8 == 0 && c.head_dim <= 512, "head_dim must be a multiple of 8, at most 512");
  gpu(c.hc_mult >= 1 && c.hc_mult <= kMaxHcDev, "hc_mult must be 1..16");
  gpu(c.n_expert_used <= kMaxExpertUsed, "n_expert_used must be at most 32");
  gpu(c.n_expert <= 4096, "n_expert must be at most 4096");
  gpu(c.n_embd % 4 == 0 && c.q_lora_rank % 4 == 0 && c.expert_ffn % 4 == 0 && c.o_lora_rank % 4 == 0,
      "n_embd, q_lora_rank, expert_ffn and o_lora_rank must be multiples of 4");
  if (csa) {
    gpu(c.index_head_dim >= 32 && c.index_head_dim <= 512, "index_head_dim must be 32..512");
    gpu(static_cast<int64_t>(c.index_n_heads) * c.index_head_dim + c.index_n_heads <= 12 * 1024,
        "index_n_heads x index_head_dim must be at most 12000");
  }
}

}  // namespace

// Where the pass-18 fusions run (measured on the H200, ext/gpu/README.md "Pass 18: outcome"): the
// fused router up to 4 lanes, one route a warp of its last block (at 6-8 lanes it routes in two
// rounds and measured 0 to -1% against the three launches); q_heads in the attention up to 2 lanes,
// where the split blocks hold two heads (+1%; four heads a block at 4-8 lanes: within noise to -0.7%).
constexpr int kRouteFusedMaxLanes = 4;
constexpr int kAttnQFusedMaxLanes = 2;

struct GpuEngine::Impl {
  Impl(const ModelConfig& c, const std::string& path, const std::vector<WeightEntry>& entries, const EngineOptions& o);
  ~Impl();

  ModelConfig cfg;
  EngineOptions opts;
  MappedFile file;
  ModelWeights hw;  // host views (validation, and the layout the device views copy)
  ModelWeights dw;  // the same views into device memory
  StateLayout layout;  // the CPU PagedState layout (paged_state.h)
  int max_blocks = 0;
  bool csa = false, hca = false;
  cudaStream_t stream = nullptr;
  // Step branches (set_branches): independent stretches of a layer run on `side`, forked from and
  // joined back into the stream by the two events (graph capture records them as parallel branches).
  bool branches = false;     // the switch
  bool branching = false;    // this step's launches branch: the switch, with no product using scratch
  bool side_pending = false;  // side work not yet joined
  // The fused mHC sites (set_hc_fused): a sublayer's mHC post waits in `post_due` for the next site
  // (hc_pre_site), which takes it into its hc_site launches or runs it first.
  bool hc_fused = false;
  struct PostDue {
    bool due = false;
    const float* Y = nullptr;  // after the attention
    const float *D = nullptr, *w = nullptr, *SH = nullptr;  // after the FFN: the MoE sum
    int k = 0;
  } post_due;
  bool comb_due = false;  // the last site's comb awaits its Sinkhorn (run_comb_due)
  // The fused router (set_route_fused): the router's product, the route and the parts in one launch
  // where router_route takes them, for steps of at most kRouteFusedMaxLanes lanes; route_done is its
  // block counter (zeroed once, left zero).
  bool route_fused = false;
  uint32_t* route_done = nullptr;
  // q_heads inside the attention's split kernel (set_attn_q_fused; AttentionLaunch::q_raw), for
  // steps of at most kAttnQFusedMaxLanes lanes.
  bool attn_q_fused = false;
  // The compressors' parallel path (set_parallel_compressor; step_ops.h compressor_update) for steps
  // where a slot has several lanes (n > n_groups: prompt rows); decode steps keep the serial kernel.
  bool parallel_compressor = false;
  uint8_t* hc_scratch = nullptr;  // hc_site's block sums
  // hc_site's post writes the streams apart from its input: x_hc and x_hc_next swap after each one
  // (launch_step starts every step on x_hc_base).
  float *x_hc_base = nullptr, *x_hc_next = nullptr;
  cudaStream_t side = nullptr;
  cudaEvent_t fork_ev = nullptr, join_ev = nullptr;
  cudaEvent_t mark_ev = nullptr;  // mark_side / wait_side_mark
  bool mark_pending = false;

  DeviceMemory weights, rings, states, pages, inputs, arena;
  DeviceMemory mma_scratch;  // the tensor-core products' scratch (allocated once the switch is seen on)
  bool mma_sized = false;
  PinnedMemory pinned;
  PinnedMemory logits_host;             // grows to the largest logits download seen
  std::vector<cudaEvent_t> piece_done;  // one per kLogitsPiece of it
  std::vector<float> slot_reset;      // one slot's compressor state as reset_slot leaves it
  std::vector<int32_t> tables;        // host block tables [slot][max_blocks]
  std::vector<int32_t> page_owner;    // per page: its slot in the current step

  // Scratch (device pointers into arena).
  int64_t cw = 0, icw = 0, n_idx = 0, n_sel = 0;
  float *x_hc, *mix_buf, *post_buf, *comb_buf, *u, *q_lat, *q, *kvf, *comp_kv, *comp_sc, *idx_q, *idx_w, *idx_kv,
      *idx_sc, *attn_out, *o_low, *y, *router, *sel_w, *ex_gate, *ex_up, *ex_down, *sh_gate, *sh_up, *sh_down,
      *idx_scores, *head_in, *logits, *attn_part;
  int32_t* argmax_tokens;  // the logit lanes' greedy tokens (step with argmax_out)
  uint8_t* x_planes;        // the integer Q8_0 products' planes of X (xplanes.cuh), max_rows columns
  int64_t x_planes_bytes = 0;
  // Producer-built planes (matvec_fused.h planes_fused): the producers of u (mHC pre) and of one
  // other X at a time (q_lat's norm, the shared SwiGLU, hc_head) write its planes here, beside the
  // prep kernel's space (the attention combine and the routed SwiGLU write theirs into that space);
  // `given` names them to the products of that X while they hold its values.
  uint8_t *planes_u, *planes_b;
  bool fused_planes = false;  // planes_fused() with the integer products on, at this step's launch
  GivenPlanes given[kGivenPlanesMax];
  uint16_t* kv16;
  int32_t *sel_id, *pair_row, *sorted_pairs, *n_parts, *comp_sel;
  ExpertPart* parts;
  double* inv_freq;

  // CUDA graphs (design.md §6): one executable graph per shape bucket (lanes, slot groups, logit
  // lanes), captured on first use and replayed after; every launch parameter a graph bakes in is a
  // function of the bucket (launch sizes use bounds from max_ctx, not this step's positions), and
  // positions, gather indices, write targets and block tables stay device inputs.
  bool graphs = false;
  bool tall = false;    // matvec's tall variant for q_b and the LM head
  bool staged = false;  // matvec's staged kernel for products of 2 or more columns
  int staged_cols = kMatvecStagedMin;  // ... of at least this many columns
  bool prefetch = false;  // the L2 prefetch before latency-bound stretches (l2_prefetch.h)
  uint64_t prefetch_cap = 0;  // bytes one window asks for at most
  std::vector<int64_t> prefetch_log;  // (window, layer, file offset, bytes) of the last launched step
  // Key: (lanes, slot groups, logit lanes, tall, the staged kernel's least columns (off: a huge
  // number), matvec_settings_key(): the chunked loads,
  // the grouped variant, stages and width, fusion, and the tensor-core switch with its launch
  // choices; a graph of one tensor-core setting never replays under the other, whose bits differ;
  // the L2 prefetch; the integer tensor cores' two thresholds and narrow-tile settings, imma.h; the
  // producer-built planes; the step branches; the own grouped kernel's row groups; the tall variant's
  // least row width; the fused mHC sites, router, q path and compressor; the attention's heads a block
  // and fewest keys a split, step_ops.h; the prompt tiles' independent MMAs, imma.h; the staged kernel's
  // fewest rows; the mHC site's streams a sums thread).
  using GraphKey =
      std::tuple<int, int, int, bool, int, int, bool, int, int, int, bool, bool, bool, bool, int, int64_t, bool, bool,
                 bool, bool, int, int, int, int64_t, int>;
  std::map<GraphKey, cudaGraphExec_t> graph_cache;
  int graphs_captured = 0;

  StepLanes lanes;  // device views of the step inputs
  const int32_t* logit_lanes_dev = nullptr;

  // Host copies of the step structure (validate_and_group).
  std::vector<int32_t> order, group_first, group_len, group_slot, lane_group, lane_t0, logit_lanes;
  int n_groups = 0, n = 0;
  const int32_t* pos = nullptr;
  const int32_t* slot_of = nullptr;

  const double* freqs(int l) const { return inv_freq + static_cast<int64_t>(l) * (cfg.rope_dim / 2); }
  template <class T>
  T* dev(T* host) const {
    if (host == nullptr) return nullptr;
    return reinterpret_cast<T*>(weights.data() + (reinterpret_cast<const uint8_t*>(host) - file.data()));
  }
  TensorView dev(const TensorView& v) const {
    TensorView d = v;
    d.data = v.data ? weights.data() + (v.data - file.data()) : nullptr;
    return d;
  }
  ModelWeights device_views() const;
  void carve_scratch();
  void validate_and_group(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                          int n_tables, const int32_t* table_slot, const int32_t* block_table, int max_blocks_in);
  void check_pages();
  void reset(int slot);
  void upload_inputs(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos);
  void point_inputs(int64_t stride);
  // Every product gets the one scratch buffer: the calls are stream-ordered, so they never
  // overlap (the SIMT products ignore it).
  MatvecScratch scratch() const {
    return MatvecScratch{reinterpret_cast<float*>(mma_scratch.data()), static_cast<size_t>(mma_scratch.bytes()),
                         x_planes, static_cast<size_t>(x_planes_bytes), {given[0], given[1]}};
  }
  // Where a producer of X writes X's planes (buf: planes_u, planes_b or the prep space), null with
  // the producer-built planes off; then give_planes names them to X's products (rows of k
  // elements, ldx apart: k unless given; n_batch > 1: the members of a batched product, k apart in
  // a row), and drop_planes(slot) ends that before anything rewrites X or buf.
  uint8_t* planes_out(uint8_t* buf) const { return fused_planes ? buf : nullptr; }
  static int64_t planes_ld(int64_t k) { return static_cast<int64_t>(matvec_planes_bytes(k, 1)); }
  void give_planes(int slot, const float* X, int64_t k, int rows, const uint8_t* buf, int64_t ldx = 0,
                   int n_batch = 1) {
    if (fused_planes)
      given[slot] = GivenPlanes{X, ldx > 0 ? ldx : k, k, rows, buf, planes_ld(k), n_batch > 1 ? k : 0, n_batch};
  }
  void drop_planes(int slot) { given[slot] = GivenPlanes{}; }
  // Launches f's kernels on the side stream, after everything launched so far; join_side() makes
  // the stream wait for them. Without branching, f runs in line (the same kernels, the same bits).
  template <class F>
  void on_side(F&& f) {
    if (!branching) {
      f();
      return;
    }
    DS4_GPU_CHECK(cudaEventRecord(fork_ev, stream));
    DS4_GPU_CHECK(cudaStreamWaitEvent(side, fork_ev, 0));
    std::swap(stream, side);
    try {
      f();
    } catch (...) {
      std::swap(stream, side);
      throw;
    }
    std::swap(stream, side);
    DS4_GPU_CHECK(cudaEventRecord(join_ev, side));
    side_pending = true;
  }
  void join_side() {
    if (!side_pending) return;
    DS4_GPU_CHECK(cudaStreamWaitEvent(stream, join_ev, 0));
    side_pending = false;
  }
  // Inside an on_side function: marks the side work launched so far; wait_side_mark() (on the
  // stream, after on_side returns) makes the stream wait for that part only. Without branching,
  // nothing (the side work already ran in line).
  void mark_side() {
    if (!branching) return;
    DS4_GPU_CHECK(cudaEventRecord(mark_ev, stream));
    mark_pending = true;
  }
  void wait_side_mark() {
    if (!mark_pending) return;
    DS4_GPU_CHECK(cudaStreamWaitEvent(stream, mark_ev, 0));
    mark_pending = false;
  }
  int staged_min() const { return staged ? staged_cols : kMatvecStagedOff; }
  void mv(const TensorView& W, const float* X, int ncols, int64_t ldx, float* Y, int64_t ldy) {
    matvec(W, X, ncols, ldx, Y, ldy, stream, tall, staged_min(), scratch());
  }
  // Products of one X, the step's n columns (matvec_multi: fused where DS4_GPU_MV_FUSE allows).
  void mvm(const MatvecProduct* ps, int m, const float* X, int64_t ldx) {
    matvec_multi(ps, m, X, n, ldx, stream, tall, staged_min(), scratch());
  }
  // The expert-grouped product of a stack over this step's parts (n_pairs of them at most).
  // x_rows: the rows of X (for the integer products' planes).
  void mvg(const TensorView& W, int n_pairs, const int32_t* x_row, const float* X, int64_t ldx, float* Y, int64_t ldy,
           int part_cols, int64_t x_rows) {
    matvec_grouped(W, parts, n_parts, n_pairs, sorted_pairs, x_row, X, ldx, Y, ldy, stream, part_cols, scratch(),
                   x_rows);
  }
  uint64_t mma_scratch_need() const;
  void ensure_mma_scratch();
  // Each returns when its calls were issued and its wait began (host_phases_us' last boundary).
  using Clock = std::chrono::steady_clock;
  Clock::time_point download_logits(float* out, uint64_t bytes);
  Clock::time_point download_argmax(int32_t* out);
  double host_phases[5] = {};  // host_phases_us of the last step
  // logits_host holds at least `bytes` (grown after the stream is idle: the old buffer may still
  // be a copy's target).
  void reserve_host(uint64_t bytes) {
    if (logits_host.size() >= bytes) return;
    DS4_GPU_CHECK(cudaStreamSynchronize(stream));
    logits_host = PinnedMemory(bytes);
  }
  // Prefetch windows (kPrefetch*: the window kinds of l2_prefetch_log).
  enum : int { kPrefetchAttnPrologue = 0, kPrefetchAttn = 1, kPrefetchFfnPrologue = 2, kPrefetchHead = 3 };
  void prefetch_window(int window, int layer, std::initializer_list<const TensorView*> tensors);
  void prefetch_attn_prologue(int l);
  CompressorLaunch compressor_launch(int l, bool indexer);
  void hc_pre_site(const HcWeights& w, const float* norm);
  HcSite site_launch(const HcWeights& w, const float* norm, float* U, uint8_t* planes) const;
  void post_site(const float* Y, const float* D, const float* w, const float* SH, int k);
  void run_post_due();
  void run_comb_due();
  void attention_layer(int l);
  void ffn_layer(int l);
  void head();
  void launch_step();
  void run_graph();
};

GpuEngine::Impl::Impl(const ModelConfig& c, const std::string& path, const std::vector<WeightEntry>& entries,
                      const EngineOptions& o)
    : cfg((check_config(c, o), c)), opts(o), file(path), hw(bind_weights(cfg, file, entries)), layout(cfg) {
  if (!available()) throw std::runtime_error("GPU engine: no GPU device is visible");
  csa = std::count(cfg.compress_ratios.begin(), cfg.compress_ratios.end(), 4) > 0;
  hca = std::count(cfg.compress_ratios.begin(), cfg.compress_ratios.end(), 128) > 0;
  max_blocks = (opts.max_ctx + kPageTokens - 1) / kPageTokens;
  // Defaults (ext/gpu/README.md, "Engine: what ran on the H200"): both passed the bit-for-bit
  // checks on an H200 and were faster there. Graphs only up to the max_ctx measured (4096): a
  // graph's launch sizes are bounds from max_ctx (the indexer grid grows as max_ctx / 256 blocks a
  // lane on every CSA layer), which a far larger max_ctx would pay at every step.
  // DS4_GPU_GRAPHS / DS4_GPU_MV_TALL = 1 or 0 override either.
  auto env_flag = [](const char* name, bool dflt) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == '\0') return dflt;
    return std::string(v) != "0";
  };
  graphs = env_flag("DS4_GPU_GRAPHS", opts.max_ctx <= kGraphsDefaultMaxCtx);
  tall = env_flag("DS4_GPU_MV_TALL", true);
  staged = env_flag("DS4_GPU_MV_STAGED", true);
  if (const char* v = std::getenv("DS4_GPU_MV_STAGED_MIN"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long c = std::strtol(v, &end, 10);
    if (end == v || *end != '\0' || c < kMatvecStagedMin || c > kMatvecStagedOff)
      throw std::invalid_argument(std::string("DS4_GPU_MV_STAGED_MIN must be a column count of at least 2, not '") + v +
                                  "'");
    staged_cols = static_cast<int>(c);
  }
  // The L2 prefetch: off by default (measured on the H200, README "Pass 9: outcome": it made flash-l4
  // decode 1-3% slower); DS4_GPU_L2_PREFETCH=1 turns it on where the device has it. A window asks
  // for at most half the L2; DS4_GPU_L2_PREFETCH_BYTES (an integer) replaces that cap.
  prefetch = env_flag("DS4_GPU_L2_PREFETCH", false) && l2_prefetch_supported();
  branches = env_flag("DS4_GPU_BRANCHES", true);
  hc_fused = env_flag("DS4_GPU_HC_FUSED", true);
  route_fused = env_flag("DS4_GPU_ROUTE_FUSED", true);
  attn_q_fused = env_flag("DS4_GPU_ATTN_Q_FUSED", true);
  parallel_compressor = env_flag("DS4_GPU_COMP_PARALLEL", true);
  prefetch_cap = l2_cache_bytes() / 2;
  if (const char* v = std::getenv("DS4_GPU_L2_PREFETCH_BYTES"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const unsigned long long b = std::strtoull(v, &end, 10);
    if (end == v || *end != '\0' || *v == '-')
      throw std::invalid_argument(std::string("DS4_GPU_L2_PREFETCH_BYTES must be a byte count, not '") + v + "'");
    prefetch_cap = b;
  }
  attention_prepare();
  matvec_prepare();  // before any graph capture
  DS4_GPU_CHECK(cudaStreamCreate(&stream));
  DS4_GPU_CHECK(cudaStreamCreate(&side));
  DS4_GPU_CHECK(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming));
  DS4_GPU_CHECK(cudaEventCreateWithFlags(&mark_ev, cudaEventDisableTiming));
  DS4_GPU_CHECK(cudaEventCreateWithFlags(&join_ev, cudaEventDisableTiming));

  // Weights: the file's bytes once, in 256 MiB pieces (a pageable copy of the mapping).
  weights = DeviceMemory(file.size());
  constexpr uint64_t kPiece = 256ull << 20;
  for (uint64_t off = 0; off < file.size(); off += kPiece)
    DS4_GPU_CHECK(cudaMemcpy(weights.data() + off, file.data() + off, std::min(kPiece, file.size() - off),
                             cudaMemcpyHostToDevice));
  dw = device_views();

  // Paged state, as PagedState allocates it (zeroed, then every slot reset).
  const int S = opts.max_slots;
  rings = DeviceMemory(2ull * cfg.n_layer * S * kRingRows * cfg.head_dim);
  states = DeviceMemory(4ull * layout.state_per_slot * S);
  pages = DeviceMemory(2ull * layout.page_elems * opts.n_pages);
  if (rings.bytes()) DS4_GPU_CHECK(cudaMemset(rings.data(), 0, rings.bytes()));
  if (pages.bytes()) DS4_GPU_CHECK(cudaMemset(pages.data(), 0, pages.bytes()));
  slot_reset.assign(layout.state_per_slot, 0.0f);
  for (const LayerStateLayout& L : layout.layers) {
    if (L.ratio == 0) continue;
    const uint64_t na = static_cast<uint64_t>(L.attn_rows) * L.attn_width;
    const uint64_t ni = static_cast<uint64_t>(L.idx_rows) * L.idx_width;
    std::fill_n(slot_reset.begin() + L.state_off + na, na, -std::numeric_limits<float>::infinity());
    std::fill_n(slot_reset.begin() + L.state_off + 2 * na + ni, ni, -std::numeric_limits<float>::infinity());
  }
  tables.assign(static_cast<size_t>(S) * max_blocks, -1);
  page_owner.assign(std::max(opts.n_pages, 1), -1);
  for (int s = 0; s < S; ++s) reset(s);

  // Step inputs: 10 arrays of max_rows, then max_rows table rows (a step packs them tighter).
  const uint64_t R = opts.max_rows;
  const uint64_t in_ints = 10 * R + R * max_blocks;
  inputs = DeviceMemory(4 * in_ints);
  pinned = PinnedMemory(4 * in_ints);
  point_inputs(static_cast<int64_t>(R));

  carve_scratch();
  ensure_mma_scratch();
  order.resize(R);
  group_first.resize(R);
  group_len.resize(R);
  group_slot.resize(R);
  lane_group.resize(R);
  lane_t0.resize(R);
  logit_lanes.resize(R);
}

GpuEngine::Impl::~Impl() {
  for (auto& g : graph_cache) (void)cudaGraphExecDestroy(g.second);
  for (cudaEvent_t e : piece_done) (void)cudaEventDestroy(e);
  if (fork_ev) (void)cudaEventDestroy(fork_ev);
  if (mark_ev) (void)cudaEventDestroy(mark_ev);
  if (join_ev) (void)cudaEventDestroy(join_ev);
  if (side) (void)cudaStreamDestroy(side);
  if (stream) (void)cudaStreamDestroy(stream);
}

ModelWeights GpuEngine::Impl::device_views() const {
  ModelWeights d = hw;
  auto hc = [&](HcWeights& h) {
    h.fn = dev(h.fn);
    h.base = dev(h.base);
    h.scale = dev(h.scale);
  };
  auto comp = [&](CompressorWeights& c) {
    c.kv = dev(c.kv);
    c.gate = dev(c.gate);
    c.ape = dev(c.ape);
    c.norm = dev(c.norm);
  };
  d.embed = dev(d.embed);
  d.output = dev(d.output);
  d.output_norm = dev(d.output_norm);
  hc(d.hc_head);
  for (LayerWeights& L : d.layers) {
    hc(L.hc_attn);
    hc(L.hc_ffn);
    L.attn_norm = dev(L.attn_norm);
    L.ffn_norm = dev(L.ffn_norm);
    L.q_a = dev(L.q_a);
    L.q_b = dev(L.q_b);
    L.kv = dev(L.kv);
    L.wo_a = dev(L.wo_a);
    L.wo_b = dev(L.wo_b);
    L.q_norm = dev(L.q_norm);
    L.kv_norm = dev(L.kv_norm);
    L.sinks = dev(L.sinks);
    comp(L.comp);
    L.idx_q_b = dev(L.idx_q_b);
    L.idx_proj = dev(L.idx_proj);
    comp(L.idx_comp);
    L.gate_inp = dev(L.gate_inp);
    L.exp_bias = dev(L.exp_bias);
    L.tid2eid = dev(L.tid2eid);
    L.gate_exps = dev(L.gate_exps);
    L.up_exps = dev(L.up_exps);
    L.down_exps = dev(L.down_exps);
    L.gate_sh = dev(L.gate_sh);
    L.up_sh = dev(L.up_sh);
    L.down_sh = dev(L.down_sh);
  }
  return d;
}

// The scratch buffers in allocation order (memory.py _device_scratch_buffers mirrors this list).
void GpuEngine::Impl::carve_scratch() {
  const int64_t R = opts.max_rows, d = cfg.n_embd, hc = cfg.hc_mult, hd = cfg.head_dim, nh = cfg.n_head;
  const int64_t ihd = cfg.index_head_dim, inh = cfg.index_n_heads, K = cfg.n_expert_used, F = cfg.expert_ffn;
  const int64_t mix = (2 + hc) * hc;
  cw = csa ? 2 * hd : (hca ? hd : 0);
  icw = csa ? 2 * ihd : 0;
  n_idx = csa ? opts.max_ctx / 4 : 0;
  n_sel = csa ? std::min<int64_t>(cfg.index_topk, opts.max_ctx / 4) : 0;
  const bool shared = cfg.n_expert_shared == 1;
  // Planes for the widest X a product reads, all of a step's rows: the attention output (the
  // grouped output projection's members side by side), the mHC stream; or the routed experts' down
  // input, a row per pair.
  const int64_t widest = std::max({nh * hd, hc * d, d, static_cast<int64_t>(cfg.q_lora_rank),
                                   static_cast<int64_t>(cfg.o_groups) * cfg.o_lora_rank, F});
  x_planes_bytes = static_cast<int64_t>(std::max(matvec_planes_bytes(widest, R), matvec_planes_bytes(F, R * K)));
  // The producer-built planes: u's, then the widest of q_lat, the shared SwiGLU's output and head_in.
  const int64_t planes_u_bytes = static_cast<int64_t>(matvec_planes_bytes(d, R));
  const int64_t planes_b_bytes =
      static_cast<int64_t>(matvec_planes_bytes(std::max({d, static_cast<int64_t>(cfg.q_lora_rank), F}), R));
  struct Part {
    void** ptr;
    int64_t bytes;
  };
  const Part parts_list[] = {
      {reinterpret_cast<void**>(&x_hc), 4 * R * hc * d},
      {reinterpret_cast<void**>(&x_hc_next), 4 * R * hc * d},
      {reinterpret_cast<void**>(&mix_buf), 4 * R * mix},
      {reinterpret_cast<void**>(&post_buf), 4 * R * hc},
      {reinterpret_cast<void**>(&comb_buf), 4 * R * hc * hc},
      {reinterpret_cast<void**>(&u), 4 * R * d},
      {reinterpret_cast<void**>(&q_lat), 4 * R * cfg.q_lora_rank},
      {reinterpret_cast<void**>(&q), 4 * R * nh * hd},
      {reinterpret_cast<void**>(&kvf), 4 * R * hd},
      {reinterpret_cast<void**>(&kv16), 2 * R * hd},
      {reinterpret_cast<void**>(&comp_kv), 4 * R * cw},
      {reinterpret_cast<void**>(&comp_sc), 4 * R * cw},
      {reinterpret_cast<void**>(&idx_q), csa ? 4 * R * inh * ihd : 0},
      {reinterpret_cast<void**>(&idx_w), csa ? 4 * R * inh : 0},
      {reinterpret_cast<void**>(&idx_kv), 4 * R * icw},
      {reinterpret_cast<void**>(&idx_sc), 4 * R * icw},
      {reinterpret_cast<void**>(&attn_out), 4 * R * nh * hd},
      {reinterpret_cast<void**>(&o_low), 4 * R * cfg.o_groups * cfg.o_lora_rank},
      {reinterpret_cast<void**>(&y), 4 * R * d},
      {reinterpret_cast<void**>(&router), 4 * R * cfg.n_expert},
      {reinterpret_cast<void**>(&sel_w), 4 * R * K},
      {reinterpret_cast<void**>(&sel_id), 4 * R * K},
      {reinterpret_cast<void**>(&pair_row), 4 * R * K},
      {reinterpret_cast<void**>(&sorted_pairs), 4 * R * K},
      {reinterpret_cast<void**>(&parts), 12 * R * K},
      {reinterpret_cast<void**>(&n_parts), 4},
      {reinterpret_cast<void**>(&route_done), 4},
      {reinterpret_cast<void**>(&ex_gate), 4 * R * K * F},
      {reinterpret_cast<void**>(&ex_up), 4 * R * K * F},
      {reinterpret_cast<void**>(&ex_down), 4 * R * K * d},
      {reinterpret_cast<void**>(&sh_gate), shared ? 4 * R * F : 0},
      {reinterpret_cast<void**>(&sh_up), shared ? 4 * R * F : 0},
      {reinterpret_cast<void**>(&sh_down), shared ? 4 * R * d : 0},
      {reinterpret_cast<void**>(&comp_sel), 4 * R * n_sel},
      {reinterpret_cast<void**>(&idx_scores), 4 * R * n_idx},
      {reinterpret_cast<void**>(&head_in), 4 * R * d},
      {reinterpret_cast<void**>(&logits), 4 * R * cfg.n_vocab},
      {reinterpret_cast<void**>(&inv_freq), 8 * static_cast<int64_t>(cfg.n_layer) * (cfg.rope_dim / 2)},
      // attention's split partials (paged_ops.cu): R x n_head x 8 splits x (head_dim + 2) floats
      {reinterpret_cast<void**>(&attn_part), 4 * attention_part_floats(static_cast<int>(R), static_cast<int>(nh),
                                                                       static_cast<int>(hd))},
      // the logit lanes' greedy tokens, then argmax_rows' work area
      {reinterpret_cast<void**>(&argmax_tokens), 4 * R + static_cast<int64_t>(argmax_work_bytes(R))},
      {reinterpret_cast<void**>(&x_planes), x_planes_bytes},
      {reinterpret_cast<void**>(&planes_u), planes_u_bytes},
      {reinterpret_cast<void**>(&planes_b), planes_b_bytes},
      {reinterpret_cast<void**>(&hc_scratch), static_cast<int64_t>(hc_site_scratch_bytes(static_cast<int>(R), d))},
  };
  auto padded = [](int64_t b) {
    return static_cast<uint64_t>((b + kScratchAlign - 1) / kScratchAlign * kScratchAlign);
  };
  uint64_t total = 0;
  for (const Part& p : parts_list) total += padded(p.bytes);
  arena = DeviceMemory(total);
  uint64_t off = 0;
  for (const Part& p : parts_list) {
    *p.ptr = arena.data() + off;
    off += padded(p.bytes);
  }
  DS4_GPU_CHECK(cudaMemset(route_done, 0, 4));  // the fused router's counter starts at zero
  // Constants: the pair -> lane map of the grouped expert products, and the RoPE tables.
  std::vector<int32_t> pr(static_cast<size_t>(R * K));
  for (int64_t p = 0; p < R * K; ++p) pr[p] = static_cast<int32_t>(p / K);
  DS4_GPU_CHECK(cudaMemcpy(pair_row, pr.data(), pr.size() * 4, cudaMemcpyHostToDevice));
  std::vector<double> f;
  for (const auto& t : cfg.rope_inv_freqs) f.insert(f.end(), t.begin(), t.end());
  if (!f.empty()) DS4_GPU_CHECK(cudaMemcpy(inv_freq, f.data(), f.size() * 8, cudaMemcpyHostToDevice));
}

// The tensor-core scratch the engine's products need at their widest: every product of the step at
// max_rows columns (the LM head has at most as many), the grouped experts at max_rows x
// n_expert_used pairs but at most kMmaGroupedScratchParts parts. 0 with the switch off (and for
// every product the tensor cores do not take). The launchers need less at fewer columns.
uint64_t GpuEngine::Impl::mma_scratch_need() const {
  const int R = opts.max_rows;
  const int max_parts = static_cast<int>(std::min<int64_t>(static_cast<int64_t>(R) * cfg.n_expert_used,
                                                           kMmaGroupedScratchParts));
  size_t need = 0;
  auto dense = [&](const TensorView& W) { need = std::max(need, matvec_scratch_bytes(W, R)); };
  auto grouped = [&](const TensorView& W) { need = std::max(need, matvec_grouped_scratch_bytes(W, max_parts)); };
  for (const LayerWeights& L : dw.layers) {
    dense(L.hc_attn.fn);
    dense(L.hc_ffn.fn);
    dense(L.q_a);
    dense(L.kv);
    dense(L.q_b);
    if (L.ratio > 0) {
      dense(L.comp.kv);
      dense(L.comp.gate);
    }
    if (L.ratio == 4) {
      dense(L.idx_proj);
      dense(L.idx_comp.kv);
      dense(L.idx_comp.gate);
      dense(L.idx_q_b);
    }
    TensorView wo_a_group = L.wo_a;  // one member of the grouped output projection's batch
    wo_a_group.ne[1] = cfg.o_lora_rank;
    dense(wo_a_group);
    dense(L.wo_b);
    dense(L.gate_inp);
    grouped(L.gate_exps);
    grouped(L.up_exps);
    grouped(L.down_exps);
    if (cfg.n_expert_shared == 1) {
      dense(L.gate_sh);
      dense(L.up_sh);
      dense(L.down_sh);
    }
  }
  dense(dw.hc_head.fn);
  dense(dw.output);
  return (static_cast<uint64_t>(need) + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
}

// With the tensor-core switch on, their kernels' shared-memory limits are raised and the scratch
// allocated once: at construction, or at the first step that sees the switch on (before any of its
// launches or captures; the stream is idle between steps), never inside a step or a graph.
void GpuEngine::Impl::ensure_mma_scratch() {
  if (mma_sized || !matvec_mma()) return;
  mma_prepare();
  const uint64_t bytes = mma_scratch_need();
  if (bytes > 0) mma_scratch = DeviceMemory(bytes);
  mma_sized = true;
}

// The CPU engine's step checks (ext/engine/plan_check.h), same messages; also each lane's group
// and its group's first position. The tables change only after every check has passed, so a
// bad plan leaves the engine as it was.
void GpuEngine::Impl::validate_and_group(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token,
                                         const int32_t* lane_pos, int n_tables, const int32_t* table_slot,
                                         const int32_t* block_table, int max_blocks_in) {
  check_step_plan(n_lanes, lane_slot, lane_token, lane_pos, n_tables, table_slot, block_table, max_blocks_in, opts,
                  cfg.n_vocab, max_blocks, page_owner.data());
  n_groups = group_lanes(n_lanes, lane_slot, lane_pos, order.data(), group_first.data(), group_len.data(),
                         group_slot.data(), lane_group.data(), lane_t0.data());
  copy_block_tables(n_tables, table_slot, block_table, max_blocks_in, tables.data(), max_blocks);
}

// Every page a lane reads or writes must be assigned (plan_check.h).
void GpuEngine::Impl::check_pages() { ds4::check_pages(n, slot_of, pos, csa, hca, tables.data(), max_blocks); }

// The step inputs' views at a stride of P ints: the 10 arrays, then the groups' table rows. Every
// launch parameter a graph bakes in comes from these views, and P depends only on the lanes, which
// the graph key holds, so a bucket's replays find their inputs where its capture put them.
void GpuEngine::Impl::point_inputs(int64_t P) {
  const int32_t* in = reinterpret_cast<const int32_t*>(inputs.data());
  lanes.slot = in;
  lanes.token = in + P;
  lanes.pos = in + 2 * P;
  lanes.group = in + 3 * P;
  lanes.t0 = in + 4 * P;
  lanes.order = in + 5 * P;
  lanes.grp_first = in + 6 * P;
  lanes.grp_len = in + 7 * P;
  lanes.grp_slot = in + 8 * P;
  logit_lanes_dev = in + 9 * P;
  lanes.tables = in + 10 * P;
  lanes.max_blocks = max_blocks;
}

// A step's lanes rounded up to 32, at most max_rows: every array entry a kernel reads (a lane's, a
// group's or a logit lane's, each below the lanes) lies inside it, and the padding is zeros.
static int64_t input_stride(int n_lanes, int64_t max_rows) {
  return std::min<int64_t>(max_rows, (n_lanes + 31) / 32 * 32);
}

void GpuEngine::Impl::upload_inputs(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token,
                                    const int32_t* lane_pos) {
  const int64_t P = input_stride(n_lanes, opts.max_rows);
  point_inputs(P);
  int32_t* h = pinned.ints();
  std::fill(h, h + 10 * P, 0);
  std::copy(lane_slot, lane_slot + n_lanes, h);
  std::copy(lane_token, lane_token + n_lanes, h + P);
  std::copy(lane_pos, lane_pos + n_lanes, h + 2 * P);
  std::copy(lane_group.begin(), lane_group.begin() + n_lanes, h + 3 * P);
  std::copy(lane_t0.begin(), lane_t0.begin() + n_lanes, h + 4 * P);
  std::copy(order.begin(), order.begin() + n_lanes, h + 5 * P);
  std::copy(group_first.begin(), group_first.begin() + n_groups, h + 6 * P);
  std::copy(group_len.begin(), group_len.begin() + n_groups, h + 7 * P);
  std::copy(group_slot.begin(), group_slot.begin() + n_groups, h + 8 * P);
  std::copy(logit_lanes.begin(), logit_lanes.end(), h + 9 * P);
  for (int g = 0; g < n_groups; ++g)
    std::copy_n(tables.data() + static_cast<int64_t>(group_slot[g]) * max_blocks, max_blocks,
                h + 10 * P + static_cast<int64_t>(g) * max_blocks);
  const uint64_t bytes = 4ull * (10 * P + static_cast<int64_t>(n_groups) * max_blocks);
  DS4_GPU_CHECK(cudaMemcpyAsync(inputs.data(), h, bytes, cudaMemcpyHostToDevice, stream));
}

// One prefetch window: the tensors' bytes in order, each from its start, until prefetch_cap bytes
// are asked for (the last one cut short; never past a tensor's end); absent tensors are skipped.
void GpuEngine::Impl::prefetch_window(int window, int layer, std::initializer_list<const TensorView*> tensors) {
  if (!prefetch || prefetch_cap == 0) return;
  L2Range r[kL2PrefetchMaxRanges];
  int m = 0;
  uint64_t left = prefetch_cap;
  for (const TensorView* t : tensors) {
    if (m == kL2PrefetchMaxRanges || left == 0) break;
    if (t->data == nullptr || t->nbytes() <= 0) continue;
    const uint64_t bytes = std::min<uint64_t>(static_cast<uint64_t>(t->nbytes()), left);
    r[m++] = L2Range{t->data, bytes};
    left -= bytes;
    prefetch_log.insert(prefetch_log.end(),
                        {window, layer, static_cast<int64_t>(t->data - weights.data()), static_cast<int64_t>(bytes)});
  }
  ds4::gpu::l2_prefetch(r, m, stream);  // (GpuEngine::l2_prefetch is the getter)
}

// Before layer l's attention prologue (mHC pre and attn_norm, then the u products, q_norm, q_b):
// the weights of those products in the order they are read.
void GpuEngine::Impl::prefetch_attn_prologue(int l) {
  const LayerWeights& L = dw.layers[l];
  prefetch_window(kPrefetchAttnPrologue, l,
                  {&L.hc_attn.fn, &L.q_a, &L.kv, &L.comp.kv, &L.comp.gate, &L.idx_proj, &L.idx_comp.kv,
                   &L.idx_comp.gate, &L.q_b, &L.idx_q_b});
}

// The compressor update of layer l's attention rows, or (indexer) of its indexer's rows, over this
// step's lanes: its state, its input projections (kv and gate, APE added) and its page rows.
CompressorLaunch GpuEngine::Impl::compressor_launch(int l, bool indexer) {
  const LayerWeights& L = dw.layers[l];
  const LayerStateLayout& LL = layout.layers[l];
  CompressorLaunch a;
  a.states = reinterpret_cast<float*>(states.data());
  a.state_per_slot = static_cast<int64_t>(layout.state_per_slot);
  a.kv_off = static_cast<int64_t>(LL.state_off) + (indexer ? 2ll * LL.attn_rows * LL.attn_width : 0);
  a.rows = indexer ? LL.idx_rows : LL.attn_rows;
  a.width = indexer ? LL.idx_width : LL.attn_width;
  a.ratio = indexer ? 4 : L.ratio;
  a.c = static_cast<int>(indexer ? cfg.index_head_dim : cfg.head_dim);
  a.rope_dim = cfg.rope_dim;
  a.k = indexer ? idx_kv : comp_kv;
  a.z = indexer ? idx_sc : comp_sc;
  a.ld = indexer ? icw : cw;
  a.norm = indexer ? L.idx_comp.norm : L.comp.norm;
  a.eps = cfg.norm_eps;
  a.inv_freq = freqs(l);
  a.qat = cfg.qat_numerics ? (indexer ? 2 : 1) : 0;
  a.pages = reinterpret_cast<uint16_t*>(pages.data());
  a.page_elems = static_cast<int64_t>(layout.page_elems);
  a.row_off = static_cast<int64_t>(indexer ? LL.idx_off : LL.comp_off);
  return a;
}

// mHC pre, then the site's RMSNorm (attn_norm / ffn_norm) fused into the same kernel: u = norm(sum pre_j X_j).
// With the fused sites (hc_fused) the sublayer's post due here runs in the site's first kernel.
void GpuEngine::Impl::hc_pre_site(const HcWeights& w, const float* norm) {
  const int64_t d = cfg.n_embd, hcd = cfg.hc_mult * d, mix = (2 + cfg.hc_mult) * cfg.hc_mult;
  if (hc_fused && hc_site_takes(cfg.hc_mult, d, static_cast<int>(w.fn.type))) {
    run_comb_due();  // the post reads the previous site's comb (normally run on its side branch)
    hc_site(site_launch(w, norm, u, planes_out(planes_u)), stream);
    if (post_due.due) std::swap(x_hc, x_hc_next);
    comb_due = true;  // its Sinkhorn: at the end of the site's side branch (run_comb_due)
    post_due = PostDue{};
  } else {
    run_post_due();  // (and any comb due before it)
    mv(w.fn, x_hc, n, hcd, mix_buf, mix);
    hc_pre(x_hc, n, cfg.hc_mult, d, mix_buf, mix, w.scale, w.base, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps,
           norm, u, post_buf, comb_buf, stream, planes_out(planes_u), planes_ld(d));
  }
  give_planes(0, u, d, n, planes_u);  // until the site's last product of u
}

// One site's hc_site launch: the post due, the site's weights, U (the site's RMSNorm norm) and its
// planes; all n lanes.
HcSite GpuEngine::Impl::site_launch(const HcWeights& w, const float* norm, float* U, uint8_t* planes) const {
  HcSite s;
  s.X = x_hc;
  s.X_out = x_hc_next;
  s.n = n;
  s.hc = cfg.hc_mult;
  s.d = cfg.n_embd;
  s.has_post = post_due.due;
  s.Y = post_due.Y;
  s.D = post_due.D;
  s.w = post_due.w;
  s.SH = post_due.SH;
  s.k = post_due.k;
  s.post = post_buf;
  s.comb = comb_buf;
  s.fn = w.fn.data;
  s.fn_type = static_cast<int>(w.fn.type);
  s.fn_row_bytes = w.fn.row_bytes();
  s.scale = w.scale;
  s.base = w.base;
  s.hc_eps = cfg.hc_eps;
  s.norm_eps = cfg.norm_eps;
  s.norm_w = norm;
  s.U = U;
  s.planes = planes;
  s.ldp = planes_ld(cfg.n_embd);
  s.scratch = hc_scratch;
  s.scratch_rows = opts.max_rows;
  return s;
}

// The mHC post of the sublayer that just ended (y = Y's rows, or the MoE sum of D, w and SH), due
// at the next site; run_post_due runs it on its own where that site does not take it.
void GpuEngine::Impl::post_site(const float* Y, const float* D, const float* w, const float* SH, int k) {
  run_post_due();  // never two due at once
  post_due = PostDue{true, Y, D, w, SH, k};
}

// The Sinkhorn of the last fused site's comb (hc_comb), due before the next post reads it: the
// layer's side branch runs it after its own work (so the shared expert starts at the fork).
void GpuEngine::Impl::run_comb_due() {
  if (!comb_due) return;
  comb_due = false;
  hc_comb(comb_buf, n, cfg.hc_sinkhorn_iters, cfg.hc_eps, stream);
}

void GpuEngine::Impl::run_post_due() {
  run_comb_due();
  if (!post_due.due) return;
  const PostDue p = post_due;
  post_due = PostDue{};
  if (p.D != nullptr)
    hc_post_moe(x_hc, n, cfg.hc_mult, cfg.n_embd, p.D, p.w, p.SH, p.k, post_buf, comb_buf, stream);
  else
    hc_post(x_hc, n, cfg.hc_mult, cfg.n_embd, p.Y, post_buf, comb_buf, stream);
}

void GpuEngine::Impl::attention_layer(int l) {
  const LayerWeights& L = dw.layers[l];
  const LayerStateLayout& LL = layout.layers[l];
  const int64_t d = cfg.n_embd, hd = cfg.head_dim, nh = cfg.n_head, ql = cfg.q_lora_rank;
  const int rd = cfg.rope_dim;
  const int64_t inh = cfg.index_n_heads, ihd = cfg.index_head_dim;
  const bool qat = cfg.qat_numerics;
  const float eps = cfg.norm_eps;

  // (A) batched projections: every product of u in one matvec_multi call (q_a, kv, the
  // compressor's kv and gate, the indexer's weights and its compressor's kv and gate), then, after
  // q_norm, both products of q_lat (q_b, the indexer's queries). Each output has matvec's bits.
  hc_pre_site(L.hc_attn, L.attn_norm);
  {
    MatvecProduct pu[kMatvecMultiMax];
    int m = 0;
    pu[m++] = {L.q_a, q_lat, ql};
    pu[m++] = {L.kv, kvf, hd};
    if (L.ratio > 0) {
      pu[m++] = {L.comp.kv, comp_kv, cw};
      pu[m++] = {L.comp.gate, comp_sc, cw};
    }
    if (L.ratio == 4) {
      pu[m++] = {L.idx_proj, idx_w, inh};
      pu[m++] = {L.idx_comp.kv, idx_kv, icw};
      pu[m++] = {L.idx_comp.gate, idx_sc, icw};
    }
    mvm(pu, m, u, d);
  }
  drop_planes(0);
  // (A') The KV side, on the side branch: the raw row's norm and RoPE, the compressors' APE and state
  // updates read only what the u products wrote; beside it the q path (q_lat's norm, q_b, the heads).
  const bool comp_parallel = parallel_compressor && n > n_groups;
  on_side([&] {
    kv_finish(kvf, n, static_cast<int>(hd), rd, L.kv_norm, eps, lanes.pos, freqs(l), qat, kv16, stream);
    if (L.ratio > 0) {
      const int64_t width = (L.ratio == 4 ? 2 : 1) * hd;
      add_ape(comp_sc, cw, n, width, L.comp.ape, L.ratio, lanes.pos, stream);
      compressor_update(compressor_launch(l, false), lanes, n, n_groups, comp_parallel, stream);
    }
    if (L.ratio == 4) {
      add_ape(idx_sc, icw, n, 2 * ihd, L.idx_comp.ape, 4, lanes.pos, stream);
      compressor_update(compressor_launch(l, true), lanes, n, n_groups, comp_parallel, stream);
    }
    run_comb_due();
  });
  rms_norm(q_lat, ql, L.q_norm, q_lat, ql, n, ql, eps, stream, planes_out(planes_b), planes_ld(ql));
  give_planes(1, q_lat, ql, n, planes_b);
  {
    MatvecProduct pq[2] = {{L.q_b, q, nh * hd}, {L.idx_q_b, idx_q, inh * ihd}};
    mvm(pq, L.ratio == 4 ? 2 : 1, q_lat, ql);
  }
  drop_planes(1);
  // The attention stretch below reads little; the output projection after it (wo_a, wo_b) is the
  // layer's largest dense read.
  prefetch_window(kPrefetchAttn, l, {&L.wo_a, &L.wo_b});
  const bool q_in_attention = attn_q_fused && n <= kAttnQFusedMaxLanes;
  if (!q_in_attention) q_heads(q, n, static_cast<int>(nh), static_cast<int>(hd), rd, eps, lanes.pos, freqs(l), stream);
  if (L.ratio == 4) {
    // Head weights are scaled by 1/sqrt(index_head_dim * index_n_heads) (spec §4.5).
    const float w_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ihd * inh)));
    idx_q_finish(idx_q, idx_w, n, static_cast<int>(inh), static_cast<int>(ihd), rd, lanes.pos, freqs(l), qat, w_scale,
                 stream);
  }
  join_side();  // the indexer and the attention read the compressed rows and kv16

  // (B) per slot. Launch sizes: this step's largest key count and indexer candidate count, or
  // under graph capture their bounds for any position below max_ctx (results are the same: the
  // kernels read each lane's own counts; the sizes only bound shared memory and the grid).
  int max_keys = 0, max_vis = 0;
  if (graphs) {
    max_keys = kRingRows + (L.ratio == 4 ? static_cast<int>(n_sel) : L.ratio == 128 ? opts.max_ctx / 128 : 0);
    max_vis = static_cast<int>(n_idx);
  } else {
    for (int i = 0; i < n; ++i) {
      const int64_t t = pos[i];
      int keys = static_cast<int>(std::min<int64_t>(t + 1, kRingRows));
      if (L.ratio == 4) keys += static_cast<int>(std::min<int64_t>(cfg.index_topk, (t + 1) / 4));
      if (L.ratio == 128) keys += static_cast<int>((t + 1) / 128);
      max_keys = std::max(max_keys, keys);
      max_vis = std::max(max_vis, static_cast<int>((t + 1) / 4));
    }
  }
  if (L.ratio == 4 && max_vis > cfg.index_topk) {
    indexer_scores(idx_q, idx_w, n, static_cast<int>(inh), static_cast<int>(ihd), lanes,
                   reinterpret_cast<const uint16_t*>(pages.data()), static_cast<int64_t>(layout.page_elems),
                   static_cast<int64_t>(LL.idx_off), cfg.index_topk, max_vis, idx_scores, n_idx, stream);
    indexer_topk(idx_scores, n_idx, n, lanes.pos, cfg.index_topk, comp_sel, n_sel, stream);
  }
  uint16_t* ring = reinterpret_cast<uint16_t*>(rings.data()) +
                   static_cast<int64_t>(l) * opts.max_slots * kRingRows * hd;
  AttentionLaunch at;
  at.q = q;
  at.out = attn_out;
  at.kv16 = kv16;
  at.ring = ring;
  at.pages = reinterpret_cast<const uint16_t*>(pages.data());
  at.page_elems = static_cast<int64_t>(layout.page_elems);
  at.row_off = static_cast<int64_t>(LL.comp_off);
  at.ratio = L.ratio;
  at.top_k = cfg.index_topk;
  at.sel = comp_sel;
  at.ld_sel = n_sel;
  at.sinks = L.sinks;
  at.n_head = static_cast<int>(nh);
  at.head_dim = static_cast<int>(hd);
  at.rope_dim = rd;
  at.inv_freq = freqs(l);
  at.max_keys = max_keys;
  at.part = attn_part;
  at.q_raw = q_in_attention;  // the split blocks do q_heads' work (skipped above)
  at.q_eps = eps;
  // (C) grouped low-rank output: group g maps heads [g*nh/G, (g+1)*nh/G) through rows
  // [g*ol, (g+1)*ol) of wo_a, then wo_b mixes all groups.
  // The G groups run as one batched launch (each group's rows as its own launch computes them),
  // their planes written by the attention's combine into the prep space.
  const int64_t G = cfg.o_groups, ol = cfg.o_lora_rank, gw = nh / G * hd;
  at.planes = planes_out(x_planes);
  at.planes_ld = planes_ld(gw);
  at.heads_per_member = static_cast<int>(nh / G);
  attention_paged(at, lanes, n, stream);
  give_planes(1, attn_out, gw, n, x_planes, nh * hd, static_cast<int>(G));
  // The ring rows on the side branch: nothing of this step reads the ring after the attention, and
  // the next writer of kv16 (the next layer's kv_finish) runs after it on the same branch.
  on_side([&] { ring_store(ring, kv16, n, static_cast<int>(hd), lanes, stream); });
  TensorView part = L.wo_a;
  part.ne[1] = ol;
  matvec_batched(part, static_cast<int>(G), ol * L.wo_a.row_bytes(), attn_out, gw, n, nh * hd, o_low, ol, G * ol,
                 stream, tall, staged_min(), scratch());
  drop_planes(1);
  mv(L.wo_b, o_low, n, G * ol, y, d);
  // The FFN prologue (mHC post and pre, router, routing, parts) is latency-bound; its two small
  // products and then the shared expert follow it.
  prefetch_window(kPrefetchFfnPrologue, l, {&L.hc_ffn.fn, &L.gate_inp, &L.gate_sh, &L.up_sh, &L.down_sh});
  post_site(y, nullptr, nullptr, nullptr, 0);  // run by the FFN's mHC site
}

void GpuEngine::Impl::ffn_layer(int l) {
  const LayerWeights& L = dw.layers[l];
  const int64_t d = cfg.n_embd, F = cfg.expert_ffn;
  const int E = cfg.n_expert, K = cfg.n_expert_used;
  hc_pre_site(L.hc_ffn, L.ffn_norm);
  // The shared expert first, on the side branch: its weights are what the FFN prologue's prefetch
  // asked for, and it reads only u and writes its own buffers, so it runs beside the router, the
  // routing and the routed experts (no bit changes).
  const bool shared = cfg.n_expert_shared == 1;
  if (shared) {
    on_side([&] {
      MatvecProduct gu[2] = {{L.gate_sh, sh_gate, F}, {L.up_sh, sh_up, F}};
      mvm(gu, 2, u, d);
      mark_side();  // the routed gate/up starts after this (wait_side_mark below)
      swiglu(sh_gate, sh_up, n, F, cfg.swiglu_clamp_shexp[l], stream, planes_out(planes_b), planes_ld(F));
      give_planes(1, sh_gate, F, n, planes_b);
      mv(L.down_sh, sh_gate, n, F, sh_down, d);
      drop_planes(1);
      run_comb_due();
    });
  } else {
    on_side([&] { run_comb_due(); });
  }
  // Every (lane, selection) pair runs its expert as one column of the expert's grouped product:
  // single-column arithmetic, whatever else the expert serves. The router's product, the route and
  // the parts: one launch where router_route takes them (the same bytes), else three.
  const int n_pairs = n * K;
  const bool hash = l < cfg.n_hash_layers;
  if (!route_fused || n > kRouteFusedMaxLanes || matvec_uses_mma(L.gate_inp) ||
      !router_route(L.gate_inp, u, n, d, router, hash, L.tid2eid, lanes.token, L.exp_bias, K,
                    cfg.expert_weights_norm, cfg.expert_weights_scale, sel_id, sel_w, kExpertPart, sorted_pairs,
                    parts, n_parts, route_done, stream)) {
    mv(L.gate_inp, u, n, d, router, E);
    route(router, n, E, K, hash, L.tid2eid, lanes.token, L.exp_bias, cfg.expert_weights_norm,
          cfg.expert_weights_scale, sel_id, sel_w, stream);
    build_expert_parts(sel_id, n_pairs, E, kExpertPart, sorted_pairs, parts, n_parts, stream);
  }
  // The routed gate/up after the shared expert's gate/up: beside it, the two contend for the SMs
  // (pass 18, call 1: the routed pair took 35 instead of 26 us once the fused router's shorter
  // route left the shared product no gap to fill); the shared SwiGLU and down still run beside it.
  wait_side_mark();
  // A part holds at most one pair per lane (routes are distinct per lane), so n lanes bound its
  // width: the kernel is sized for that (wider parts would still run, in pieces).
  const int part_cols = std::min<int>(n, kExpertPart);
  // Gate, up and SwiGLU in one launch where matvec_grouped_pair takes them (the same bits: each
  // sum as matvec_grouped gives it, the swiglu kernel's expression on it); else three launches
  // (always with the tensor-core switch on: the pair declines stacks the tensor cores take), the
  // SwiGLU writing the down product's planes into the prep space (the side branch never preps).
  if (!matvec_grouped_pair(L.gate_exps, L.up_exps, parts, n_parts, n_pairs, sorted_pairs, pair_row, u, d, ex_gate,
                           nullptr, F, cfg.swiglu_clamp_exp[l], stream, part_cols, n, scratch())) {
    mvg(L.gate_exps, n_pairs, pair_row, u, d, ex_gate, F, part_cols, n);
    mvg(L.up_exps, n_pairs, pair_row, u, d, ex_up, F, part_cols, n);
    drop_planes(0);
    swiglu(ex_gate, ex_up, n_pairs, F, cfg.swiglu_clamp_exp[l], stream, planes_out(x_planes), planes_ld(F));
    give_planes(0, ex_gate, F, n_pairs, x_planes);
  }
  mvg(L.down_exps, n_pairs, nullptr, ex_gate, F, ex_down, d, part_cols, n_pairs);
  drop_planes(0);
  // The last large read of the layer: what follows (combine, mHC post, then the next layer's mHC
  // pre, or the head's) is latency-bound until the next layer's u products or the LM head.
  if (l + 1 < cfg.n_layer) {
    prefetch_attn_prologue(l + 1);
  } else if (!logit_lanes.empty()) {
    prefetch_window(kPrefetchHead, cfg.n_layer, {&dw.hc_head.fn, &dw.output});
  }
  join_side();  // the MoE combine (in hc_post_moe) reads the shared expert's output
  post_site(nullptr, ex_down, sel_w, shared ? sh_down : nullptr, K);  // run by the next site, or the head
}

void GpuEngine::Impl::head() {
  const int64_t d = cfg.n_embd, hcd = cfg.hc_mult * d, mix = (2 + cfg.hc_mult) * cfg.hc_mult;
  const int n_out = static_cast<int>(logit_lanes.size());
  if (hc_fused && hc_site_takes(cfg.hc_mult, d, static_cast<int>(dw.hc_head.fn.type))) {
    // The last layer's post and the head's site for the logit lanes only (no later kernel reads
    // the other lanes' streams).
    run_comb_due();
    if (n_out > 0) {
      HcSite s = site_launch(dw.hc_head, dw.output_norm, head_in, planes_out(planes_b));
      s.head = true;
      s.lanes = logit_lanes_dev;
      s.n = n_out;
      hc_site(s, stream);
    }
    post_due = PostDue{};
  } else {
    run_post_due();  // the last layer's
    if (n_out == 0) return;
    mv(dw.hc_head.fn, x_hc, n, hcd, mix_buf, mix);
    hc_head(x_hc, logit_lanes_dev, n_out, cfg.hc_mult, d, mix_buf, mix, dw.hc_head.scale, dw.hc_head.base,
            cfg.hc_eps, cfg.norm_eps, dw.output_norm, head_in, stream, planes_out(planes_b), planes_ld(d));
  }
  if (n_out == 0) return;
  give_planes(1, head_in, d, n_out, planes_b);
  mv(dw.output, head_in, n_out, d, logits, cfg.n_vocab);
  drop_planes(1);
}

// Every kernel of a step, in order, on the stream (the inputs are already on their way).
void GpuEngine::Impl::launch_step() {
  fused_planes = planes_fused() && matvec_int8();
  // The side branch's products must not share the scratch with the stream's: with the planes given
  // it preps none, and without the tensor cores nothing else of the scratch is used.
  branching = branches && fused_planes && !matvec_mma();
  drop_planes(0);
  drop_planes(1);
  post_due = PostDue{};
  comb_due = false;
  mark_pending = false;
  if (x_hc_base == nullptr) x_hc_base = x_hc;
  x_hc_next = x_hc == x_hc_base ? x_hc_next : x_hc;
  x_hc = x_hc_base;
  prefetch_log.clear();
  prefetch_attn_prologue(0);  // embedding rows and the first mHC pre read little
  // Every mHC stream starts as the embedding row (hc_mult copies).
  embed_rows(dw.embed, lanes.token, n, x_hc, static_cast<int64_t>(cfg.hc_mult) * cfg.n_embd, stream, cfg.hc_mult);
  for (int l = 0; l < cfg.n_layer; ++l) {
    attention_layer(l);
    ffn_layer(l);
  }
  head();
  join_side();
}

// Replay the step's bucket graph, capturing it first if this bucket is new.
void GpuEngine::Impl::run_graph() {
  constexpr size_t kMaxGraphs = 256;  // prompts make many buckets; forget all past this many
  const GraphKey key{n, n_groups, static_cast<int>(logit_lanes.size()), tall, staged_min(), matvec_settings_key(),
                     prefetch, matvec_imma(), matvec_imma_grouped(), matvec_imma_narrow_rows(), matvec_imma_ahead(),
                     matvec_imma_persist(), planes_fused(), branches, matvec_grouped_groups(), matvec_tall_min_k(),
                     hc_fused, route_fused, attn_q_fused, parallel_compressor, attn_heads_setting(),
                     attn_split_min(), matvec_imma_indep(), matvec_staged_min_rows(), hc_site_streams()};
  auto it = graph_cache.find(key);
  if (it == graph_cache.end()) {
    if (graph_cache.size() >= kMaxGraphs) {
      for (auto& g : graph_cache) (void)cudaGraphExecDestroy(g.second);
      graph_cache.clear();
    }
    cudaGraph_t graph = nullptr;
    DS4_GPU_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      launch_step();
    } catch (...) {
      (void)cudaStreamEndCapture(stream, &graph);
      if (graph) (void)cudaGraphDestroy(graph);
      throw;
    }
    DS4_GPU_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    (void)cudaGraphDestroy(graph);
    check(err, "cudaGraphInstantiate");
    it = graph_cache.emplace(key, exec).first;
    ++graphs_captured;
  }
  DS4_GPU_CHECK(cudaGraphLaunch(it->second, stream));
}

// --- GpuEngine -------------------------------------------------------------------------------

GpuEngine::GpuEngine(const ModelConfig& cfg, const std::string& gguf_path, const std::vector<WeightEntry>& weights,
                     const EngineOptions& opts)
    : impl_(std::make_unique<Impl>(cfg, gguf_path, weights, opts)) {}

GpuEngine::~GpuEngine() = default;

void GpuEngine::step(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                     const int32_t* lane_logits, int n_tables, const int32_t* table_slot, const int32_t* block_table,
                     int max_blocks, float* logits_out, int32_t* argmax_out) {
  Impl& m = *impl_;
  if (n_lanes <= 0) return;
  const Impl::Clock::time_point t0 = Impl::Clock::now();
  m.ensure_mma_scratch();  // the switch may have been turned on since construction
  m.validate_and_group(n_lanes, lane_slot, lane_token, lane_pos, n_tables, table_slot, block_table, max_blocks);
  m.n = n_lanes;
  m.pos = lane_pos;
  m.slot_of = lane_slot;
  m.check_pages();
  m.logit_lanes.clear();
  for (int i = 0; i < n_lanes; ++i)
    if (lane_logits[i]) m.logit_lanes.push_back(i);
  const Impl::Clock::time_point t1 = Impl::Clock::now();
  m.upload_inputs(n_lanes, lane_slot, lane_token, lane_pos);
  const Impl::Clock::time_point t2 = Impl::Clock::now();
  if (m.graphs) {
    m.run_graph();
  } else {
    m.launch_step();
  }
  const Impl::Clock::time_point t3 = Impl::Clock::now();
  const uint64_t logit_bytes = 4ull * m.logit_lanes.size() * m.cfg.n_vocab;
  const Impl::Clock::time_point waited_from =
      argmax_out ? m.download_argmax(argmax_out) : m.download_logits(logits_out, logit_bytes);
  const Impl::Clock::time_point t4 = Impl::Clock::now();
  const Impl::Clock::time_point at[6] = {t0, t1, t2, t3, waited_from, t4};
  for (int k = 0; k < 5; ++k) m.host_phases[k] = std::chrono::duration<double, std::micro>(at[k + 1] - at[k]).count();
}

std::vector<double> GpuEngine::host_phases_us() const {
  return std::vector<double>(impl_->host_phases, impl_->host_phases + 5);
}

// Each logit lane's argmax (argmax_rows, numpy's rule) into out: n_out ints leave the device
// instead of n_out x n_vocab floats. Then the stream is idle.
GpuEngine::Impl::Clock::time_point GpuEngine::Impl::download_argmax(int32_t* out) {
  const int n_out = static_cast<int>(logit_lanes.size());
  const uint64_t bytes = 4ull * n_out;
  if (n_out > 0) {
    reserve_host(bytes);
    argmax_rows(logits, cfg.n_vocab, n_out, cfg.n_vocab, argmax_tokens, argmax_tokens + opts.max_rows, stream);
    DS4_GPU_CHECK(cudaMemcpyAsync(logits_host.bytes(), argmax_tokens, bytes, cudaMemcpyDeviceToHost, stream));
  }
  const Clock::time_point waited_from = Clock::now();
  DS4_GPU_CHECK(cudaStreamSynchronize(stream));
  if (n_out > 0) std::memcpy(out, logits_host.bytes(), bytes);
  return waited_from;
}

// The step's logits into the caller's (pageable) array through the pinned buffer, piece by piece,
// then the stream is idle.
GpuEngine::Impl::Clock::time_point GpuEngine::Impl::download_logits(float* out, uint64_t bytes) {
  if (bytes == 0) {
    const Clock::time_point waited_from = Clock::now();
    DS4_GPU_CHECK(cudaStreamSynchronize(stream));
    return waited_from;
  }
  reserve_host(bytes);
  const uint64_t n_pieces = (bytes + kLogitsPiece - 1) / kLogitsPiece;
  while (piece_done.size() < n_pieces) {
    cudaEvent_t e = nullptr;
    DS4_GPU_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    piece_done.push_back(e);
  }
  const uint8_t* src = reinterpret_cast<const uint8_t*>(logits);
  for (uint64_t i = 0; i < n_pieces; ++i) {
    const uint64_t off = i * kLogitsPiece, len = std::min(kLogitsPiece, bytes - off);
    DS4_GPU_CHECK(cudaMemcpyAsync(logits_host.bytes() + off, src + off, len, cudaMemcpyDeviceToHost, stream));
    DS4_GPU_CHECK(cudaEventRecord(piece_done[i], stream));
  }
  uint8_t* dst = reinterpret_cast<uint8_t*>(out);
  const Clock::time_point waited_from = Clock::now();  // the wait overlaps the pieces' host copies
  for (uint64_t i = 0; i < n_pieces; ++i) {
    const uint64_t off = i * kLogitsPiece, len = std::min(kLogitsPiece, bytes - off);
    DS4_GPU_CHECK(cudaEventSynchronize(piece_done[i]));
    std::memcpy(dst + off, logits_host.bytes() + off, len);
  }
  DS4_GPU_CHECK(cudaStreamSynchronize(stream));
  return waited_from;
}

void GpuEngine::set_graphs(bool on) { impl_->graphs = on; }
bool GpuEngine::graphs() const { return impl_->graphs; }
int GpuEngine::graphs_captured() const { return impl_->graphs_captured; }
void GpuEngine::set_matvec_tall(bool on) { impl_->tall = on; }
bool GpuEngine::matvec_tall() const { return impl_->tall; }
void GpuEngine::set_matvec_staged(bool on) { impl_->staged = on; }
bool GpuEngine::matvec_staged() const { return impl_->staged; }
void GpuEngine::set_matvec_staged_min(int cols) {
  if (cols < kMatvecStagedMin) throw std::invalid_argument("set_matvec_staged_min: at least 2 columns");
  impl_->staged_cols = cols;
}
int GpuEngine::matvec_staged_min() const { return impl_->staged_cols; }
void GpuEngine::set_l2_prefetch(bool on) { impl_->prefetch = on && l2_prefetch_supported(); }
bool GpuEngine::l2_prefetch() const { return impl_->prefetch; }
void GpuEngine::set_branches(bool on) { impl_->branches = on; }
bool GpuEngine::branches() const { return impl_->branches; }
void GpuEngine::set_hc_fused(bool on) { impl_->hc_fused = on; }
bool GpuEngine::hc_fused() const { return impl_->hc_fused; }
void GpuEngine::set_route_fused(bool on) { impl_->route_fused = on; }
bool GpuEngine::route_fused() const { return impl_->route_fused; }
void GpuEngine::set_attn_q_fused(bool on) { impl_->attn_q_fused = on; }
bool GpuEngine::attn_q_fused() const { return impl_->attn_q_fused; }
void GpuEngine::set_parallel_compressor(bool on) { impl_->parallel_compressor = on; }
bool GpuEngine::parallel_compressor() const { return impl_->parallel_compressor; }
std::vector<int64_t> GpuEngine::l2_prefetch_log() const { return impl_->prefetch_log; }
uint64_t GpuEngine::l2_prefetch_window_bytes() const { return impl_->prefetch_cap; }

// Zero the slot's rings, set its compressor states to (0, -inf) and its block table to -1 (the
// CPU's PagedState::reset_slot); pages are left as they are, as there.
void GpuEngine::Impl::reset(int slot) {
  if (slot < 0 || slot >= opts.max_slots)
    throw std::out_of_range("slot " + std::to_string(slot) + " is outside 0.." + std::to_string(opts.max_slots - 1));
  const uint64_t ring_bytes = 2ull * kRingRows * cfg.head_dim;
  for (int l = 0; l < cfg.n_layer; ++l)
    DS4_GPU_CHECK(cudaMemsetAsync(rings.data() + (static_cast<uint64_t>(l) * opts.max_slots + slot) * ring_bytes, 0,
                                  ring_bytes, stream));
  if (layout.state_per_slot > 0)
    DS4_GPU_CHECK(cudaMemcpyAsync(states.data() + 4ull * layout.state_per_slot * slot, slot_reset.data(),
                                  4ull * layout.state_per_slot, cudaMemcpyHostToDevice, stream));
  std::fill_n(tables.begin() + static_cast<int64_t>(slot) * max_blocks, max_blocks, -1);
  DS4_GPU_CHECK(cudaStreamSynchronize(stream));
}

void GpuEngine::reset_slot(int slot) { impl_->reset(slot); }

SlotStateExport GpuEngine::export_slot_state(int slot, const int32_t* block_table, int max_blocks,
                                             int64_t n_tokens) const {
  const Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("export_slot_state: " + msg); };
  if (slot < 0 || slot >= m.opts.max_slots) fail("slot " + std::to_string(slot) + " out of range");
  if (n_tokens < 0 || n_tokens > m.opts.max_ctx) fail("n_tokens " + std::to_string(n_tokens) + " outside 0..max_ctx");
  if (max_blocks < 0) fail("negative max_blocks");
  auto page = [&](int64_t lp) {
    const int32_t p = lp < max_blocks ? block_table[lp] : -1;
    if (p < 0 || p >= m.opts.n_pages)
      fail("logical page " + std::to_string(lp) + " maps to " + std::to_string(p) + ", not a page of the pool");
    return static_cast<int64_t>(p);
  };
  DS4_GPU_CHECK(cudaStreamSynchronize(m.stream));
  auto down = [](void* dst, const uint8_t* src, uint64_t bytes) {
    if (bytes) DS4_GPU_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
  };
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  const uint16_t* pages = reinterpret_cast<const uint16_t*>(m.pages.data());
  const float* states = reinterpret_cast<const float*>(m.states.data()) + m.layout.state_per_slot * slot;
  SlotStateExport out;
  out.ring.resize(c.n_layer);
  out.comp.resize(c.n_layer);
  out.index.resize(c.n_layer);
  out.attn_kv.resize(c.n_layer);
  out.attn_score.resize(c.n_layer);
  out.index_kv.resize(c.n_layer);
  out.index_score.resize(c.n_layer);
  for (int l = 0; l < c.n_layer; ++l) {
    const LayerStateLayout& L = m.layout.layers[l];
    out.ring[l].resize(kRingRows * hd);
    down(out.ring[l].data(),
         m.rings.data() + 2ull * (static_cast<uint64_t>(l) * m.opts.max_slots + slot) * kRingRows * hd,
         2ull * kRingRows * hd);
    if (L.ratio == 0) continue;
    const int64_t n_rows = n_tokens / L.ratio;
    out.comp[l].resize(n_rows * hd);
    if (L.ratio == 4) out.index[l].resize(n_rows * ihd);
    for (int64_t j = 0; j < n_rows; ++j) {
      const int64_t start = j * L.ratio;
      const int64_t p = page(start / kPageTokens);
      const int64_t r = (start % kPageTokens) / L.ratio;
      const uint16_t* row = pages + p * m.layout.page_elems + L.comp_off + r * hd;
      down(out.comp[l].data() + j * hd, reinterpret_cast<const uint8_t*>(row), 2ull * hd);
      if (L.ratio == 4) {
        const uint16_t* irow = pages + p * m.layout.page_elems + L.idx_off + r * ihd;
        down(out.index[l].data() + j * ihd, reinterpret_cast<const uint8_t*>(irow), 2ull * ihd);
      }
    }
    const uint64_t na = static_cast<uint64_t>(L.attn_rows) * L.attn_width;
    const uint64_t ni = static_cast<uint64_t>(L.idx_rows) * L.idx_width;
    const float* base = states + L.state_off;
    out.attn_kv[l].resize(na);
    out.attn_score[l].resize(na);
    down(out.attn_kv[l].data(), reinterpret_cast<const uint8_t*>(base), 4 * na);
    down(out.attn_score[l].data(), reinterpret_cast<const uint8_t*>(base + na), 4 * na);
    if (L.ratio == 4) {
      out.index_kv[l].resize(ni);
      out.index_score[l].resize(ni);
      down(out.index_kv[l].data(), reinterpret_cast<const uint8_t*>(base + 2 * na), 4 * ni);
      down(out.index_score[l].data(), reinterpret_cast<const uint8_t*>(base + 2 * na + ni), 4 * ni);
    }
  }
  return out;
}

void GpuEngine::import_slot_state(int slot, const int32_t* block_table, int max_blocks, int64_t n_tokens,
                                  const SlotStateExport& st) {
  Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("import_slot_state: " + msg); };
  if (slot < 0 || slot >= m.opts.max_slots) fail("slot " + std::to_string(slot) + " out of range");
  if (n_tokens < 0 || n_tokens > m.opts.max_ctx) fail("n_tokens " + std::to_string(n_tokens) + " outside 0..max_ctx");
  if (max_blocks < 0) fail("negative max_blocks");
  const size_t L = static_cast<size_t>(c.n_layer);
  if (st.ring.size() != L || st.comp.size() != L || st.index.size() != L || st.attn_kv.size() != L ||
      st.attn_score.size() != L || st.index_kv.size() != L || st.index_score.size() != L)
    fail("the state has a different layer count");
  auto page = [&](int64_t lp) {
    const int32_t p = lp < max_blocks ? block_table[lp] : -1;
    if (p < 0 || p >= m.opts.n_pages)
      fail("logical page " + std::to_string(lp) + " maps to " + std::to_string(p) + ", not a page of the pool");
    return static_cast<int64_t>(p);
  };
  auto up = [](uint8_t* dst, const void* src, uint64_t bytes, size_t have) {
    if (have < bytes) throw std::invalid_argument("import_slot_state: a part of the state is too short");
    if (bytes) DS4_GPU_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  };
  DS4_GPU_CHECK(cudaStreamSynchronize(m.stream));
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  uint8_t* pages = m.pages.data();
  uint8_t* states = m.states.data() + 4ull * m.layout.state_per_slot * slot;
  for (int l = 0; l < c.n_layer; ++l) {
    const LayerStateLayout& Ly = m.layout.layers[l];
    up(m.rings.data() + 2ull * (static_cast<uint64_t>(l) * m.opts.max_slots + slot) * kRingRows * hd,
       st.ring[l].data(), 2ull * kRingRows * hd, 2 * st.ring[l].size());
    if (Ly.ratio == 0) continue;
    const int64_t n_rows = n_tokens / Ly.ratio;
    for (int64_t j = 0; j < n_rows; ++j) {
      const int64_t start = j * Ly.ratio;
      const int64_t p = page(start / kPageTokens);
      const int64_t r = (start % kPageTokens) / Ly.ratio;
      if (st.comp[l].size() < static_cast<size_t>((j + 1) * hd)) fail("too few compressed rows");
      up(pages + 2 * (p * m.layout.page_elems + Ly.comp_off + r * hd), st.comp[l].data() + j * hd, 2ull * hd,
         2ull * hd);
      if (Ly.ratio == 4) {
        if (st.index[l].size() < static_cast<size_t>((j + 1) * ihd)) fail("too few indexer rows");
        up(pages + 2 * (p * m.layout.page_elems + Ly.idx_off + r * ihd), st.index[l].data() + j * ihd, 2ull * ihd,
           2ull * ihd);
      }
    }
    const uint64_t na = static_cast<uint64_t>(Ly.attn_rows) * Ly.attn_width;
    const uint64_t ni = static_cast<uint64_t>(Ly.idx_rows) * Ly.idx_width;
    uint8_t* base = states + 4 * Ly.state_off;
    up(base, st.attn_kv[l].data(), 4 * na, 4 * st.attn_kv[l].size());
    up(base + 4 * na, st.attn_score[l].data(), 4 * na, 4 * st.attn_score[l].size());
    if (Ly.ratio == 4) {
      up(base + 8 * na, st.index_kv[l].data(), 4 * ni, 4 * st.index_kv[l].size());
      up(base + 8 * na + 4 * ni, st.index_score[l].data(), 4 * ni, 4 * st.index_score[l].size());
    }
  }
}

std::vector<std::pair<std::string, uint64_t>> GpuEngine::allocated_bytes() const {
  const Impl& m = *impl_;
  return {
      {"rings", m.rings.bytes()},         {"compressor_state", m.states.bytes()},
      {"pages", m.pages.bytes()},         {"step_inputs", m.inputs.bytes()},
      {"scratch", m.arena.bytes() + m.mma_scratch.bytes()},
      {"weights_device", m.weights.bytes()},
  };
}

std::string GpuEngine::device_name() const { return ds4::gpu::device_name(); }

}  // namespace ds4::gpu
