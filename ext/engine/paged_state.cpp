// Paged sequence state (layout: paged_state.h).
#include "paged_state.h"

#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>

namespace ds4 {

AlignedBuffer::AlignedBuffer(uint64_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const uint64_t padded = (bytes + 63) / 64 * 64;  // aligned_alloc wants a multiple of the alignment
  void* p = std::aligned_alloc(64, padded);
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, padded);
  ptr_.reset(static_cast<uint8_t*>(p));
}

StateLayout::StateLayout(const ModelConfig& cfg) {
  const uint64_t hd = static_cast<uint64_t>(cfg.head_dim), ihd = static_cast<uint64_t>(cfg.index_head_dim);
  layers.resize(cfg.n_layer);
  for (int l = 0; l < cfg.n_layer; ++l) {
    LayerStateLayout& L = layers[l];
    L.ratio = cfg.compress_ratios[l];
    L.state_off = state_per_slot;
    L.comp_off = page_elems;
    if (L.ratio == 4) {
      // Overlapping CSA pools the previous and current block: 2m rows at double width.
      L.attn_rows = 8;
      L.attn_width = static_cast<int>(2 * hd);
      L.idx_rows = 8;
      L.idx_width = static_cast<int>(2 * ihd);
      L.rows_per_page = kPageTokens / 4;
      state_per_slot += 2ull * L.attn_rows * L.attn_width + 2ull * L.idx_rows * L.idx_width;
      L.idx_off = L.comp_off + L.rows_per_page * hd;
      page_elems += L.rows_per_page * (hd + ihd);
    } else if (L.ratio == 128) {
      L.attn_rows = 128;
      L.attn_width = static_cast<int>(hd);
      L.rows_per_page = 1;
      state_per_slot += 2ull * L.attn_rows * L.attn_width;
      page_elems += hd;
    }
  }
}

PagedState::PagedState(const ModelConfig& cfg, int max_slots, int max_ctx, int n_pages)
    : head_dim_(cfg.head_dim),
      index_head_dim_(cfg.index_head_dim),
      n_layer_(cfg.n_layer),
      max_slots_(max_slots),
      n_pages_(n_pages),
      max_blocks_((max_ctx + kPageTokens - 1) / kPageTokens),
      layout_(cfg) {
  if (max_slots < 1) throw std::invalid_argument("max_slots must be at least 1");
  if (max_ctx < 1) throw std::invalid_argument("max_ctx must be at least 1");
  if (n_pages < 0) throw std::invalid_argument("n_pages must be >= 0");
  const uint64_t hd = static_cast<uint64_t>(cfg.head_dim);
  rings_ = AlignedBuffer(2ull * cfg.n_layer * max_slots * kRingRows * hd);
  states_ = AlignedBuffer(4ull * layout_.state_per_slot * max_slots);
  pages_ = AlignedBuffer(2ull * layout_.page_elems * n_pages);
  tables_ = AlignedBuffer(4ull * (static_cast<uint64_t>(max_slots) * max_blocks_ + n_pages));
  for (int s = 0; s < max_slots; ++s) reset_slot(s);
}

uint16_t* PagedState::ring_row(int layer, int slot, int64_t pos) const {
  const uint64_t row = (static_cast<uint64_t>(layer) * max_slots_ + slot) * kRingRows + (pos % kRingRows);
  return reinterpret_cast<uint16_t*>(rings_.data()) + row * head_dim_;
}

CompressorState PagedState::attn_state(int layer, int slot) const {
  const LayerStateLayout& L = layout_.layers[layer];
  float* base = reinterpret_cast<float*>(states_.data()) + layout_.state_per_slot * slot + L.state_off;
  const uint64_t n = static_cast<uint64_t>(L.attn_rows) * L.attn_width;
  return {base, base + n, L.attn_rows, L.attn_width};
}

CompressorState PagedState::index_state(int layer, int slot) const {
  const LayerStateLayout& L = layout_.layers[layer];
  float* base = reinterpret_cast<float*>(states_.data()) + layout_.state_per_slot * slot + L.state_off +
                2ull * L.attn_rows * L.attn_width;
  const uint64_t n = static_cast<uint64_t>(L.idx_rows) * L.idx_width;
  return {base, base + n, L.idx_rows, L.idx_width};
}

uint16_t* PagedState::comp_row(int layer, int page, int row_in_page) const {
  const LayerStateLayout& L = layout_.layers[layer];
  return reinterpret_cast<uint16_t*>(pages_.data()) + layout_.page_elems * page + L.comp_off +
         static_cast<uint64_t>(row_in_page) * head_dim_;
}

uint16_t* PagedState::index_row(int layer, int page, int row_in_page) const {
  const LayerStateLayout& L = layout_.layers[layer];
  return reinterpret_cast<uint16_t*>(pages_.data()) + layout_.page_elems * page + L.idx_off +
         static_cast<uint64_t>(row_in_page) * index_head_dim_;
}

int32_t* PagedState::table(int slot) const {
  return reinterpret_cast<int32_t*>(tables_.data()) + static_cast<uint64_t>(slot) * max_blocks_;
}

int32_t* PagedState::page_owner() const {
  return reinterpret_cast<int32_t*>(tables_.data()) + static_cast<uint64_t>(max_slots_) * max_blocks_;
}

void PagedState::reset_slot(int slot) {
  if (slot < 0 || slot >= max_slots_)
    throw std::out_of_range("slot " + std::to_string(slot) + " is outside 0.." + std::to_string(max_slots_ - 1));
  for (int l = 0; l < n_layer_; ++l) {
    std::memset(ring_row(l, slot, 0), 0, 2ull * kRingRows * head_dim_);
    const LayerStateLayout& L = layout_.layers[l];
    if (L.ratio == 0) continue;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (const CompressorState& st : {attn_state(l, slot), index_state(l, slot)}) {
      const uint64_t n = static_cast<uint64_t>(st.rows) * st.width;
      for (uint64_t i = 0; i < n; ++i) {
        st.kv[i] = 0.0f;
        st.score[i] = neg_inf;
      }
    }
  }
  int32_t* t = table(slot);
  for (int i = 0; i < max_blocks_; ++i) t[i] = -1;
}

}  // namespace ds4
