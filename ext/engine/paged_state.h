// Sequence state of the paged engine (design.md §5, serving_notes.md §2), generalised to any
// config. Byte sizes here are mirrored by ds4_app/engine/memory.py (tested equal).
//
// Per slot, not paged:
//   ring      [layer][slot][128 rows][head_dim] f16; logical position p lives at row p mod 128.
//   compressor state, per compressed layer, fp32, value and score halves of equal shape:
//     CSA attention [2m = 8 rows][2 * head_dim], CSA indexer [8][2 * index_head_dim],
//     HCA [128 rows][head_dim]. Initial value 0 and score -inf (the "absent" block).
// Paged (shared pool of n_pages pages of 128 logical tokens):
//   per CSA layer 32 compressed rows [head_dim] f16 plus 32 indexer rows [index_head_dim] f16;
//   per HCA layer 1 compressed row [head_dim] f16.
//   Compressed entry j of ratio m: logical page (j*m)/128, row (j*m mod 128)/m of that page.
// Block tables: [slot][ceil(max_ctx/128)] int32, -1 where unassigned; refreshed from the plan;
//   plus one int32 per page (its slot in the current step) to refuse a page named twice.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "engine.h"

namespace ds4 {

constexpr int kRingRows = 128;
constexpr int kPageTokens = 128;

// An owned, 64-byte aligned, zeroed byte buffer (exactly `bytes` are counted as allocated).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t bytes);
  uint8_t* data() const { return ptr_.get(); }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> ptr_;
  uint64_t bytes_ = 0;
};

// One compressor's fp32 state for one slot: value and score, rows x width each.
struct CompressorState {
  float* kv = nullptr;
  float* score = nullptr;
  int rows = 0, width = 0;
};

// Where each layer's compressor state sits in a slot's states and its rows in a page (the layout
// above). The GPU engine allocates and addresses its device state by the same numbers.
struct LayerStateLayout {
  int ratio = 0;
  uint64_t state_off = 0;  // float offset of this layer's state inside one slot's states
  int attn_rows = 0, attn_width = 0, idx_rows = 0, idx_width = 0;
  uint64_t comp_off = 0, idx_off = 0;  // element offsets of this layer's rows inside a page
  int rows_per_page = 0;
};

// The per-layer layouts of a config and the sizes they add up to.
struct StateLayout {
  explicit StateLayout(const ModelConfig& cfg);
  std::vector<LayerStateLayout> layers;
  uint64_t state_per_slot = 0;  // floats
  uint64_t page_elems = 0;      // f16 elements per page
};

class PagedState {
 public:
  PagedState(const ModelConfig& cfg, int max_slots, int max_ctx, int n_pages);

  int max_slots() const { return max_slots_; }
  int n_pages() const { return n_pages_; }
  int max_blocks() const { return max_blocks_; }

  uint16_t* ring_row(int layer, int slot, int64_t pos) const;
  CompressorState attn_state(int layer, int slot) const;
  CompressorState index_state(int layer, int slot) const;
  // Compressed rows of a physical page (attention: head_dim wide; indexer: index_head_dim wide).
  uint16_t* comp_row(int layer, int page, int row_in_page) const;
  uint16_t* index_row(int layer, int page, int row_in_page) const;

  int32_t* table(int slot) const;
  // Scratch map page -> slot for validating a step's tables (n_pages entries).
  int32_t* page_owner() const;
  // Physical page of logical page lp of a slot (caller has checked it is assigned).
  int page_of(int slot, int64_t lp) const { return table(slot)[lp]; }

  // Zero the ring, set compressor states to (0, -inf) and the block table to -1.
  void reset_slot(int slot);

  uint64_t ring_bytes() const { return rings_.bytes(); }
  uint64_t state_bytes() const { return states_.bytes(); }
  uint64_t page_bytes() const { return pages_.bytes(); }
  uint64_t table_bytes() const { return tables_.bytes(); }

 private:
  int head_dim_, index_head_dim_, n_layer_;
  int max_slots_, n_pages_, max_blocks_;
  StateLayout layout_;
  AlignedBuffer rings_, states_, pages_, tables_;
};

}  // namespace ds4
