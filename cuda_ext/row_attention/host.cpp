// The host build of the row attention: every (entry, head, query) row on this thread, chunk after chunk, the 32
// lanes of kernel.cu's warp run one after another, through the same pieces (rows.h), so the same bits.
#include <vector>

#include "rows.h"

namespace {

template <typename T>
int attend_rows(const dflash::RowAttentionArgs<T>& a) {
  const int64_t group = a.heads / a.kv_heads;
  std::vector<dflash::LaneSoftmax> lanes(dflash::kLanes);
  float partial[dflash::kLanes];
  for (int64_t b = 0; b < a.batch; ++b) {
    if (!dflash::row_slot_valid(a, b)) return dflash::kBadArgument;
    for (int64_t h = 0; h < a.heads; ++h) {
      const int64_t base = dflash::cache_offset(a, b, h / group);
      for (int64_t i = 0; i < a.queries; ++i) {
        const T* query = dflash::query_row(a, b, h, i);
        const int64_t end = dflash::row_key_end(a, b, i);
        for (int64_t c = 0; c < a.chunks; ++c) {
          const int64_t begin = c * dflash::kRowChunk;
          const int64_t stop = begin + dflash::kRowChunk < end ? begin + dflash::kRowChunk : end;
          for (int lane = 0; lane < dflash::kLanes; ++lane) dflash::lane_start(lanes[lane]);
          for (int64_t j = begin; j < stop; ++j) {
            for (int lane = 0; lane < dflash::kLanes; ++lane) {
              partial[lane] = dflash::lane_dot(query, a.keys + base + j * a.dim, a.dim, lane);
            }
            const float score = dflash::butterfly_sum(partial) * a.scale;
            for (int lane = 0; lane < dflash::kLanes; ++lane) {
              dflash::lane_add(lanes[lane], score, a.values + base + j * a.dim, a.dim, lane);
            }
          }
          float* state = dflash::chunk_state(a, b, h, i, c);
          for (int lane = 0; lane < dflash::kLanes; ++lane) dflash::lane_store(a, lanes[lane], state, lane);
        }
        float* out = dflash::row_out(a, b, h, i);
        for (int64_t d = 0; d < a.dim; ++d) out[d] = dflash::merge_chunks(a, b, h, i, d);
      }
    }
  }
  return dflash::kOk;
}

}  // namespace

// q, keys, values: float32, or bfloat16 (their bits) when bf16 is 1; partials and out float32. A slot outside the
// cache is refused (-1) before anything is written.
extern "C" int dflash_row_attention_host(const void* q, const void* keys, const void* values, const int64_t* slots,
                                         const int64_t* positions, float* partials, float* out, int64_t batch,
                                         int64_t heads, int64_t kv_heads, int64_t queries, int64_t dim,
                                         int64_t capacity, int64_t num_slots, int64_t chunks, int64_t bf16,
                                         float scale) {
  if (batch < 0 || queries < 0 || kv_heads < 1 || heads < 1 || heads % kv_heads != 0 || dim < 1
      || dim > dflash::kRowMaxHeadDim || chunks < 1) {
    return dflash::kBadArgument;
  }
  for (int64_t b = 0; b < batch; ++b) {
    if (slots[b] < 0 || slots[b] >= num_slots) return dflash::kBadArgument;
  }
  if (bf16) {
    const dflash::RowAttentionArgs<uint16_t> a{(const uint16_t*)q, (const uint16_t*)keys, (const uint16_t*)values,
                                               slots, positions, partials, out, batch, heads, kv_heads, queries, dim,
                                               capacity, num_slots, chunks, scale};
    return attend_rows(a);
  }
  const dflash::RowAttentionArgs<float> a{(const float*)q, (const float*)keys, (const float*)values, slots, positions,
                                          partials, out, batch, heads, kv_heads, queries, dim, capacity, num_slots,
                                          chunks, scale};
  return attend_rows(a);
}
