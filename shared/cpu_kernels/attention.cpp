// Attention of query rows over cached keys, one (row, head) at a time, float32:
//   out[b, i, h, :] = sum_j p_j v[b, h / group, j, :],  p = softmax_j(scale * q[b, h, i, :] . k[b, h / group, j, :])
// over the keys j the mask shows that row. Masked keys are skipped (their weight is an exact 0), and every
// visible key goes through the same instructions in key order, so a row's result depends only on its own query
// and visible keys: not on how many rows share the call, nor on how many masked keys follow (a verify block's
// rows equal one-token rows bit for bit; cache garbage past a row's keys is never read).
//
// Keys and values are float32 or bfloat16 (a bfloat16 KV cache: each value widened to float32 as it is loaded, the
// arithmetic float32 as before). AVX2 + FMA; head_dim a multiple of 8 (the caller checks). Plain C ABI, loaded
// with ctypes.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cache_pages.h"
#include "simd_exp.h"

namespace {

// Eight consecutive cache elements as float32: loaded, or bfloat16 bit patterns shifted into the high half.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// Eight dot products at once: q [dim] against keys k[0..7] (rows of dim). Each key's lanes are summed by the
// same tree ((0+1)+(2+3))+((4+5)+(6+7)) whatever its place among the eight, so a score is the same number in
// every call that computes it; a NaN in one key (cache garbage) stays in that key's score.
inline __m256 dot8(const float* q, const float* k, int64_t dim) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 qd = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(qd, load8(k + d), a0);
    a1 = _mm256_fmadd_ps(qd, load8(k + dim + d), a1);
    a2 = _mm256_fmadd_ps(qd, load8(k + 2 * dim + d), a2);
    a3 = _mm256_fmadd_ps(qd, load8(k + 3 * dim + d), a3);
    a4 = _mm256_fmadd_ps(qd, load8(k + 4 * dim + d), a4);
    a5 = _mm256_fmadd_ps(qd, load8(k + 5 * dim + d), a5);
    a6 = _mm256_fmadd_ps(qd, load8(k + 6 * dim + d), a6);
    a7 = _mm256_fmadd_ps(qd, load8(k + 7 * dim + d), a7);
  }
  // hadd pairs lanes within each 128-bit half: after three rounds, lane i of each half holds a partial of key i.
  const __m256 h01 = _mm256_hadd_ps(a0, a1), h23 = _mm256_hadd_ps(a2, a3);
  const __m256 h45 = _mm256_hadd_ps(a4, a5), h67 = _mm256_hadd_ps(a6, a7);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  // h0123 = [k0 lo, k1 lo, k2 lo, k3 lo | k0 hi, k1 hi, k2 hi, k3 hi] (each a sum of four lanes), same for 4..7
  const __m256 lows = _mm256_permute2f128_ps(h0123, h4567, 0x20), highs = _mm256_permute2f128_ps(h0123, h4567, 0x31);
  return _mm256_add_ps(lows, highs);  // [s0 .. s7]
}

using dflash::kKeyBlock;  // keys per block (cache_pages.h)

// out[0 .. 8 LANES) += sum over visible keys j in [begin, end), in order, of w[j] * v[j][0 .. 8 LANES)
// (v rows of stride dim). The accumulators are registers (LANES is a compile-time count).
template <int LANES>
inline void accumulate(const float* w, const uint8_t* seen, const float* v, int64_t dim, int64_t begin, int64_t end,
                       float* out) {
  __m256 acc[LANES];
  for (int d = 0; d < LANES; ++d) acc[d] = _mm256_loadu_ps(out + 8 * d);
  for (int64_t j = begin; j < end; ++j) {
    if (!seen[j]) continue;
    const __m256 p = _mm256_set1_ps(w[j]);
    const float* vj = v + j * dim;
    for (int d = 0; d < LANES; ++d) acc[d] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vj + 8 * d), acc[d]);
  }
  for (int d = 0; d < LANES; ++d) _mm256_storeu_ps(out + 8 * d, acc[d]);
}

// Keys (or values) [begin, end) of a block as float32 rows of dim, zero-padded to whole chunks of 8 keys: float32
// ones where they lie (the partial chunk copied into `padded`), bfloat16 ones widened into `widened` once per
// block, so that every row of the block reads float32 (exact: a bfloat16 is the top half of a float32).
inline const float* block_rows(const float* x, int64_t begin, int64_t end, int64_t dim, float* padded, float*) {
  const int64_t full = (end - begin) / 8 * 8;
  if (full == end - begin) return x + begin * dim;
  for (int64_t i = 0; i < 8 * dim; ++i) padded[i] = 0.0f;
  for (int64_t i = 0; i < (end - begin - full) * dim; ++i) padded[i] = x[(begin + full) * dim + i];
  return nullptr;  // the caller reads the full chunks in place and the last from padded
}
inline const float* block_rows(const uint16_t* x, int64_t begin, int64_t end, int64_t dim, float*, float* widened) {
  const int64_t count = (end - begin) * dim, padded_count = (end - begin + 7) / 8 * 8 * dim;
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(widened + i, load8(x + begin * dim + i));  // (dim % 8 == 0)
  for (; i < padded_count; ++i) widened[i] = 0.0f;
  return widened;
}

// All query rows of one (batch entry, KV head): the group's heads x the call's rows, each against the keys its
// mask row shows. Keys and values are read block by block and reused by every row (not re-read per row); each
// row's arithmetic is still its own, in key order (its accumulators are stored and reloaded between blocks,
// which is exact), so its result is the one it would get alone. T: float (float32 cache) or uint16_t (bfloat16).
//   q: rows_total row pointers (dim each); visible: a mask row per row; out: a row of dim per row; padded: 8 keys
//   of dim floats; widened: kKeyBlock keys of dim floats.
//   k_pages, v_pages: where the keys (values) lie, page_rows rows of dim each a page: key j is row j % page_rows of
//   page j / page_rows (one page of at least `keys` rows: contiguous keys); page_rows is a multiple of kKeyBlock
//   where there are several, so that a block never straddles two pages.
template <typename T>
void attend_rows(const float* const* q, const uint8_t* const* visible, float* const* out, int64_t rows_total,
                 const T* const* k_pages, const T* const* v_pages, int64_t page_rows, int64_t keys, int64_t dim,
                 float scale, float* scores, float* padded, float* widened) {
  const int64_t stride = (keys + 7) / 8 * 8;  // scores row length
  const __m256 scale8 = _mm256_set1_ps(scale);
  for (int64_t block = 0; block < keys; block += kKeyBlock) {
    const int64_t end = block + kKeyBlock < keys ? block + kKeyBlock : keys;
    const T* k = k_pages[block / page_rows] + (block % page_rows) * dim;  // the block's first key
    const float* rows = block_rows(k, 0, end - block, dim, padded, widened);  // null: float32 keys in place
    const int64_t full = block + (end - block) / 8 * 8;
    for (int64_t r = 0; r < rows_total; ++r) {
      for (int64_t j = block; j < end; j += 8) {  // every key through dot8, the last partial chunk zero-padded
        const float* chunk = rows != nullptr ? rows + (j - block) * dim
                                             : (j < full ? reinterpret_cast<const float*>(k) + (j - block) * dim
                                                         : padded);
        _mm256_storeu_ps(scores + r * stride + j, _mm256_mul_ps(dot8(q[r], chunk, dim), scale8));
      }
    }
  }
  std::vector<float> inverse_total(rows_total, 0.0f);
  for (int64_t r = 0; r < rows_total; ++r) {
    float* w = scores + r * stride;
    const uint8_t* seen = visible[r];
    float top = -INFINITY;
    for (int64_t j = 0; j < keys; ++j) {
      if (seen[j]) top = w[j] > top ? w[j] : top;
    }
    for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(out[r] + d, _mm256_setzero_ps());
    if (top == -INFINITY) continue;  // no visible key (a padding row): zeros, never read
    const __m256 top8 = _mm256_set1_ps(top);
    for (int64_t j = 0; j < stride; j += 8) {  // masked keys' weights are garbage here and skipped below
      _mm256_storeu_ps(w + j, dflash::exp8(_mm256_sub_ps(_mm256_loadu_ps(w + j), top8)));
    }
    float total = 0.0f;
    for (int64_t j = 0; j < keys; ++j) {
      if (seen[j]) total += w[j];
    }
    inverse_total[r] = 1.0f / total;
  }
  for (int64_t block = 0; block < keys; block += kKeyBlock) {
    const int64_t end = block + kKeyBlock < keys ? block + kKeyBlock : keys, n = end - block;
    const T* v = v_pages[block / page_rows] + (block % page_rows) * dim;
    const float* rows = block_rows(v, 0, n, dim, padded, widened);
    const float* values = rows != nullptr ? rows : reinterpret_cast<const float*>(v);  // (in place)
    for (int64_t r = 0; r < rows_total; ++r) {
      if (inverse_total[r] == 0.0f) continue;
      const float* w = scores + r * stride + block;
      const uint8_t* seen = visible[r] + block;
      for (int64_t d = 0; d < dim; d += 64) {  // 64 columns at a time: their accumulators fit in registers
        switch ((dim - d) / 8 < 8 ? (dim - d) / 8 : 8) {
          case 8: accumulate<8>(w, seen, values + d, dim, 0, n, out[r] + d); break;
          case 7: accumulate<7>(w, seen, values + d, dim, 0, n, out[r] + d); break;
          case 6: accumulate<6>(w, seen, values + d, dim, 0, n, out[r] + d); break;
          case 5: accumulate<5>(w, seen, values + d, dim, 0, n, out[r] + d); break;
          case 4: accumulate<4>(w, seen, values + d, dim, 0, n, out[r] + d); break;
          case 3: accumulate<3>(w, seen, values + d, dim, 0, n, out[r] + d); break;
          case 2: accumulate<2>(w, seen, values + d, dim, 0, n, out[r] + d); break;
          default: accumulate<1>(w, seen, values + d, dim, 0, n, out[r] + d); break;
        }
      }
    }
  }
  for (int64_t r = 0; r < rows_total; ++r) {
    const __m256 inverse = _mm256_set1_ps(inverse_total[r]);
    for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(out[r] + d, _mm256_mul_ps(_mm256_loadu_ps(out[r] + d), inverse));
  }
}

// One past the last key any of a batch entry's rows sees (visible [rows, keys]): the keys past it are masked for
// every row, so attention stops there instead of at the batch's longest context (a row's result is the same
// either way: masked keys never enter its sums).
int64_t visible_extent(const uint8_t* visible, int64_t rows, int64_t keys) {
  int64_t extent = 0;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = visible + i * keys;
    for (int64_t j = keys; j > extent; --j) {
      if (row[j - 1]) {
        extent = j;
        break;
      }
    }
  }
  return extent;
}

// q [batch, heads, rows, dim] contiguous; k, v: [keys, dim] blocks at batch and kv-head strides (elements);
// visible [batch, rows, keys] (bytes, 1 = the row sees the key); out [batch, rows, heads, dim] contiguous.
// Computes the units [u0, u1) of the batch * kv_heads (batch entry, kv head) pairs, unit b * kv_heads + g: the
// query heads of kv head g for every row of entry b. A unit's result does not depend on which others share the
// call, so units split between threads give the same bits (decoder_layer.cpp).
template <typename T>
void attend(const float* q, const T* k, const T* v, int64_t k_batch_stride, int64_t k_head_stride,
            int64_t v_batch_stride, int64_t v_head_stride, const uint8_t* visible, int64_t heads,
            int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim, float scale, float* out, int64_t u0,
            int64_t u1) {
  const int64_t group = heads / kv_heads, rows_total = group * rows;
  std::vector<float> scores(rows_total * ((keys + 7) / 8 * 8)), padded(8 * dim), widened(kKeyBlock * dim);
  std::vector<const float*> q_rows(rows_total);
  std::vector<const uint8_t*> mask_rows(rows_total);
  std::vector<float*> out_rows(rows_total);
  for (int64_t unit = u0; unit < u1; ++unit) {
    const int64_t b = unit / kv_heads, g = unit % kv_heads;
    const int64_t extent = visible_extent(visible + b * rows * keys, rows, keys);
    for (int64_t h = g * group, r = 0; h < (g + 1) * group; ++h) {
      for (int64_t i = 0; i < rows; ++i, ++r) {
        q_rows[r] = q + ((b * heads + h) * rows + i) * dim;
        mask_rows[r] = visible + (b * rows + i) * keys;
        out_rows[r] = out + ((b * rows + i) * heads + h) * dim;
      }
    }
    const T* k_page = k + b * k_batch_stride + g * k_head_stride;
    const T* v_page = v + b * v_batch_stride + g * v_head_stride;
    attend_rows(q_rows.data(), mask_rows.data(), out_rows.data(), rows_total, &k_page, &v_page, keys > 0 ? keys : 1,
                extent, dim, scale, scores.data(), padded.data(), widened.data());
  }
}

// attend() for one unit, batch entry b's query heads of kv head g, over a paged cache [pages, kv_heads,
// page_size, dim] at slot `slot` (cache_pages.h): q [batch, heads, rows, dim], visible [batch, rows, keys], out
// [batch, rows, heads, dim] as in attend.
template <typename T>
void attend_cache_unit(const float* q, const T* k_cache, const T* v_cache, const CachePages& pages, int64_t slot,
                       const uint8_t* visible, int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys,
                       int64_t dim, float scale, float* out, int64_t b, int64_t g) {
  const int64_t group = heads / kv_heads, rows_total = group * rows;
  std::vector<float> scores(rows_total * ((keys + 7) / 8 * 8)), padded(8 * dim), widened(kKeyBlock * dim);
  std::vector<const float*> q_rows(rows_total);
  std::vector<const uint8_t*> mask_rows(rows_total);
  std::vector<float*> out_rows(rows_total);
  for (int64_t h = g * group, r = 0; h < (g + 1) * group; ++h) {
    for (int64_t i = 0; i < rows; ++i, ++r) {
      q_rows[r] = q + ((b * heads + h) * rows + i) * dim;
      mask_rows[r] = visible + (b * rows + i) * keys;
      out_rows[r] = out + ((b * rows + i) * heads + h) * dim;
    }
  }
  const int64_t extent = visible_extent(visible + b * rows * keys, rows, keys);
  std::vector<const T*> k_pages, v_pages;
  for (int64_t p = 0; p < extent; p += pages.page_size) {
    k_pages.push_back(k_cache + dflash::cache_row(pages, kv_heads, slot, g, p, dim));
    v_pages.push_back(v_cache + dflash::cache_row(pages, kv_heads, slot, g, p, dim));
  }
  attend_rows(q_rows.data(), mask_rows.data(), out_rows.data(), rows_total, k_pages.data(), v_pages.data(),
              pages.page_size, extent, dim, scale, scores.data(), padded.data(), widened.data());
}

}  // namespace

extern "C" {

// dflash_attention on the (batch entry, kv head) units [u0, u1) only (see attend); the caller checks the shape.
void dflash_attention_units(const float* q, const void* k, const void* v, int64_t bf16, int64_t k_batch_stride,
                            int64_t k_head_stride, int64_t v_batch_stride, int64_t v_head_stride,
                            const uint8_t* visible, int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys,
                            int64_t dim, float scale, float* out, int64_t u0, int64_t u1) {
  if (bf16) {
    attend(q, static_cast<const uint16_t*>(k), static_cast<const uint16_t*>(v), k_batch_stride, k_head_stride,
           v_batch_stride, v_head_stride, visible, heads, kv_heads, rows, keys, dim, scale, out, u0, u1);
  } else {
    attend(q, static_cast<const float*>(k), static_cast<const float*>(v), k_batch_stride, k_head_stride,
           v_batch_stride, v_head_stride, visible, heads, kv_heads, rows, keys, dim, scale, out, u0, u1);
  }
}

// Unit b * kv_heads + g of attention over one layer's paged cache (float32, or bfloat16 where bf16 != 0): batch
// entry b's rows at slots[b]; the caller checks the shape and that the slots' pages hold the first `keys`
// positions (cache_reads).
void dflash_attention_cache_unit(const float* q, const void* k_cache, const void* v_cache, int64_t bf16,
                                 const CachePages* pages, const int64_t* slots, const uint8_t* visible, int64_t heads,
                                 int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim, float scale, float* out,
                                 int64_t unit) {
  const int64_t b = unit / kv_heads, g = unit % kv_heads;
  if (bf16) {
    attend_cache_unit(q, static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache), *pages,
                      slots[b], visible, heads, kv_heads, rows, keys, dim, scale, out, b, g);
  } else {
    attend_cache_unit(q, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache), *pages, slots[b],
                      visible, heads, kv_heads, rows, keys, dim, scale, out, b, g);
  }
}

// Attention over a layer's paged cache, every unit: q [batch, heads, rows, dim], slots [batch], visible [batch,
// rows, keys], out [batch, rows, heads, dim]. Returns 0; -1 for a slot or page outside the cache; -2 for a shape
// this kernel does not take (dim, heads, or pages a key block would straddle).
int dflash_attention_cache(const float* q, const void* k_cache, const void* v_cache, int64_t bf16,
                           const CachePages* pages, const int64_t* slots, const uint8_t* visible, int64_t batch,
                           int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim, float scale,
                           float* out) {
  if (dim % 8 != 0 || dim > 256 || kv_heads <= 0 || heads % kv_heads != 0) return -2;
  if (!dflash::cache_pages_fit(*pages, kKeyBlock) || keys > dflash::cache_capacity(*pages)) return -2;
  for (int64_t b = 0; b < batch; ++b) {
    if (!dflash::cache_reads(*pages, slots[b], keys)) return -1;
  }
  for (int64_t unit = 0; unit < batch * kv_heads; ++unit) {
    dflash_attention_cache_unit(q, k_cache, v_cache, bf16, pages, slots, visible, heads, kv_heads, rows, keys, dim,
                                scale, out, unit);
  }
  return 0;
}

// attend() over float32 keys and values (bf16 != 0: bfloat16 ones, k and v pointing at uint16 bit patterns),
// every unit. dim <= 256. Returns 0, or -1 for a dim this kernel does not take.
int dflash_attention(const float* q, const void* k, const void* v, int64_t bf16, int64_t k_batch_stride,
                     int64_t k_head_stride, int64_t v_batch_stride, int64_t v_head_stride, const uint8_t* visible,
                     int64_t batch, int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim,
                     float scale, float* out) {
  if (dim % 8 != 0 || dim > 256 || heads % kv_heads != 0) return -1;
  dflash_attention_units(q, k, v, bf16, k_batch_stride, k_head_stride, v_batch_stride, v_head_stride, visible, heads,
                         kv_heads, rows, keys, dim, scale, out, 0, batch * kv_heads);
  return 0;
}

}  // extern "C"
