// The DFlash 2 walk kernel: one thread block per batch row walks its B-1 rows in order; at each row the block's
// threads score the K candidates (rows.h: walk_score), then one thread chooses (walk_choose: the argmax, or
// softmax and the draw, in candidate order as the host build does). One launch for the whole path.
#include <cuda_runtime.h>

#include "../common/launch.cuh"
#include "rows.h"

namespace {

constexpr int kThreads = 128;
constexpr int64_t kMaxRank = dflash::kWalkMaxRank;
constexpr int64_t kMaxCandidates = dflash::kWalkMaxCandidates;

__global__ void __launch_bounds__(kThreads) walk_kernel(dflash::WalkArgs a) {
  __shared__ float query[kMaxRank];
  __shared__ float scores[kMaxCandidates];
  __shared__ float scratch[kMaxCandidates];
  __shared__ int64_t previous;
  __shared__ int valid;
  const int64_t b = blockIdx.x;
  if (threadIdx.x == 0) {
    valid = dflash::walk_ids_valid(a, b);
    previous = a.anchors[b];
  }
  __syncthreads();
  if (!valid) {  // a token id outside the vocabulary: the host build's refused row (rows.h: walk_refuse)
    for (int64_t t = threadIdx.x; t < a.rows; t += kThreads) dflash::walk_refuse(a, b, t);
    return;
  }
  for (int64_t t = 0; t < a.rows; ++t) {
    dflash::walk_query(a, b, t, previous, query, threadIdx.x, kThreads);
    __syncthreads();
    for (int64_t k = threadIdx.x; k < a.K; k += kThreads) scores[k] = dflash::walk_score(a, b, t, k, query);
    __syncthreads();
    if (threadIdx.x == 0) {
      float* q_row = a.q != nullptr ? a.q + (b * a.rows + t) * a.K : scratch;
      const int64_t choice = dflash::walk_choose(a, b, t, scores, q_row);
      dflash::walk_record(a, b, t, choice);
      previous = a.candidates[(b * a.rows + t) * a.K + choice];
    }
    __syncthreads();
  }
}

}  // namespace

extern "C" int dflash_dflash2_walk_probe() { return dflash::probe(walk_kernel); }

extern "C" int dflash_dflash2_walk_cuda(const float* unary, const int64_t* candidates, const int64_t* anchors,
                                        const float* projected, const float* predecessor, const float* successor,
                                        const float* temperatures, const double* uniforms, int64_t batch,
                                        int64_t rows, int64_t K, int64_t rank, int64_t vocab, int64_t* tokens,
                                        int64_t* choices, float* q, void* stream) {
  if (batch < 0 || batch > dflash::kMaxGrid || rows < 0 || K < 1 || rank < 1 || rank > kMaxRank
      || K > kMaxCandidates || uniforms == nullptr) {
    return dflash::kBadArgument;
  }
  if (batch == 0 || rows == 0) return dflash::kOk;
  const dflash::WalkArgs a{unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms,
                           batch, rows, K, rank, vocab, tokens, choices, q};
  walk_kernel<<<(unsigned)batch, kThreads, 0, (cudaStream_t)stream>>>(a);
  return dflash::launch_status();
}
