// What the two screened greedy heads (head.cc: bfloat16, head8.cc: int8) share: each token's radius, the decision
// over the screened logits, and the checks of their inputs. The bounds and their proofs are in each screen's file.
#pragma once

#include "common.h"

namespace opt {

// Each token's radius: rad_j = 1e-30 + c.w[0] u[0][j] + c.w[1] u[1][j] + c.w[2] u[2][j]; a screen with fewer terms
// points the rest at u[0] with a zero weight (adding +0 changes no sum), so the loop has no branch and vectorizes.
struct Radius {
  const float* u[3];
  float w[3];
  float operator()(int64_t j) const { return ((1e-30f + w[0] * u[0][j]) + w[1] * u[1][j]) + w[2] * u[2][j]; }
};

// Each row's token (tok[M]) from its screened logits approx [M, N], first multiplied by row_scale[r] where that is
// given, and its radius; `all` rows score every token exactly (xs [M, K] the rows, e [N, K] the embedding;
// `exclude` [M] a token each row may not take, -1 for none; `allowed` [M, words] structured output's masks).
void decide_rows(const float* xs, float* approx, const float* e, int64_t m, int64_t k, int64_t n,
                 const std::vector<Radius>& rads, const std::vector<char>& all, const int32_t* exclude,
                 const int32_t* allowed, int64_t words, const float* row_scale, int32_t* tok);
// The largest of v[0..n) and 0.
float largest(const float* v, int64_t n);
// A non-finite input, or one whose logits could overflow float32 (|x| |e_j| past 1e37), is scored exactly.
bool scored_exactly(double x_norm, float max_norm);
// The token masks' words per row (0: none), or -1 when `allowed` is not [M, 0] or [M, ceil(N / 32)].
int64_t mask_words(const ffi::Buffer<ffi::S32>& allowed, int64_t m, int64_t n);

}  // namespace opt
