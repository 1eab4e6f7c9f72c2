// What every CUDA entry point does after its launch, and the probe the loader runs once (device only).
#pragma once

#include <cuda_runtime.h>

#include "hd.h"

namespace dflash {

// 0, or the launch's cudaError_t (positive): a launch that failed is reported, never silently skipped.
inline int launch_status() { return (int)cudaGetLastError(); }

// Whether a kernel can run on the current device (the runtime linked into this library is usable with the
// driver, and the library holds code for this architecture): 0, or the cudaError_t.
template <typename Kernel>
int probe(Kernel kernel) {
  cudaFuncAttributes attributes;
  return (int)cudaFuncGetAttributes(&attributes, kernel);
}

// The dynamic shared memory a launch may use beside the kernel's static shared memory (48 KB in all without
// opting in), or -1 if the kernel cannot be inspected.
template <typename Kernel>
int64_t dynamic_shared_budget(Kernel kernel) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) return -1;
  return 48 * 1024 - (int64_t)attributes.sharedSizeBytes;
}

}  // namespace dflash

// A CUDA error's name, for the Python message.
extern "C" const char* dflash_cuda_error_name(int error);
