// y[M, N] = x[M, K] @ W[K, N]: float32 activations, bfloat16 weights (exact: a bfloat16 is the top half of a
// float32), float32 products and sums. A float32 model whose weights came from a bfloat16 checkpoint computes
// the same function while reading half the bytes (on a small CPU the one-token step is bound by weight reads).
//
// Weight layout: tiles of 16 output columns, each tile [K][16] contiguous ("packed B"), so that one tile
// streams through the cache in order: w[t][k][j] = W[k, 16 t + j], the last tile zero-padded.
//
// Every output element is one float32 accumulator summed over k = 0..K-1 in order, whatever M is and whichever
// block of rows it falls in, so a row's result does not depend on the other rows of the call: a verify block's
// rows equal one-token rows bit for bit (the row invariance lossless verification relies on).
//
// AVX2 + FMA; where the CPU has AVX-512F, dflash_bf16_gemm hands the product to bf16_gemm_avx512.cpp (the same
// sums, bit for bit, more of them at once). Plain C ABI (loaded with ctypes; no torch headers, so it builds in
// about a second).
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 16;    // output columns per tile: two 8-float registers
constexpr int kMaxRows = 6;  // rows per micro-kernel call: 12 accumulators + 2 weight registers + 1 broadcast

// 16 bfloat16 weights -> two registers of 8 float32 (shift each 16-bit pattern into the high half).
inline void widen(const uint16_t* p, __m256& lo, __m256& hi) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(b)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(b, 1)), 16));
}

inline void load_tile_row(const uint16_t* w, __m256& lo, __m256& hi) { widen(w, lo, hi); }

inline void load_tile_row(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}

inline void store_row(__m256 lo, __m256 hi, float* y, int cols) {
  if (cols == kTile) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  float row[kTile];
  _mm256_storeu_ps(row, lo);
  _mm256_storeu_ps(row + 8, hi);
  std::memcpy(y, row, sizeof(float) * cols);
}

// Rows r < MR of x (row stride ldx) times one weight tile (bfloat16 or already widened) -> y (row stride ldy).
// The accumulators are named locals (an array of them gets spilled to the stack on every k).
template <int MR, typename Weight>
void micro_kernel(const float* x, int64_t ldx, const Weight* w, int64_t K, float* y, int64_t ldy, int cols) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    load_tile_row(w + k * kTile, lo, hi);
    const float* xk = x + k;
    __m256 a = _mm256_broadcast_ss(xk);
    c00 = _mm256_fmadd_ps(a, lo, c00);
    c01 = _mm256_fmadd_ps(a, hi, c01);
    if constexpr (MR > 1) {
      a = _mm256_broadcast_ss(xk + ldx);
      c10 = _mm256_fmadd_ps(a, lo, c10);
      c11 = _mm256_fmadd_ps(a, hi, c11);
    }
    if constexpr (MR > 2) {
      a = _mm256_broadcast_ss(xk + 2 * ldx);
      c20 = _mm256_fmadd_ps(a, lo, c20);
      c21 = _mm256_fmadd_ps(a, hi, c21);
    }
    if constexpr (MR > 3) {
      a = _mm256_broadcast_ss(xk + 3 * ldx);
      c30 = _mm256_fmadd_ps(a, lo, c30);
      c31 = _mm256_fmadd_ps(a, hi, c31);
    }
    if constexpr (MR > 4) {
      a = _mm256_broadcast_ss(xk + 4 * ldx);
      c40 = _mm256_fmadd_ps(a, lo, c40);
      c41 = _mm256_fmadd_ps(a, hi, c41);
    }
    if constexpr (MR > 5) {
      a = _mm256_broadcast_ss(xk + 5 * ldx);
      c50 = _mm256_fmadd_ps(a, lo, c50);
      c51 = _mm256_fmadd_ps(a, hi, c51);
    }
  }
  store_row(c00, c01, y, cols);
  if constexpr (MR > 1) store_row(c10, c11, y + ldy, cols);
  if constexpr (MR > 2) store_row(c20, c21, y + 2 * ldy, cols);
  if constexpr (MR > 3) store_row(c30, c31, y + 3 * ldy, cols);
  if constexpr (MR > 4) store_row(c40, c41, y + 4 * ldy, cols);
  if constexpr (MR > 5) store_row(c50, c51, y + 5 * ldy, cols);
}

// All M rows against one tile, kMaxRows at a time, then the remainder.
template <typename Weight>
void tile_rows(const float* x, int64_t M, int64_t K, const Weight* w, float* y, int64_t N, int cols) {
  int64_t m = 0;
  for (; m + kMaxRows <= M; m += kMaxRows) micro_kernel<kMaxRows>(x + m * K, K, w, K, y + m * N, N, cols);
  const float* xm = x + m * K;
  float* ym = y + m * N;
  switch (M - m) {
    case 5: micro_kernel<5>(xm, K, w, K, ym, N, cols); break;
    case 4: micro_kernel<4>(xm, K, w, K, ym, N, cols); break;
    case 3: micro_kernel<3>(xm, K, w, K, ym, N, cols); break;
    case 2: micro_kernel<2>(xm, K, w, K, ym, N, cols); break;
    case 1: micro_kernel<1>(xm, K, w, K, ym, N, cols); break;
    default: break;
  }
}

}  // namespace

extern "C" {

void dflash_bf16_gemm_avx512(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y);
void dflash_bf16_gemm_avx512_tiles(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y,
                                   int64_t t0, int64_t t1);

// 1 where dflash_bf16_gemm uses the AVX-512 kernel (the CPU has AVX-512F and the OS saves its registers).
int dflash_bf16_gemm_uses_avx512() {
  static const int uses = __builtin_cpu_supports("avx512f") ? 1 : 0;
  return uses;
}

// The AVX2 kernel whatever the CPU, on the output tiles [t0, t1) only (16 columns each; the rest of y untouched):
// every element is computed as in the whole product, so a product split by tiles between threads gives the same
// bits (decoder_layer.cpp's pooled GEMMs).
void dflash_bf16_gemm_avx2_tiles(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y,
                                 int64_t t0, int64_t t1) {
  // More rows than one micro-kernel call reuse each tile: widen it to float32 once (K x 16, in cache).
  std::vector<float> widened(M > kMaxRows ? static_cast<size_t>(K) * kTile : 0);
  for (int64_t t = t0; t < t1; ++t) {
    const uint16_t* tile = w + t * K * kTile;
    const int cols = static_cast<int>(N - t * kTile < kTile ? N - t * kTile : kTile);
    if (widened.empty()) {
      tile_rows(x, M, K, tile, y + t * kTile, N, cols);
      continue;
    }
    for (int64_t k = 0; k < K; ++k) {
      __m256 lo, hi;
      widen(tile + k * kTile, lo, hi);
      _mm256_storeu_ps(widened.data() + k * kTile, lo);
      _mm256_storeu_ps(widened.data() + k * kTile + 8, hi);
    }
    tile_rows(x, M, K, widened.data(), y + t * kTile, N, cols);
  }
}

// The AVX2 kernel whatever the CPU (dflash_bf16_gemm's arguments; the tests compare the two).
void dflash_bf16_gemm_avx2(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  dflash_bf16_gemm_avx2_tiles(x, M, K, w, N, y, 0, (N + kTile - 1) / kTile);
}

// dflash_bf16_gemm on the output tiles [t0, t1) only, with this CPU's kernel.
void dflash_bf16_gemm_tiles(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y, int64_t t0,
                            int64_t t1) {
  if (dflash_bf16_gemm_uses_avx512()) {
    dflash_bf16_gemm_avx512_tiles(x, M, K, w, N, y, t0, t1);
  } else {
    dflash_bf16_gemm_avx2_tiles(x, M, K, w, N, y, t0, t1);
  }
}

// x [M, K] and y [M, N] row-major float32; w: ceil(N / 16) tiles of [K][16] bfloat16 bit patterns.
void dflash_bf16_gemm(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  dflash_bf16_gemm_tiles(x, M, K, w, N, y, 0, (N + kTile - 1) / kTile);
}

}  // extern "C"
