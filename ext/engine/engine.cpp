// The DS4 step executor on the CPU (design.md §6): one forward pass over all lanes of a step.
//
// Per layer:
//   (A) batched over lanes: mHC pre, attn_norm, q_a -> q_norm -> q_b, per-head norm + RoPE,
//       kv -> kv_norm -> RoPE (-> FP8 QAT), compressor and indexer projections;
//   (B) per slot, its lanes in order (slots in parallel): store the lane's raw row, update the
//       compressors (emitting finished rows into pages), pick the indexer's top-k, attend;
//       lane i's row is written before lane i attends and lane i+1's only after, so a
//       16-row prompt chunk never overwrites a ring row an earlier lane still reads;
//   (C) batched: grouped output projection, mHC post, then the FFN site (mHC pre, ffn_norm,
//       MoE, mHC post).
// Then hc_head, output_norm and the LM head for the lanes that asked for logits.
//
// Batch invariance: matmul computes each column with single-column arithmetic, and everything
// else here is per lane with a fixed order (threads split lanes, slots or heads, never a sum),
// so a lane's logits are bit-identical whatever shares its step.
//
// Threads: a piece of work goes to the pool only when each thread's share is worth a hand-off
// (kParallelWork, in multiply-adds; the matmul has its own grain): most per-lane operations of a
// decode step are a microsecond or less, and waking a worker costs more than that. Independent
// products go to the pool together (matmul_batch: all projections of u, then those of the q
// latent, the wo_a groups, the experts' gate/up, their down): one hand-off each instead of one
// per product (a 1-lane decode step of the tiny model made 88 pool calls, now 38).
#include "engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "attention.h"
#include "compressor.h"
#include "ds4/kernels.h"
#include "mhc.h"
#include "moe.h"
#include "ops.h"
#include "paged_state.h"
#include "plan_check.h"
#include "scratch.h"
#include "weights.h"

namespace ds4 {

namespace {

// Multiply-adds (or comparable scalar operations) below which a share of work stays on the
// calling thread: about 0.5-1 us, a few times a hand-off to a spinning worker (0.1-0.2 us).
// Measured on the tiny model, 2 threads: 1024-8192 give the same step times, 32768 leaves most
// of a decode step serial (docs/performance.md).
constexpr int64_t kParallelWork = 4096;

int64_t grain_for(int64_t work_per_item) { return std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_item)); }

// The shared checks (plan_check.h) with the CPU kernels' own limits between their halves.
void check_config(const ModelConfig& c, const EngineOptions& o) {
  check_config_layers(c);
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(c.head_dim <= kMaxHeadDim && c.index_head_dim <= kMaxHeadDim, "head dims above 4096 are not supported");
  need(c.hc_mult >= 1 && c.hc_mult <= kMaxHc, "hc_mult must be in 1..16");
  check_config_shapes(c, o);
}

}  // namespace

struct Engine::Impl {
  Impl(const ModelConfig& c, const std::string& path, const std::vector<WeightEntry>& entries, const EngineOptions& o)
      : cfg((check_config(c, o), c)),
        opts(o),
        file(path),
        w(bind_weights(cfg, file, entries)),
        state(cfg, o.max_slots, o.max_ctx, o.n_pages),
        sc(cfg, o.max_rows, o.max_ctx),
        pool(o.n_threads),  // 0: physical cores
        order(o.max_rows),
        group_first(o.max_rows),
        group_len(o.max_rows),
        group_slot(o.max_rows),
        logit_lanes(o.max_rows),
        moe_lists(cfg, o.max_rows) {
    hcs.hc = cfg.hc_mult;
    hcs.d = cfg.n_embd;
    hcs.iters = cfg.hc_sinkhorn_iters;
    hcs.hc_eps = cfg.hc_eps;
    hcs.norm_eps = cfg.norm_eps;
    for (int l = 1; l < cfg.n_layer; ++l) rope_as_prev[l] = cfg.rope_inv_freqs[l] == cfg.rope_inv_freqs[l - 1];
  }

  ModelConfig cfg;
  EngineOptions opts;
  MappedFile file;
  ModelWeights w;
  PagedState state;
  Scratch sc;
  ThreadPool pool;
  HcShape hcs;
  // Lane grouping of the current step (O(max_rows) ints, not counted as scratch).
  std::vector<int> order, group_first, group_len, group_slot, logit_lanes;
  // rope_as_prev[l]: layer l's RoPE frequencies are layer l-1's, so the lanes' tables in sc.rope
  // (computed for this step's positions at layer l-1) serve it unchanged.
  std::vector<char> rope_as_prev = std::vector<char>(cfg.n_layer, 0);
  // x_ss[i]: the sum of squares of lane i's mHC state as the last hc_post left it (hc_pre and
  // hc_head read it instead of summing again); valid from the first hc_post of the step on.
  std::vector<double> x_ss = std::vector<double>(opts.max_rows, 0.0);
  bool x_ss_valid = false;
  int n_groups = 0;
  MoeLists moe_lists;
  // Independent products of one batched hand-off (matmul_batch), filled by add_job.
  static constexpr int kMaxJobs = 64;
  MatmulJob jobs[kMaxJobs];
  int n_jobs = 0;

  // Step inputs, valid during step().
  int n = 0;
  const int32_t* tok = nullptr;
  const int32_t* pos = nullptr;
  const int32_t* slot_of = nullptr;

  void validate_and_group(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                          int n_tables, const int32_t* table_slot, const int32_t* block_table, int max_blocks);
  void check_pages();
  void embed();
  // f(i) for every lane; work: its rough cost per lane in multiply-adds.
  template <class F>
  void per_lane(int64_t work, F&& f) {
    pool.parallel_for(n, grain_for(work), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) f(static_cast<int>(i));
    });
  }
  // Queue Y = W·X over the step's lanes (X rows ldx apart, Y rows ldy apart) for run_jobs.
  void add_job(const TensorView& W, const float* X, int64_t ldx, float* Y, int64_t ldy) {
    if (n_jobs == kMaxJobs) run_jobs();  // the queued products are independent: any split is fine
    jobs[n_jobs++] = MatmulJob::product(W, n, X, ldx, Y, ldy);
  }
  void add_task(void (*fn)(const MatmulJob&, int64_t, int64_t), int64_t rows, int64_t cost_per_row) {
    if (n_jobs == kMaxJobs) run_jobs();
    jobs[n_jobs++] = MatmulJob::task(fn, this, rows, cost_per_row);
  }
  void run_jobs() {
    matmul_batch(jobs, n_jobs, pool);
    n_jobs = 0;
  }
  void hc_pre(const HcWeights& hw, const float* norm);
  void hc_post();
  void attention_layer(int l);
  void attend_slot(int l, int g, bool parallel_heads);
  void ffn_layer(int l);
  void head(const int32_t* lane_logits, float* logits_out);
};

void Engine::Impl::validate_and_group(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token,
                                      const int32_t* lane_pos, int n_tables, const int32_t* table_slot,
                                      const int32_t* block_table, int max_blocks) {
  check_step_plan(n_lanes, lane_slot, lane_token, lane_pos, n_tables, table_slot, block_table, max_blocks, opts,
                  cfg.n_vocab, state.max_blocks(), state.page_owner());
  // The slots' tables are the rows of one array that starts at state.table(0).
  copy_block_tables(n_tables, table_slot, block_table, max_blocks, state.table(0), state.max_blocks());
  n_groups = group_lanes(n_lanes, lane_slot, lane_pos, order.data(), group_first.data(), group_len.data(),
                         group_slot.data(), nullptr, nullptr);
}

// Every page a lane will read or write must be assigned: done before any state changes and
// outside the thread pool, so a bad plan throws cleanly.
void Engine::Impl::check_pages() {
  bool csa = false, hca = false;
  for (int r : cfg.compress_ratios) {
    csa = csa || r == 4;
    hca = hca || r == 128;
  }
  ds4::check_pages(n, slot_of, pos, csa, hca, state.table(0), state.max_blocks());
}

void Engine::Impl::embed() {
  const int64_t d = cfg.n_embd, hc = cfg.hc_mult;
  per_lane(hc * d, [&](int i) {
    float* x = sc.x_hc + i * hc * d;
    dequantize_row(w.embed.type, w.embed.data + static_cast<int64_t>(tok[i]) * w.embed.row_bytes(), x, d);
    for (int64_t s = 1; s < hc; ++s) std::memcpy(x + s * d, x, sizeof(float) * d);  // identical streams
  });
}

// mHC pre of every lane, then the sub-layer's RMSNorm of its input u (one hand-off for both). The
// Sinkhorn of each lane's comb, which only hc_post reads, is queued as a task for the next batch
// of products (the sub-layer's first), off the serial path of a one-lane step.
void Engine::Impl::hc_pre(const HcWeights& hw, const float* norm) {
  const int64_t d = cfg.n_embd, hcd = cfg.hc_mult * d, mix = (2 + cfg.hc_mult) * cfg.hc_mult;
  matmul(hw.fn, sc.x_hc, n, hcd, sc.hc_mix, mix, pool);
  per_lane(3 * hcd, [&](int i) {
    float* u = sc.u + i * d;
    hc_pre_lane(hcs, hw, sc.x_hc + i * hcd, x_ss_valid ? &x_ss[i] : nullptr, sc.hc_mix + i * mix, u,
                sc.hc_post + i * cfg.hc_mult, sc.hc_comb + i * cfg.hc_mult * cfg.hc_mult);
    rms_norm(u, norm, u, d, cfg.norm_eps);
  });
  // A Sinkhorn is a chain of ~2 * iters dependent divisions and adds (~0.3 us at 20 iterations);
  // its cost in matmul_batch's multiply-add units, measured: about 75 * hc a pass.
  const int64_t sinkhorn_cost = static_cast<int64_t>(cfg.hc_sinkhorn_iters) * 2 * 75 * cfg.hc_mult;
  add_task(
      [](const MatmulJob& j, int64_t r0, int64_t r1) {
        const Impl& m = *static_cast<const Impl*>(j.ctx);
        for (int64_t i = r0; i < r1; ++i) hc_comb_lane(m.hcs, m.sc.hc_comb + i * m.cfg.hc_mult * m.cfg.hc_mult);
      },
      n, sinkhorn_cost);
}

// mHC post of every lane (the sub-layer's output in sc.y), keeping each new state's sum of squares.
void Engine::Impl::hc_post() {
  const int64_t d = cfg.n_embd, hc = cfg.hc_mult;
  per_lane(hc * (hc + 1) * d, [&](int i) {
    x_ss[i] = hc_post_lane(hcs, sc.x_hc + i * hc * d, sc.y + i * d, sc.hc_post + i * hc, sc.hc_comb + i * hc * hc);
  });
  x_ss_valid = true;
}

void Engine::Impl::attention_layer(int l) {
  const LayerWeights& L = w.layers[l];
  const int64_t d = cfg.n_embd, hd = cfg.head_dim, nh = cfg.n_head, ql = cfg.q_lora_rank, rd = cfg.rope_dim;
  const int64_t inh = cfg.index_n_heads, ihd = cfg.index_head_dim;
  const double* inv_freq = cfg.rope_inv_freqs[l].data();
  const bool qat = cfg.qat_numerics;

  // (A) batched projections: every product of u in one hand-off to the pool, then those of the
  // normed q latent in another, then every lane's norms, RoPE and QAT round trips in one pass.
  hc_pre(L.hc_attn, L.attn_norm);
  add_job(L.q_a, sc.u, d, sc.q_lat, ql);
  add_job(L.kv, sc.u, d, sc.kv, hd);
  if (L.ratio > 0) {
    add_job(L.comp.kv, sc.u, d, sc.comp_kv, sc.cw);
    add_job(L.comp.gate, sc.u, d, sc.comp_sc, sc.cw);
  }
  if (L.ratio == 4) {
    add_job(L.idx_proj, sc.u, d, sc.idx_w, inh);
    add_job(L.idx_comp.kv, sc.u, d, sc.idx_kv, sc.icw);
    add_job(L.idx_comp.gate, sc.u, d, sc.idx_sc, sc.icw);
  }
  run_jobs();
  per_lane(2 * ql, [&](int i) { rms_norm(sc.q_lat + i * ql, L.q_norm, sc.q_lat + i * ql, ql, cfg.norm_eps); });
  add_job(L.q_b, sc.q_lat, ql, sc.q, nh * hd);
  if (L.ratio == 4) add_job(L.idx_q_b, sc.q_lat, ql, sc.idx_q, inh * ihd);
  run_jobs();
  const int64_t ape_w = std::max(sc.cw, sc.icw);
  auto add_ape = [&](const TensorView& ape, float* z, int64_t width, int i) {
    float* row = sc.ape + i * ape_w;
    dequantize_row(ape.type, ape.data + (pos[i] % L.ratio) * ape.row_bytes(), row, width);
    for (int64_t k = 0; k < width; ++k) z[k] += row[k];
  };
  const int64_t comp_width = (L.ratio == 4 ? 2 : 1) * hd;
  // Head weights of the indexer are scaled by 1/sqrt(index_head_dim * index_n_heads) (spec §4.5).
  const float w_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ihd * inh)));
  int64_t lane_work = 3 * (nh + 1) * hd + 4 * rd;
  if (L.ratio > 0) lane_work += 2 * comp_width;
  if (L.ratio == 4) lane_work += inh * ihd * (qat ? 8 : 2) + 4 * ihd;
  per_lane(lane_work, [&](int i) {
    RopeTable rope;
    if (rope_as_prev[l]) {
      rope.load(sc.rope + i * rd, static_cast<int>(rd / 2));
    } else {
      rope.init(inv_freq, static_cast<int>(rd / 2), pos[i]);
      rope.save(sc.rope + i * rd);
    }
    for (int64_t h = 0; h < nh; ++h) {
      float* qh = sc.q + (i * nh + h) * hd;
      rms_norm(qh, nullptr, qh, hd, cfg.norm_eps);  // per-head unweighted norm
      rope.apply(qh + (hd - rd), false);
    }
    float* kv = sc.kv + i * hd;
    rms_norm(kv, L.kv_norm, kv, hd, cfg.norm_eps);
    rope.apply(kv + (hd - rd), false);
    if (qat) fp8_round_trip(kv, hd - rd);
    if (L.ratio > 0) add_ape(L.comp.ape, sc.comp_sc + i * sc.cw, comp_width, i);
    if (L.ratio == 4) {
      for (int64_t h = 0; h < inh; ++h) {
        float* qh = sc.idx_q + (i * inh + h) * ihd;
        rope.apply(qh + (ihd - rd), false);
        if (qat) {
          hadamard(qh, ihd);
          fp4_round_trip(qh, ihd);
        }
      }
      for (int64_t h = 0; h < inh; ++h) sc.idx_w[i * inh + h] *= w_scale;
      add_ape(L.idx_comp.ape, sc.idx_sc + i * sc.icw, 2 * ihd, i);
    }
  });

  // (B) per slot, lanes in order. Slots in parallel when there are enough of them; else one
  // slot at a time with its heads (and indexer entries) split, if that is worth a hand-off.
  int64_t attn_work = 0;  // multiply-adds of every lane's attention (window + compressed keys)
  for (int i = 0; i < n; ++i) attn_work += 2 * nh * hd * (std::min<int64_t>(pos[i] + 1, kRingRows) + sc.n_comp);
  if (n_groups >= pool.size() || attn_work < 2 * kParallelWork) {
    pool.parallel_for(n_groups, grain_for(attn_work / n_groups), [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) attend_slot(l, static_cast<int>(g), false);
    });
  } else {
    for (int g = 0; g < n_groups; ++g) attend_slot(l, g, true);
  }

  // (C) grouped low-rank output: group g maps heads [g*nh/G, (g+1)*nh/G) through rows
  // [g*ol, (g+1)*ol) of wo_a, then wo_b mixes all groups.
  const int64_t G = cfg.o_groups, ol = cfg.o_lora_rank, gw = nh / G * hd;
  for (int64_t g = 0; g < G; ++g) {
    TensorView part = L.wo_a;
    part.ne[1] = ol;
    part.data = L.wo_a.data + g * ol * L.wo_a.row_bytes();
    add_job(part, sc.attn_out + g * gw, nh * hd, sc.o_low + g * ol, G * ol);
  }
  run_jobs();
  matmul(L.wo_b, sc.o_low, n, G * ol, sc.y, d, pool);
  hc_post();
}

void Engine::Impl::attend_slot(int l, int g, bool parallel_heads) {
  const LayerWeights& L = w.layers[l];
  const int slot = group_slot[g];
  const int hd = cfg.head_dim, ihd = cfg.index_head_dim, rd = cfg.rope_dim, nh = cfg.n_head;
  const double* inv_freq = cfg.rope_inv_freqs[l].data();
  const bool qat = cfg.qat_numerics;
  for (int k = 0; k < group_len[g]; ++k) {
    const int i = order[group_first[g] + k];
    const int64_t t = pos[i];
    f32_to_f16_row(sc.kv + static_cast<int64_t>(i) * hd, state.ring_row(l, slot, t), hd);

    int32_t* sel = sc.comp_sel + i * sc.n_comp;
    int n_sel = 0;
    float* pooled = sc.pooled + i * sc.pool_w;
    if (L.ratio > 0) {
      if (compressor_push(state.attn_state(l, slot), L.ratio, hd, sc.comp_kv + i * sc.cw, sc.comp_sc + i * sc.cw, t,
                          pooled)) {
        const int64_t start = t + 1 - L.ratio;  // first token of the finished block
        finish_compressed_row(pooled, hd, L.comp.norm, cfg.norm_eps, inv_freq, rd, start,
                              qat ? RowQat::Fp8 : RowQat::None,
                              state.comp_row(l, state.page_of(slot, start / kPageTokens),
                                             static_cast<int>((start % kPageTokens) / L.ratio)));
      }
    }
    if (L.ratio == 4) {
      if (compressor_push(state.index_state(l, slot), 4, ihd, sc.idx_kv + i * sc.icw, sc.idx_sc + i * sc.icw, t,
                          pooled)) {
        const int64_t start = t + 1 - 4;
        finish_compressed_row(pooled, ihd, L.idx_comp.norm, cfg.norm_eps, inv_freq, rd, start,
                              qat ? RowQat::HadamardFp4 : RowQat::None,
                              state.index_row(l, state.page_of(slot, start / kPageTokens),
                                              static_cast<int>((start % kPageTokens) / 4)));
      }
      const int64_t n_vis = (t + 1) / 4;
      const int64_t k_sel = std::min<int64_t>(cfg.index_topk, n_vis);
      if (k_sel < n_vis) {
        float* scores = sc.idx_scores + i * sc.n_idx;
        const float* iq = sc.idx_q + static_cast<int64_t>(i) * cfg.index_n_heads * ihd;
        const float* iw = sc.idx_w + static_cast<int64_t>(i) * cfg.index_n_heads;
        if (parallel_heads) {
          pool.parallel_for(n_vis, grain_for(cfg.index_n_heads * ihd), [&](int64_t b, int64_t e) {
            indexer_scores(state, l, slot, iq, iw, cfg.index_n_heads, ihd, b, e, scores);
          });
        } else {
          indexer_scores(state, l, slot, iq, iw, cfg.index_n_heads, ihd, 0, n_vis, scores);
        }
        indexer_topk(scores, n_vis, k_sel, sc.idx_order + i * sc.n_idx, sel);
      } else {
        for (int64_t s = 0; s < n_vis; ++s) sel[s] = static_cast<int32_t>(s);  // all fit: no scoring needed
      }
      n_sel = static_cast<int>(k_sel);
    } else if (L.ratio == 128) {
      const int64_t n_vis = (t + 1) / 128;
      for (int64_t s = 0; s < n_vis; ++s) sel[s] = static_cast<int32_t>(s);
      n_sel = static_cast<int>(n_vis);
    }

    LaneKeys keys;
    keys.state = &state;
    keys.layer = l;
    keys.slot = slot;
    keys.ratio = L.ratio;
    keys.win_first = std::max<int64_t>(0, t - (kRingRows - 1));
    keys.n_win = static_cast<int>(t - keys.win_first + 1);
    keys.comp = sel;
    keys.n_comp = n_sel;
    RopeTable rope;
    rope.load(sc.rope + static_cast<int64_t>(i) * rd, rd / 2);  // lane i's, saved in (A)
    const float* q = sc.q + static_cast<int64_t>(i) * nh * hd;
    float* logits = sc.att_logits + static_cast<int64_t>(i) * nh * sc.n_keys;
    float* out = sc.attn_out + static_cast<int64_t>(i) * nh * hd;
    if (parallel_heads) {
      pool.parallel_for(nh, grain_for(2 * hd * keys.count()), [&](int64_t b, int64_t e) {
        attend_heads(keys, q, L.sinks, hd, rd, rope, logits, sc.n_keys, out, static_cast<int>(b), static_cast<int>(e));
      });
    } else {
      attend_heads(keys, q, L.sinks, hd, rd, rope, logits, sc.n_keys, out, 0, nh);
    }
  }
}

void Engine::Impl::ffn_layer(int l) {
  const LayerWeights& L = w.layers[l];
  const int64_t d = cfg.n_embd;
  hc_pre(L.hc_ffn, L.ffn_norm);
  add_job(L.gate_inp, sc.u, d, sc.router, cfg.n_expert);  // with hc_pre's Sinkhorn task
  run_jobs();
  moe_forward(cfg, L, l, n, tok, sc, moe_lists, pool);
  hc_post();
}

void Engine::Impl::head(const int32_t* lane_logits, float* logits_out) {
  const int64_t d = cfg.n_embd, hcd = cfg.hc_mult * d, mix = (2 + cfg.hc_mult) * cfg.hc_mult;
  int n_out = 0;
  for (int i = 0; i < n; ++i)
    if (lane_logits[i]) logit_lanes[n_out++] = i;
  if (n_out == 0) return;
  matmul(w.hc_head.fn, sc.x_hc, n, hcd, sc.hc_mix, mix, pool);
  pool.parallel_for(n_out, grain_for(3 * hcd), [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      const int i = logit_lanes[j];
      float* h = sc.head_in + j * d;
      hc_head_lane(hcs, w.hc_head, sc.x_hc + i * hcd, x_ss_valid ? &x_ss[i] : nullptr, sc.hc_mix + i * mix, h);
      rms_norm(h, w.output_norm, h, d, cfg.norm_eps);
    }
  });
  matmul(w.output, sc.head_in, n_out, d, logits_out, cfg.n_vocab, pool);
}

Engine::Engine(const ModelConfig& cfg, const std::string& gguf_path, const std::vector<WeightEntry>& weights,
               const EngineOptions& opts)
    : impl_(std::make_unique<Impl>(cfg, gguf_path, weights, opts)) {}

Engine::~Engine() = default;

void Engine::step(int n_lanes, const int32_t* lane_slot, const int32_t* lane_token, const int32_t* lane_pos,
                  const int32_t* lane_logits, int n_tables, const int32_t* table_slot, const int32_t* block_table,
                  int max_blocks, float* logits_out) {
  Impl& m = *impl_;
  if (n_lanes <= 0) return;
  m.validate_and_group(n_lanes, lane_slot, lane_token, lane_pos, n_tables, table_slot, block_table, max_blocks);
  m.n = n_lanes;
  m.tok = lane_token;
  m.pos = lane_pos;
  m.slot_of = lane_slot;
  m.check_pages();
  m.x_ss_valid = false;  // until the first hc_post
  m.embed();
  for (int l = 0; l < m.cfg.n_layer; ++l) {
    m.attention_layer(l);
    m.ffn_layer(l);
  }
  m.head(lane_logits, logits_out);
}

void Engine::reset_slot(int slot) { impl_->state.reset_slot(slot); }

SlotStateExport Engine::export_slot_state(int slot, const int32_t* block_table, int max_blocks,
                                          int64_t n_tokens) const {
  const Impl& m = *impl_;
  const ModelConfig& c = m.cfg;
  auto fail = [](const std::string& msg) { throw std::invalid_argument("export_slot_state: " + msg); };
  if (slot < 0 || slot >= m.opts.max_slots) fail("slot " + std::to_string(slot) + " out of range");
  if (n_tokens < 0 || n_tokens > m.opts.max_ctx) fail("n_tokens " + std::to_string(n_tokens) + " outside 0..max_ctx");
  if (max_blocks < 0) fail("negative max_blocks");
  // The physical page of logical page lp, checked against the table and the pool.
  auto page = [&](int64_t lp) {
    const int32_t p = lp < max_blocks ? block_table[lp] : -1;
    if (p < 0 || p >= m.opts.n_pages)
      fail("logical page " + std::to_string(lp) + " maps to " + std::to_string(p) + ", not a page of the pool");
    return static_cast<int>(p);
  };
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  SlotStateExport out;
  out.ring.resize(c.n_layer);
  out.comp.resize(c.n_layer);
  out.index.resize(c.n_layer);
  out.attn_kv.resize(c.n_layer);
  out.attn_score.resize(c.n_layer);
  out.index_kv.resize(c.n_layer);
  out.index_score.resize(c.n_layer);
  auto copy_state = [](const CompressorState& st, std::vector<float>& kv, std::vector<float>& score) {
    const int64_t n = static_cast<int64_t>(st.rows) * st.width;
    kv.assign(st.kv, st.kv + n);
    score.assign(st.score, st.score + n);
  };
  for (int l = 0; l < c.n_layer; ++l) {
    const uint16_t* ring = m.state.ring_row(l, slot, 0);
    out.ring[l].assign(ring, ring + kRingRows * hd);
    const int ratio = c.compress_ratios[l];
    if (ratio == 0) continue;
    const int64_t n_rows = n_tokens / ratio;
    out.comp[l].resize(n_rows * hd);
    if (ratio == 4) out.index[l].resize(n_rows * ihd);
    for (int64_t j = 0; j < n_rows; ++j) {
      const int64_t start = j * ratio;
      const int p = page(start / kPageTokens);
      const int r = static_cast<int>((start % kPageTokens) / ratio);
      std::copy(m.state.comp_row(l, p, r), m.state.comp_row(l, p, r) + hd, out.comp[l].begin() + j * hd);
      if (ratio == 4)
        std::copy(m.state.index_row(l, p, r), m.state.index_row(l, p, r) + ihd, out.index[l].begin() + j * ihd);
    }
    copy_state(m.state.attn_state(l, slot), out.attn_kv[l], out.attn_score[l]);
    if (ratio == 4) copy_state(m.state.index_state(l, slot), out.index_kv[l], out.index_score[l]);
  }
  return out;
}

std::vector<std::pair<std::string, uint64_t>> Engine::allocated_bytes() const {
  const Impl& m = *impl_;
  return {
      {"rings", m.state.ring_bytes()},
      {"compressor_state", m.state.state_bytes()},
      {"pages", m.state.page_bytes()},
      {"block_tables", m.state.table_bytes()},
      {"scratch", m.sc.arena.bytes()},
      {"weights_mapped", m.file.size()},
  };
}

}  // namespace ds4
