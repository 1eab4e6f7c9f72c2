// A DFlash / DFlash 2 drafter's denoising of one block per request in one call, for the float32 path with
// bfloat16-tiled weights (the draft step of the demo drafter spent half its time in per-op dispatch). Each layer:
//   the input norm; (DFlash 2) the attention conv's kernel projection and its tap-set-0 filter; the q and k/v
//   projections, q/k norms + rotary, the block's keys and values written into the cache; attention over the slot's
//   cached context and block as the layer's visibility mask allows; the o projection; (DFlash 2) the tap-set-1
//   filter; the residual add with the post-attention norm; the same conv pair around the gated MLP; and the
//   residual add with the next norm (the following layer's input norm, or the drafter's final one).
// The same kernels on the same values in the same order as the per-op path (draft_model.py, dflash2_model.py), so
// the same bits: the conv filter is compiled without contraction, so each product and sum rounds as PyTorch's
// separate multiply and add do. A worker pool shares the projections and attention as in decoder_layer.cpp.
// Plain C ABI, loaded with ctypes: the structs mirror draft_block.py's ctypes structures field by field.
#include <cstdint>

#include "no_contraction.h"
#include "pooled_jobs.h"

extern "C" {

// A DFlash 2 dynamic convolution: kernel_projection as bf16_gemm tiles (out 2 * kernel * hidden / group), base
// [2, kernel, hidden] float32 (tap set, offset, channel). Both null: no convolution (DFlash).
struct DraftConv {
  const uint16_t* projection;
  const float* base;
};

// One layer: weights as bf16_gemm tiles (q out heads * dim, kv out 2 * kv_heads * dim (k then v), o out hidden,
// gate_up out 2 * intermediate, down out hidden); float32 norms: q_norm [heads, dim], k_norm [kv_heads, dim], the
// others [hidden].
struct DraftLayer {
  const uint16_t* q;
  const float* q_norm;
  float q_eps;
  const uint16_t* kv;
  const float* k_norm;
  float k_eps;
  const uint16_t* o;
  const float* post_norm;
  float post_eps;
  const uint16_t* gate_up;
  const uint16_t* down;
  const float* next_norm;
  float next_eps;
  DraftConv attention_conv;
  DraftConv mlp_conv;
};

// What every layer shares: the drafter's shape, the convs' kernel size and channel group (0 without convs), its
// GEMM (amx: 1 for weights in the "amx" layout, see bf16_gemm_amx.cpp), attention's score scale, the first
// layer's input norm, and the context projection: fc (bf16_gemm tiles, in features_width = taps * hidden, out
// hidden) and the hidden norm after it (null fc: dflash_draft_ingest refuses).
struct DraftShape {
  int64_t layers, hidden, heads, kv_heads, dim, intermediate, conv_kernel, conv_group, amx;
  float scale;
  const float* first_norm;
  float first_eps;
  int64_t features_width;
  const uint16_t* fc;
  const float* context_norm;
  float context_eps;
};

// One block per batch entry: seq rows at positions [batch, seq] of slots [batch], attending over the first `keys`
// positions of their slots; cos, sin [batch, seq, dim]; visible: per layer [batch, seq, keys] (1 = the row sees
// the key); k_caches, v_caches: a [pages, kv_heads, page_size, dim] cache per layer, float32 or (kv_bf16 != 0)
// bfloat16, whose slots' positions lie where `pages` says (cache_pages.h: every layer's alike).
struct DraftStep {
  int64_t batch, seq, keys, kv_bf16;
  const CachePages* pages;
  const float* cos;
  const float* sin;
  const int64_t* slots;
  const int64_t* positions;
  const uint8_t* const* visible;
  void* const* k_caches;
  void* const* v_caches;
};

// Context rows for the caches: features [rows, features_width] of the target at slots [rows] and positions [rows],
// cos, sin [rows, dim]; the caches as in DraftStep; scratch: context and normed [rows, hidden], kv [rows, 2 *
// kv_heads * dim].
struct DraftContext {
  int64_t rows, kv_bf16;
  const CachePages* pages;
  const float* features;
  const float* cos;
  const float* sin;
  const int64_t* slots;
  const int64_t* positions;
  void* const* k_caches;
  void* const* v_caches;
  float *context, *normed, *kv;
};

// Buffers every layer reuses: filtered and projected [rows, hidden]; dynamic [rows, 2 * kernel * hidden / group];
// q_rows, q and attended [rows, heads * dim]; kv [rows, 2 * kv_heads * dim]; gate_up [rows, 2 * intermediate];
// act [rows, intermediate].
struct DraftScratch {
  float *filtered, *projected, *dynamic, *q_rows, *q, *attended, *kv, *gate_up, *act;
};

}  // extern "C"

namespace {

using dflash::WorkerPool;
using dflash::jobs::pooled_gemm;

DFLASH_NO_CONTRACTION_BEGIN

// out [rows, hidden]: row r (row t = r % block of its block) = sum over offsets o of
// (base[set, o] + dynamic[r, set, o, channel / group]) * x[r - o], x before the block's start counting as zero;
// the sum taken in offset order. dynamic [rows, 2, kernel, hidden / group].
void conv_filter(const float* x, const float* dynamic, const float* base, int64_t set, int64_t rows, int64_t block,
                 int64_t hidden, int64_t kernel, int64_t group, float* out) {
  DFLASH_NO_CONTRACTION
  const int64_t groups = hidden / group;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % block;
    const float* offsets = dynamic + (r * 2 + set) * kernel * groups;  // [kernel, groups]
    const float* taps = base + set * kernel * hidden;                   // [kernel, hidden]
    float* y = out + r * hidden;
    for (int64_t c = 0; c < hidden; ++c) {
      const float weight = taps[c] + offsets[c / group];
      y[c] = x[r * hidden + c] * weight;
    }
    for (int64_t o = 1; o < kernel; ++o) {
      for (int64_t c = 0; c < hidden; ++c) {
        const float weight = taps[o * hidden + c] + offsets[o * groups + c / group];
        const float earlier = t >= o ? x[(r - o) * hidden + c] : 0.0f;
        y[c] = y[c] + earlier * weight;
      }
    }
  }
}

DFLASH_NO_CONTRACTION_END

// The conv's tap-set-0 filter of a sublayer's input x (its kernel projection into dynamic first), or x itself
// without a conv.
const float* conv_prepare(WorkerPool* pool, const DraftConv& conv, const DraftShape& shape, int64_t rows,
                          int64_t block, const float* x, float* dynamic, float* filtered) {
  if (conv.projection == nullptr) return x;
  const int64_t width = 2 * shape.conv_kernel * (shape.hidden / shape.conv_group);
  pooled_gemm(pool, shape.amx, x, rows, shape.hidden, conv.projection, width, dynamic);
  conv_filter(x, dynamic, conv.base, 0, rows, block, shape.hidden, shape.conv_kernel, shape.conv_group, filtered);
  return filtered;
}

// The conv's tap-set-1 filter of a sublayer's output z (with the offsets conv_prepare projected), or z itself.
const float* conv_finish(const DraftConv& conv, const DraftShape& shape, int64_t rows, int64_t block, const float* z,
                         const float* dynamic, float* filtered) {
  if (conv.projection == nullptr) return z;
  conv_filter(z, dynamic, conv.base, 1, rows, block, shape.hidden, shape.conv_kernel, shape.conv_group, filtered);
  return filtered;
}

}  // namespace

extern "C" {

// DFlashDraftModel.ingest_context in one call: fc, the hidden norm, then every layer's k/v projection, k norm and
// rotary, written into its cache. Returns 0; -1 for a slot or position outside the cache (nothing written); -2 for
// a shape the kernels refuse.
int dflash_draft_ingest(const DraftLayer* layers, const DraftShape* shape, const DraftContext* context,
                        void* pool_handle) {
  WorkerPool* pool = static_cast<WorkerPool*>(pool_handle);
  const int64_t kv_heads = shape->kv_heads, dim = shape->dim, hidden = shape->hidden, rows = context->rows;
  if (shape->fc == nullptr || dim % 8 != 0 || dim > 256 || kv_heads <= 0) return -2;
  for (int64_t r = 0; r < rows; ++r) {
    if (!dflash::cache_holds(*context->pages, context->slots[r], context->positions[r])) return -1;
  }
  pooled_gemm(pool, shape->amx, context->features, rows, shape->features_width, shape->fc, hidden, context->context);
  dflash_rms_norm(context->context, rows, hidden, shape->context_norm, shape->context_eps, context->normed);
  for (int64_t index = 0; index < shape->layers; ++index) {
    const DraftLayer& layer = layers[index];
    pooled_gemm(pool, shape->amx, context->normed, rows, hidden, layer.kv, 2 * kv_heads * dim, context->kv);
    // each row a batch entry of one position: rows of several requests, each at its own slot
    if (dflash_qk_rotary_cache(context->kv, rows, 1, 0, kv_heads, dim, layer.k_norm, layer.k_eps, context->cos,
                               context->sin, context->slots, context->positions, context->k_caches[index],
                               context->v_caches[index], context->kv_bf16, context->pages, nullptr) != 0) {
      return -1;  // refused before this layer wrote (the checks above make it unreachable)
    }
  }
  return 0;
}

// x [batch * seq, hidden]: the block embeddings in, the last residual out (updated in place); h [batch * seq,
// hidden]: the final norm's output. Returns 0; -1 for a slot or position outside the cache (nothing written); -2
// for a shape the kernels refuse (nothing written). pool: a dflash_pool_create pool, or null for this thread.
int dflash_draft_block(const DraftLayer* layers, const DraftShape* shape, const DraftStep* step,
                       const DraftScratch* scratch, float* x, float* h, void* pool_handle) {
  WorkerPool* pool = static_cast<WorkerPool*>(pool_handle);
  const int64_t heads = shape->heads, kv_heads = shape->kv_heads, dim = shape->dim, hidden = shape->hidden;
  if (dim % 8 != 0 || dim > 256 || kv_heads <= 0 || heads % kv_heads != 0) return -2;
  if (shape->conv_kernel < 0 || (shape->conv_kernel > 0 && (shape->conv_group <= 0 || hidden % shape->conv_group)))
    return -2;
  const CachePages& pages = *step->pages;
  for (int64_t b = 0; b < step->batch; ++b) {  // checked before layer 0 writes: every layer writes the same places
    for (int64_t t = 0; t < step->seq; ++t) {
      if (!dflash::cache_holds(pages, step->slots[b], step->positions[b * step->seq + t])) return -1;
    }
  }
  if (step->keys > dflash::cache_capacity(pages) || !dflash::cache_pages_fit(pages, dflash::kKeyBlock)) return -2;
  for (int64_t b = 0; b < step->batch; ++b) {
    if (!dflash::cache_reads(pages, step->slots[b], step->keys)) return -1;
  }
  const int64_t rows = step->batch * step->seq, block = step->seq;
  dflash_rms_norm(x, rows, hidden, shape->first_norm, shape->first_eps, h);
  for (int64_t index = 0; index < shape->layers; ++index) {
    const DraftLayer& layer = layers[index];
    char* k_cache = static_cast<char*>(step->k_caches[index]);
    char* v_cache = static_cast<char*>(step->v_caches[index]);
    const float* input =
        conv_prepare(pool, layer.attention_conv, *shape, rows, block, h, scratch->dynamic, scratch->filtered);
    pooled_gemm(pool, shape->amx, input, rows, hidden, layer.q, heads * dim, scratch->q_rows);
    dflash_qk_rotary_cache(scratch->q_rows, step->batch, step->seq, heads, 0, dim, layer.q_norm, layer.q_eps,
                           step->cos, step->sin, step->slots, step->positions, k_cache, v_cache, step->kv_bf16,
                           step->pages, scratch->q);
    pooled_gemm(pool, shape->amx, input, rows, hidden, layer.kv, 2 * kv_heads * dim, scratch->kv);
    dflash_qk_rotary_cache(scratch->kv, step->batch, step->seq, 0, kv_heads, dim, layer.k_norm, layer.k_eps,
                           step->cos, step->sin, step->slots, step->positions, k_cache, v_cache, step->kv_bf16,
                           step->pages, nullptr);
    dflash::jobs::CacheAttention attention{scratch->q, k_cache, v_cache, step->kv_bf16, step->pages, step->slots,
                                           step->visible[index], heads, kv_heads, dim, step->seq, step->keys,
                                           shape->scale, scratch->attended};
    dflash::jobs::pooled_cache_attention(pool, step->batch, &attention);
    pooled_gemm(pool, shape->amx, scratch->attended, rows, heads * dim, layer.o, hidden, scratch->projected);
    const float* delta =
        conv_finish(layer.attention_conv, *shape, rows, block, scratch->projected, scratch->dynamic, scratch->filtered);
    dflash_add_rms_norm(x, delta, rows, hidden, layer.post_norm, layer.post_eps, x, h);
    input = conv_prepare(pool, layer.mlp_conv, *shape, rows, block, h, scratch->dynamic, scratch->filtered);
    pooled_gemm(pool, shape->amx, input, rows, hidden, layer.gate_up, 2 * shape->intermediate, scratch->gate_up);
    dflash_silu_mul(scratch->gate_up, rows, shape->intermediate, scratch->act);
    pooled_gemm(pool, shape->amx, scratch->act, rows, shape->intermediate, layer.down, hidden, scratch->projected);
    delta = conv_finish(layer.mlp_conv, *shape, rows, block, scratch->projected, scratch->dynamic, scratch->filtered);
    dflash_add_rms_norm(x, delta, rows, hidden, layer.next_norm, layer.next_eps, x, h);
  }
  return 0;
}

}  // extern "C"
