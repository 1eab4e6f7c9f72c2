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
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "worker_pool.h"

extern "C" {

void dflash_bf16_gemm_tiles(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y, int64_t t0,
                            int64_t t1);
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
                           int64_t num_slots, int64_t capacity, float* q);
void dflash_silu_mul(const float* gate_up, int64_t rows, int64_t intermediate, float* act);

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

// What every layer shares: the model's shape, attention's score scale and the first layer's input norm.
struct StackShape {
  int64_t layers, hidden, heads, kv_heads, dim, intermediate;
  float scale;
  const float* first_norm;
  float first_eps;
};

// One forward: batch rows of seq tokens each, attending over the first `keys` positions of their slots. cos, sin
// [batch, seq, dim]; slots [batch]; positions [batch, seq]; visible [batch, seq, keys] (1 = the row sees the
// key); k_caches, v_caches: a [num_slots, kv_heads, capacity, dim] cache per layer, float32 or (kv_bf16 != 0)
// bfloat16; taps: per layer null, or where its output residual goes (rows of hidden floats, tap_stride apart).
struct StackStep {
  int64_t batch, seq, keys, num_slots, capacity, kv_bf16;
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

namespace {

constexpr int64_t kTile = 16;          // output columns per weight tile (bf16_gemm.cpp)
constexpr int64_t kPartsPerThread = 4;  // parts per thread of a pooled GEMM: a late helper still takes a share

// The parts [0, parts) of a job, on the pool's threads (pool null: on this thread, in order).
void run_parts(dflash::WorkerPool* pool, int64_t parts, dflash::WorkerPool::Part part, void* context) {
  if (pool == nullptr) {
    for (int64_t p = 0; p < parts; ++p) part(context, p);
  } else {
    pool->run(parts, part, context);
  }
}

struct GemmJob {
  const float* x;
  int64_t M, K;
  const uint16_t* w;
  int64_t N;
  float* y;
  int64_t tiles, parts;
};

void gemm_part(void* context, int64_t part) {
  const GemmJob& job = *static_cast<const GemmJob*>(context);
  dflash_bf16_gemm_tiles(job.x, job.M, job.K, job.w, job.N, job.y, part * job.tiles / job.parts,
                         (part + 1) * job.tiles / job.parts);
}

// dflash_bf16_gemm's product, its output tiles shared between the pool's threads (pool null: this thread alone).
void pooled_gemm(dflash::WorkerPool* pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                 float* y) {
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int64_t threads = pool == nullptr ? 1 : pool->threads();
  const int64_t parts = threads == 1 ? 1 : std::min(tiles, kPartsPerThread * threads);
  GemmJob job{x, M, K, w, N, y, tiles, parts};
  run_parts(pool, parts, gemm_part, &job);
}

// Attention of every row of a forward: unit b * kv_heads + g is batch entry b's query heads of kv head g, over
// its own slot's keys, read straight from the cache.
struct AttentionJob {
  const StackShape* shape;
  const StackStep* step;
  const float* q;
  const char* k_cache;
  const char* v_cache;
  float* attended;
};

void attention_part(void* context, int64_t unit) {
  const AttentionJob& job = *static_cast<const AttentionJob*>(context);
  const StackShape& shape = *job.shape;
  const StackStep& step = *job.step;
  const int64_t heads = shape.heads, kv_heads = shape.kv_heads, dim = shape.dim, seq = step.seq;
  const int64_t b = unit / kv_heads, g = unit % kv_heads;
  const int64_t slot_stride = kv_heads * step.capacity * dim, head_stride = step.capacity * dim;
  const int64_t offset = step.slots[b] * slot_stride * (step.kv_bf16 ? 2 : 4);  // bytes
  dflash_attention_units(job.q + b * heads * seq * dim, job.k_cache + offset, job.v_cache + offset, step.kv_bf16,
                         slot_stride, head_stride, slot_stride, head_stride, step.visible + b * seq * step.keys,
                         heads, kv_heads, seq, step.keys, dim, shape.scale, job.attended + b * seq * heads * dim, g,
                         g + 1);
}

}  // namespace

extern "C" {

// x [batch * seq, hidden]: the embeddings in, the last residual out (updated in place); h [batch * seq, hidden]:
// the final norm's output. Returns 0; -1 for a slot or position outside the cache (nothing written); -2 for a
// shape attention refuses (nothing written).
// pool: a dflash_pool_create pool, or null for this thread alone.
int dflash_decoder_stack(const StackLayer* layers, const StackShape* shape, const StackStep* step,
                         const StackScratch* scratch, float* x, float* h, void* pool_handle) {
  dflash::WorkerPool* pool = static_cast<dflash::WorkerPool*>(pool_handle);
  const int64_t heads = shape->heads, kv_heads = shape->kv_heads, dim = shape->dim, hidden = shape->hidden;
  if (dim % 8 != 0 || dim > 256 || kv_heads <= 0 || heads % kv_heads != 0) return -2;
  for (int64_t b = 0; b < step->batch; ++b) {  // checked before layer 0 writes: every layer writes the same places
    if (step->slots[b] < 0 || step->slots[b] >= step->num_slots) return -1;
    for (int64_t t = 0; t < step->seq; ++t) {
      const int64_t position = step->positions[b * step->seq + t];
      if (position < 0 || position >= step->capacity) return -1;
    }
  }
  if (step->keys > step->capacity) return -2;  // (after the range check: keys past the cache mean a position past it)
  const int64_t rows = step->batch * step->seq, width = (heads + 2 * kv_heads) * dim;
  dflash_rms_norm(x, rows, hidden, shape->first_norm, shape->first_eps, h);
  for (int64_t index = 0; index < shape->layers; ++index) {
    const StackLayer& layer = layers[index];
    char* k_cache = static_cast<char*>(step->k_caches[index]);
    char* v_cache = static_cast<char*>(step->v_caches[index]);
    pooled_gemm(pool, h, rows, hidden, layer.qkv, width, scratch->qkv);
    dflash_qk_rotary_cache(scratch->qkv, step->batch, step->seq, heads, kv_heads, dim, layer.qk_norm, layer.qk_eps,
                           step->cos, step->sin, step->slots, step->positions, k_cache, v_cache, step->kv_bf16,
                           step->num_slots, step->capacity, scratch->q);
    AttentionJob attention{shape, step, scratch->q, k_cache, v_cache, scratch->attended};
    run_parts(pool, step->batch * kv_heads, attention_part, &attention);
    pooled_gemm(pool, scratch->attended, rows, heads * dim, layer.o, hidden, scratch->projected);
    dflash_add_rms_norm(x, scratch->projected, rows, hidden, layer.post_norm, layer.post_eps, x, h);
    pooled_gemm(pool, h, rows, hidden, layer.gate_up, 2 * shape->intermediate, scratch->gate_up);
    dflash_silu_mul(scratch->gate_up, rows, shape->intermediate, scratch->act);
    pooled_gemm(pool, scratch->act, rows, shape->intermediate, layer.down, hidden, scratch->projected);
    dflash_add_rms_norm(x, scratch->projected, rows, hidden, layer.next_norm, layer.next_eps, x, h);
    if (step->taps[index] != nullptr) {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(step->taps[index] + r * step->tap_stride, x + r * hidden, hidden * sizeof(float));
      }
    }
  }
  return 0;
}

// y [M, N] = x [M, K] @ the tiled weight, as dflash_bf16_gemm, shared between a pool's threads (the lm_head).
void dflash_bf16_gemm_pooled(void* pool, const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                             float* y) {
  pooled_gemm(static_cast<dflash::WorkerPool*>(pool), x, M, K, w, N, y);
}

}  // extern "C"
