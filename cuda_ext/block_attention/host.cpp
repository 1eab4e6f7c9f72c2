// The host build of the block attention kernel: every (entry, head, query) row on this thread, reading its keys
// straight from the cache, through the same pieces as kernel.cu.
#include <vector>

#include "rows.h"

namespace {

template <typename T>
int attend_all(const dflash::AttentionArgs<T>& a) {
  const int64_t batch = a.batch, heads = a.heads, kv_heads = a.kv_heads, queries = a.queries, dim = a.dim;
  const T *keys = a.keys, *values = a.values;
  const float scale = a.scale;
  std::vector<float> acc(dim);
  const int64_t group = heads / kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    if (!dflash::attention_row_valid(a, b)) {  // a slot or length outside the cache: zeros, as the CUDA kernel
      for (int64_t e = 0; e < queries * heads * dim; ++e) a.out[b * queries * heads * dim + e] = 0.0f;
      continue;
    }
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = dflash::cache_offset(a, b, h / group);
      for (int64_t i = 0; i < queries; ++i) {
        int64_t lo, hi;
        dflash::key_range(a, b, i, &lo, &hi);
        const T* query = dflash::query_row(a, b, h, i);
        dflash::OnlineSoftmax state{0.0f, 0.0f};
        for (int64_t j = lo; j < hi; ++j) {
          const float score = dflash::dot(query, keys + base + j * dim, dim) * scale;
          dflash::online_add(state, acc.data(), score, values + base + j * dim, dim);
        }
        dflash::online_finish(state, acc.data(), dflash::out_row(a, b, h, i), dim);
      }
    }
  }
  return dflash::kOk;
}

}  // namespace

// q, keys, values: float32, or bfloat16 (their bits) when bf16 is 1. out: float32.
extern "C" int dflash_block_attention_host(const void* q, const void* keys, const void* values,
                                           const int64_t* slots, const int64_t* ends, const int64_t* positions,
                                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t queries,
                                           int64_t dim, int64_t capacity, int64_t num_slots, int64_t window,
                                           int64_t causal, int64_t bf16, float scale, float* out) {
  if (batch < 0 || kv_heads < 1 || heads < 1 || heads % kv_heads != 0 || dim < 1 || dim > dflash::kMaxHeadDim) {
    return dflash::kBadArgument;
  }
  if (bf16) {
    const dflash::AttentionArgs<uint16_t> a{(const uint16_t*)q, (const uint16_t*)keys, (const uint16_t*)values, slots,
                                            ends, positions, batch, heads, kv_heads, queries, dim, capacity,
                                            num_slots, window, causal, scale, out};
    return attend_all(a);
  }
  const dflash::AttentionArgs<float> a{(const float*)q, (const float*)keys, (const float*)values, slots, ends,
                                       positions, batch, heads, kv_heads, queries, dim, capacity, num_slots, window,
                                       causal, scale, out};
  return attend_all(a);
}
