// The CUDA error names behind the positive status codes of the entry points, and the probe the loader runs once
// (cuda_ext/build.py): every kernel of this library can run on the current device.
#include <cuda_runtime.h>

#include "launch.cuh"

extern "C" const char* dflash_cuda_error_name(int error) { return cudaGetErrorString((cudaError_t)error); }
