// What every kernel shares: the host/device qualifier and the few numeric primitives whose exact roundings both
// builds must agree on. Each kernel's per-row logic is written once, as DFLASH_HD functions: nvcc compiles them
// into the CUDA kernel, the host compiler into the CPU build that the test suite runs against the PyTorch
// reference. Both builds are compiled without floating-point contraction (-ffp-contract=off, --fmad=false), and
// exp is our own polynomial rather than each platform's libm, so a function gives the same bits on both.
#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash {

// Return codes of the C entry points: 0 done; negative: refused before any memory was read; positive: the
// cudaError_t of a failed launch (common/launch.cuh).
constexpr int kOk = 0;
constexpr int kBadArgument = -1;  // a shape or size the kernel does not take
constexpr int kBadToken = -2;     // a token id outside the vocabulary (nothing meaningful written)
constexpr int64_t kMaxGrid = 2147483647;  // thread blocks in a launch's x dimension

// The inverse-CDF draw sums probabilities in chunks of this many entries: sequentially inside a chunk, then the
// chunk totals sequentially. The PyTorch reference (shared/sampling.py: sample_from) sums in the same order, so
// the draw is the same token on every build; the chunks are what the GPU reads in parallel.
constexpr int64_t kCdfChunk = 256;

DFLASH_HD float float_from_bits(uint32_t bits) {
  union { uint32_t u; float f; } value;
  value.u = bits;
  return value.f;
}

DFLASH_HD uint32_t bits_of(float x) {
  union { float f; uint32_t u; } value;
  value.f = x;
  return value.u;
}

DFLASH_HD bool is_nan(float x) { return x != x; }

// An element of a float32 or bfloat16 tensor (bfloat16 passed as its bits, uint16_t) as float32.
DFLASH_HD float to_float(float x) { return x; }
DFLASH_HD float to_float(uint16_t bf16) { return float_from_bits((uint32_t)bf16 << 16); }

// float32 -> bfloat16 bits, rounding to nearest even (a NaN stays a quiet NaN), as torch converts.
DFLASH_HD uint16_t bf16_round(float x) {
  const uint32_t bits = bits_of(x);
  if (is_nan(x)) return (uint16_t)((bits >> 16) | 0x40u);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// exp(x) for x <= 0 (Cephes' polynomial after a power-of-two range reduction), float32 accuracy; -inf and
// anything below -87.3 give the smallest normal's neighbourhood, i.e. ~0. Plain mul/add, no libm call.
DFLASH_HD float exp_nonpositive(float x) {
  if (is_nan(x)) return x;  // (a NaN's conversion to an integer below differs between CPU and GPU)
  x = x < -87.3365f ? -87.3365f : x;
  const float scaled = x * 1.44269504088896341f;
  const float n = (float)(int32_t)(scaled < 0.0f ? scaled - 0.5f : scaled + 0.5f);  // round half away from 0
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + (r + 1.0f);
  return y * float_from_bits((uint32_t)((int32_t)n + 127) << 23);
}

// The better of two (value, index) candidates of an argmax: the larger value, NaN above everything (as torch's
// argmax), the smaller index on ties, so any order of combining gives the same winner.
struct ArgBest {
  float value;
  int64_t index;  // -1: no candidate yet
};

DFLASH_HD ArgBest better(ArgBest a, ArgBest b) {
  if (a.index < 0) return b;
  if (b.index < 0) return a;
  const bool a_nan = is_nan(a.value), b_nan = is_nan(b.value);
  if (a_nan != b_nan) return a_nan ? a : b;
  if (!a_nan && a.value != b.value) return a.value > b.value ? a : b;
  return a.index < b.index ? a : b;
}

// argmax of x[begin, end) taking every stride-th entry (a lane of `stride` lanes reads begin + lane, ...).
DFLASH_HD ArgBest argmax_strided(const float* x, int64_t begin, int64_t end, int64_t stride) {
  ArgBest best = {0.0f, -1};
  for (int64_t i = begin; i < end; i += stride) best = better(best, ArgBest{x[i], i});
  return best;
}

// The sum of values(i) for i in one CDF chunk [begin, end), in order, in double.
template <typename Values>
DFLASH_HD double chunk_total(const Values& values, int64_t begin, int64_t end) {
  double total = 0.0;
  for (int64_t i = begin; i < end; ++i) total += (double)values(i);
  return total;
}

// The first i in [begin, end) whose cumulative value start + (values(begin) + ... + values(i)) exceeds target
// (start: the chunks before, summed), or -1. The sum inside the chunk is the one chunk_total makes.
template <typename Values>
DFLASH_HD int64_t chunk_first_above(const Values& values, int64_t begin, int64_t end, double start, double target) {
  double within = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    within += (double)values(i);
    if (start + within > target) return i;
  }
  return -1;
}

// The whole draw on one thread: a token from values(0 .. count) (need not be normalised) with uniform u in [0, 1).
// Chunk totals, then u * total located; past the end (u * total == total, or all zero) clamps to the last id.
template <typename Values>
DFLASH_HD int64_t draw_sequential(const Values& values, int64_t count, double u) {
  double total = 0.0;
  for (int64_t begin = 0; begin < count; begin += kCdfChunk) {
    total += chunk_total(values, begin, begin + kCdfChunk < count ? begin + kCdfChunk : count);
  }
  const double target = u * total;
  double start = 0.0;
  for (int64_t begin = 0; begin < count; begin += kCdfChunk) {
    const int64_t end = begin + kCdfChunk < count ? begin + kCdfChunk : count;
    const int64_t found = chunk_first_above(values, begin, end, start, target);
    if (found >= 0) return found;
    start += chunk_total(values, begin, end);
  }
  return count - 1;
}

}  // namespace dflash
