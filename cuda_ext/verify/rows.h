// Verification of one batch row, as the pieces both builds run (host.cpp loops over rows on one thread;
// kernel.cu gives each row a thread block and splits the vocabulary-wide pieces over its threads).
//
// Row b drafted num_drafts[b] tokens of a block padded to `width`. Position i of scores scores draft i; position
// num_drafts[b] gives the token after a fully accepted block. A greedy row's scores are logits: it accepts the
// longest prefix equal to the argmax and takes the argmax after it. A sampled row's scores are probabilities p
// after the request's logits processing: draft i is accepted when accept_u[i] * q_i(d_i) < p_i(d_i); at the first
// rejection the next token is drawn from max(0, p - q) (p itself if that is all zero), else the bonus from p,
// with sample_u. q comes as a point mass on the draft, sparse (K ids and probabilities per position) or dense.
// Every piece computes the same numbers as the PyTorch reference (cuda_ext/verify/reference.py).
#pragma once

#include "../common/hd.h"

namespace dflash {

enum QForm : int32_t { kPointMass = 0, kSparse = 1, kDense = 2 };

struct VerifyArgs {
  const float* scores;        // [batch, width + 1, vocab]: logits (greedy rows) or probabilities (sampled rows)
  const int64_t* draft;       // [batch, width]
  const int64_t* num_drafts;  // [batch], each in 0 .. width
  const uint8_t* sampled;     // [batch]: 1 = rejection sampling, 0 = greedy prefix match
  const int32_t* q_form;      // [batch]: QForm of the row's proposal (sampled rows)
  const float* q_dense;       // [batch, width, vocab] (rows of form kDense), or null
  const int64_t* q_ids;       // [batch, width, K] (rows of form kSparse), or null
  const float* q_probs;       // [batch, width, K]
  const double* accept_u;     // [batch, width]
  const double* sample_u;     // [batch]
  float* workspace;           // [batch, 2, vocab]: a sampled row's residual, and its sparse q summed per id
  int64_t batch, width, vocab, K;
  int64_t* out;               // [batch, 2]: accepted count, next token; (-1, -1) for a row row_ids_valid refuses
};

DFLASH_HD const float* scores_at(const VerifyArgs& a, int64_t b, int64_t i) {
  return a.scores + (b * (a.width + 1) + i) * a.vocab;
}

// Whether the row can be verified without reading outside its arguments: a draft count within the block, draft
// ids (and sparse q ids) inside the vocabulary, and the tensors its q form needs (null when absent). The kernel
// checks this itself, so the caller never reads values back before the launch (a CUDA graph captures it).
DFLASH_HD bool row_ids_valid(const VerifyArgs& a, int64_t b) {
  const int64_t k = a.num_drafts[b];
  if (k < 0 || k > a.width) return false;
  if (a.sampled[b]) {
    const int32_t form = a.q_form[b];
    if (form < kPointMass || form > kDense) return false;
    if (form == kDense && k > 0 && a.q_dense == nullptr) return false;
    if (form == kSparse && k > 0 && (a.K == 0 || a.q_ids == nullptr || a.q_probs == nullptr)) return false;
  }
  for (int64_t i = 0; i < k; ++i) {
    const int64_t d = a.draft[b * a.width + i];
    if (d < 0 || d >= a.vocab) return false;
  }
  if (a.sampled[b] && a.q_form[b] == kSparse) {
    for (int64_t j = 0; j < k * a.K; ++j) {
      const int64_t id = a.q_ids[b * a.width * a.K + j];
      if (id < 0 || id >= a.vocab) return false;
    }
  }
  return true;
}

// q_i(token) of a sampled row: sparse probabilities summed over the ids equal to token, in their order, from 0
// (what scattering them onto a zero row gives).
DFLASH_HD float q_at(const VerifyArgs& a, int64_t b, int64_t i, int64_t token) {
  switch (a.q_form[b]) {
    case kPointMass:
      return token == a.draft[b * a.width + i] ? 1.0f : 0.0f;
    case kSparse: {
      const int64_t* ids = a.q_ids + (b * a.width + i) * a.K;
      const float* probs = a.q_probs + (b * a.width + i) * a.K;
      float q = 0.0f;
      for (int64_t j = 0; j < a.K; ++j) {
        if (ids[j] == token) q += probs[j];
      }
      return q;
    }
    default:
      return a.q_dense[(b * a.width + i) * a.vocab + token];
  }
}

// A sampled row's accepted count: the acceptance tests in order, up to the first failure.
DFLASH_HD int64_t sampled_accepted(const VerifyArgs& a, int64_t b) {
  const int64_t k = a.num_drafts[b];
  for (int64_t i = 0; i < k; ++i) {
    const int64_t d = a.draft[b * a.width + i];
    const double p = (double)scores_at(a, b, i)[d];
    const double q = (double)q_at(a, b, i, d);
    if (!(a.accept_u[b * a.width + i] * q < p)) return i;
  }
  return k;
}

DFLASH_HD float clamp_nonnegative(float x) { return x > 0.0f ? x : 0.0f; }

// The residual max(0, p - q) at the rejected position i, for v in [begin, end) every stride-th: the entries a
// sparse or point-mass q leaves at p, and a dense q's differences. The entries a sparse or point-mass q touches
// are then set by residual_patch, after a sparse q's probabilities are summed per id (sparse_q_reset, then
// sparse_q_accumulate): O(vocab + K), where looking each id up among the K would be O(K^2).
DFLASH_HD void residual_fill(const VerifyArgs& a, int64_t b, int64_t i, int64_t begin, int64_t end, int64_t stride) {
  const float* p = scores_at(a, b, i);
  float* r = a.workspace + 2 * b * a.vocab;
  if (a.q_form[b] == kDense) {
    const float* q = a.q_dense + (b * a.width + i) * a.vocab;
    for (int64_t v = begin; v < end; v += stride) r[v] = clamp_nonnegative(p[v] - q[v]);
  } else {
    for (int64_t v = begin; v < end; v += stride) r[v] = p[v];
  }
}

DFLASH_HD float* q_sums(const VerifyArgs& a, int64_t b) { return a.workspace + (2 * b + 1) * a.vocab; }

// The j-th sparse id's sum slot to 0 (any order; duplicates write the same 0).
DFLASH_HD void sparse_q_reset(const VerifyArgs& a, int64_t b, int64_t i, int64_t j) {
  q_sums(a, b)[a.q_ids[(b * a.width + i) * a.K + j]] = 0.0f;
}

// Each id's probabilities summed in the order of the K entries, as scattering them onto a zero row does (one
// thread: the order of a repeated id's additions is the reference's).
DFLASH_HD void sparse_q_accumulate(const VerifyArgs& a, int64_t b, int64_t i) {
  const int64_t* ids = a.q_ids + (b * a.width + i) * a.K;
  const float* probs = a.q_probs + (b * a.width + i) * a.K;
  float* sums = q_sums(a, b);
  for (int64_t j = 0; j < a.K; ++j) sums[ids[j]] += probs[j];
}

// The j-th touched entry (j < K for sparse q, j == 0 for a point mass), after residual_fill and, for sparse q,
// sparse_q_accumulate. A repeated id writes the same value each time.
DFLASH_HD void residual_patch(const VerifyArgs& a, int64_t b, int64_t i, int64_t j) {
  const int32_t form = a.q_form[b];
  if (form == kDense || (form == kPointMass && j > 0)) return;
  const float* p = scores_at(a, b, i);
  float* r = a.workspace + 2 * b * a.vocab;
  if (form == kPointMass) {
    const int64_t token = a.draft[b * a.width + i];
    r[token] = clamp_nonnegative(p[token] - 1.0f);
    return;
  }
  const int64_t token = a.q_ids[(b * a.width + i) * a.K + j];
  r[token] = clamp_nonnegative(p[token] - q_sums(a, b)[token]);
}

DFLASH_HD int64_t touched_entries(const VerifyArgs& a, int64_t b) {
  return a.q_form[b] == kSparse ? a.K : (a.q_form[b] == kPointMass ? 1 : 0);
}

// The values a row draws from: the residual in the workspace, or a row of p.
struct RowValues {
  const float* values;
  DFLASH_HD float operator()(int64_t v) const { return values[v]; }
};

// Whether any of values[begin, end) (every stride-th) is positive: a sum of non-negative values is positive
// exactly when one of them is, whatever the order of the sum.
DFLASH_HD bool any_positive(const float* values, int64_t begin, int64_t end, int64_t stride) {
  for (int64_t v = begin; v < end; v += stride) {
    if (values[v] > 0.0f) return true;
  }
  return false;
}

// One row on one thread (the host build; the CUDA kernel runs the same pieces over a block's threads).
DFLASH_HD void verify_row_sequential(const VerifyArgs& a, int64_t b) {
  int64_t* out = a.out + 2 * b;
  if (!row_ids_valid(a, b)) {
    out[0] = out[1] = -1;
    return;
  }
  const int64_t k = a.num_drafts[b];
  if (!a.sampled[b]) {
    int64_t accepted = 0;
    int64_t next = argmax_strided(scores_at(a, b, 0), 0, a.vocab, 1).index;
    while (accepted < k && next == a.draft[b * a.width + accepted]) {
      ++accepted;
      next = argmax_strided(scores_at(a, b, accepted), 0, a.vocab, 1).index;
    }
    out[0] = accepted;
    out[1] = next;
    return;
  }
  const int64_t accepted = sampled_accepted(a, b);
  const float* values = scores_at(a, b, accepted);  // the bonus position, or the p of a rejected one
  if (accepted < k) {
    residual_fill(a, b, accepted, 0, a.vocab, 1);
    if (a.q_form[b] == kSparse) {
      for (int64_t j = 0; j < a.K; ++j) sparse_q_reset(a, b, accepted, j);
      sparse_q_accumulate(a, b, accepted);
    }
    for (int64_t j = 0; j < touched_entries(a, b); ++j) residual_patch(a, b, accepted, j);
    const float* residual = a.workspace + 2 * b * a.vocab;
    if (any_positive(residual, 0, a.vocab, 1)) values = residual;
  }
  out[0] = accepted;
  out[1] = draw_sequential(RowValues{values}, a.vocab, a.sample_u[b]);
}

}  // namespace dflash
