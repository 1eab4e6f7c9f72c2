// A dense decoder layer's step in two calls instead of about ten, for the float32 path with bfloat16-tiled
// weights (on a small model the one-token step is bound by per-call overhead, not arithmetic):
//   dflash_layer_attention: q/k/v projection, q/k norms + rotary + cache write, attention, o projection, the
//                           residual add with the post-attention norm, and the gate/up projection;
//   dflash_layer_mlp_out:   the down projection and the residual add with the next norm.
// The activation between them (silu(gate) * up) stays PyTorch's, so this computes exactly what the per-op path
// computes: the same kernels (bf16_gemm.cpp, layer_ops.cpp, attention.cpp) on the same values in the same order,
// row by row (a row's result never depends on the other rows). Plain C ABI, loaded with ctypes.
#include <cstdint>

extern "C" {

void dflash_bf16_gemm(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y);
int dflash_attention(const float* q, const float* k, const float* v, int64_t k_batch_stride, int64_t k_head_stride,
                     int64_t v_batch_stride, int64_t v_head_stride, const uint8_t* visible, int64_t batch,
                     int64_t heads, int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim, float scale,
                     float* out);
void dflash_add_rms_norm(const float* x, const float* delta, int64_t rows, int64_t n, const float* weight,
                         float eps, float* summed, float* out);
int dflash_qk_rotary_cache(const float* qkv, int64_t batch, int64_t seq, int64_t heads, int64_t kv_heads, int64_t dim,
                           const float* norm_weight, float eps, const float* cos, const float* sin,
                           const int64_t* slots, const int64_t* positions, float* k_cache, float* v_cache,
                           int64_t num_slots, int64_t capacity, float* q);

// h, x [batch * seq, hidden]: the layer's normed input and the residual stream. Weights as bf16_gemm tiles:
// qkv_w (out (heads + 2 kv_heads) * dim), o_w (out hidden), gate_up_w (out gate_up_width). qk_norm, cos, sin,
// slots, positions, caches: as dflash_qk_rotary_cache; the caches are this layer's [num_slots, kv_heads,
// capacity, dim]. visible [batch, seq, keys]: which of the slot's first `keys` positions each row sees.
// Scratch: qkv [rows, (heads + 2 kv_heads) * dim], q and attended [rows * heads * dim], projected [rows, hidden].
// Writes x_out = x + o_proj(attention), h_out = post_norm(x_out), gate_up = h_out @ gate_up_w.
// Returns 0; -1 for a slot or position outside the cache (nothing written); -2 for a shape attention refuses.
int dflash_layer_attention(const float* h, const float* x, int64_t batch, int64_t seq, int64_t hidden,
                           const uint16_t* qkv_w, int64_t heads, int64_t kv_heads, int64_t dim, const float* qk_norm,
                           float qk_eps, const float* cos, const float* sin, const int64_t* slots,
                           const int64_t* positions, float* k_cache, float* v_cache, int64_t num_slots,
                           int64_t capacity, const uint8_t* visible, int64_t keys, float scale, const uint16_t* o_w,
                           const float* post_norm, float post_eps, const uint16_t* gate_up_w, int64_t gate_up_width,
                           float* qkv, float* q, float* attended, float* projected, float* x_out, float* h_out,
                           float* gate_up) {
  if (dim % 8 != 0 || dim > 256 || kv_heads <= 0 || heads % kv_heads != 0) return -2;
  const int64_t rows = batch * seq, width = (heads + 2 * kv_heads) * dim;
  dflash_bf16_gemm(h, rows, hidden, qkv_w, width, qkv);
  if (dflash_qk_rotary_cache(qkv, batch, seq, heads, kv_heads, dim, qk_norm, qk_eps, cos, sin, slots, positions,
                             k_cache, v_cache, num_slots, capacity, q) != 0) {
    return -1;
  }
  if (keys > capacity) return -2;  // (after the range check: keys past the cache mean a position past it)
  const int64_t slot_stride = kv_heads * capacity * dim, head_stride = capacity * dim;
  for (int64_t b = 0; b < batch; ++b) {  // each row reads its own slot's keys straight from the cache
    const int64_t offset = slots[b] * slot_stride;
    if (dflash_attention(q + b * heads * seq * dim, k_cache + offset, v_cache + offset, slot_stride, head_stride,
                         slot_stride, head_stride, visible + b * seq * keys, 1, heads, kv_heads, seq, keys, dim,
                         scale, attended + b * seq * heads * dim) != 0) {
      return -2;
    }
  }
  dflash_bf16_gemm(attended, rows, heads * dim, o_w, hidden, projected);
  dflash_add_rms_norm(x, projected, rows, hidden, post_norm, post_eps, x_out, h_out);
  dflash_bf16_gemm(h_out, rows, hidden, gate_up_w, gate_up_width, gate_up);
  return 0;
}

// act [rows, intermediate] (silu(gate) * up), x [rows, hidden]: x_out = x + act @ down_w, h_out = norm(x_out).
void dflash_layer_mlp_out(const float* act, int64_t rows, int64_t intermediate, const uint16_t* down_w,
                          const float* x, int64_t hidden, const float* norm, float eps, float* projected,
                          float* x_out, float* h_out) {
  dflash_bf16_gemm(act, rows, intermediate, down_w, hidden, projected);
  dflash_add_rms_norm(x, projected, rows, hidden, norm, eps, x_out, h_out);
}

}  // extern "C"
