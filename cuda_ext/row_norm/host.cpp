// The host build of the row RMSNorm: every row on this thread, the 32 lanes of kernel.cu's warp one after another,
// through the same pieces (rows.h), so the same bits.
#include "rows.h"

namespace {

template <typename T>
int normalize_rows(const dflash::RowNormArgs<T>& a) {
  float partial[dflash::kLanes];
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int lane = 0; lane < dflash::kLanes; ++lane) partial[lane] = dflash::lane_squares(a, r, lane);
    const float inverse = dflash::inverse_rms(a, dflash::butterfly_sum(partial));
    for (int lane = 0; lane < dflash::kLanes; ++lane) dflash::lane_normalize(a, r, inverse, lane);
  }
  return dflash::kOk;
}

}  // namespace

// x, weight, out: float32, or bfloat16 (their bits) when bf16 is 1.
extern "C" int dflash_row_norm_host(const void* x, const void* weight, void* out, int64_t rows, int64_t dim,
                                    int64_t weight_rows, int64_t bf16, float eps) {
  if (rows < 0 || dim < 1 || weight_rows < 1) return dflash::kBadArgument;
  if (bf16) {
    const dflash::RowNormArgs<uint16_t> a{(const uint16_t*)x, (const uint16_t*)weight, (uint16_t*)out, rows, dim,
                                          weight_rows, eps};
    return normalize_rows(a);
  }
  const dflash::RowNormArgs<float> a{(const float*)x, (const float*)weight, (float*)out, rows, dim, weight_rows, eps};
  return normalize_rows(a);
}
