// The small per-layer operations of a decoder step, fused so that each costs one call instead of a handful
// of PyTorch ops (on a small model the one-token step is bound by op dispatch, not arithmetic):
// - RMSNorm, alone or after the residual add;
// - the attention input: q and k heads normalized (Qwen3's q/k norms) and rotated (rotate-half RoPE), q laid
//   out for attention, k and v written into the positional KV cache;
// - the gated MLP's activation, silu(gate) * up.
// Float32, row by row (a row's result never depends on the other rows). Plain C ABI, loaded with ctypes.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cache_pages.h"
#include "simd_exp.h"

namespace {

// Sum of squares of n floats: eight lanes, then the lanes in a fixed order, then the scalar tail.
inline float sum_of_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc);
  float lanes[8];
  _mm256_storeu_ps(lanes, acc);
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// out = weight * (x / sqrt(mean(x^2) + eps)) over one row of n (weight may be null: ones).
inline void normalize_row(const float* x, const float* weight, int64_t n, float eps, float* out) {
  const float inverse = 1.0f / std::sqrt(sum_of_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = weight ? weight[i] * (x[i] * inverse) : x[i] * inverse;
}

}  // namespace

extern "C" {

// x, out [rows, n]; weight [n].
void dflash_rms_norm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) normalize_row(x + r * n, weight, n, eps, out + r * n);
}

// summed = x + delta; out = rms_norm(summed): the residual stream and the next sublayer's input in one pass.
void dflash_add_rms_norm(const float* x, const float* delta, int64_t rows, int64_t n, const float* weight,
                         float eps, float* summed, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* s = summed + r * n;
    for (int64_t i = 0; i < n; ++i) s[i] = x[r * n + i] + delta[r * n + i];
    normalize_row(s, weight, n, eps, out + r * n);
  }
}

}  // extern "C"

namespace {

// A float32 value as a cache element: itself, or its bfloat16 bit pattern rounded to nearest even, as PyTorch's
// float -> bfloat16 conversion rounds (the PyTorch path's cache write gives the same bits; a NaN stays a NaN,
// whose bit pattern in PyTorch depends on its code path).
inline void store(float* out, float x) { *out = x; }
inline void store(uint16_t* out, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  *out = std::isnan(x) ? uint16_t{0x7FC0} : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

template <typename T>
void rotary_cache(const float* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim,
                  const float* norm_weight, float eps, const float* cos, const float* sin, const int64_t* slots,
                  const int64_t* positions, T* k_cache, T* v_cache, const CachePages& pages, float* q) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  float normed[1024], rotated[1024];
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      const float* row = qkv + (b * seq + t) * width;
      const float* c = cos + (b * seq + t) * dim;
      const float* s = sin + (b * seq + t) * dim;
      const int64_t position = positions[b * seq + t];
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const float* x = row + h * dim;
        if (norm_weight) {
          normalize_row(x, norm_weight + h * dim, dim, eps, normed);
          x = normed;
        }
        float* out = h < heads ? q + ((b * heads + h) * seq + t) * dim : rotated;
        for (int64_t d = 0; d < half; ++d) {  // rotate half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
          out[d] = x[d] * c[d] - x[d + half] * s[d];
          out[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
        }
        if (h >= heads) {
          T* key = k_cache + dflash::cache_row(pages, kv_heads, slots[b], h - heads, position, dim);
          for (int64_t d = 0; d < dim; ++d) store(key + d, rotated[d]);
        }
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const float* x = row + (heads + kv_heads + h) * dim;
        T* out = v_cache + dflash::cache_row(pages, kv_heads, slots[b], h, position, dim);
        for (int64_t d = 0; d < dim; ++d) store(out + d, x[d]);
      }
    }
  }
}

}  // namespace

extern "C" {

// qkv [batch, seq, (heads + 2 kv_heads) * dim] (a fused projection's rows); cos, sin [batch, seq, dim];
// norm_weight [heads + kv_heads, dim] or null (no q/k norm); slots [batch]; positions [batch, seq].
// Writes q [batch, heads, seq, dim] and, for each row, k and v into the caches [pages, kv_heads, page_size, dim]
// (float32, or bfloat16 where bf16 != 0) where `pages` puts (slots[b], positions[b, t]) (cache_pages.h). Returns 0,
// or -1 (nothing written) when a slot, position or page is outside the cache or dim is odd.
int dflash_qk_rotary_cache(const float* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim,
                           const float* norm_weight, float eps, const float* cos, const float* sin,
                           const int64_t* slots, const int64_t* positions, void* k_cache, void* v_cache, int64_t bf16,
                           const CachePages* pages, float* q) {
  if (dim % 2 != 0 || dim > 1024) return -1;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      if (!dflash::cache_holds(*pages, slots[b], positions[b * seq + t])) return -1;
    }
  }
  if (bf16) {
    rotary_cache(qkv, batch, seq, heads, kv_heads, dim, norm_weight, eps, cos, sin, slots, positions,
                 static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), *pages, q);
  } else {
    rotary_cache(qkv, batch, seq, heads, kv_heads, dim, norm_weight, eps, cos, sin, slots, positions,
                 static_cast<float*>(k_cache), static_cast<float*>(v_cache), *pages, q);
  }
  return 0;
}

// gate_up [rows, 2 * intermediate] (each row gate then up, a fused projection's output) -> act [rows,
// intermediate] = silu(gate) * up, silu(g) = g / (1 + exp(-g)) rounded before the product (PyTorch's order; its
// exp is another polynomial, so values may differ from F.silu in the last bit). A row's tail past the last eight
// goes through the same instructions on masked lanes, so every element is computed alike.
void dflash_silu_mul(const float* gate_up, int64_t rows, int64_t intermediate, float* act) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up + r * 2 * intermediate;
    const float* up = gate + intermediate;
    float* out = act + r * intermediate;
    for (int64_t i = 0; i < intermediate; i += 8) {
      const int64_t left = intermediate - i < 8 ? intermediate - i : 8;
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), lane);
      const __m256 g = _mm256_maskload_ps(gate + i, mask), u = _mm256_maskload_ps(up + i, mask);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, dflash::exp8(_mm256_xor_ps(g, sign))));
      _mm256_maskstore_ps(out + i, mask, _mm256_mul_ps(silu, u));
    }
  }
}

}  // extern "C"
