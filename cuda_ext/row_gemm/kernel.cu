// A GEMM whose rows never depend on how many rows share the call (CUDA only, bfloat16 or float16 operands,
// float32 sums): out[m, n] = sum_k x[m, k] * w[n, k]. cuBLAS picks its algorithm, and with it the order and
// splitting of each sum, by the row count, so a verify block's rows differ from one-token rows (on an H200 the
// down projection's, K = 12288: docs/architecture.md, "On a GPU"). Here the order of every sum depends on N, K and
// the slice length alone:
// - pass 1: a warp owns one 16-column tile of w and one K slice; it walks the slice in steps of 16 with the
//   tensor cores (wmma 16x16x16, float32 accumulators), for up to kRowTiles 16-row tiles of x at once (each weight
//   fragment loaded once for all of them); every (row, column) entry's slice sum is the same chain of mma steps
//   whatever the row count, and an entry's value never depends on the other rows of its tile;
// - pass 2: one thread per output entry adds the slices' partial sums in slice order and rounds to the output type.
// The slice length (op.py: `slice_length`) is chosen from N, K and the multiprocessor count only, so that a layer
// with few column tiles (o_proj, down_proj) still has enough warps in flight to read its weights at full speed.
// x comes padded to a whole number of 16-row tiles (op.py pads with zeros; padded rows are never written out).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include "../common/launch.cuh"

namespace {

using namespace nvcuda;

constexpr int kTile = 16;      // wmma's m = n = k
constexpr int kWarps = 4;      // warps per thread block, each its own column tile
constexpr int kRowTiles = 4;   // 16-row tiles of x one warp carries at once (64 rows)
constexpr int kSumThreads = 256;

constexpr int kBfloat16 = 1;   // the element type codes op.py passes
constexpr int kFloat16 = 2;

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
slice_partials(const T* __restrict__ x, const T* __restrict__ w, float* __restrict__ partials,
               int64_t rows_padded, int64_t N, int64_t K, int64_t slice_length) {
  const int64_t n0 = ((int64_t)blockIdx.x * kWarps + threadIdx.x / 32) * kTile;
  if (n0 >= N) return;
  const int64_t slice = blockIdx.y;
  const int64_t first_row = (int64_t)blockIdx.z * kRowTiles * kTile;
  const int64_t k_begin = slice * slice_length;
  const int64_t k_end = k_begin + slice_length < K ? k_begin + slice_length : K;
  const int64_t left = (rows_padded - first_row) / kTile;
  const int tiles = left < kRowTiles ? (int)left : kRowTiles;
  wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float> sums[kRowTiles];
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) wmma::fill_fragment(sums[t], 0.0f);
#pragma unroll 4  // (loads of the next steps issued ahead: the same operations in the same order)
  for (int64_t k0 = k_begin; k0 < k_end; k0 += kTile) {
    wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, T, wmma::col_major> weights;  // w[n0.., k0..] as K x N
    wmma::load_matrix_sync(weights, w + n0 * K + k0, (unsigned)K);
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
      if (t < tiles) {
        wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, T, wmma::row_major> rows;
        wmma::load_matrix_sync(rows, x + (first_row + t * kTile) * K + k0, (unsigned)K);
        wmma::mma_sync(sums[t], rows, weights, sums[t]);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
    if (t < tiles) {
      float* target = partials + (slice * rows_padded + first_row + t * kTile) * N + n0;
      wmma::store_matrix_sync(target, sums[t], (unsigned)N, wmma::mem_row_major);
    }
  }
}

__device__ __forceinline__ void store_as(__nv_bfloat16* out, float value) { *out = __float2bfloat16_rn(value); }
__device__ __forceinline__ void store_as(__half* out, float value) { *out = __float2half_rn(value); }

template <typename T>
__global__ void __launch_bounds__(kSumThreads)
sum_slices(const float* __restrict__ partials, T* __restrict__ out, int64_t rows, int64_t rows_padded, int64_t N,
           int64_t slices, int64_t out_stride) {
  const int64_t entry = (int64_t)blockIdx.x * kSumThreads + threadIdx.x;
  if (entry >= rows * N) return;
  const int64_t m = entry / N, n = entry % N;
  float total = partials[m * N + n];
  for (int64_t s = 1; s < slices; ++s) total = total + partials[(s * rows_padded + m) * N + n];  // slice order
  store_as(out + m * out_stride + n, total);
}

template <typename T>
int launch(const void* x, const void* w, float* partials, void* out, int64_t rows, int64_t rows_padded, int64_t N,
           int64_t K, int64_t slice_length, int64_t slices, int64_t out_stride, cudaStream_t stream) {
  const dim3 grid((unsigned)((N / kTile + kWarps - 1) / kWarps), (unsigned)slices,
                  (unsigned)((rows_padded / kTile + kRowTiles - 1) / kRowTiles));
  slice_partials<T><<<grid, kWarps * 32, 0, stream>>>((const T*)x, (const T*)w, partials, rows_padded, N, K,
                                                      slice_length);
  const int error = dflash::launch_status();
  if (error) return error;
  const int64_t entries = rows * N;
  sum_slices<T><<<(unsigned)((entries + kSumThreads - 1) / kSumThreads), kSumThreads, 0, stream>>>(
      partials, (T*)out, rows, rows_padded, N, slices, out_stride);
  return dflash::launch_status();
}

}  // namespace

extern "C" int dflash_row_gemm_probe() { return dflash::probe(slice_partials<__nv_bfloat16>); }

// x [rows_padded, K] (contiguous, rows_padded a multiple of 16, rows past `rows` zeros), w [N, K] contiguous,
// partials float32 [slices, rows_padded, N] (scratch), out [rows, N] with rows out_stride apart; the pointers
// 32-byte aligned. dtype: 1 bfloat16, 2 float16.
extern "C" int dflash_row_gemm_cuda(const void* x, const void* w, float* partials, void* out, int64_t rows,
                                    int64_t rows_padded, int64_t N, int64_t K, int64_t slice_length, int64_t slices,
                                    int64_t out_stride, int64_t dtype, void* stream) {
  const bool shapes = rows >= 0 && rows_padded >= rows && rows_padded % kTile == 0 && N > 0 && N % kTile == 0
                      && K > 0 && K % kTile == 0 && slice_length > 0 && slice_length % kTile == 0 && slices > 0
                      && (slices - 1) * slice_length < K && slices * slice_length >= K && out_stride >= N;
  const bool grid = (N / kTile + kWarps - 1) / kWarps <= dflash::kMaxGrid && slices <= 65535
                    && (rows_padded / kTile + kRowTiles - 1) / kRowTiles <= 65535
                    && (rows * N + kSumThreads - 1) / kSumThreads <= dflash::kMaxGrid;
  const bool aligned = ((uintptr_t)x | (uintptr_t)w | (uintptr_t)partials) % 32 == 0;
  if (!shapes || !grid || !aligned || (dtype != kBfloat16 && dtype != kFloat16)) return dflash::kBadArgument;
  if (rows == 0) return dflash::kOk;
  const cudaStream_t on = (cudaStream_t)stream;
  if (dtype == kBfloat16) {
    return launch<__nv_bfloat16>(x, w, partials, out, rows, rows_padded, N, K, slice_length, slices, out_stride, on);
  }
  return launch<__half>(x, w, partials, out, rows, rows_padded, N, K, slice_length, slices, out_stride, on);
}
