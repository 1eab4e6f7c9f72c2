// The DFlash 2 selector's walk through one block row's candidates, as the pieces both builds run (host.cpp on one
// thread; kernel.cu with a block's threads over the K candidates). Row t takes a candidate k of
//   score_k = unary[t, k] + sum_r (predecessor[prev, r] * projected[t, r]) * successor[candidates[t, k], r]
// (prev: the token chosen for row t-1, the anchor before row 0): the best score on a greedy row (the first best on
// ties: candidates come best first), else a draw from q = softmax(score / temperature) with the row's uniform.
// The PyTorch reference is reference.py's walk; it and this make the same choices from the same inputs up to the
// last bits of q (torch's softmax rounds differently), which only matter for a uniform that lands within them.
#pragma once

#include "../common/hd.h"

namespace dflash {

struct WalkArgs {
  const float* unary;         // [batch, rows, K]
  const int64_t* candidates;  // [batch, rows, K]
  const int64_t* anchors;     // [batch]
  const float* projected;     // [batch, rows, rank]
  const float* predecessor;   // [vocab, rank]
  const float* successor;     // [vocab, rank]
  const float* temperatures;  // [batch]: <= 0 greedy
  const double* uniforms;     // [batch, rows] (read for sampled rows only; may be null when all are greedy)
  int64_t batch, rows, K, rank, vocab;
  int64_t* tokens;            // [batch, rows]
  int64_t* choices;           // [batch, rows]: each token's index among its row's candidates
  float* q;                   // [batch, rows, K]: the distribution each token came from (one-hot if greedy), or null
};

constexpr float kMinTemperature = 1e-6f;  // the reference clamps temperatures to this before dividing
constexpr int64_t kWalkMaxRank = 1024;        // the CUDA kernel's shared-memory limits (op.py falls back above)
constexpr int64_t kWalkMaxCandidates = 2048;

DFLASH_HD bool walk_ids_valid(const WalkArgs& a, int64_t b) {
  if (a.anchors[b] < 0 || a.anchors[b] >= a.vocab) return false;
  for (int64_t j = 0; j < a.rows * a.K; ++j) {
    const int64_t id = a.candidates[b * a.rows * a.K + j];
    if (id < 0 || id >= a.vocab) return false;
  }
  return true;
}

// query[r] = predecessor[previous, r] * projected[b, t, r] for r in [begin, end) every stride-th.
DFLASH_HD void walk_query(const WalkArgs& a, int64_t b, int64_t t, int64_t previous, float* query, int64_t begin,
                          int64_t stride) {
  const float* pred = a.predecessor + previous * a.rank;
  const float* proj = a.projected + (b * a.rows + t) * a.rank;
  for (int64_t r = begin; r < a.rank; r += stride) query[r] = pred[r] * proj[r];
}

// Candidate k's score at row t. The pair term is summed in 8 interleaved partial sums (rank r into sum r % 8,
// in order), added pairwise at the end: the same order in both builds, and 8 independent chains instead of one
// (a single running sum is a chain of rank dependent adds: the host walk of 16 demo blocks took 0.77 ms).
DFLASH_HD float walk_score(const WalkArgs& a, int64_t b, int64_t t, int64_t k, const float* query) {
  const int64_t at = (b * a.rows + t) * a.K + k;
  const float* succ = a.successor + a.candidates[at] * a.rank;
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t r = 0;
  for (; r + 8 <= a.rank; r += 8) {
    for (int j = 0; j < 8; ++j) part[j] += query[r + j] * succ[r + j];
  }
  for (int j = 0; r < a.rank; ++r, ++j) part[j] += query[r] * succ[r];
  const float pair = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  return a.unary[at] + pair;
}

// q over the K scores of a sampled row, in place into q: softmax(score / temperature), sums in candidate order.
DFLASH_HD void walk_softmax(const float* scores, int64_t K, float temperature, float* q) {
  const float t = temperature > kMinTemperature ? temperature : kMinTemperature;
  float top = scores[0] / t;
  for (int64_t k = 1; k < K; ++k) top = scores[k] / t > top ? scores[k] / t : top;
  float total = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    q[k] = exp_nonpositive(scores[k] / t - top);
    total += q[k];
  }
  for (int64_t k = 0; k < K; ++k) q[k] = q[k] / total;
}

struct QValues {
  const float* q;
  DFLASH_HD float operator()(int64_t k) const { return q[k]; }
};

// Row t's choice among its scores (q: K floats of scratch, or the output row), and q written where asked.
DFLASH_HD int64_t walk_choose(const WalkArgs& a, int64_t b, int64_t t, const float* scores, float* q) {
  if (a.temperatures[b] <= 0.0f) {
    const int64_t choice = argmax_strided(scores, 0, a.K, 1).index;
    for (int64_t k = 0; k < a.K; ++k) q[k] = k == choice ? 1.0f : 0.0f;
    return choice;
  }
  walk_softmax(scores, a.K, a.temperatures[b], q);
  return draw_sequential(QValues{q}, a.K, a.uniforms[b * a.rows + t]);
}

// A refused row (a token id outside the vocabulary): tokens and choices -1, q zero.
DFLASH_HD void walk_refuse(const WalkArgs& a, int64_t b, int64_t t) {
  a.tokens[b * a.rows + t] = a.choices[b * a.rows + t] = -1;
  if (a.q != nullptr) {
    for (int64_t k = 0; k < a.K; ++k) a.q[(b * a.rows + t) * a.K + k] = 0.0f;
  }
}

DFLASH_HD void walk_record(const WalkArgs& a, int64_t b, int64_t t, int64_t choice) {
  a.choices[b * a.rows + t] = choice;
  a.tokens[b * a.rows + t] = a.candidates[(b * a.rows + t) * a.K + choice];
}

}  // namespace dflash
