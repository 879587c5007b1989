// The model's weights as read-only views into the memory-mapped GGUF file (spec §11.3 names).
//
// Nothing is copied: every TensorView points into the mapping. Loading checks each tensor's
// type, shape (against ModelConfig) and that its bytes lie inside the file, and throws one
// clear line naming the tensor otherwise.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "ds4/kernels.h"
#include "engine.h"

namespace ds4 {

// A read-only private mapping of a whole file (RAII).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

// One mHC site: fn [hc_mult*d cols, (2+hc)*hc rows], base, scale (fp32 vectors).
struct HcWeights {
  TensorView fn;
  const float* base = nullptr;
  const float* scale = nullptr;
};

// A compressor (attention: c = head_dim; indexer: c = index_head_dim).
struct CompressorWeights {
  TensorView kv, gate;  // [d, coff*c]
  TensorView ape;       // [coff*c, m]; any float type, dequantized one row at a time
  const float* norm = nullptr;  // [c]
};

struct LayerWeights {
  int ratio = 0;
  HcWeights hc_attn, hc_ffn;
  const float* attn_norm = nullptr;
  const float* ffn_norm = nullptr;
  TensorView q_a, q_b, kv, wo_a, wo_b;
  const float* q_norm = nullptr;
  const float* kv_norm = nullptr;
  const float* sinks = nullptr;
  CompressorWeights comp;      // ratio > 0
  TensorView idx_q_b, idx_proj;  // ratio 4
  CompressorWeights idx_comp;  // ratio 4
  TensorView gate_inp;         // router [d, n_expert]
  const float* exp_bias = nullptr;    // biased layers
  const int32_t* tid2eid = nullptr;   // hash layers: [n_vocab][n_expert_used]
  TensorView gate_exps, up_exps, down_exps;  // [d, F, E], [d, F, E], [F, d, E]
  TensorView gate_sh, up_sh, down_sh;        // shared expert (n_expert_shared == 1)
};

struct ModelWeights {
  TensorView embed;   // [d, n_vocab]
  TensorView output;  // [d, n_vocab]
  const float* output_norm = nullptr;
  HcWeights hc_head;  // fn [hc*d, hc], base [hc], scale [1]
  std::vector<LayerWeights> layers;
};

// Resolve every tensor the step needs from the file's tensor list (offsets are absolute).
ModelWeights bind_weights(const ModelConfig& cfg, const MappedFile& file, const std::vector<WeightEntry>& entries);

}  // namespace ds4
