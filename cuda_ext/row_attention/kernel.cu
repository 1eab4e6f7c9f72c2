// The row attention kernels (rows.h says what a row computes): chunk_states, a thread block per (batch entry, KV
// head, key chunk) and a warp per query row of that head's group (group heads x queries), each warp taking its
// row's keys of the chunk in position order, the lanes splitting every dot product and adding their parts in
// common/warp_rows.h's butterfly; then merge_states, a thread block per row and a thread per dim, merging the row's chunk
// states in chunk order.
#include <cuda_runtime.h>

#include "../common/launch.cuh"
#include "rows.h"

namespace {

constexpr int kWarps = 4;          // query rows per thread block of chunk_states
constexpr int kMergeThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kWarps * dflash::kLanes) chunk_states(dflash::RowAttentionArgs<T> a) {
  const int lane = threadIdx.x % dflash::kLanes;
  const int64_t b = blockIdx.x / a.kv_heads, g = blockIdx.x % a.kv_heads, c = blockIdx.y;
  const int64_t group = a.heads / a.kv_heads;
  const int64_t r = (int64_t)blockIdx.z * kWarps + threadIdx.x / dflash::kLanes;
  if (r >= group * a.queries || !dflash::row_slot_valid(a, b)) return;
  const int64_t h = g * group + r / a.queries, i = r % a.queries;
  const int64_t begin = c * dflash::kRowChunk, end = dflash::row_key_end(a, b, i);
  const int64_t stop = begin + dflash::kRowChunk < end ? begin + dflash::kRowChunk : end;
  const T* query = dflash::query_row(a, b, h, i);
  const int64_t base = dflash::cache_offset(a, b, g);
  dflash::LaneSoftmax state;
  dflash::lane_start(state);
  for (int64_t j = begin; j < stop; ++j) {
    const float score = dflash::warp_butterfly_sum(dflash::lane_dot(query, a.keys + base + j * a.dim, a.dim, lane));
    dflash::lane_add(state, score * a.scale, a.values + base + j * a.dim, a.dim, lane);
  }
  dflash::lane_store(a, state, dflash::chunk_state(a, b, h, i, c), lane);
}

template <typename T>
__global__ void __launch_bounds__(kMergeThreads) merge_states(dflash::RowAttentionArgs<T> a) {
  const int64_t row = blockIdx.x;
  const int64_t b = row / (a.heads * a.queries), h = row / a.queries % a.heads, i = row % a.queries;
  float* out = dflash::row_out(a, b, h, i);
  const bool valid = dflash::row_slot_valid(a, b);
  for (int64_t d = threadIdx.x; d < a.dim; d += kMergeThreads) {
    out[d] = valid ? dflash::merge_chunks(a, b, h, i, d) : 0.0f;
  }
}

template <typename T>
int launch(const dflash::RowAttentionArgs<T>& a, cudaStream_t stream) {
  const int64_t rows = a.heads / a.kv_heads * a.queries;
  const dim3 grid((unsigned)(a.batch * a.kv_heads), (unsigned)a.chunks, (unsigned)((rows + kWarps - 1) / kWarps));
  chunk_states<T><<<grid, kWarps * dflash::kLanes, 0, stream>>>(a);
  const int error = dflash::launch_status();
  if (error) return error;
  merge_states<T><<<(unsigned)(a.batch * a.heads * a.queries), kMergeThreads, 0, stream>>>(a);
  return dflash::launch_status();
}

}  // namespace

extern "C" int dflash_row_attention_probe() {
  const int f32 = dflash::probe(chunk_states<float>);
  return f32 != 0 ? f32 : dflash::probe(merge_states<uint16_t>);
}

// q, keys, values: float32, or bfloat16 (their bits) when bf16 is 1; partials and out float32.
extern "C" int dflash_row_attention_cuda(const void* q, const void* keys, const void* values, const int64_t* slots,
                                         const int64_t* positions, float* partials, float* out, int64_t batch,
                                         int64_t heads, int64_t kv_heads, int64_t queries, int64_t dim,
                                         int64_t capacity, int64_t num_slots, int64_t chunks, int64_t bf16,
                                         float scale, void* stream) {
  if (batch < 0 || queries < 0 || kv_heads < 1 || heads < 1 || heads % kv_heads != 0 || dim < 1
      || dim > dflash::kRowMaxHeadDim || chunks < 1 || chunks > 65535 || batch * kv_heads > dflash::kMaxGrid
      || (heads / kv_heads * queries + kWarps - 1) / kWarps > 65535 || batch * heads * queries > dflash::kMaxGrid) {
    return dflash::kBadArgument;
  }
  if (batch == 0 || queries == 0) return dflash::kOk;
  if (bf16) {
    const dflash::RowAttentionArgs<uint16_t> a{(const uint16_t*)q, (const uint16_t*)keys, (const uint16_t*)values,
                                               slots, positions, partials, out, batch, heads, kv_heads, queries, dim,
                                               capacity, num_slots, chunks, scale};
    return launch(a, (cudaStream_t)stream);
  }
  const dflash::RowAttentionArgs<float> a{(const float*)q, (const float*)keys, (const float*)values, slots, positions,
                                          partials, out, batch, heads, kv_heads, queries, dim, capacity, num_slots,
                                          chunks, scale};
  return launch(a, (cudaStream_t)stream);
}
