// Sampling on the CPU: one call draws a token for every row of logits after temperature, top-k and
// top-p, in a few passes over each row (the PyTorch path of sampling/sampler.py runs ~25 full-row
// operators for a top-p draw); another gives the model's log-probability of given tokens.
//
// The rule, per row (sampler.py's `sample_weights_reference` is the same rule by sorting):
//   weights w_j = exp(l_j / T − max_i l_i / T) (float32, `exp8`; unnormalized: the rule only
//   uses ratios);
//   order the tokens by (w descending, token id ascending); candidates: the first top_k in that
//   order (top_k 0 or >= V: all) with w > 0;
//   kept: each candidate whose mass before it is below top_p · (the candidates' mass) (top_p 1: all);
//   drawn: the first kept token, in token-id order, at which the running mass exceeds u · (the kept
//   mass), u in [0, 1) the row's uniform.
// Masses are float64 sums (their order of summation is this file's; a sum that differs in the last
// bits moves a boundary only for a uniform or top_p within ~1e-15 of it). A row holding NaN or +inf,
// or only -inf (a model gone wrong), draws token 0 instead of failing.
//
// Selection without sorting: weights >= 0 order as their float32 bit patterns (`key`), so a
// histogram of the keys' high bits finds the bucket where a prefix of the order ends; only that
// bucket's tokens are looked at again (a histogram of the next bits, then a sort of the few left).
// A prefix of the order is one (key, id) pair (`Boundary`).
//
// Rows are independent (threads split rows): a row's token never depends on the rest of the batch.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

using forklm::exp8;
using forklm::hmax;
using forklm::hsum;

inline uint32_t key_of(float w) {
  uint32_t k;
  std::memcpy(&k, &w, sizeof k);
  return k;
}

// The end of a prefix of the order: token j is in it iff key_j > key, or key_j == key and j <= id.
struct Boundary {
  uint32_t key;
  int64_t id;
  bool contains(uint32_t k, int64_t j) const { return k > key || (k == key && j <= id); }
};

constexpr int L1_SHIFT = 19, L1_BINS = (0x3F800000u >> L1_SHIFT) + 1;  // w <= 1.0: keys <= 0x3F800000
constexpr int L2_SHIFT = 10, L2_BINS = 512;                           // the next 9 bits
constexpr int COPIES = 4;  // level-1 histograms filled in turn (independent chains of adds)

// max_j l_j; false for a broken row (a NaN, +inf, or only -inf).
bool row_max(const float* l, int64_t V, float* out) {
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 unord = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    const __m256 x = _mm256_loadu_ps(l + j);
    unord = _mm256_or_ps(unord, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // max_ps would drop a NaN
    vmax = _mm256_max_ps(vmax, x);
  }
  float mx = hmax(vmax);
  bool nan = _mm256_movemask_ps(unord) != 0;
  for (; j < V; ++j) {
    nan = nan || std::isnan(l[j]);
    mx = std::max(mx, l[j]);
  }
  *out = mx;
  return !nan && std::isfinite(mx);
}

// Row weights into w [V]; returns false for a broken row.
bool row_weights(const float* l, int64_t V, float temperature, float* w) {
  float mx;
  if (!row_max(l, V, &mx)) return false;
  int64_t j = 0;
  // w = exp(l / T − mx / T): softmax's numerator at temperature T, as `torch.softmax(l / T)` forms it
  const __m256 t = _mm256_set1_ps(temperature), m = _mm256_set1_ps(mx / temperature);
  for (j = 0; j + 8 <= V; j += 8)
    _mm256_storeu_ps(w + j, exp8(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(l + j), t), m)));
  if (j < V) {  // the tail through one padded vector
    alignas(32) float x[8];
    for (int i = 0; i < 8; ++i) x[i] = j + i < V ? l[j + i] / temperature - mx / temperature : -INFINITY;
    _mm256_store_ps(x, exp8(_mm256_load_ps(x)));
    for (int64_t i = 0; j + i < V; ++i) w[j + i] = x[i];
  }
  return true;
}

// A float64 sum of floats taken 8 at a time: two 4-lane accumulators, added in a fixed order.
struct Sum8d {
  __m256d a = _mm256_setzero_pd(), b = _mm256_setzero_pd();
  void add(__m256 x) {
    a = _mm256_add_pd(a, _mm256_cvtps_pd(_mm256_castps256_ps128(x)));
    b = _mm256_add_pd(b, _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)));
  }
  double total() const {
    alignas(32) double s[4];
    _mm256_store_pd(s, _mm256_add_pd(a, b));
    return (s[0] + s[1]) + (s[2] + s[3]);
  }
};

// Σ w over [0, V) in float64, 8 lanes in a fixed order.
double total_mass(const float* w, int64_t V) {
  Sum8d sum;
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) sum.add(_mm256_loadu_ps(w + j));
  double r = sum.total();
  for (; j < V; ++j) r += w[j];
  return r;
}

inline float float_of(uint32_t key) {
  float f;
  std::memcpy(&f, &key, sizeof f);
  return f;
}

// The candidates: every token (`all`) or the listed ones (ascending ids).
struct Candidates {
  bool all;
  std::vector<int64_t> ids;

  // f(j) for each candidate with w_j > 0 and lo <= w_j < hi, by id (every token: 8 compared at once,
  // so a row's many light tokens cost one vector compare per 8).
  template <class F>
  void each_in(const float* w, int64_t V, float lo, float hi, F&& f) const {
    if (!all) {
      for (int64_t j : ids)
        if (w[j] > 0.f && w[j] >= lo && w[j] < hi) f(j);
      return;
    }
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi), zero = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= V; j += 8) {
      const __m256 x = _mm256_loadu_ps(w + j);
      const __m256 in = _mm256_and_ps(_mm256_and_ps(_mm256_cmp_ps(x, vlo, _CMP_GE_OQ), _mm256_cmp_ps(x, vhi, _CMP_LT_OQ)),
                                      _mm256_cmp_ps(x, zero, _CMP_GT_OQ));
      for (unsigned bits = static_cast<unsigned>(_mm256_movemask_ps(in)); bits != 0; bits &= bits - 1)
        f(j + __builtin_ctz(bits));
    }
    for (; j < V; ++j)
      if (w[j] > 0.f && w[j] >= lo && w[j] < hi) f(j);
  }
};

// The last candidate (w > 0) of the shortest prefix of the order whose inclusive metric reaches
// `goal` (metric w: MASS, or 1: COUNT), and that prefix's metric. No prefix reaching it (the goal
// above the candidates' total: rounding, or fewer than top_k tokens): the last candidate.
// `floor`: a weight below which no token can end the prefix (skipped: most of a peaked row's tokens).
template <bool MASS>
std::pair<Boundary, double> prefix_end(const float* w, int64_t V, const Candidates& cand, double goal, float floor) {
  std::vector<double> h1(COPIES * L1_BINS, 0.0);
  unsigned copy = 0;
  const float inf = std::numeric_limits<float>::infinity();
  cand.each_in(w, V, floor, inf, [&](int64_t j) {
    h1[copy * L1_BINS + (key_of(w[j]) >> L1_SHIFT)] += MASS ? static_cast<double>(w[j]) : 1.0;
    copy = (copy + 1) & (COPIES - 1);
  });
  for (int b = 0; b < L1_BINS; ++b)
    h1[b] = (h1[b] + h1[L1_BINS + b]) + (h1[2 * L1_BINS + b] + h1[3 * L1_BINS + b]);
  double above = 0.0;
  int c1 = -1, lowest = -1;
  for (int b = L1_BINS - 1; b >= 0; --b) {
    if (h1[b] == 0.0) continue;
    lowest = b;
    if (above + h1[b] >= goal) {
      c1 = b;
      break;
    }
    above += h1[b];
  }
  if (lowest < 0) return {Boundary{0, V - 1}, 0.0};  // no candidate with w > 0 (not reached: rows have mass)
  if (c1 < 0) {  // short of the goal: the whole set, ending at its last token in the order
    c1 = lowest;
    above -= h1[lowest];
  }
  std::vector<int64_t> bucket;  // the crossing bucket's tokens, by id
  const float bucket_lo = std::max(floor, float_of(static_cast<uint32_t>(c1) << L1_SHIFT));
  const float bucket_hi = c1 + 1 < L1_BINS ? float_of(static_cast<uint32_t>(c1 + 1) << L1_SHIFT) : inf;
  cand.each_in(w, V, bucket_lo, bucket_hi, [&](int64_t j) { bucket.push_back(j); });
  double h2[L2_BINS] = {};
  for (int64_t j : bucket) h2[(key_of(w[j]) >> L2_SHIFT) & (L2_BINS - 1)] += MASS ? static_cast<double>(w[j]) : 1.0;
  int c2 = -1;
  lowest = -1;
  for (int b = L2_BINS - 1; b >= 0; --b) {
    if (h2[b] == 0.0) continue;
    lowest = b;
    if (above + h2[b] >= goal) {
      c2 = b;
      break;
    }
    above += h2[b];
  }
  if (c2 < 0) {
    c2 = lowest;
    above -= h2[lowest];
  }
  std::vector<std::pair<uint32_t, int64_t>> last;  // the crossing sub-bucket, in the order
  for (int64_t j : bucket) {
    const uint32_t k = key_of(w[j]);
    if (static_cast<int>((k >> L2_SHIFT) & (L2_BINS - 1)) == c2) last.emplace_back(k, j);
  }
  std::sort(last.begin(), last.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  for (size_t i = 0; i < last.size(); ++i) {
    above += MASS ? static_cast<double>(w[last[i].second]) : 1.0;
    if (above >= goal || i + 1 == last.size()) return {Boundary{last[i].first, last[i].second}, above};
  }
  return {Boundary{0, V - 1}, above};  // not reached: the sub-bucket holds a token
}

constexpr int64_t DRAW_BLOCK = 256;

// The first token of `kept` (candidates within boundary `b`) in id order at which the running mass
// exceeds target; past the end (rounding): the last kept token.
int64_t draw(const float* w, int64_t V, const Candidates& cand, const Boundary& b, double target) {
  double acc = 0.0;
  int64_t last = -1;
  if (!cand.all) {
    for (int64_t j : cand.ids) {
      const uint32_t k = key_of(w[j]);
      if (k == 0 || !b.contains(k, j)) continue;
      acc += w[j];
      last = j;
      if (acc > target) return j;
    }
    return last >= 0 ? last : 0;
  }
  // every token a candidate: block masses of the kept tokens (vectorized), then one block's walk
  float bw;
  std::memcpy(&bw, &b.key, sizeof bw);
  const __m256 vb = _mm256_set1_ps(bw);
  for (int64_t s = 0; s < V; s += DRAW_BLOCK) {
    const int64_t e = std::min(V, s + DRAW_BLOCK);
    double block = 0.0;
    bool ties = false;  // a token equal to the boundary's weight: its id decides
    if (e - s == DRAW_BLOCK) {
      Sum8d sum;
      __m256 eq = _mm256_setzero_ps();
      for (int64_t j = s; j < e; j += 8) {
        const __m256 x = _mm256_loadu_ps(w + j);
        sum.add(_mm256_and_ps(x, _mm256_cmp_ps(x, vb, _CMP_GT_OQ)));
        eq = _mm256_or_ps(eq, _mm256_cmp_ps(x, vb, _CMP_EQ_OQ));
      }
      block = sum.total();
      ties = bw > 0.f && _mm256_movemask_ps(eq) != 0;  // (a boundary of weight 0: every token, zeros weigh nothing)
    } else {
      ties = true;
    }
    if (ties) {  // recount the block token by token
      block = 0.0;
      for (int64_t j = s; j < e; ++j)
        if (key_of(w[j]) != 0 && b.contains(key_of(w[j]), j)) block += w[j];
    }
    if (block == 0.0) continue;
    if (acc + block > target) {
      for (int64_t j = s; j < e; ++j) {
        const uint32_t k = key_of(w[j]);
        if (k == 0 || !b.contains(k, j)) continue;
        acc += w[j];
        last = j;
        if (acc > target) return j;
      }
      // rounding between the block sum and the walk: go on to the next blocks
      continue;
    }
    acc += block;
    for (int64_t j = e - 1; j >= s; --j)  // remember the block's last kept token
      if (key_of(w[j]) != 0 && b.contains(key_of(w[j]), j)) {
        last = j;
        break;
      }
  }
  return last >= 0 ? last : 0;
}

int64_t sample_row(const float* l, int64_t V, float temperature, int64_t top_k, double top_p, double u, float* w) {
  if (!row_weights(l, V, temperature, w)) return 0;
  Candidates cand{true, {}};
  Boundary set{0, V - 1};  // every token
  double mass = total_mass(w, V);
  if (top_k > 0 && top_k < V) {
    set = prefix_end<false>(w, V, cand, static_cast<double>(top_k), 0.f).first;
    cand.all = false;
    cand.ids.reserve(top_k);
    for (int64_t j = 0; j < V; ++j)
      if (key_of(w[j]) != 0 && set.contains(key_of(w[j]), j)) cand.ids.push_back(j);
    mass = 0.0;
    for (int64_t j : cand.ids) mass += w[j];
  }
  if (top_p < 1.0) {
    // Tokens lighter than (mass − goal) / n weigh less than mass − goal together, so the rest reach
    // the goal: the prefix ends at a token at least that heavy (kept 0.1% below: rounding).
    const double goal = top_p * mass, n = cand.all ? static_cast<double>(V) : static_cast<double>(cand.ids.size());
    const float floor = mass - goal > 1e-9 * mass ? static_cast<float>(0.999 * (mass - goal) / n) : 0.f;
    const auto r = prefix_end<true>(w, V, cand, goal, floor);
    set = r.first;
    mass = r.second;
  }
  return draw(w, V, cand, set, u * mass);
}

void check_logits(const torch::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_cpu(),
              "logits must be a float32 CPU matrix [b, V]");
}

torch::Tensor sample_logits(const torch::Tensor& logits_in, double temperature, int64_t top_k, double top_p,
                            const torch::Tensor& u_in) {
  check_logits(logits_in);
  const torch::Tensor logits = logits_in.contiguous();
  const torch::Tensor u = u_in.contiguous();
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == torch::kFloat64 && u.is_cpu() && u.size(0) == logits.size(0),
              "uniforms must be float64 [b]");
  TORCH_CHECK(temperature > 0 && std::isfinite(temperature), "temperature must be a positive number");
  TORCH_CHECK(top_k >= 0, "top_k must be >= 0");
  TORCH_CHECK(top_p > 0 && top_p <= 1, "top_p must be in (0, 1]");
  const int64_t b = logits.size(0), V = logits.size(1);
  torch::Tensor out = torch::empty({b}, torch::kInt64);
  if (b == 0) return out;
  TORCH_CHECK(V > 0, "the vocabulary is empty");
  const float* lp = logits.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, b, 1, [&](int64_t r0, int64_t r1) {
    std::vector<float> w(V);
    for (int64_t r = r0; r < r1; ++r)
      op[r] = sample_row(lp + r * V, V, static_cast<float>(temperature), top_k, top_p, up[r], w.data());
  });
  return out;
}

// The weights the draw uses ([b, V]; rows of a broken row: NaN), for tests.
torch::Tensor sample_weights(const torch::Tensor& logits_in, double temperature) {
  check_logits(logits_in);
  const torch::Tensor logits = logits_in.contiguous();
  const int64_t b = logits.size(0), V = logits.size(1);
  torch::Tensor w = torch::empty({b, V}, torch::kFloat32);
  for (int64_t r = 0; r < b; ++r)
    if (!row_weights(logits.data_ptr<float>() + r * V, V, static_cast<float>(temperature), w.data_ptr<float>() + r * V))
      w[r].fill_(std::numeric_limits<float>::quiet_NaN());
  return w;
}

// log softmax(l)[token] = l_token − max − log Σ exp(l − max), the sum in float64 lanes.
torch::Tensor token_logprobs(const torch::Tensor& logits_in, const torch::Tensor& tokens_in) {
  check_logits(logits_in);
  const torch::Tensor logits = logits_in.contiguous();
  const torch::Tensor tokens = tokens_in.contiguous();
  const int64_t b = logits.size(0), V = logits.size(1);
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == torch::kInt64 && tokens.size(0) == b,
              "tokens must be int64 [b]");
  torch::Tensor out = torch::empty({b}, torch::kFloat32);
  const float* lp = logits.data_ptr<float>();
  const int64_t* tp = tokens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r)
    TORCH_CHECK(tp[r] >= 0 && tp[r] < V, "token ", tp[r], " is outside the vocabulary of ", V);
  at::parallel_for(0, b, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = lp + r * V;
      float mx;
      int64_t j = 0;
      if (!row_max(l, V, &mx)) {  // as log_softmax would give: NaN
        op[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const __m256 m = _mm256_set1_ps(mx);
      Sum8d acc;
      for (j = 0; j + 8 <= V; j += 8) acc.add(exp8(_mm256_sub_ps(_mm256_loadu_ps(l + j), m)));
      double sum = acc.total();
      for (; j < V; ++j) sum += std::exp(static_cast<double>(l[j]) - mx);
      op[r] = static_cast<float>(static_cast<double>(l[tp[r]]) - mx - std::log(sum));
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_logits", &sample_logits,
        "tokens [b] int64 drawn from logits [b, V] float32 at temperature, top_k, top_p with uniforms u [b] float64",
        py::call_guard<py::gil_scoped_release>());
  m.def("sample_weights", &sample_weights, "the draw's weights [b, V] float32: exp(l / T - max l / T)",
        py::call_guard<py::gil_scoped_release>());
  m.def("token_logprobs", &token_logprobs, "log_softmax(logits)[r, tokens[r]] for logits [b, V] float32",
        py::call_guard<py::gil_scoped_release>());
}
