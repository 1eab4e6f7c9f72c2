// The verify kernel: one thread block per batch row, the whole step (greedy prefix match or rejection sampling,
// the residual draw and the bonus token) in one launch. The pieces are rows.h's, the ones the host build
// runs; the vocabulary-wide ones (argmax, residual, draw) are split over the block's threads.
#include <cuda_runtime.h>

#include "../common/block_reduce.cuh"
#include "../common/launch.cuh"
#include "rows.h"

namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) verify_kernel(dflash::VerifyArgs a) {
  extern __shared__ double chunk_starts[];  // one per CDF chunk of the vocabulary
  __shared__ dflash::ArgBest argmax_scratch[kThreads];
  __shared__ int64_t found[kThreads];
  __shared__ double total;
  __shared__ int64_t shared_count;
  __shared__ int valid;
  const int64_t b = blockIdx.x;
  int64_t* out = a.out + 2 * b;
  if (threadIdx.x == 0) valid = dflash::row_ids_valid(a, b);
  __syncthreads();
  if (!valid) {
    if (threadIdx.x == 0) out[0] = out[1] = -1;
    return;
  }
  const int64_t k = a.num_drafts[b];
  if (!a.sampled[b]) {
    int64_t accepted = 0;
    int64_t next = dflash::block_argmax<kThreads>(dflash::scores_at(a, b, 0), a.vocab, argmax_scratch).index;
    while (accepted < k && next == a.draft[b * a.width + accepted]) {  // uniform: every thread has the same next
      ++accepted;
      next = dflash::block_argmax<kThreads>(dflash::scores_at(a, b, accepted), a.vocab, argmax_scratch).index;
    }
    if (threadIdx.x == 0) {
      out[0] = accepted;
      out[1] = next;
    }
    return;
  }
  if (threadIdx.x == 0) shared_count = dflash::sampled_accepted(a, b);
  __syncthreads();
  const int64_t accepted = shared_count;
  const float* values = dflash::scores_at(a, b, accepted);
  if (accepted < k) {
    dflash::residual_fill(a, b, accepted, threadIdx.x, a.vocab, kThreads);
    if (a.q_form[b] == dflash::kSparse) {  // uniform across the block: one row's form
      for (int64_t j = threadIdx.x; j < a.K; j += kThreads) dflash::sparse_q_reset(a, b, accepted, j);
      __syncthreads();
      if (threadIdx.x == 0) dflash::sparse_q_accumulate(a, b, accepted);
    }
    __syncthreads();
    // a repeated sparse id is patched by several threads with the same value: a benign race
    for (int64_t j = threadIdx.x; j < dflash::touched_entries(a, b); j += kThreads) {
      dflash::residual_patch(a, b, accepted, j);
    }
    __syncthreads();
    const float* residual = a.workspace + 2 * b * a.vocab;
    if (__syncthreads_or(dflash::any_positive(residual, threadIdx.x, a.vocab, kThreads))) values = residual;
  }
  const int64_t token = dflash::block_draw<kThreads>(dflash::RowValues{values}, a.vocab, a.sample_u[b], chunk_starts,
                                                      found, &total);
  if (threadIdx.x == 0) {
    out[0] = accepted;
    out[1] = token;
  }
}

}  // namespace

int64_t kSharedBudget() {
  static const int64_t budget = dflash::dynamic_shared_budget(verify_kernel);  // once per process
  return budget;
}

extern "C" int dflash_verify_probe() { return dflash::probe(verify_kernel); }

extern "C" int dflash_verify_cuda(const float* scores, const int64_t* draft, const int64_t* num_drafts,
                                  const uint8_t* sampled, const int32_t* q_form, const float* q_dense,
                                  const int64_t* q_ids, const float* q_probs, const double* accept_u,
                                  const double* sample_u, float* workspace, int64_t batch, int64_t width,
                                  int64_t vocab, int64_t K, int64_t* out, void* stream) {
  const int64_t chunks = (vocab + dflash::kCdfChunk - 1) / dflash::kCdfChunk;
  const int64_t shared_bytes = chunks * (int64_t)sizeof(double);
  if (batch < 0 || batch > dflash::kMaxGrid || width < 0 || vocab < 1 || K < 0
      || shared_bytes > kSharedBudget()) {
    return dflash::kBadArgument;
  }
  if (batch == 0) return dflash::kOk;
  const dflash::VerifyArgs args{scores, draft, num_drafts, sampled, q_form, q_dense, q_ids, q_probs,
                                accept_u, sample_u, workspace, batch, width, vocab, K, out};
  verify_kernel<<<(unsigned)batch, kThreads, (size_t)shared_bytes, (cudaStream_t)stream>>>(args);
  return dflash::launch_status();
}
