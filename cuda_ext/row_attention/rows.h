// The target's causal attention for one query row, in an order that depends on the row alone, as the pieces both
// builds run (host.cpp: row after row on one thread; kernel.cu: a warp per row, a thread block per KV head and
// key chunk). Used by --batch-invariant: a verify block's rows, one-token rows and rows beside longer requests
// all get the same bits, because nothing in a row's arithmetic depends on the other rows of the call:
// - query i of entry b (at positions[b, i]) attends causally to its request's cached keys [0, positions + 1);
// - the keys are cut into chunks of kRowChunk positions counted from 0 (never from the batch's longest row), each
//   chunk's online softmax (top score, total, weighted values) taken key by key in position order;
// - a dot product is split over 32 lanes (lane l: dims l, l + 32, ...) and their partial sums added in a fixed
//   butterfly (common/warp_rows.h); the host build adds them the same way;
// - the chunks' states are merged in chunk order (merge_chunks); chunks past the row's end are empty and skipped.
// Both builds run without contraction and with our own exp (common/hd.h), so they give the same bits.
#pragma once

#include "../common/cache_rows.h"
#include "../common/hd.h"
#include "../common/warp_rows.h"

namespace dflash {

constexpr int64_t kRowChunk = 256;         // key positions per chunk
constexpr int64_t kRowMaxHeadDim = 256;    // a lane holds at most kRowMaxHeadDim / kLanes dims of a row's values
constexpr int kLaneDims = (int)(kRowMaxHeadDim / kLanes);

// T: float, or bfloat16 (its bits, uint16_t); the arithmetic is float32.
template <typename T>
struct RowAttentionArgs {
  const T* q;                // [batch, heads, queries, dim]
  const T* keys;             // [slots, kv_heads, capacity, dim]: one layer's cache
  const T* values;           // [slots, kv_heads, capacity, dim]
  const int64_t* slots;      // [batch]
  const int64_t* positions;  // [batch, queries]
  float* partials;           // [batch, heads, queries, chunks, 2 + dim]: each chunk's top, total and values
  float* out;                // [batch, queries, heads * dim]
  int64_t batch, heads, kv_heads, queries, dim, capacity, num_slots, chunks;
  float scale;
};


template <typename T>
DFLASH_HD bool row_slot_valid(const RowAttentionArgs<T>& a, int64_t b) {
  return a.slots[b] >= 0 && a.slots[b] < a.num_slots;
}

// The end of the keys query i of entry b sees: its position + 1, within the chunks the call covers and the cache.
template <typename T>
DFLASH_HD int64_t row_key_end(const RowAttentionArgs<T>& a, int64_t b, int64_t i) {
  int64_t end = a.positions[b * a.queries + i] + 1;
  const int64_t covered = a.chunks * kRowChunk;
  end = end < covered ? end : covered;
  end = end < a.capacity ? end : a.capacity;
  return end > 0 ? end : 0;
}

// One lane's share of dot(x, y): dims lane, lane + 32, ... in order.
template <typename T>
DFLASH_HD float lane_dot(const T* x, const T* y, int64_t dim, int lane) {
  float sum = 0.0f;
  for (int64_t d = lane; d < dim; d += kLanes) sum = sum + to_float(x[d]) * to_float(y[d]);
  return sum;
}

// A chunk's running softmax, as one lane holds it: top score, total of exp(score - top), and its dims' weighted
// values (acc[j] for dim lane + 32 j).
struct LaneSoftmax {
  float top;
  float total;  // 0: no key yet
  float acc[kLaneDims];
};

DFLASH_HD void lane_start(LaneSoftmax& s) {
  s.top = 0.0f;
  s.total = 0.0f;
  for (int j = 0; j < kLaneDims; ++j) s.acc[j] = 0.0f;
}

// One more key (its score, the same in every lane, and its value row) into the lane's state.
// (The loops run over the fixed kLaneDims with a guard, so that the CUDA build keeps acc in registers.)
template <typename T>
DFLASH_HD void lane_add(LaneSoftmax& s, float score, const T* value, int64_t dim, int lane) {
  if (s.total == 0.0f) {
    s.top = score;
    s.total = 1.0f;
    for (int j = 0; j < kLaneDims; ++j) {
      const int64_t d = lane + (int64_t)j * kLanes;
      if (d < dim) s.acc[j] = to_float(value[d]);
    }
  } else if (score > s.top) {
    const float shrink = exp_nonpositive(s.top - score);
    s.total = s.total * shrink + 1.0f;
    for (int j = 0; j < kLaneDims; ++j) {
      const int64_t d = lane + (int64_t)j * kLanes;
      if (d < dim) s.acc[j] = s.acc[j] * shrink + to_float(value[d]);
    }
    s.top = score;
  } else {
    const float weight = exp_nonpositive(score - s.top);
    s.total = s.total + weight;
    for (int j = 0; j < kLaneDims; ++j) {
      const int64_t d = lane + (int64_t)j * kLanes;
      if (d < dim) s.acc[j] = s.acc[j] + weight * to_float(value[d]);
    }
  }
}

template <typename T>
DFLASH_HD float* chunk_state(const RowAttentionArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t c) {
  return a.partials + (((b * a.heads + h) * a.queries + i) * a.chunks + c) * (2 + a.dim);
}

// The lane's dims of a chunk's state into partials (lane 0 also writes top and total).
template <typename T>
DFLASH_HD void lane_store(const RowAttentionArgs<T>& a, const LaneSoftmax& s, float* state, int lane) {
  if (lane == 0) {
    state[0] = s.top;
    state[1] = s.total;
  }
  for (int j = 0; j < kLaneDims; ++j) {
    const int64_t d = lane + (int64_t)j * kLanes;
    if (d < a.dim) state[2 + d] = s.acc[j];
  }
}

// Output dim d of row (b, h, i): the chunks' states merged in chunk order, empty chunks skipped; 0 for a row
// that sees no key.
template <typename T>
DFLASH_HD float merge_chunks(const RowAttentionArgs<T>& a, int64_t b, int64_t h, int64_t i, int64_t d) {
  float top = 0.0f, total = 0.0f, acc = 0.0f;
  for (int64_t c = 0; c < a.chunks; ++c) {
    const float* state = chunk_state(a, b, h, i, c);
    const float chunk_total = state[1];
    if (chunk_total == 0.0f) continue;
    if (total == 0.0f) {
      top = state[0];
      total = chunk_total;
      acc = state[2 + d];
    } else if (state[0] > top) {
      const float shrink = exp_nonpositive(top - state[0]);
      total = total * shrink + chunk_total;
      acc = acc * shrink + state[2 + d];
      top = state[0];
    } else {
      const float weight = exp_nonpositive(state[0] - top);
      total = total + chunk_total * weight;
      acc = acc + state[2 + d] * weight;
    }
  }
  return total > 0.0f ? acc / total : 0.0f;
}

template <typename T>
DFLASH_HD float* row_out(const RowAttentionArgs<T>& a, int64_t b, int64_t h, int64_t i) {
  return a.out + ((b * a.queries + i) * a.heads + h) * a.dim;
}

}  // namespace dflash
