// A row's reduction split over a warp's 32 lanes in an order fixed by the row alone: lane l takes elements l,
// l + 32, ... in order, and the lanes' parts are added in one xor butterfly (offsets 16, 8, 4, 2, 1). The CUDA
// kernels run the butterfly with __shfl_xor_sync; the host builds run butterfly_sum on an array of the 32 parts,
// the same additions, so the same bits (every lane ends with the same value: addition is commutative).
#pragma once

#include "hd.h"

namespace dflash {

constexpr int kLanes = 32;  // a warp

DFLASH_HD float butterfly_sum(float* partial) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    float next[kLanes];
    for (int l = 0; l < kLanes; ++l) next[l] = partial[l] + partial[l ^ offset];
    for (int l = 0; l < kLanes; ++l) partial[l] = next[l];
  }
  return partial[0];
}

#ifdef __CUDACC__
// The device's butterfly: the same additions as butterfly_sum, lane by lane.
__device__ __forceinline__ float warp_butterfly_sum(float partial) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2) partial = partial + __shfl_xor_sync(0xffffffffu, partial, offset);
  return partial;
}
#endif

}  // namespace dflash
