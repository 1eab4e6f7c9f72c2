// The "amx" layout's product, on AMX tiles (AMX-BF16; Linux grants the tile state on request): y[M, N] = x[M, K]
// @ W[K, N] with x rounded to bfloat16 (round to nearest even, as PyTorch rounds), bfloat16 weights, float32
// sums. That is a bfloat16 model's matmul (what a bfloat16 checkpoint computes in PyTorch or vLLM), not the
// float32 one of bf16_gemm.cpp: its results differ from those, and it runs only for a model packed in the "amx"
// layout (shared/packed_linear.py), never in place of the float32 kernels.
//
// Row invariance: each row of a tile has accumulators of its own and each output element sums its K products in
// one fixed order (32-value blocks in order, the tile multiply's own order within a block), so a row's result
// never depends on the other rows of the call: a verify block's rows equal one-token rows bit for bit here too.
// Split by output tiles between threads (pooled_jobs.h), the same bits.
//
// Weight layout ("pairs", CpuKernels.bf16_tiles(weight, "amx")): bf16_gemm.cpp's [K][16] tiles with each two
// rows k, k + 1 (k even) interleaved column by column, w[t][k / 2][j][k % 2], as the tile multiply reads its
// right-hand side (a final odd row stays alone). Full 32-deep blocks are loaded as tiles straight from it, a
// partial last block is zero-padded first.
//
// Built for AMX by the pragma (the library's other flags are AVX2's); callers check dflash_amx_available first:
// the CPU reports AMX-BF16, AMX-TILE and AVX-512BW, and the kernel granted this process the tile state. With a
// compiler that lacks the AMX intrinsics it builds as "not available".
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__GNUC__) || defined(__clang__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define DFLASH_HAVE_AMX 1
#endif

#ifdef DFLASH_HAVE_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,amx-tile,amx-bf16")
// (only the intrinsics under the pragma: a standard header included here would compile its inline functions for
// AVX-512, and the linker keeps one copy of each for the whole library, AVX2-only callers included)
#include <immintrin.h>

namespace {

constexpr int kTile = 16;   // output columns per weight tile
constexpr int kBlock = 32;  // K values one tile multiply covers (16 pairs)
constexpr int kGroup = 4;   // output tiles accumulated at once: tmm0-3; tmm4 holds x's rows, tmm5 a weight block
constexpr int kRows = 16;   // the most rows a tile holds

struct TileConfig {  // LDTILECFG's 64-byte layout (palette 1)
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure(int rows) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {  // accumulators: rows x 16 float32; x: rows x 32 bfloat16
    config.rows[t] = static_cast<uint8_t>(rows);
    config.colsb[t] = 64;
  }
  config.rows[5] = kBlock / 2;  // a weight block: 16 pairs x 16 columns x 2
  config.colsb[5] = 64;
  _tile_loadconfig(&config);
}

// x [M][K] float32 -> [M][Kp] bfloat16 bit patterns (Kp: K rounded up to kBlock, zero-padded), rounded to nearest
// even; a NaN stays a (quiet) NaN.
void round_rows(const float* x, int64_t M, int64_t K, int64_t Kp, uint16_t* out) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
  const __m512i quiet = _mm512_set1_epi32(0x00400000), exponent = _mm512_set1_epi32(0x7f800000);
  const __m512i mantissa = _mm512_set1_epi32(0x007fffff);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < Kp; k += 16) {
      const int64_t left = K - k;
      const __mmask16 valid = left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1u);
      const __m512i bits = _mm512_castps_si512(_mm512_maskz_loadu_ps(valid, x + m * K + k));
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
      __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(half, odd)), 16);
      const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent) &
                            _mm512_test_epi32_mask(bits, mantissa);
      rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_srli_epi32(_mm512_or_si512(bits, quiet), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * Kp + k), _mm512_cvtepi32_epi16(rounded));
    }
  }
}

// The last, partial block of one weight tile (rows k0..K-1 of the pairs layout) as a full one: zero-padded.
void padded_block(const uint16_t* tile, int64_t K, int64_t k0, uint16_t* out) {
  std::memset(out, 0, sizeof(uint16_t) * kBlock * kTile);
  const int64_t paired = (K - k0) / 2 * 2;  // rows already interleaved in pairs
  std::memcpy(out, tile + k0 * kTile, sizeof(uint16_t) * paired * kTile);
  if (K - k0 > paired) {  // an odd K: the final row alone, paired here with zeros
    const uint16_t* row = tile + (K - 1) * kTile;
    for (int j = 0; j < kTile; ++j) out[paired * kTile + 2 * j] = row[j];
  }
}

}  // namespace

extern "C" {

// 1 where the AMX kernel can run (see the header comment); decided once per process.
int dflash_amx_available() {
  static const int available = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 0;
    const bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u, avx512bw = (ebx >> 30) & 1u;
    if (!amx_bf16 || !amx_tile || !avx512bw || !__builtin_cpu_supports("avx512f")) return 0;
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0 ? 1 : 0;
  }();
  return available;
}

// The padded row length of x's bfloat16 copy (dflash_amx_round_rows): K rounded up to 32.
int64_t dflash_amx_padded_k(int64_t K) { return (K + kBlock - 1) / kBlock * kBlock; }

// x [M, K] float32 -> out [M, dflash_amx_padded_k(K)] bfloat16 bit patterns, rounded to nearest even, zero-padded.
void dflash_amx_round_rows(const float* x, int64_t M, int64_t K, uint16_t* out) {
  round_rows(x, M, K, dflash_amx_padded_k(K), out);
}

// The output tiles [t0, t1) only (16 columns each; the rest of y untouched) of xb @ w: xb from
// dflash_amx_round_rows, w in the pairs layout.
void dflash_amx_gemm_rounded_tiles(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y,
                                   int64_t t0, int64_t t1) {
  const uint16_t* rounded = xb;
  const int64_t Kp = dflash_amx_padded_k(K);
  const int64_t full = K / kBlock * kBlock;  // blocks read straight from w; a partial one is padded
  alignas(64) uint16_t padded[kGroup * kBlock * kTile];  // a partial last block of each tile in the group
  alignas(64) float edge[kRows * kTile];                   // a partial last tile's rows
  const int64_t tiles = (N + kTile - 1) / kTile;
  int configured = -1;
  for (int64_t t = t0; t < t1; t += kGroup) {
    const int group = static_cast<int>(t1 - t < kGroup ? t1 - t : kGroup);
    if (full < K) {
      for (int g = 0; g < group; ++g) {
        padded_block(w + (t + g) * K * kTile, K, full, padded + g * kBlock * kTile);
      }
    }
    for (int64_t m = 0; m < M; m += kRows) {
      const int rows = static_cast<int>(M - m < kRows ? M - m : kRows);
      if (rows != configured) {
        configure(rows);
        configured = rows;
      }
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < Kp; kb += kBlock) {
        _tile_loadd(4, rounded + m * Kp + kb, Kp * 2);
        // output tile C: its weight block into tmm5, then x's rows times it into accumulator C (the tile
        // intrinsics take register numbers as literals, hence a macro)
#define DFLASH_AMX_DOT(C)                                                                                  \
  if (group > C) {                                                                                         \
    if (kb < full) {                                                                                       \
      _tile_loadd(5, w + (t + C) * K * kTile + kb * kTile, 64);                                            \
    } else {                                                                                               \
      _tile_loadd(5, padded + C * kBlock * kTile, 64);                                              \
    }                                                                                                      \
    _tile_dpbf16ps(C, 4, 5);                                                                               \
  }
        DFLASH_AMX_DOT(0)
        DFLASH_AMX_DOT(1)
        DFLASH_AMX_DOT(2)
        DFLASH_AMX_DOT(3)
#undef DFLASH_AMX_DOT
      }
      // each accumulator's rows into y (a partial last tile through a scratch tile)
#define DFLASH_AMX_STORE(C)                                                                                \
  if (group > C) {                                                                                         \
    const int64_t tile = t + C;                                                                            \
    const int cols = static_cast<int>(tile + 1 == tiles ? N - tile * kTile : kTile);                       \
    if (cols == kTile) {                                                                                   \
      _tile_stored(C, y + m * N + tile * kTile, N * 4);                                                    \
    } else {                                                                                               \
      _tile_stored(C, edge, kTile * 4);                                                             \
      for (int r = 0; r < rows; ++r) {                                                                     \
        std::memcpy(y + (m + r) * N + tile * kTile, edge + r * kTile, sizeof(float) * cols);       \
      }                                                                                                    \
    }                                                                                                      \
  }
      DFLASH_AMX_STORE(0)
      DFLASH_AMX_STORE(1)
      DFLASH_AMX_STORE(2)
      DFLASH_AMX_STORE(3)
#undef DFLASH_AMX_STORE
    }
  }
  _tile_release();  // no tile state kept between calls (none to save at a context switch)
}

}  // extern "C"
#pragma GCC pop_options

// Outside the pragma (they use std::vector, see the includes): the float32 entries.
extern "C" {

// As dflash_amx_gemm_rounded_tiles, from float32 x (rounded here, on this thread's buffer).
void dflash_amx_gemm_tiles(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y, int64_t t0,
                           int64_t t1) {
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(static_cast<size_t>(M * dflash_amx_padded_k(K)));
  dflash_amx_round_rows(x, M, K, rounded.data());
  dflash_amx_gemm_rounded_tiles(rounded.data(), M, K, w, N, y, t0, t1);
}

// x [M, K] and y [M, N] row-major float32; w: ceil(N / 16) tiles in the pairs layout.
void dflash_amx_gemm(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
  constexpr int64_t kColumns = 16;  // output columns per weight tile
  dflash_amx_gemm_tiles(x, M, K, w, N, y, 0, (N + kColumns - 1) / kColumns);
}

}  // extern "C"

#else  // a compiler without the AMX intrinsics: never used

extern "C" {
int dflash_amx_available() { return 0; }
int64_t dflash_amx_padded_k(int64_t K) { return K; }
void dflash_amx_round_rows(const float*, int64_t, int64_t, uint16_t*) {}
void dflash_amx_gemm_rounded_tiles(const uint16_t*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t,
                                   int64_t) {}
void dflash_amx_gemm_tiles(const float*, int64_t, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t) {}
void dflash_amx_gemm(const float*, int64_t, int64_t, const uint16_t*, int64_t, float*) {}
}

#endif
