// The row RMSNorm kernel: a warp per row (rows.h says what a row computes), its lanes' sums of squares added in
// common/warp_rows.h's butterfly.
#include <cuda_runtime.h>

#include "../common/launch.cuh"
#include "rows.h"

namespace {

constexpr int kWarps = 8;  // rows per thread block

template <typename T>
__global__ void __launch_bounds__(kWarps * dflash::kLanes) row_norm_kernel(dflash::RowNormArgs<T> a) {
  const int lane = threadIdx.x % dflash::kLanes;
  const int64_t r = (int64_t)blockIdx.x * kWarps + threadIdx.x / dflash::kLanes;
  if (r >= a.rows) return;
  const float total = dflash::warp_butterfly_sum(dflash::lane_squares(a, r, lane));
  dflash::lane_normalize(a, r, dflash::inverse_rms(a, total), lane);
}

}  // namespace

extern "C" int dflash_row_norm_probe() { return dflash::probe(row_norm_kernel<uint16_t>); }

// x, weight, out: float32, or bfloat16 (their bits) when bf16 is 1.
extern "C" int dflash_row_norm_cuda(const void* x, const void* weight, void* out, int64_t rows, int64_t dim,
                                    int64_t weight_rows, int64_t bf16, float eps, void* stream) {
  if (rows < 0 || dim < 1 || weight_rows < 1 || (rows + kWarps - 1) / kWarps > dflash::kMaxGrid) {
    return dflash::kBadArgument;
  }
  if (rows == 0) return dflash::kOk;
  const unsigned blocks = (unsigned)((rows + kWarps - 1) / kWarps);
  if (bf16) {
    const dflash::RowNormArgs<uint16_t> a{(const uint16_t*)x, (const uint16_t*)weight, (uint16_t*)out, rows, dim,
                                          weight_rows, eps};
    row_norm_kernel<uint16_t><<<blocks, kWarps * dflash::kLanes, 0, (cudaStream_t)stream>>>(a);
  } else {
    const dflash::RowNormArgs<float> a{(const float*)x, (const float*)weight, (float*)out, rows, dim, weight_rows, eps};
    row_norm_kernel<float><<<blocks, kWarps * dflash::kLanes, 0, (cudaStream_t)stream>>>(a);
  }
  return dflash::launch_status();
}
