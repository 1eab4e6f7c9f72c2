// The building blocks of the one-call forwards (decoder_layer.cpp for the target, draft_block.cpp for the
// drafter): the elementary kernels' C entry points, and the two jobs a worker pool shares between its threads, a
// GEMM split by output tiles and attention over a slot cache split by (batch entry, kv head). Which thread runs a
// part never changes its result, so the bits are those of one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cache_pages.h"
#include "worker_pool.h"

extern "C" {

void dflash_bf16_gemm_tiles(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y, int64_t t0,
                            int64_t t1);
int64_t dflash_amx_padded_k(int64_t K);
void dflash_amx_round_rows(const float* x, int64_t M, int64_t K, uint16_t* out);
void dflash_amx_gemm_rounded_tiles(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y,
                                   int64_t t0, int64_t t1);
void dflash_attention_units(const float* q, const void* k, const void* v, int64_t bf16, int64_t k_batch_stride,
                            int64_t k_head_stride, int64_t v_batch_stride, int64_t v_head_stride,
                            const uint8_t* visible, int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys,
                            int64_t dim, float scale, float* out, int64_t u0, int64_t u1);
void dflash_rms_norm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* out);
void dflash_add_rms_norm(const float* x, const float* delta, int64_t rows, int64_t n, const float* weight,
                         float eps, float* summed, float* out);
int dflash_qk_rotary_cache(const float* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim,
                           const float* norm_weight, float eps, const float* cos, const float* sin,
                           const int64_t* slots, const int64_t* positions, void* k_cache, void* v_cache, int64_t bf16,
                           const CachePages* pages, float* q);
void dflash_attention_cache_unit(const float* q, const void* k_cache, const void* v_cache, int64_t bf16,
                                 const CachePages* pages, const int64_t* slots, const uint8_t* visible, int64_t heads,
                                 int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim, float scale, float* out,
                                 int64_t unit);
void dflash_silu_mul(const float* gate_up, int64_t rows, int64_t intermediate, float* act);

}  // extern "C"

namespace dflash::jobs {

constexpr int64_t kTile = 16;           // output columns per weight tile (bf16_gemm.cpp)
constexpr int64_t kPartsPerThread = 4;  // parts per thread of a pooled GEMM: a late helper still takes a share

// The parts [0, parts) of a job, on the pool's threads (pool null: on this thread, in order).
inline void run_parts(WorkerPool* pool, int64_t parts, WorkerPool::Part part, void* context) {
  if (pool == nullptr) {
    for (int64_t p = 0; p < parts; ++p) part(context, p);
  } else {
    pool->run(parts, part, context);
  }
}

struct GemmJob {
  const uint16_t* xb;  // x rounded to bfloat16 once for every part: weights in the "amx" layout (bf16_gemm_amx.cpp);
                       // null: bf16_gemm.cpp's float32 product
  const float* x;
  int64_t M, K;
  const uint16_t* w;
  int64_t N;
  float* y;
  int64_t tiles, parts;
};

inline void gemm_part(void* context, int64_t part) {
  const GemmJob& job = *static_cast<const GemmJob*>(context);
  const int64_t t0 = part * job.tiles / job.parts, t1 = (part + 1) * job.tiles / job.parts;
  if (job.xb != nullptr) {
    dflash_amx_gemm_rounded_tiles(job.xb, job.M, job.K, job.w, job.N, job.y, t0, t1);
  } else {
    dflash_bf16_gemm_tiles(job.x, job.M, job.K, job.w, job.N, job.y, t0, t1);
  }
}

// y [M, N] = x [M, K] @ w (bf16_gemm.cpp's tiles, or bf16_gemm_amx.cpp's where amx), the output tiles shared
// between the pool's threads (pool null: this thread alone).
inline void pooled_gemm(WorkerPool* pool, int64_t amx, const float* x, int64_t M, int64_t K, const uint16_t* w,
                        int64_t N, float* y) {
  if (M == 0) return;
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int64_t threads = pool == nullptr ? 1 : pool->threads();
  const int64_t parts = threads == 1 ? 1 : std::min(tiles, kPartsPerThread * threads);
  const uint16_t* xb = nullptr;
  if (amx) {  // (on the caller's buffer: the parts only read it, and the call returns when every part is done)
    thread_local std::vector<uint16_t> rounded;
    rounded.resize(static_cast<size_t>(M * dflash_amx_padded_k(K)));
    dflash_amx_round_rows(x, M, K, rounded.data());
    xb = rounded.data();
  }
  GemmJob job{xb, x, M, K, w, N, y, tiles, parts};
  run_parts(pool, parts, gemm_part, &job);
}

// Attention of batch entries of seq rows each, read straight from one layer's cache [pages, kv_heads, page_size,
// dim] (float32, or bfloat16 where kv_bf16; `pages` says where each slot's positions lie): q [batch, heads, seq,
// dim]; slots [batch]; visible [batch, seq, keys] (1 = the row sees the key); attended [batch, seq, heads * dim].
// The caller checks that the slots' pages hold the first `keys` positions.
struct CacheAttention {
  const float* q;
  const char* k_cache;
  const char* v_cache;
  int64_t kv_bf16;
  const CachePages* pages;
  const int64_t* slots;
  const uint8_t* visible;
  int64_t heads, kv_heads, dim, seq, keys;
  float scale;
  float* attended;
};

// Unit b * kv_heads + g: batch entry b's query heads of kv head g.
inline void cache_attention_part(void* context, int64_t unit) {
  const CacheAttention& job = *static_cast<const CacheAttention*>(context);
  dflash_attention_cache_unit(job.q, job.k_cache, job.v_cache, job.kv_bf16, job.pages, job.slots, job.visible,
                              job.heads, job.kv_heads, job.seq, job.keys, job.dim, job.scale, job.attended, unit);
}

inline void pooled_cache_attention(WorkerPool* pool, int64_t batch, CacheAttention* job) {
  run_parts(pool, batch * job->kv_heads, cache_attention_part, job);
}

}  // namespace dflash::jobs
