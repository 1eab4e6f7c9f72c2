// RMSNorm of one row, as the pieces both builds run (host.cpp: row after row; kernel.cu: a warp per row), for
// --batch-invariant: PyTorch's reduction over a row picks how many threads share it by the number of rows (on a
// GPU, for a hidden size of 4096: 512 threads for one row, 32 from 16 rows up), so a one-token row and a verify
// block's rows summed their squares in different orders. Here lane l sums elements l, l + 32, ... in order and the
// lanes' parts are added in the fixed butterfly of common/warp_rows.h. The rest follows shared/layers.py's
// rms_normalize: x * (1 / sqrt(mean + eps)) in float32, rounded to x's type, times the weight (in float32 for a
// float32 row; a bfloat16 product rounded to bfloat16 otherwise). sqrt and the division are IEEE on both builds.
#pragma once

#include <math.h>

#include "../common/hd.h"
#include "../common/warp_rows.h"

namespace dflash {

template <typename T>
struct RowNormArgs {
  const T* x;       // [rows, dim]
  const T* weight;  // [weight_rows, dim]: row r uses weight row r % weight_rows (a [heads, dim] weight per head)
  T* out;           // [rows, dim]
  int64_t rows, dim, weight_rows;
  float eps;
};


DFLASH_HD void norm_store(float* out, float y, float w) { *out = w * y; }
DFLASH_HD void norm_store(uint16_t* out, float y, float w) {
  *out = bf16_round(w * to_float(bf16_round(y)));  // y rounded to bfloat16, then the bfloat16 product
}

// One lane's part of row r's sum of squares: elements lane, lane + 32, ... in order.
template <typename T>
DFLASH_HD float lane_squares(const RowNormArgs<T>& a, int64_t r, int lane) {
  float sum = 0.0f;
  const T* x = a.x + r * a.dim;
  for (int64_t d = lane; d < a.dim; d += kLanes) {
    const float v = to_float(x[d]);
    sum = sum + v * v;
  }
  return sum;
}

// 1 / sqrt(mean of the squares + eps) from the row's total.
template <typename T>
DFLASH_HD float inverse_rms(const RowNormArgs<T>& a, float total) {
  return 1.0f / sqrtf(total / (float)a.dim + a.eps);
}

// The lane's elements of row r's output.
template <typename T>
DFLASH_HD void lane_normalize(const RowNormArgs<T>& a, int64_t r, float inverse, int lane) {
  const T* x = a.x + r * a.dim;
  const T* w = a.weight + (r % a.weight_rows) * a.dim;
  T* out = a.out + r * a.dim;
  for (int64_t d = lane; d < a.dim; d += kLanes) norm_store(out + d, to_float(x[d]) * inverse, to_float(w[d]));
}

}  // namespace dflash
