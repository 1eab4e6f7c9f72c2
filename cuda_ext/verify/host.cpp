// The host build of the verify kernel: every row on this thread, through the same pieces as kernel.cu.
#include "rows.h"

extern "C" int dflash_verify_host(const float* scores, const int64_t* draft, const int64_t* num_drafts,
                                  const uint8_t* sampled, const int32_t* q_form, const float* q_dense,
                                  const int64_t* q_ids, const float* q_probs, const double* accept_u,
                                  const double* sample_u, float* workspace, int64_t batch, int64_t width,
                                  int64_t vocab, int64_t K, int64_t* out) {
  if (batch < 0 || width < 0 || vocab < 1 || K < 0) return dflash::kBadArgument;
  const dflash::VerifyArgs args{scores, draft, num_drafts, sampled, q_form, q_dense, q_ids, q_probs,
                                accept_u, sample_u, workspace, batch, width, vocab, K, out};
  for (int64_t b = 0; b < batch; ++b) dflash::verify_row_sequential(args, b);
  return dflash::kOk;
}
