// The KV compressor (spec §4.4), one slot's state, one token at a time.
//
// Token t's projections go into the slot's fp32 state; when (t+1) mod m == 0 the block
// j = t / m is pooled with a per-channel softmax over its candidates and the row is finished
// (RMSNorm, RoPE at j·m, optional QAT round trip, f16) into its page.
//   CSA (m = 4, overlap): state rows [0, m) = previous block, [m, 2m) = current block, each
//     2c wide; channel ch pools the previous block's k[ch] with the current block's k[c + ch].
//     A fresh slot's previous rows are (0, -inf): block 0 has no previous half.
//   HCA (m = 128): rows [0, m) = the current block, c wide.
#pragma once

#include <cstdint>

#include "paged_state.h"

namespace ds4 {

enum class RowQat { None, Fp8, HadamardFp4 };

// Store (k, z) of token t (z already includes ape[t mod m]); on block completion write the
// pooled row (c values) to out and return true.
bool compressor_push(const CompressorState& st, int ratio, int c, const float* k, const float* z, int64_t t,
                     float* out);

// Finish a pooled row in place and store it as f16: weighted RMSNorm, RoPE of the last
// rope_dim values at position pos, the QAT round trip (FP8 on [0, c - rope_dim), or Hadamard +
// FP4 on all c values), then f16.
void finish_compressed_row(float* row, int c, const float* norm, float eps, const double* inv_freq, int rope_dim,
                           int64_t pos, RowQat qat, uint16_t* dst);

}  // namespace ds4
