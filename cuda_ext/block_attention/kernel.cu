// The block attention kernel: a thread block per (batch entry, KV head), a thread per query row of that head's
// group (group heads x block queries). The rows' key ranges are read tile by tile into shared memory, each tile
// once for all rows; each thread then runs rows.h's online softmax over the tile's keys in its own range, in
// position order, as the host build does. No padding work: a tile spans only the keys some row sees.
#include <cuda_runtime.h>

#include "../common/launch.cuh"
#include "rows.h"

namespace {

constexpr int64_t kTileKeys = 16;
constexpr int kMaxRows = dflash::kAttentionMaxRows;

template <typename T>
__global__ void block_attention_kernel(dflash::AttentionArgs<T> a) {
  extern __shared__ unsigned char tile_bytes[];
  T* tile = reinterpret_cast<T*>(tile_bytes);  // [2, kTileKeys, dim]: keys then values
  __shared__ int64_t span[2];
  const int64_t b = blockIdx.x / a.kv_heads, g = blockIdx.x % a.kv_heads;
  const int64_t group = a.heads / a.kv_heads;
  const int64_t row = threadIdx.x, rows = group * a.queries;
  const int64_t h = g * group + row / a.queries, i = row % a.queries;
  if (!dflash::attention_row_valid(a, b)) {  // a slot or length outside the cache: zeros, no key is read
    for (int64_t e = threadIdx.x; e < rows * a.dim; e += blockDim.x) {
      dflash::out_row(a, b, g * group + e / a.dim / a.queries, e / a.dim % a.queries)[e % a.dim] = 0.0f;
    }
    return;
  }
  int64_t lo = 0, hi = 0;
  if (row < rows) dflash::key_range(a, b, i, &lo, &hi);
  if (threadIdx.x == 0) {  // the union of the rows' ranges
    int64_t first = a.capacity, last = 0;
    for (int64_t r = 0; r < a.queries; ++r) {
      int64_t l, e;
      dflash::key_range(a, b, r, &l, &e);
      if (l < e) {
        first = l < first ? l : first;
        last = e > last ? e : last;
      }
    }
    span[0] = first;
    span[1] = last;
  }
  __syncthreads();
  const int64_t base = dflash::cache_offset(a, b, g);
  float acc[dflash::kMaxHeadDim];
  dflash::OnlineSoftmax state{0.0f, 0.0f};
  const T* query = row < rows ? dflash::query_row(a, b, h, i) : nullptr;
  for (int64_t start = span[0]; start < span[1]; start += kTileKeys) {
    const int64_t count = span[1] - start < kTileKeys ? span[1] - start : kTileKeys;
    for (int64_t e = threadIdx.x; e < count * a.dim; e += blockDim.x) {
      tile[e] = a.keys[base + start * a.dim + e];
      tile[kTileKeys * a.dim + e] = a.values[base + start * a.dim + e];
    }
    __syncthreads();
    if (row < rows) {
      for (int64_t j = 0; j < count; ++j) {
        const int64_t position = start + j;
        if (position < lo || position >= hi) continue;
        const float score = dflash::dot(query, tile + j * a.dim, a.dim) * a.scale;
        dflash::online_add(state, acc, score, tile + (kTileKeys + j) * a.dim, a.dim);
      }
    }
    __syncthreads();
  }
  if (row < rows) dflash::online_finish(state, acc, dflash::out_row(a, b, h, i), a.dim);
}

template <typename T>
int launch(const dflash::AttentionArgs<T>& a, cudaStream_t stream) {
  const int threads = (int)(((a.heads / a.kv_heads) * a.queries + 31) / 32 * 32);
  const size_t shared_bytes = 2 * kTileKeys * a.dim * sizeof(T);
  block_attention_kernel<T><<<(unsigned)(a.batch * a.kv_heads), threads, shared_bytes, stream>>>(a);
  return dflash::launch_status();
}

}  // namespace

extern "C" int dflash_block_attention_probe() {
  const int f32 = dflash::probe(block_attention_kernel<float>);
  return f32 != 0 ? f32 : dflash::probe(block_attention_kernel<uint16_t>);
}

// q, keys, values: float32, or bfloat16 (their bits) when bf16 is 1. out: float32.
extern "C" int dflash_block_attention_cuda(const void* q, const void* keys, const void* values,
                                           const int64_t* slots, const int64_t* ends, const int64_t* positions,
                                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t queries,
                                           int64_t dim, int64_t capacity, int64_t num_slots, int64_t window,
                                           int64_t causal, int64_t bf16, float scale, float* out, void* stream) {
  if (batch < 0 || kv_heads < 1 || heads < 1 || heads % kv_heads != 0 || dim < 1 || dim > dflash::kMaxHeadDim
      || (heads / kv_heads) * queries > kMaxRows || batch * kv_heads > dflash::kMaxGrid) {
    return dflash::kBadArgument;
  }
  if (batch == 0 || queries == 0) return dflash::kOk;
  if (bf16) {
    const dflash::AttentionArgs<uint16_t> a{(const uint16_t*)q, (const uint16_t*)keys, (const uint16_t*)values, slots,
                                            ends, positions, batch, heads, kv_heads, queries, dim, capacity,
                                            num_slots, window, causal, scale, out};
    return launch(a, (cudaStream_t)stream);
  }
  const dflash::AttentionArgs<float> a{(const float*)q, (const float*)keys, (const float*)values, slots, ends,
                                       positions, batch, heads, kv_heads, queries, dim, capacity, num_slots, window,
                                       causal, scale, out};
  return launch(a, (cudaStream_t)stream);
}
