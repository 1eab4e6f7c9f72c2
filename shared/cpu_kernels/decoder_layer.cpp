// A dense decoder's whole layer stack in one call, for the float32 path with bfloat16-tiled weights (on a small
// model the step is bound by per-call overhead, not arithmetic: two calls and three PyTorch ops per layer cost the
// demo target's one-token step half its time). Each layer:
//   q/k/v projection, q/k norms + rotary + cache write, attention, o projection, the residual add with the
//   post-attention norm, the gate/up projection, silu(gate) * up, the down projection, and the residual add with
//   the next norm (the following layer's input norm, or the model's final one).
// The same kernels (bf16_gemm.cpp, layer_ops.cpp, attention.cpp) on the same values in the same order as the
// per-op path, row by row (a row's result never depends on the other rows), so the same bits.
// With a worker pool (worker_pool.h) the projections are split by output tiles and attention by (batch entry, kv
// head) between its threads: each output element is still computed by the same instructions from the same
// values, so the bits do not depend on the thread count (the tests compare 1, 2 and 3 threads).
// Plain C ABI, loaded with ctypes: the structs mirror layer_step.py's ctypes structures field by field.
#include <cstdint>
#include <cstring>

#include "pooled_jobs.h"

extern "C" {

// One layer: weights as bf16_gemm tiles (qkv out (heads + 2 kv_heads) * dim, o out hidden, gate_up out
// 2 * intermediate, down out hidden), float32 norm weights (qk_norm [heads + kv_heads, dim] or null).
struct StackLayer {
  const uint16_t* qkv;
  const float* qk_norm;
  float qk_eps;
  const uint16_t* o;
  const float* post_norm;
  float post_eps;
  const uint16_t* gate_up;
  const uint16_t* down;
  const float* next_norm;
  float next_eps;
};

// What every layer shares: the model's shape, its GEMM (amx: 1 for weights in the "amx" layout, see
// bf16_gemm_amx.cpp), attention's score scale and the first layer's input norm.
struct StackShape {
  int64_t layers, hidden, heads, kv_heads, dim, intermediate, amx;
  float scale;
  const float* first_norm;
  float first_eps;
};

// One forward: batch rows of seq tokens each, attending over the first `keys` positions of their slots. cos, sin
// [batch, seq, dim]; slots [batch]; positions [batch, seq]; visible [batch, seq, keys] (1 = the row sees the
// key); k_caches, v_caches: a [pages, kv_heads, page_size, dim] cache per layer, float32 or (kv_bf16 != 0)
// bfloat16, whose slots' positions lie where `pages` says (cache_pages.h: every layer's alike); taps: per layer
// null, or where its output residual goes (rows of hidden floats, tap_stride apart).
struct StackStep {
  int64_t batch, seq, keys, kv_bf16;
  const CachePages* pages;
  const float* cos;
  const float* sin;
  const int64_t* slots;
  const int64_t* positions;
  const uint8_t* visible;
  void* const* k_caches;
  void* const* v_caches;
  float* const* taps;
  int64_t tap_stride;
};

// Buffers every layer reuses: qkv [rows, (heads + 2 kv_heads) * dim], q and attended [rows * heads * dim],
// projected [rows, hidden], gate_up [rows, 2 * intermediate], act [rows, intermediate].
struct StackScratch {
  float *qkv, *q, *attended, *projected, *gate_up, *act;
};

}  // extern "C"

using dflash::jobs::pooled_gemm;

extern "C" {

// x [batch * seq, hidden]: the embeddings in, the last residual out (updated in place); h [batch * seq, hidden]:
// the final norm's output. Returns 0; -1 for a slot, position or page outside the cache (nothing written); -2 for
// a shape attention refuses (nothing written).
// pool: a dflash_pool_create pool, or null for this thread alone.
int dflash_decoder_stack(const StackLayer* layers, const StackShape* shape, const StackStep* step,
                         const StackScratch* scratch, float* x, float* h, void* pool_handle) {
  dflash::WorkerPool* pool = static_cast<dflash::WorkerPool*>(pool_handle);
  const int64_t heads = shape->heads, kv_heads = shape->kv_heads, dim = shape->dim, hidden = shape->hidden;
  if (dim % 8 != 0 || dim > 256 || kv_heads <= 0 || heads % kv_heads != 0) return -2;
  const CachePages& pages = *step->pages;
  for (int64_t b = 0; b < step->batch; ++b) {  // checked before layer 0 writes: every layer writes the same places
    for (int64_t t = 0; t < step->seq; ++t) {
      if (!dflash::cache_holds(pages, step->slots[b], step->positions[b * step->seq + t])) return -1;
    }
  }
  // (after the range check: keys past the cache mean a position past it)
  if (step->keys > dflash::cache_capacity(pages) || !dflash::cache_pages_fit(pages, dflash::kKeyBlock)) return -2;
  for (int64_t b = 0; b < step->batch; ++b) {
    if (!dflash::cache_reads(pages, step->slots[b], step->keys)) return -1;
  }
  const int64_t rows = step->batch * step->seq, width = (heads + 2 * kv_heads) * dim;
  dflash_rms_norm(x, rows, hidden, shape->first_norm, shape->first_eps, h);
  for (int64_t index = 0; index < shape->layers; ++index) {
    const StackLayer& layer = layers[index];
    char* k_cache = static_cast<char*>(step->k_caches[index]);
    char* v_cache = static_cast<char*>(step->v_caches[index]);
    pooled_gemm(pool, shape->amx, h, rows, hidden, layer.qkv, width, scratch->qkv);
    dflash_qk_rotary_cache(scratch->qkv, step->batch, step->seq, heads, kv_heads, dim, layer.qk_norm, layer.qk_eps,
                           step->cos, step->sin, step->slots, step->positions, k_cache, v_cache, step->kv_bf16,
                           step->pages, scratch->q);
    dflash::jobs::CacheAttention attention{scratch->q, k_cache, v_cache, step->kv_bf16, step->pages, step->slots,
                                           step->visible, heads, kv_heads, dim, step->seq, step->keys, shape->scale,
                                           scratch->attended};
    dflash::jobs::pooled_cache_attention(pool, step->batch, &attention);
    pooled_gemm(pool, shape->amx, scratch->attended, rows, heads * dim, layer.o, hidden, scratch->projected);
    dflash_add_rms_norm(x, scratch->projected, rows, hidden, layer.post_norm, layer.post_eps, x, h);
    pooled_gemm(pool, shape->amx, h, rows, hidden, layer.gate_up, 2 * shape->intermediate, scratch->gate_up);
    dflash_silu_mul(scratch->gate_up, rows, shape->intermediate, scratch->act);
    pooled_gemm(pool, shape->amx, scratch->act, rows, shape->intermediate, layer.down, hidden, scratch->projected);
    dflash_add_rms_norm(x, scratch->projected, rows, hidden, layer.next_norm, layer.next_eps, x, h);
    if (step->taps[index] != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(step->taps[index] + r * step->tap_stride, x + r * hidden, hidden * sizeof(float));
      }
    }
  }
  return 0;
}

// y [M, N] = x [M, K] @ the tiled weight, as dflash_bf16_gemm (dflash_amx_gemm where amx), shared between a
// pool's threads (the lm_head).
void dflash_bf16_gemm_pooled(void* pool, int64_t amx, const float* x, int64_t M, int64_t K, const uint16_t* w,
                             int64_t N, float* y) {
  pooled_gemm(static_cast<dflash::WorkerPool*>(pool), amx, x, M, K, w, N, y);
}

}  // extern "C"
