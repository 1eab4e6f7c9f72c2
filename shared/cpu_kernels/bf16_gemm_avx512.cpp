// bf16_gemm.cpp's product with AVX-512 registers, for CPUs that have them: y[M, N] = x[M, K] @ W[K, N] with
// float32 activations and the same bfloat16 weight tiles ([K][16] per 16 output columns).
//
// Bit-identical to the AVX2 kernel: each output element is still one float32 accumulator, fused-multiply-added
// over k = 0..K-1 in order (a 16-wide register holds 16 such accumulators side by side, as two 8-wide ones do
// there). Only how many accumulators run at once changes: up to 8 rows x 2 tiles, or one row x 8 tiles, so the
// one-token product is not bound by the latency of a single chain of adds. A row's result still never depends on
// the other rows of the call (the row invariance verification relies on).
//
// Compiled with the library's AVX2 flags; the functions here are built for AVX-512F by the pragma and only
// called where the CPU reports it (dflash_bf16_gemm in bf16_gemm.cpp checks).
#pragma GCC push_options
#pragma GCC target("avx512f")
#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int kTile = 16;  // output columns per tile: one 16-float register
constexpr int kRows = 8;   // rows per block

// 16 bfloat16 weights -> 16 float32 (each 16-bit pattern shifted into the high half).
inline __m512 widen16(const uint16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// Rows [0, MR) of x (row stride K) times NT consecutive tiles (each K x 16) -> y (row stride N). The last of the
// NT tiles keeps `last_cols` of its 16 columns (the matrix's final tile may be partial).
template <int MR, int NT>
void block(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N, int last_cols) {
  __m512 acc[MR][NT];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wt[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) wt[t] = widen16(w + (t * K + k) * kTile);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_fmadd_ps(a, wt[t], acc[r][t]);
    }
  }
  const __mmask16 last = static_cast<__mmask16>((1u << last_cols) - 1u);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) {
      float* out = y + r * N + t * kTile;
      if (t == NT - 1 && last_cols < kTile) {
        _mm512_mask_storeu_ps(out, last, acc[r][t]);
      } else {
        _mm512_storeu_ps(out, acc[r][t]);
      }
    }
}

// Tiles per block for MR rows: about 16 accumulators, fewer tiles as rows grow.
constexpr int tiles_for(int rows) { return rows == 1 ? 8 : rows == 2 ? 4 : rows <= 4 ? 3 : 2; }

// MR rows against tiles [t0, t1): blocks of tiles_for(MR) tiles, the remaining tiles one at a time.
template <int MR>
void rows_block(const float* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t t0, int64_t t1) {
  constexpr int NT = tiles_for(MR);
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int final_cols = static_cast<int>(N - (tiles - 1) * kTile);  // the matrix's last tile may be partial
  int64_t t = t0;
  for (; t + NT <= t1; t += NT) {
    block<MR, NT>(x, K, w + t * K * kTile, y + t * kTile, N, t + NT == tiles ? final_cols : kTile);
  }
  for (; t < t1; ++t) block<MR, 1>(x, K, w + t * K * kTile, y + t * kTile, N, t + 1 == tiles ? final_cols : kTile);
}

void rows_tail(int64_t rows, const float* x, int64_t K, const uint16_t* w, float* y, int64_t N, int64_t t0,
               int64_t t1) {
  switch (rows) {
    case 7: rows_block<7>(x, K, w, y, N, t0, t1); break;
    case 6: rows_block<6>(x, K, w, y, N, t0, t1); break;
    case 5: rows_block<5>(x, K, w, y, N, t0, t1); break;
    case 4: rows_block<4>(x, K, w, y, N, t0, t1); break;
    case 3: rows_block<3>(x, K, w, y, N, t0, t1); break;
    case 2: rows_block<2>(x, K, w, y, N, t0, t1); break;
    case 1: rows_block<1>(x, K, w, y, N, t0, t1); break;
    default: break;
  }
}

}  // namespace

extern "C" {

// As dflash_bf16_gemm_avx2_tiles (same arguments, same result bit for bit); only where the CPU has AVX-512F.
void dflash_bf16_gemm_avx512_tiles(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y,
                                   int64_t first, int64_t end) {
  // Columns in groups of 16 tiles (256 columns: their weights stay in cache while every row block passes).
  constexpr int64_t kGroup = 16;
  for (int64_t t0 = first; t0 < end; t0 += kGroup) {
    const int64_t t1 = t0 + kGroup < end ? t0 + kGroup : end;
    int64_t m = 0;
    for (; m + kRows <= M; m += kRows) rows_block<kRows>(x + m * K, K, w, y + m * N, N, t0, t1);
    rows_tail(M - m, x + m * K, K, w, y + m * N, N, t0, t1);
  }
}

// As dflash_bf16_gemm (same arguments, same result bit for bit); only where the CPU has AVX-512F.
void dflash_bf16_gemm_avx512(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  dflash_bf16_gemm_avx512_tiles(x, M, K, w, N, y, 0, (N + kTile - 1) / kTile);
}

}  // extern "C"
#pragma GCC pop_options
