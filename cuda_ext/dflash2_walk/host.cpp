// The host build of the DFlash 2 walk: every batch row on this thread, through the same pieces as kernel.cu. It
// is also the CPU drafter's walk (cuda_ext/dflash2_walk/op.py: cpu_default).
#include <vector>

#include "rows.h"

extern "C" int dflash_dflash2_walk_host(const float* unary, const int64_t* candidates, const int64_t* anchors,
                                        const float* projected, const float* predecessor, const float* successor,
                                        const float* temperatures, const double* uniforms, int64_t batch,
                                        int64_t rows, int64_t K, int64_t rank, int64_t vocab, int64_t* tokens,
                                        int64_t* choices, float* q) {
  if (batch < 0 || rows < 0 || K < 1 || rank < 1 || uniforms == nullptr) return dflash::kBadArgument;
  const dflash::WalkArgs a{unary, candidates, anchors, projected, predecessor, successor, temperatures, uniforms,
                           batch, rows, K, rank, vocab, tokens, choices, q};
  std::vector<float> query(rank), scores(K), scratch(K);
  for (int64_t b = 0; b < batch; ++b) {
    if (!dflash::walk_ids_valid(a, b)) {  // refused as the CUDA kernel refuses it
      for (int64_t t = 0; t < rows; ++t) dflash::walk_refuse(a, b, t);
      continue;
    }
    int64_t previous = anchors[b];
    for (int64_t t = 0; t < rows; ++t) {
      dflash::walk_query(a, b, t, previous, query.data(), 0, 1);
      for (int64_t k = 0; k < K; ++k) scores[k] = dflash::walk_score(a, b, t, k, query.data());
      float* q_row = q != nullptr ? q + (b * rows + t) * K : scratch.data();
      const int64_t choice = dflash::walk_choose(a, b, t, scores.data(), q_row);
      dflash::walk_record(a, b, t, choice);
      previous = candidates[(b * rows + t) * K + choice];
    }
  }
  return dflash::kOk;
}
