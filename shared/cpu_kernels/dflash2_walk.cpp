// The DFlash 2 selector's greedy walk through each block's candidates (draft_worker.dflash2_model.walk with
// every row greedy): row t takes the candidate k with the best
//   score_k = unary[t, k] + sum_r predecessor[prev, r] * projected[t, r] * successor[candidates[t, k], r]
// (prev: the token chosen for row t-1, the anchor before row 0), the first best on ties (candidates come best
// first). One call for the whole batch instead of a handful of PyTorch ops per row. Float32; C ABI (ctypes).
#include <cstdint>
#include <vector>

extern "C" {

// unary, candidates [batch, rows, K]; anchors [batch]; projected [batch, rows, rank]; predecessor, successor
// [vocab, rank]. Writes tokens and choices (the index k of each token among its row's candidates) [batch, rows]. Returns 0, or -1 (nothing meaningful written) for a token id
// outside the vocabulary.
int dflash_greedy_walk(const float* unary, const int64_t* candidates, const int64_t* anchors, const float* projected,
                       const float* predecessor, const float* successor, int64_t batch, int64_t rows, int64_t K,
                       int64_t rank, int64_t vocab, int64_t* tokens, int64_t* choices) {
  std::vector<float> query(rank);
  for (int64_t b = 0; b < batch; ++b) {
    int64_t previous = anchors[b];
    for (int64_t t = 0; t < rows; ++t) {
      if (previous < 0 || previous >= vocab) return -1;
      const float* pred = predecessor + previous * rank;
      const float* proj = projected + (b * rows + t) * rank;
      for (int64_t r = 0; r < rank; ++r) query[r] = pred[r] * proj[r];
      const float* u = unary + (b * rows + t) * K;
      const int64_t* ids = candidates + (b * rows + t) * K;
      int64_t best = -1;
      float best_score = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        if (ids[k] < 0 || ids[k] >= vocab) return -1;
        const float* succ = successor + ids[k] * rank;
        float pair = 0.0f;
        for (int64_t r = 0; r < rank; ++r) pair += query[r] * succ[r];
        const float score = u[k] + pair;
        if (best < 0 || score > best_score) {
          best = k;
          best_score = score;
        }
      }
      previous = ids[best];
      tokens[b * rows + t] = previous;
      choices[b * rows + t] = best;
    }
  }
  return 0;
}

}  // extern "C"
