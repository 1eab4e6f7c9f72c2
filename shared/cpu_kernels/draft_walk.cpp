// A DFlash 2 drafter's greedy drafts of each block in one call, from the block's final hidden states: the target's
// lm_head over the drafted rows, each row's top-K candidates (top_k.cpp), the selector's hidden projection, and
// the greedy walk through the candidates (the host walk of cuda_ext/dflash2_walk: the same score sums in the same
// order, compiled without contraction as that build is, and the same choice: the best score, NaN above all, the
// first on ties). In the draft call these were five calls with PyTorch between them (the demo drafter's logits and
// walk: 0.3 ms of a 0.77 ms draft call at concurrency 1, most of it dispatch and cold caches).
// The same bits as that path: the same GEMMs on the same rows (pooled_jobs.h: any thread count), the same top-k.
// Plain C ABI, loaded with ctypes: the struct mirrors draft_walk.py's ctypes structure field by field.
#include <cstdint>
#include <cstring>
#include <vector>

#include "no_contraction.h"
#include "pooled_jobs.h"

extern "C" {

void dflash_top_k(const float* x, int64_t rows, int64_t n, int64_t k, float* values, int64_t* ids);

// The tail's weights: lm_head (bf16_gemm tiles, in hidden, out vocab) and the selector's hidden projection (out
// rank), both in one layout (amx: 1 for the "amx" layout); the selector's codebooks [selector_vocab, rank] float32;
// top_k candidates a row (1 <= top_k <= vocab).
struct DraftWalkWeights {
  int64_t hidden, vocab, top_k, rank, selector_vocab, amx;
  const uint16_t* lm_head;
  const uint16_t* projection;
  const float* predecessor;
  const float* successor;
};

}  // extern "C"

namespace {

DFLASH_NO_CONTRACTION_BEGIN

// The candidate's score: unary + sum_r (predecessor[previous, r] * projected[r]) * successor[candidate, r], the
// pair sum in 8 interleaved partial sums added pairwise (cuda_ext/dflash2_walk/rows.h: walk_query, walk_score).
float walk_score(float unary, const float* query, const float* successor, int64_t rank) {
  DFLASH_NO_CONTRACTION
  float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t r = 0;
  for (; r + 8 <= rank; r += 8) {
    for (int j = 0; j < 8; ++j) part[j] += query[r + j] * successor[r + j];
  }
  for (int j = 0; r < rank; ++r, ++j) part[j] += query[r] * successor[r];
  const float pair = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  return unary + pair;
}

void walk_query(const float* predecessor, const float* projected, int64_t rank, float* query) {
  DFLASH_NO_CONTRACTION
  for (int64_t r = 0; r < rank; ++r) query[r] = predecessor[r] * projected[r];
}

DFLASH_NO_CONTRACTION_END

// Whether score a at index i beats the best so far (value best at index best_index; -1: none): the larger value,
// NaN above everything, the smaller index on ties (cuda_ext/common/hd.h: better).
bool beats(float a, int64_t i, float best, int64_t best_index) {
  if (best_index < 0) return true;
  const bool a_nan = a != a, best_nan = best != best;
  if (a_nan != best_nan) return a_nan;
  if (!a_nan && a != best) return a > best;
  return i < best_index;
}

}  // namespace

extern "C" {

// h [batch, block, hidden]: a block's final hidden states (row 0 the anchor's); rows 1..rows of each block are
// drafted (1 <= rows < block). anchors [batch]: the token before row 1. tokens [batch, rows] out. Returns 0; 1
// where a row's logits hold fewer than top_k numbers (NaN: the caller takes its per-op path, nothing chosen); -1
// for sizes it does not take; -2 for a token id outside the selector's vocabulary (an anchor).
int dflash_draft_greedy_walk(const DraftWalkWeights* weights, const float* h, int64_t batch, int64_t block,
                             int64_t rows, const int64_t* anchors, int64_t* tokens, void* pool_handle) {
  dflash::WorkerPool* pool = static_cast<dflash::WorkerPool*>(pool_handle);
  const DraftWalkWeights& w = *weights;
  const int64_t hidden = w.hidden, vocab = w.vocab, K = w.top_k, rank = w.rank, M = batch * rows;
  if (batch < 0 || rows < 1 || rows >= block || K < 1 || K > vocab || rank < 1 || w.selector_vocab < vocab) return -1;
  for (int64_t b = 0; b < batch; ++b) {
    if (anchors[b] < 0 || anchors[b] >= w.selector_vocab) return -2;
  }
  if (batch == 0) return 0;
  thread_local std::vector<float> x, logits, projected, unary, query;
  thread_local std::vector<int64_t> candidates;
  x.resize(M * hidden);
  logits.resize(M * vocab);
  projected.resize(M * rank);
  unary.resize(M * K);
  candidates.resize(M * K);
  query.resize(rank);
  for (int64_t b = 0; b < batch; ++b) {  // the drafted rows, dense: [batch * rows, hidden]
    std::memcpy(x.data() + b * rows * hidden, h + (b * block + 1) * hidden, sizeof(float) * rows * hidden);
  }
  dflash::jobs::pooled_gemm(pool, w.amx, x.data(), M, hidden, w.lm_head, vocab, logits.data());
  dflash_top_k(logits.data(), M, vocab, K, unary.data(), candidates.data());
  for (int64_t r = 0; r < M; ++r) {
    if (candidates[r * K + K - 1] < 0) return 1;
  }
  dflash::jobs::pooled_gemm(pool, w.amx, x.data(), M, hidden, w.projection, rank, projected.data());
  for (int64_t b = 0; b < batch; ++b) {
    int64_t previous = anchors[b];
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t row = b * rows + t;
      walk_query(w.predecessor + previous * rank, projected.data() + row * rank, rank, query.data());
      float best = 0.0f;
      int64_t choice = -1;
      for (int64_t k = 0; k < K; ++k) {
        const float score = walk_score(unary[row * K + k], query.data(), w.successor + candidates[row * K + k] * rank,
                                       rank);
        if (beats(score, k, best, choice)) best = score, choice = k;
      }
      previous = tokens[row] = candidates[row * K + choice];
    }
  }
  return 0;
}

}  // extern "C"
