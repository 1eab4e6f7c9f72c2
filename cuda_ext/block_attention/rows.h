// The drafter's block attention for one query row, as the pieces both builds run (host.cpp: row after row on one
// thread; kernel.cu: a thread per row, keys and values staged through shared memory a tile at a time).
//
// Query row i of batch entry b (a block token at positions[b, i]) attends to the cached keys of its request's
// slot at positions [lo, hi): everything before ends[b] (the cached context and the whole block: non-causal
// within the block), cut to the causal prefix for causal layers and to the sliding window where the layer has
// one. Heads share KV heads in groups (GQA). Only a row's own keys are read: ragged context lengths cost no
// padding work. The softmax is computed online, key by key in position order, so a row's result depends on its
// own query and keys only. The PyTorch reference (reference.py: shared.attention.cached_attention over a mask)
// rounds differently: the two agree to float32 accuracy, not bit for bit.
#pragma once

#include "../common/cache_rows.h"
#include "../common/hd.h"

namespace dflash {

// T: the element type of q and the cache, float or bfloat16 (its bits, uint16_t); the arithmetic is float32.
template <typename T>
struct AttentionArgs {
  const T* q;              // [batch, heads, queries, dim]
  const T* keys;           // [slots, kv_heads, capacity, dim]: one layer's cache
  const T* values;         // [slots, kv_heads, capacity, dim]
  const int64_t* slots;    // [batch]
  const int64_t* ends;     // [batch]: keys at positions < ends[b] are the block's and its context's
  const int64_t* positions;  // [batch, queries]: each query's position
  int64_t batch, heads, kv_heads, queries, dim, capacity, num_slots, window, causal;  // window 0: none
  float scale;
  float* out;              // [batch, queries, heads * dim]
};

constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kAttentionMaxRows = 256;  // the CUDA kernel's rows per block: group heads x queries (op.py falls back above)


template <typename T>
DFLASH_HD bool attention_row_valid(const AttentionArgs<T>& a, int64_t b) {
  if (a.slots[b] < 0 || a.slots[b] >= a.num_slots) return false;
  return a.ends[b] >= 0 && a.ends[b] <= a.capacity;
}

// The key positions [*lo, *hi) that query i of entry b sees.
template <typename T>
DFLASH_HD void key_range(const AttentionArgs<T>& a, int64_t b, int64_t i, int64_t* lo, int64_t* hi) {
  const int64_t position = a.positions[b * a.queries + i];
  int64_t begin = 0, end = a.ends[b];
  if (a.causal && position + 1 < end) end = position + 1;
  if (a.window > 0) {
    if (position - a.window + 1 > begin) begin = position - a.window + 1;
    if (position + a.window < end) end = position + a.window;
  }
  *lo = begin;
  *hi = end > begin ? end : begin;
}

// The running softmax of one row: the largest score so far and the sum of exp(score - top); acc holds the
// values weighted alike.
struct OnlineSoftmax {
  float top;
  float total;  // 0: no key yet
};

template <typename T>
DFLASH_HD float dot(const T* x, const T* y, int64_t dim) {
  float sum = 0.0f;
  for (int64_t d = 0; d < dim; ++d) sum += to_float(x[d]) * to_float(y[d]);
  return sum;
}

// One more key (its score and value row) into the row's state.
template <typename T>
DFLASH_HD void online_add(OnlineSoftmax& s, float* acc, float score, const T* value, int64_t dim) {
  if (s.total == 0.0f) {
    s.top = score;
    s.total = 1.0f;
    for (int64_t d = 0; d < dim; ++d) acc[d] = to_float(value[d]);
  } else if (score > s.top) {
    const float shrink = exp_nonpositive(s.top - score);
    s.total = s.total * shrink + 1.0f;
    for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] * shrink + to_float(value[d]);
    s.top = score;
  } else {
    const float weight = exp_nonpositive(score - s.top);
    s.total = s.total + weight;
    for (int64_t d = 0; d < dim; ++d) acc[d] = acc[d] + weight * to_float(value[d]);
  }
}

// The row's output: acc / total (zeros for a row that sees no key).
DFLASH_HD void online_finish(const OnlineSoftmax& s, const float* acc, float* out, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = s.total > 0.0f ? acc[d] / s.total : 0.0f;
}

template <typename T>
DFLASH_HD float* out_row(const AttentionArgs<T>& a, int64_t b, int64_t h, int64_t i) {
  return a.out + ((b * a.queries + i) * a.heads + h) * a.dim;
}

}  // namespace dflash
