// Attention of query rows over cached keys, one (row, head) at a time, float32:
//   out[b, i, h, :] = sum_j p_j v[b, h / group, j, :],  p = softmax_j(scale * q[b, h, i, :] . k[b, h / group, j, :])
// over the keys j the mask shows that row. Masked keys are skipped (their weight is an exact 0), and every
// visible key goes through the same instructions in key order, so a row's result depends only on its own query
// and visible keys: not on how many rows share the call, nor on how many masked keys follow (a verify block's
// rows equal one-token rows bit for bit; cache garbage past a row's keys is never read).
//
// AVX2 + FMA; head_dim a multiple of 8 (the caller checks). Plain C ABI, loaded with ctypes.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline float horizontal_sum(__m256 v) {
  const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
}

inline float dot(const float* a, const float* b, int64_t dim) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
  for (int64_t d = 8; d < dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return horizontal_sum(acc);
}

// exp(x) for x <= 0 to float32 accuracy (Cephes' polynomial on a power-of-two range reduction); each lane
// alike, so a value's result never depends on its neighbours.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(scale));
}

// One (row, head): scores of the visible keys, their softmax weights, the weighted sum of values.
void attend_row(const float* q, const float* k, const float* v, const uint8_t* visible, int64_t keys,
                int64_t dim, float scale, float* weights, float* out) {
  float top = -INFINITY;
  for (int64_t j = 0; j < keys; ++j) {
    if (!visible[j]) continue;
    weights[j] = dot(q, k + j * dim, dim) * scale;
    top = weights[j] > top ? weights[j] : top;
  }
  for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(out + d, _mm256_setzero_ps());
  if (top == -INFINITY) return;  // no visible key (a padding row): zeros, never read
  const __m256 top8 = _mm256_set1_ps(top);
  int64_t j = 0;
  for (; j + 8 <= keys; j += 8) {  // masked keys' weights are garbage here and skipped below
    _mm256_storeu_ps(weights + j, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(weights + j), top8)));
  }
  if (j < keys) {
    float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t t = j; t < keys; ++t) tail[t - j] = visible[t] ? weights[t] - top : 0.0f;
    _mm256_storeu_ps(tail, exp_nonpositive(_mm256_loadu_ps(tail)));
    for (int64_t t = j; t < keys; ++t) weights[t] = tail[t - j];
  }
  float total = 0.0f;
  for (int64_t t = 0; t < keys; ++t) {
    if (visible[t]) total += weights[t];
  }
  constexpr int kMaxDim = 256;
  __m256 acc[kMaxDim / 8];
  const int64_t lanes = dim / 8;
  for (int64_t d = 0; d < lanes; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t t = 0; t < keys; ++t) {
    if (!visible[t]) continue;
    const __m256 p = _mm256_set1_ps(weights[t]);
    const float* vt = v + t * dim;
    for (int64_t d = 0; d < lanes; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vt + 8 * d), acc[d]);
  }
  const __m256 inverse = _mm256_set1_ps(1.0f / total);
  for (int64_t d = 0; d < lanes; ++d) _mm256_storeu_ps(out + 8 * d, _mm256_mul_ps(acc[d], inverse));
}

}  // namespace

extern "C" {

// q [batch, heads, rows, dim] contiguous; k, v: [keys, dim] blocks at batch and kv-head strides (elements);
// visible [batch, rows, keys] (bytes, 1 = the row sees the key); out [batch, rows, heads, dim] contiguous.
// dim <= 256. Returns 0, or -1 for a dim this kernel does not take.
int dflash_attention(const float* q, const float* k, const float* v, int64_t k_batch_stride, int64_t k_head_stride,
                     int64_t v_batch_stride, int64_t v_head_stride, const uint8_t* visible, int64_t batch,
                     int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim, float scale,
                     float* out) {
  if (dim % 8 != 0 || dim > 256 || heads % kv_heads != 0) return -1;
  const int64_t group = heads / kv_heads;
  std::vector<float> weights(keys + 8);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* kh = k + b * k_batch_stride + (h / group) * k_head_stride;
      const float* vh = v + b * v_batch_stride + (h / group) * v_head_stride;
      for (int64_t i = 0; i < rows; ++i) {
        attend_row(q + ((b * heads + h) * rows + i) * dim, kh, vh, visible + (b * rows + i) * keys, keys, dim,
                   scale, weights.data(), out + ((b * rows + i) * heads + h) * dim);
      }
    }
  }
  return 0;
}

}  // extern "C"
