// Block-wide steps of the CUDA kernels, built from the shared DFLASH_HD pieces: every thread of the block calls
// them (uniformly) and gets the same result. Device only.
#pragma once

#include <cuda_runtime.h>

#include "hd.h"

namespace dflash {

// argmax of x[0, count) over the block's THREADS threads (a strided slice each, then a tree of `better`, which
// picks the same winner in any order).
template <int THREADS>
__device__ ArgBest block_argmax(const float* x, int64_t count, ArgBest* scratch) {
  scratch[threadIdx.x] = argmax_strided(x, threadIdx.x, count, THREADS);
  __syncthreads();
  for (int half = THREADS / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) scratch[threadIdx.x] = better(scratch[threadIdx.x], scratch[threadIdx.x + half]);
    __syncthreads();
  }
  const ArgBest best = scratch[0];
  __syncthreads();
  return best;
}

// The inverse-CDF draw of draw_sequential over the block: chunk totals in parallel, their running sums on one
// thread (the order draw_sequential adds them in), then each thread looks for the first entry past the target
// in its chunks; the smallest index found wins. starts: a chunk count of doubles; found: THREADS int64s.
template <int THREADS, typename Values>
__device__ int64_t block_draw(const Values& values, int64_t count, double u, double* starts, int64_t* found,
                              double* total) {
  const int64_t chunks = (count + kCdfChunk - 1) / kCdfChunk;
  for (int64_t c = threadIdx.x; c < chunks; c += THREADS) {
    const int64_t begin = c * kCdfChunk, end = begin + kCdfChunk < count ? begin + kCdfChunk : count;
    starts[c] = chunk_total(values, begin, end);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double running = 0.0;
    for (int64_t c = 0; c < chunks; ++c) {
      const double chunk = starts[c];
      starts[c] = running;
      running += chunk;
    }
    *total = running;
  }
  __syncthreads();
  const double target = u * *total;
  int64_t first = -1;
  for (int64_t c = threadIdx.x; c < chunks && first < 0; c += THREADS) {
    const int64_t begin = c * kCdfChunk, end = begin + kCdfChunk < count ? begin + kCdfChunk : count;
    first = chunk_first_above(values, begin, end, starts[c], target);
  }
  found[threadIdx.x] = first;
  __syncthreads();
  for (int half = THREADS / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const int64_t other = found[threadIdx.x + half];
      if (other >= 0 && (found[threadIdx.x] < 0 || other < found[threadIdx.x])) found[threadIdx.x] = other;
    }
    __syncthreads();
  }
  const int64_t token = found[0] >= 0 ? found[0] : count - 1;
  __syncthreads();
  return token;
}

}  // namespace dflash
