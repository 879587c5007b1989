// Exhaustive check of ext/cpu/expf_exact.h: every variant against libm's expf on all 2^32 float
// bit patterns. Built like the module (baseline x86-64, no contraction), from the repo root:
//   g++ -std=c++17 -O2 -ffp-contract=off -Iext/cpu ext/cpu/tools/expf_exhaustive.cpp -o /tmp/expf_exhaustive && /tmp/expf_exhaustive
// Prints, per variant, inputs checked, exact bit matches, NaN results that are NaN on both sides
// but with different bits, and mismatches (with the first few shown); exits 1 on any mismatch.
// Variants the CPU lacks (AVX2, AVX-512) are reported as skipped. An optional argument STRIDE
// (a power of two) checks only every STRIDE-th bit pattern, for a quick run.
#include <gnu/libc-version.h>

#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include "expf_exact.h"

namespace {

constexpr int64_t kBlock = 1 << 16;

struct Tally {
  const char* name;
  uint64_t checked = 0, exact = 0, nan_bits = 0, wrong = 0;
};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void compare(Tally& t, const float* x, const float* ref, const float* got, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    ++t.checked;
    if (bits(ref[i]) == bits(got[i])) {
      ++t.exact;
    } else if (std::isnan(ref[i]) && std::isnan(got[i])) {
      ++t.nan_bits;
    } else {
      if (++t.wrong <= 8)
        std::printf("  %s: x=%a (0x%08x) libm=%a (0x%08x) got=%a (0x%08x)\n", t.name, x[i], bits(x[i]), ref[i],
                    bits(ref[i]), got[i], bits(got[i]));
    }
  }
}

DS4_EXPF_AVX2 void run_avx2(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, ds4::exp_exact_avx2(_mm256_loadu_ps(x + i)));
}

DS4_EXPF_AVX512 void run_avx512(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, ds4::exp_exact_avx512(_mm512_loadu_ps(x + i)));
}

}  // namespace

int main(int argc, char** argv) {
  const uint64_t stride = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1;
  if (stride == 0 || (stride & (stride - 1)) != 0 || stride > (uint64_t{1} << 16)) {
    std::fprintf(stderr, "STRIDE must be a power of two up to 65536\n");
    return 2;
  }
  __builtin_cpu_init();
  const bool fma = __builtin_cpu_supports("fma");
  const bool avx2 = fma && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  // Through a volatile pointer: the reference is the library's expf, never a compiler builtin.
  float (*volatile libm_expf)(float) = expf;
  std::printf("glibc %s; hardware FMA %d, AVX2 %d, AVX-512 %d\n", gnu_get_libc_version(), fma, avx2, avx512);

  static float x[kBlock], ref[kBlock], got[kBlock];
  Tally t_fma{"scalar-fma"}, t_soft{"scalar-soft"}, t_avx2{"avx2"}, t_avx512{"avx512"};
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t base = 0; base < (uint64_t{1} << 32); base += kBlock * stride) {
    for (int64_t i = 0; i < kBlock; ++i) x[i] = from_bits(static_cast<uint32_t>(base + i * stride));
    for (int64_t i = 0; i < kBlock; ++i) ref[i] = libm_expf(x[i]);
    if (fma) {
      for (int64_t i = 0; i < kBlock; ++i) got[i] = ds4::exp_exact_fma(x[i]);
      compare(t_fma, x, ref, got, kBlock);
    }
    for (int64_t i = 0; i < kBlock; ++i) got[i] = ds4::exp_exact_soft(x[i]);
    compare(t_soft, x, ref, got, kBlock);
    if (avx2) {
      run_avx2(x, got, kBlock);
      compare(t_avx2, x, ref, got, kBlock);
    }
    if (avx512) {
      run_avx512(x, got, kBlock);
      compare(t_avx512, x, ref, got, kBlock);
    }
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  bool ok = true;
  for (const Tally* t : {&t_fma, &t_soft, &t_avx2, &t_avx512}) {
    if (t->checked == 0) {
      std::printf("%-12s skipped (CPU lacks it)\n", t->name);
      continue;
    }
    std::printf("%-12s checked %" PRIu64 "  exact %" PRIu64 "  NaN-with-other-bits %" PRIu64 "  mismatches %" PRIu64 "\n",
                t->name, t->checked, t->exact, t->nan_bits, t->wrong);
    ok = ok && t->wrong == 0;
  }
  std::printf("%.1f s\n", secs);
  return ok ? 0 : 1;
}
