// The DS4 step executor: paged multi-lane state and one forward step over a StepPlan.
//
// The Python side (ds4_app/engine/runner.py through ext/python/_native.pyx) builds one Engine
// per loaded model and calls step() once per engine step with the GIL released.
// Ownership: the engine maps the GGUF file read-only (weights are not copied on the CPU) and
// owns all sequence state: per slot the raw ring (128 rows x head_dim, f16, per layer) and the
// fp32 compressor states; the shared page pool of compressed rows (f16); per slot block tables.
// Policy (which slot holds which pages, who runs) belongs to the Python scheduler.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace ds4 {

// Mirrors ds4_app.engine.config.DS4Config (same names, same meaning).
struct ModelConfig {
  int n_vocab = 0, n_embd = 0, n_layer = 0, n_head = 0, head_dim = 0, rope_dim = 0;
  int q_lora_rank = 0, o_groups = 0, o_lora_rank = 0;
  std::vector<int> compress_ratios;  // per trunk layer: 0, 4 or 128
  int index_n_heads = 0, index_head_dim = 0, index_topk = 0;
  int n_expert = 0, n_expert_used = 0, n_expert_shared = 0, expert_ffn = 0;
  float expert_weights_scale = 1.0f;
  bool expert_weights_norm = true;
  int n_hash_layers = 0;
  std::vector<float> swiglu_clamp_exp, swiglu_clamp_shexp;  // per layer
  int hc_mult = 4, hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f, norm_eps = 1e-6f;
  // Per-layer RoPE inverse frequencies (rope_dim/2 each), computed once in Python by
  // DS4Config.rope(layer).inv_freqs(rope_dim) so every backend uses the same table.
  std::vector<std::vector<double>> rope_inv_freqs;
  int sliding_window = 128;
  bool qat_numerics = false;
};

// One tensor of the GGUF file: its name, ggml type id, shape (ne) and absolute byte offset.
struct WeightEntry {
  std::string name;
  int32_t type = 0;
  int64_t ne[4] = {1, 1, 1, 1};
  uint64_t offset = 0;
};

// A copy of one slot's sequence state, for tests (Engine::export_slot_state). Per layer l:
// ring[l]: 128 x head_dim f16 bits (row = position mod 128); comp[l]: the n_tokens / ratio
// compressed rows visible after n_tokens tokens, in entry order (head_dim f16 each); index[l]:
// the CSA indexer rows likewise (index_head_dim each); attn_kv/attn_score and index_kv/index_score:
// the fp32 compressor states, rows x width row-major (empty where the layer has none).
struct SlotStateExport {
  std::vector<std::vector<uint16_t>> ring, comp, index;
  std::vector<std::vector<float>> attn_kv, attn_score, index_kv, index_score;
};

struct EngineOptions {
  int max_slots = 1;
  int max_ctx = 4096;
  int n_pages = 32;  // physical pages of 128 tokens in the shared pool
  int max_rows = 16;  // most lanes one step may carry
  int n_threads = 0;  // 0: physical cores
};

class Engine {
 public:
  Engine(const ModelConfig& cfg, const std::string& gguf_path, const std::vector<WeightEntry>& weights,
         const EngineOptions& opts);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // One forward step. Lanes are chronological per slot (see ds4_app/engine/plan.py).
  // block_table is n_tables x max_blocks (row i belongs to table_slot[i]).
  // logits_out receives sum(lane_logits) x n_vocab floats, in lane order.
  void step(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
            const int32_t* lane_logits, int n_tables, const int32_t* table_slot, const int32_t* block_table,
            int max_blocks, float* logits_out);

  // Forget everything a slot held (ring, compressor state) so a new sequence starts clean.
  void reset_slot(int slot);

  // Testing hook, read-only: copy slot's state as it stands after n_tokens tokens, reading the
  // compressed and indexer rows through block_table (max_blocks entries, the slot's table).
  // Throws std::invalid_argument when a needed page is unassigned or outside the pool.
  SlotStateExport export_slot_state(int slot, const int32_t* block_table, int max_blocks, int64_t n_tokens) const;

  // Bytes the engine allocated, by section: "rings", "compressor_state", "pages", "block_tables",
  // "scratch" (and "weights_mapped" for the mapped file). Must equal the Python memory plan.
  std::vector<std::pair<std::string, uint64_t>> allocated_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ds4
