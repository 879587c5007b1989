// Binding GGUF tensors to the DS4 step (names: spec §11.3).
#include "weights.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace ds4 {

MappedFile::MappedFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open model file " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw std::runtime_error("cannot stat model file " + path + ": " + std::strerror(err));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  if (size_ == 0) {
    ::close(fd);
    throw std::runtime_error("model file " + path + " is empty");
  }
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (p == MAP_FAILED) throw std::runtime_error("cannot map model file " + path + ": " + std::strerror(err));
  data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

namespace {

std::string shape_str(const int64_t* ne, int n) {
  std::ostringstream os;
  os << '[';
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << ne[i];
  os << ']';
  return os.str();
}

class Binder {
 public:
  Binder(const MappedFile& file, const std::vector<WeightEntry>& entries) : file_(file) {
    for (const auto& e : entries) by_name_[e.name] = &e;
  }

  bool has(const std::string& name) const { return by_name_.count(name) != 0; }

  // A tensor of exactly the given shape (trailing dims 1), any executable type.
  TensorView tensor(const std::string& name, std::initializer_list<int64_t> shape) const {
    auto it = by_name_.find(name);
    if (it == by_name_.end()) throw std::runtime_error("model file is missing tensor " + name);
    const WeightEntry& e = *it->second;
    if (!dtype_supported(e.type))
      throw std::runtime_error("tensor " + name + " has unsupported ggml type " + std::to_string(e.type));
    int64_t want[4] = {1, 1, 1, 1};
    int i = 0;
    for (int64_t s : shape) want[i++] = s;
    for (int k = 0; k < 4; ++k) {
      if (e.ne[k] != want[k])
        throw std::runtime_error("tensor " + name + " has shape " + shape_str(e.ne, 4) + ", expected " +
                                 shape_str(want, 4));
    }
    TensorView v;
    v.type = static_cast<DType>(e.type);
    for (int k = 0; k < 4; ++k) v.ne[k] = e.ne[k];
    if (v.ne[0] % block_elems(v.type) != 0)
      throw std::runtime_error("tensor " + name + ": row of " + std::to_string(v.ne[0]) +
                               " values is not a whole number of " + dtype_name(v.type) + " blocks");
    const uint64_t nbytes = static_cast<uint64_t>(v.nbytes());
    if (e.offset > file_.size() || nbytes > file_.size() - e.offset) {
      const uint64_t missing = e.offset + nbytes - file_.size();
      throw std::runtime_error("model file truncated at tensor " + name + ": " + std::to_string(missing) +
                               " bytes beyond the end of the file");
    }
    v.data = file_.data() + e.offset;
    return v;
  }

  // A 1-D fp32 vector of n values (norm weights, biases, sinks, mHC base/scale). llama.cpp's
  // converter writes every 1-D tensor as F32, so another type is a malformed file.
  const float* f32(const std::string& name, int64_t n) const {
    TensorView v = tensor(name, {n});
    if (v.type != DType::F32)
      throw std::runtime_error("tensor " + name + " has type " + dtype_name(v.type) + "; 1-D tensors must be F32");
    if (reinterpret_cast<uintptr_t>(v.data) % alignof(float) != 0)
      throw std::runtime_error("tensor " + name + " is not 4-byte aligned in the file");
    return reinterpret_cast<const float*>(v.data);
  }

  // A matrix whose values are read as floats by the step (not through matmul): F16/F32/BF16.
  TensorView float_matrix(const std::string& name, std::initializer_list<int64_t> shape) const {
    TensorView v = tensor(name, shape);
    if (v.type != DType::F32 && v.type != DType::F16 && v.type != DType::BF16)
      throw std::runtime_error("tensor " + name + " has type " + dtype_name(v.type) + "; expected F32, F16 or BF16");
    return v;
  }

 private:
  const MappedFile& file_;
  std::unordered_map<std::string, const WeightEntry*> by_name_;
};

HcWeights bind_hc(const Binder& b, const std::string& prefix, int64_t hc_dim, int64_t rows) {
  HcWeights h;
  h.fn = b.tensor(prefix + "_fn.weight", {hc_dim, rows});
  h.base = b.f32(prefix + "_base.weight", rows);
  return h;
}

}  // namespace

ModelWeights bind_weights(const ModelConfig& cfg, const MappedFile& file, const std::vector<WeightEntry>& entries) {
  const Binder b(file, entries);
  const int64_t d = cfg.n_embd, hc = cfg.hc_mult, hcd = hc * d, mix = (2 + hc) * hc;
  const int64_t hd = cfg.head_dim, nh = cfg.n_head, E = cfg.n_expert, F = cfg.expert_ffn;
  const int64_t ihd = cfg.index_head_dim;
  ModelWeights w;
  w.embed = b.tensor("token_embd.weight", {d, cfg.n_vocab});
  w.output = b.tensor("output.weight", {d, cfg.n_vocab});
  w.output_norm = b.f32("output_norm.weight", d);
  w.hc_head = bind_hc(b, "output_hc", hcd, hc);
  w.hc_head.scale = b.f32("output_hc_scale.weight", 1);

  for (int l = 0; l < cfg.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    LayerWeights L;
    L.ratio = cfg.compress_ratios[l];
    L.hc_attn = bind_hc(b, p + "hc_attn", hcd, mix);
    L.hc_attn.scale = b.f32(p + "hc_attn_scale.weight", 3);
    L.hc_ffn = bind_hc(b, p + "hc_ffn", hcd, mix);
    L.hc_ffn.scale = b.f32(p + "hc_ffn_scale.weight", 3);
    L.attn_norm = b.f32(p + "attn_norm.weight", d);
    L.ffn_norm = b.f32(p + "ffn_norm.weight", d);
    L.q_a = b.tensor(p + "attn_q_a.weight", {d, cfg.q_lora_rank});
    L.q_norm = b.f32(p + "attn_q_a_norm.weight", cfg.q_lora_rank);
    L.q_b = b.tensor(p + "attn_q_b.weight", {cfg.q_lora_rank, nh * hd});
    L.kv = b.tensor(p + "attn_kv.weight", {d, hd});
    L.kv_norm = b.f32(p + "attn_kv_a_norm.weight", hd);
    L.sinks = b.f32(p + "attn_sinks.weight", nh);
    L.wo_a = b.tensor(p + "attn_output_a.weight", {nh * hd / cfg.o_groups, int64_t(cfg.o_groups) * cfg.o_lora_rank});
    L.wo_b = b.tensor(p + "attn_output_b.weight", {int64_t(cfg.o_groups) * cfg.o_lora_rank, d});
    if (L.ratio > 0) {
      const int64_t coff = L.ratio == 4 ? 2 : 1;
      L.comp.kv = b.tensor(p + "attn_compressor_kv.weight", {d, coff * hd});
      L.comp.gate = b.tensor(p + "attn_compressor_gate.weight", {d, coff * hd});
      L.comp.ape = b.float_matrix(p + "attn_compressor_ape.weight", {coff * hd, L.ratio});
      L.comp.norm = b.f32(p + "attn_compressor_norm.weight", hd);
    }
    if (L.ratio == 4) {
      const int64_t inh = cfg.index_n_heads;
      L.idx_q_b = b.tensor(p + "indexer.attn_q_b.weight", {cfg.q_lora_rank, inh * ihd});
      L.idx_proj = b.tensor(p + "indexer.proj.weight", {d, inh});
      L.idx_comp.kv = b.tensor(p + "indexer_compressor_kv.weight", {d, 2 * ihd});
      L.idx_comp.gate = b.tensor(p + "indexer_compressor_gate.weight", {d, 2 * ihd});
      L.idx_comp.ape = b.float_matrix(p + "indexer_compressor_ape.weight", {2 * ihd, 4});
      L.idx_comp.norm = b.f32(p + "indexer_compressor_norm.weight", ihd);
    }
    L.gate_inp = b.tensor(p + "ffn_gate_inp.weight", {d, E});
    if (l < cfg.n_hash_layers) {
      TensorView t = b.tensor(p + "ffn_gate_tid2eid.weight", {cfg.n_expert_used, cfg.n_vocab});
      if (t.type != DType::I32)
        throw std::runtime_error("tensor " + p + "ffn_gate_tid2eid.weight has type " + dtype_name(t.type) +
                                 "; expected I32");
      L.tid2eid = reinterpret_cast<const int32_t*>(t.data);
      const int64_t n_ids = static_cast<int64_t>(cfg.n_vocab) * cfg.n_expert_used;
      for (int64_t k = 0; k < n_ids; ++k) {
        if (L.tid2eid[k] < 0 || L.tid2eid[k] >= E)
          throw std::runtime_error("tensor " + p + "ffn_gate_tid2eid.weight maps token " +
                                   std::to_string(k / cfg.n_expert_used) + " to expert " +
                                   std::to_string(L.tid2eid[k]) + ", outside 0.." + std::to_string(E - 1));
      }
    } else {
      L.exp_bias = b.f32(p + "exp_probs_b.bias", E);
    }
    L.gate_exps = b.tensor(p + "ffn_gate_exps.weight", {d, F, E});
    L.up_exps = b.tensor(p + "ffn_up_exps.weight", {d, F, E});
    L.down_exps = b.tensor(p + "ffn_down_exps.weight", {F, d, E});
    if (cfg.n_expert_shared == 1) {
      L.gate_sh = b.tensor(p + "ffn_gate_shexp.weight", {d, F});
      L.up_sh = b.tensor(p + "ffn_up_shexp.weight", {d, F});
      L.down_sh = b.tensor(p + "ffn_down_shexp.weight", {F, d});
    }
    w.layers.push_back(L);
  }
  return w;
}

}  // namespace ds4
