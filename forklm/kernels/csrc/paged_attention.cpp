// Decode attention over the paged KV cache on x86 CPUs with AVX2 (float32 arithmetic over a float32,
// float16 or bfloat16 cache), as one call per layer:
// rotary embedding of the new tokens' q and k, their K/V written into the cache, and every decode
// row's attention over its KV segments, merged exactly by log-sum-exp.
//
// Work comes as items (the plan of kernels/segment_attention.py, for CPUs): an item is a run of KV
// blocks holding `tokens` tokens, read by a set of rows. A shared prompt is one item listing every
// sample that shares it (its K/V read once for all of them: the rows' p = h / g query heads of a KV
// head are M = rows·p query vectors against the same keys, the bifurcated product); each row's own
// tail is an item of its own.
//
// Batch invariance: a row's output depends on its keys and their positions alone, never on the rows
// beside it, how its keys are split into items or where its blocks lie in the pool. So a row's keys
// go in chunks at fixed positions [k·C, (k + 1)·C) of its sequence (the units of thread work: item,
// KV head, the item's part of a chunk); a chunk that spans two items runs as two units, the second
// continuing the first's state. Inside a chunk, the online softmax decides one KV block at a time
// (`attend_range`): S = (scale·Q) Kᵀ [M, n]; where the block's max passes m by a margin, m' = that max,
// acc = acc·e^(m−m'), l = l·e^(m−m'); then P = exp(S − m'), l = l + ΣP (the block's sum), acc = acc + P V;
// every score in one order whatever M (`scores_tile`), every value's chain over the keys in key
// order. Each (row, head) merges its chunks in chunk order:
//   lse_k = m_k + log l_k,  o = Σ exp(lse_k − lse) acc_k / l_k            (docs/design.md)
// Rotary: out[i] = x[i]·cos[i] + x[(i + D/2) mod D]·sin_signed[i] with sin_signed = [−sin₁, sin₂],
// two products and a sum each rounded (built with -ffp-contract=off): bit for bit the model's
// `apply_rope` in PyTorch.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include "simd_math.h"

#include <algorithm>
#include <atomic>
#include <memory>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {


using forklm::exp8;
using forklm::hmax;
using forklm::hsum;

// The cache holds float32 or float16 (`Fp16`: IEEE binary16 bits, converted with F16C); either way
// the arithmetic is float32.
struct Fp16 {
  uint16_t bits;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const Fp16* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(Fp16* p, __m256 v) {  // rounded to nearest even, as torch's .to(float16)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// A bfloat16 cache (a bfloat16 model's own KV dtype): the top 16 bits of a float32, widened exactly.
struct Bf16 {
  uint16_t bits;
};

inline __m256 load8(const Bf16* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
inline void store8(Bf16* p, __m256 v) {  // rounded to nearest even, NaN kept quiet, as torch's .to(bfloat16)
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);  // the 8 halves in the low 128 bits
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

struct Items {
  const int32_t* rows_start;   // [I + 1] CSR offsets into rows
  const int32_t* rows;         // batch rows reading each item
  const int32_t* blocks_start; // [I + 1] CSR offsets into blocks
  const int32_t* blocks;       // the items' block ids, in order
  const int32_t* tokens;       // [I] tokens of each item
  int64_t num_items;
};

// The one order every score is computed in, whatever the number of query rows, the tile or the
// build (so a row's scores never depend on the rows beside it): 8 lanes over d (lane i sums
// d = i, i + 8, ... in d order, one FMA chain each), then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline float tree_sum(__m256 a) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, a), _mm256_hadd_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

// The vectors a scores tile runs on. Lanes8: one query row a 256-bit vector. Lanes16 (the AVX-512
// build): two rows a 512-bit vector, lanes 0-7 row 2i and 8-15 row 2i + 1, each lane the same FMA chain
// over d as Lanes8's, the key's 8 values in both halves, the query rows paired ([M / 2][D / 8][16],
// `pair_rows`). half(v, r): query row r's 8 lanes of v.
struct Lanes8 {
  using V = __m256;
  static constexpr int ROWS = 1;
  static V zero() { return _mm256_setzero_ps(); }
  template <typename T>
  static V key(const T* p) { return load8(p); }
  static V query(const float* q, int64_t D, int i, int64_t d) { return _mm256_loadu_ps(q + i * D + d); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static __m256 half(V v, int) { return v; }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int ROWS = 2;
  static V zero() { return _mm512_setzero_ps(); }
  template <typename T>
  static V key(const T* p) { return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(load8(p)))); }
  static V query(const float* q2, int64_t D, int i, int64_t d) { return _mm512_loadu_ps(q2 + i * 2 * D + 2 * d); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 half(V v, int r) {
    return r ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)) : _mm512_castps512_ps256(v);
  }
};
#endif

// S[m, j] = Q[m] · K[j] for MR vectors of query rows (MR · L::ROWS rows) against n keys (rows D apart,
// straight from the cache), in the order above: 4 keys at a time, MR·4 accumulators, the 4 keys'
// vectors loaded once for the MR vectors; two hadds reduce a row's 4 scores at once, in the same pairs
// as tree_sum.
template <typename L, int MR, typename T>
inline void scores_tile(const float* q, int64_t D, const T* kp, int64_t n, int64_t NP, float* s) {
  using V = typename L::V;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const T* k = kp + j * D;
    V a[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 4; ++c) a[i][c] = L::zero();
    for (int64_t d = 0; d < D; d += 8) {
      const V k0 = L::key(k + d), k1 = L::key(k + D + d), k2 = L::key(k + 2 * D + d), k3 = L::key(k + 3 * D + d);
      for (int i = 0; i < MR; ++i) {
        const V qv = L::query(q, D, i, d);
        a[i][0] = L::fma(qv, k0, a[i][0]);
        a[i][1] = L::fma(qv, k1, a[i][1]);
        a[i][2] = L::fma(qv, k2, a[i][2]);
        a[i][3] = L::fma(qv, k3, a[i][3]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < L::ROWS; ++r) {
        // lanes [a0 a1 a2 a3] of the low half plus those of the high half
        const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(L::half(a[i][0], r), L::half(a[i][1], r)),
                                        _mm256_hadd_ps(L::half(a[i][2], r), L::half(a[i][3], r)));
        _mm_storeu_ps(s + (i * L::ROWS + r) * NP + j, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
      }
  }
  for (; j < n; ++j)
    for (int i = 0; i < MR; ++i) {
      V a = L::zero();
      for (int64_t d = 0; d < D; d += 8) a = L::fma(L::query(q, D, i, d), L::key(kp + j * D + d), a);
      for (int r = 0; r < L::ROWS; ++r) s[(i * L::ROWS + r) * NP + j] = tree_sum(L::half(a, r));
    }
}

// Query rows a scores tile takes: AVX2's 16 vector registers hold 2 rows' 8 accumulators, the 4 keys
// and a query vector.
constexpr int SCORE_ROWS = 2;

#if defined(__AVX512F__)
// q [M, D] -> q2 [M / 2][D / 8][16]: rows 2i and 2i + 1 side by side, 8 values of each at a time.
inline void pair_rows(const float* q, int64_t M, int64_t D, float* q2) {
  for (int64_t i = 0; i + 1 < M; i += 2)
    for (int64_t d = 0; d < D; d += 8) {
      std::copy(q + i * D + d, q + i * D + d + 8, q2 + i * D + 2 * d);
      std::copy(q + (i + 1) * D + d, q + (i + 1) * D + d + 8, q2 + i * D + 2 * d + 8);
    }
}
constexpr int SCORE_PAIRS = 6;  // 24 accumulators, 4 keys, a query vector: 29 of the 32 registers
#endif

// acc[m, :] += P[m, 0:n] · V[0:n, :] for MR <= 3 rows, 32 of the D values a pass: 4·MR chains in flight
// (pv_tile's 16-value passes give 2·MR, which wait on the FMA latency when MR is small: a one-sample step's
// units have MR = p, often 3). Each value's sum over j runs in the same order as pv_tile's: the same bits.
template <int MR, typename T>
inline void pv_tile_wide(const float* p, int64_t NP, int64_t n, const T* v, int64_t D, float* acc, int64_t& d) {
  static_assert(MR <= 3, "4·MR accumulators, the values and the broadcasts fill AVX2's 16 registers at MR = 3");
  for (; d + 32 <= D; d += 32) {
    __m256 a[MR][4];
    for (int i = 0; i < MR; ++i)
      for (int k = 0; k < 4; ++k) a[i][k] = _mm256_loadu_ps(acc + i * D + d + 8 * k);
    for (int64_t j = 0; j < n; ++j) {
      __m256 pb[MR];
      for (int i = 0; i < MR; ++i) pb[i] = _mm256_broadcast_ss(p + i * NP + j);
      for (int k = 0; k < 4; ++k) {
        const __m256 vk = load8(v + j * D + d + 8 * k);
        for (int i = 0; i < MR; ++i) a[i][k] = _mm256_fmadd_ps(pb[i], vk, a[i][k]);
      }
    }
    for (int i = 0; i < MR; ++i)
      for (int k = 0; k < 4; ++k) _mm256_storeu_ps(acc + i * D + d + 8 * k, a[i][k]);
  }
}

// acc[m, :] += P[m, 0:n] · V[0:n, :] for MR rows; V rows `vs` apart, D a multiple of 16.
template <int MR, typename T>
inline void pv_tile(const float* p, int64_t NP, int64_t n, const T* v, int64_t D, float* acc) {
  int64_t d = 0;
  if constexpr (MR <= 3) pv_tile_wide<MR>(p, NP, n, v, D, acc, d);
  for (; d < D; d += 16) {
    __m256 a0[MR], a1[MR];
    for (int i = 0; i < MR; ++i) {
      a0[i] = _mm256_loadu_ps(acc + i * D + d);
      a1[i] = _mm256_loadu_ps(acc + i * D + d + 8);
    }
    for (int64_t j = 0; j < n; ++j) {
      const __m256 v0 = load8(v + j * D + d), v1 = load8(v + j * D + d + 8);
      for (int i = 0; i < MR; ++i) {
        const __m256 pb = _mm256_broadcast_ss(p + i * NP + j);
        a0[i] = _mm256_fmadd_ps(pb, v0, a0[i]);
        a1[i] = _mm256_fmadd_ps(pb, v1, a1[i]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(acc + i * D + d, a0[i]);
      _mm256_storeu_ps(acc + i * D + d + 8, a1[i]);
    }
  }
}

#if defined(__AVX512F__)
// The 512-bit form of pv_tile (the build with AVX-512, on CPUs with AVX512-VNNI: the block kernel's
// VNNI build rule): 16 lanes a vector, up to 4 vectors across. Each value is the same FMA chain over
// the keys, in the same order, as the 256-bit tiles': the same bits, with half the instructions.
template <int MR, int NV>
inline void pv_tile512_cols(const float* p, int64_t NP, int64_t n, const float* v, int64_t D, float* acc, int64_t d) {
  __m512 a[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int k = 0; k < NV; ++k) a[i][k] = _mm512_loadu_ps(acc + i * D + d + 16 * k);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vk[NV];
    for (int k = 0; k < NV; ++k) vk[k] = _mm512_loadu_ps(v + j * D + d + 16 * k);
    for (int i = 0; i < MR; ++i) {
      const __m512 pb = _mm512_set1_ps(p[i * NP + j]);
      for (int k = 0; k < NV; ++k) a[i][k] = _mm512_fmadd_ps(pb, vk[k], a[i][k]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(acc + i * D + d + 16 * k, a[i][k]);
}

// acc[m, :] += P[m, 0:n] · V[0:n, :] for MR <= 6 rows of float32 values (D a multiple of 16).
template <int MR>
inline void pv_tile512(const float* p, int64_t NP, int64_t n, const float* v, int64_t D, float* acc) {
  int64_t d = 0;
  for (; d + 64 <= D; d += 64) pv_tile512_cols<MR, 4>(p, NP, n, v, D, acc, d);
  for (; d + 16 <= D; d += 16) pv_tile512_cols<MR, 1>(p, NP, n, v, D, acc, d);
}
#endif

constexpr int64_t DIRECT_MAX_ROWS = 24;  // up to this many query rows a unit reads a float16 block's values as stored

// The block's n value rows as float32 (exact widening of a float16 cache), converted once for all
// of a unit's row tiles instead of once per tile.
inline const float* widen_piece(const float* vp, int64_t, int64_t, std::vector<float>&) { return vp; }
template <typename H>
inline const float* widen_piece(const H* vp, int64_t n, int64_t D, std::vector<float>& buf) {
  buf.resize(n * D);
  for (int64_t i = 0; i < n * D; i += 8) _mm256_storeu_ps(buf.data() + i, load8(vp + i));
  return buf.data();
}

// Row tiles of 6 (12 accumulators, the two loaded vectors and a broadcast: 15 of AVX2's 16
// registers), then 4, 3, 2 or 1 for the rest: tile(std::integral_constant<int, MR>, m) for rows
// [m, m + MR). Each row's sums run in the same order in any tile.
template <typename F>
inline void by_rows(int64_t M, F tile) {
  int64_t m = 0;
  for (; m + 6 <= M; m += 6) tile(std::integral_constant<int, 6>{}, m);
  for (; m + 4 <= M; m += 4) tile(std::integral_constant<int, 4>{}, m);
  switch (M - m) {
    case 3: tile(std::integral_constant<int, 3>{}, m); break;
    case 2: tile(std::integral_constant<int, 2>{}, m); break;
    case 1: tile(std::integral_constant<int, 1>{}, m); break;
    default: break;
  }
}

// Tiles of R rows, then R − 1, ... for the rest: tile(std::integral_constant<int, MR>, m) for rows [m, m + MR).
template <int R, typename F>
inline void by_rows_of(int64_t M, int64_t m, F tile) {
  for (; m + R <= M; m += R) tile(std::integral_constant<int, R>{}, m);
  if constexpr (R > 1)
    if (m < M) by_rows_of<R - 1>(M, m, tile);
}

// How far a block's largest score may pass the running reference before the state is rescaled to it:
// P = exp(S − m) stays below e^8 (float32 holds the sums easily) and rescales become rare, so a row's
// value chains run unbroken over many blocks.
constexpr float RESCALE_MARGIN = 8.f;

// Keys [n0, n1) of an item for M query vectors (scaled, [M, D]) in one KV head, continuing the online
// softmax state the caller holds: acc [M, D] (unnormalized), mx [M] (the reference the exps are taken
// from), l [M, 8] (their sum in 8 lanes, a block's key j in lane j mod 8, added up at the merge).
// Every decision is taken per KV block, from that block's keys alone: its scores, whether one passes
// mx + RESCALE_MARGIN (then, and at the first block, mx moves to the block's largest and acc, l are
// rescaled), its exps (added to l); each value's chain over the keys runs in key order, broken only
// where a row is rescaled. So a row's result depends on its keys and the block boundaries
// alone, never on how many rows share the unit, where the blocks lie in the pool (adjacent blocks are
// read as one piece of up to 64 keys, as fast) or which unit ran the keys before.
template <typename T>
void attend_range(const float* q, int64_t M, int64_t D, const T* K, const T* V, const int32_t* blocks,
                  int64_t bs, int64_t n0, int64_t n1, float* acc, float* mx, float* l) {
  constexpr int64_t PIECE = 64;  // keys a piece may hold (runs of adjacent blocks)
  thread_local std::vector<float> s, vf, alpha, q2;
#if defined(__AVX512F__)
  q2.resize(M / 2 * 2 * D);
  pair_rows(q, M, D, q2.data());
#endif
  const int64_t cap = std::max<int64_t>(PIECE, (bs + 7) / 8 * 8);
  s.resize(M * cap);
  const int64_t max_blocks = cap / std::max<int64_t>(bs, 1) + 2;
  alpha.resize(M * max_blocks);
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = n0; t < n1;) {
    // a piece: the rest of this block, then (blocks of a multiple of 8 keys) adjacent blocks up to PIECE keys
    const int64_t slot0 = static_cast<int64_t>(blocks[t / bs]) * bs + t % bs;
    int64_t n = std::min(bs - t % bs, n1 - t);
    if (bs % 8 == 0 && t % bs == 0)
      while (n + bs <= PIECE && t + n < n1 && static_cast<int64_t>(blocks[(t + n) / bs]) * bs == slot0 + n)
        n += std::min(bs, n1 - t - n);
    const int64_t NP = (n + 7) / 8 * 8;
    const int64_t nb = t % bs == 0 ? (n + bs - 1) / bs : 1;  // the piece's blocks (parts of blocks)
    const T* kp = K + slot0 * D;
    float* sp = s.data();
    // the scores (a float16 block's keys widened as read: a float32 copy for many rows measured slower)
#if defined(__AVX512F__)
    if (M > 1) {  // two rows a vector, then the odd row
      by_rows_of<SCORE_PAIRS>(M / 2, 0, [&](auto mp, int64_t i) {
        scores_tile<Lanes16, decltype(mp)::value>(q2.data() + 2 * i * D, D, kp, n, NP, sp + 2 * i * NP);
      });
    }
    if (M % 2) scores_tile<Lanes8, 1>(q + (M - 1) * D, D, kp, n, NP, sp + (M - 1) * NP);
#else
    by_rows_of<SCORE_ROWS>(M, 0, [&](auto mr, int64_t m) {
      scores_tile<Lanes8, decltype(mr)::value>(q + m * D, D, kp, n, NP, sp + m * NP);
    });
#endif
    for (int64_t m = 0; m < M; ++m) {
      float* row = sp + m * NP;
      for (int64_t j = n; j < NP; ++j) row[j] = -std::numeric_limits<float>::infinity();
      __m256 lv = _mm256_loadu_ps(l + m * 8);
      float ref = mx[m];
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t j0 = b * bs, j1 = std::min(n, j0 + (nb == 1 ? n : bs)), J1 = (j1 + 7) / 8 * 8;
        // rescale where a score of the block passes ref + RESCALE_MARGIN (or is NaN), and at the first block
        bool over = ref == -std::numeric_limits<float>::infinity();
        if (!over) {
          const __m256 th = _mm256_set1_ps(ref + RESCALE_MARGIN);
          int mask = 0;
          for (int64_t j = j0; j < J1; j += 8) mask |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), th, _CMP_NLE_UQ));
          over = mask != 0;
        }
        float a = 1.f;
        if (over) {
          __m256 vmax = ninf;
          for (int64_t j = j0; j < J1; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + j));
          const float m_new = std::max(ref, hmax(vmax));  // a NaN score spreads through P below
          a = std::exp(ref - m_new);  // ref = -inf at first: 0
          ref = m_new;
          lv = _mm256_mul_ps(lv, _mm256_set1_ps(a));
        }
        alpha[m * max_blocks + b] = a;
        const __m256 mb = _mm256_set1_ps(ref);
        for (int64_t j = j0; j < J1; j += 8) {
          const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mb));
          _mm256_storeu_ps(row + j, e);
          lv = _mm256_add_ps(lv, e);
        }
      }
      _mm256_storeu_ps(l + m * 8, lv);
      mx[m] = ref;
    }
    // P·V: each row tile's chains over the piece's keys, broken at the blocks where one of its rows is
    // rescaled. Value rows read by every row tile: widened once for the many-row units (faster at many
    // query rows; a few rows read float16 values widened as read). Every tile runs each value's chain
    // in key order: the same bits.
    const T* vraw = V + slot0 * D;
    const auto pv_rows = [&](auto mr, int64_t m, const auto* vp, auto tile) {
      constexpr int MR = decltype(mr)::value;
      int64_t j0 = 0;
      for (int64_t b = 0; b < nb; ++b) {
        bool rescale = false;
        for (int i = 0; i < MR; ++i) rescale |= alpha[(m + i) * max_blocks + b] != 1.f;
        if (!rescale) continue;
        const int64_t jb = b * bs;
        if (jb > j0) tile(mr, sp + m * NP + j0, NP, jb - j0, vp + j0 * D, D, &acc[m * D]);
        for (int i = 0; i < MR; ++i) {
          const __m256 ab = _mm256_set1_ps(alpha[(m + i) * max_blocks + b]);
          for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(&acc[(m + i) * D + d], _mm256_mul_ps(ab, _mm256_loadu_ps(&acc[(m + i) * D + d])));
        }
        j0 = jb;
      }
      tile(mr, sp + m * NP + j0, NP, n - j0, vp + j0 * D, D, &acc[m * D]);
    };
    const auto pv256 = [](auto mr, const float* p, int64_t np, int64_t k, const auto* v, int64_t d, float* a) {
      pv_tile<decltype(mr)::value>(p, np, k, v, d, a);
    };
    if (M > DIRECT_MAX_ROWS) {
      const float* vw = widen_piece(vraw, n, D, vf);
#if defined(__AVX512F__)
      const auto pv512 = [](auto mr, const float* p, int64_t np, int64_t k, const float* v, int64_t d, float* a) {
        pv_tile512<decltype(mr)::value>(p, np, k, v, d, a);
      };
      by_rows(M, [&](auto mr, int64_t m) { pv_rows(mr, m, vw, pv512); });
#else
      by_rows(M, [&](auto mr, int64_t m) { pv_rows(mr, m, vw, pv256); });
#endif
    } else {
      by_rows(M, [&](auto mr, int64_t m) { pv_rows(mr, m, vraw, pv256); });
    }
    t += n;
  }
}

inline void rope_row(const float* x, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < D; ++i) out[i] = x[i] * c[i] + x[(i + half) % D] * s[i];
}

inline void store_row(const float* x, int64_t D, float* out) { std::copy(x, x + D, out); }
template <typename H>
inline void store_row(const float* x, int64_t D, H* out) {
  for (int64_t d = 0; d < D; d += 8) store8(out + d, _mm256_loadu_ps(x + d));
}

// The most bytes one kernel call keeps in chunk states before it runs its rows in groups (tests lower it).
inline std::atomic<int64_t>& state_budget() {
  static std::atomic<int64_t> bytes{int64_t(256) << 20};
  return bytes;
}
inline int64_t state_budget_bytes() { return state_budget().load(std::memory_order_relaxed); }

// The attention of rows [0, num_rows) over the items of `it` (row ids local to these tables):
// qp [num_rows, h, D] rotated queries, op [num_rows, h·D] the outputs; K / V the caches [g, S, D].
template <typename KV>
void attend_items(const Items& it, int64_t num_rows, const float* qp, float* op, const KV* K, const KV* V,
                  int64_t g, int64_t S, int64_t D, int64_t h, int64_t bs, float scale, int64_t chunk_tokens) {
  const int64_t p = h / g, I = it.num_items;
  // Each row's items, in item order: its keys are their keys one after the other, so an item starts at
  // the same key position for each of its rows (the engine's plans: shared segments, then the tail).
  std::vector<int64_t> row_count(num_rows + 1, 0);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t r = it.rows_start[i]; r < it.rows_start[i + 1]; ++r) ++row_count[it.rows[r] + 1];
  for (int64_t r = 0; r < num_rows; ++r) row_count[r + 1] += row_count[r];
  std::vector<int64_t> fill(row_count.begin(), row_count.end() - 1), row_item(row_count[num_rows]);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t r = it.rows_start[i]; r < it.rows_start[i + 1]; ++r) row_item[fill[it.rows[r]]++] = i;
  // Keys go in chunks at fixed key positions [k·C, (k + 1)·C) of a row's sequence, each with its own
  // online-softmax state, merged at the end in chunk order: the same chunks, states and merge whatever
  // rows share the row's items. An item's chunk that began in the row's previous item continues that
  // item's state (so its units wait for that item's: below).
  const int64_t C = std::max<int64_t>(chunk_tokens, bs) / bs * bs;
  std::vector<int64_t> item_start(I, -1), item_depth(I, -1), row_chunk0(num_rows + 1, 0);
  for (int64_t r = 0; r < num_rows; ++r) {
    TORCH_CHECK(row_count[r + 1] > row_count[r], "row ", r, " reads no item");
    int64_t pos = 0;
    for (int64_t at = row_count[r]; at < row_count[r + 1]; ++at) {
      const int64_t i = row_item[at], depth = at - row_count[r];
      if (item_start[i] < 0) {
        item_start[i] = pos;
        item_depth[i] = depth;
      }
      TORCH_CHECK(item_start[i] == pos && item_depth[i] == depth, "item ", i,
                  " must follow the same items in every row that reads it");
      pos += it.tokens[i];
    }
    row_chunk0[r + 1] = row_chunk0[r] + (pos + C - 1) / C;
  }
  struct Unit {
    int32_t item, head, n0, n1;  // KV head `head`, keys [n0, n1) of the item: one chunk's part
    int32_t r0, r1;              // the item's rows it_rows[r0:r1] (all of them, or a share: see below)
    int64_t chunk;               // the chunk's index in its rows' sequences
    bool resume;                 // the chunk began in the rows' previous item: continue its state
  };
  // Units by item depth (an item's predecessors first); a unit that resumes a chunk waits for the
  // units of the rows' previous item on the same (KV head, chunk). Few units a step (one shared
  // prompt's) would leave threads idle: those of many rows are shared out by rows (rows never change
  // each other's results).
  std::vector<int64_t> order(I);
  for (int64_t i = 0; i < I; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return item_depth[x] < item_depth[y]; });
  int64_t base_units = 0;
  for (int64_t i = 0; i < I; ++i) base_units += g * ((item_start[i] + it.tokens[i] - 1) / C - item_start[i] / C + 1);
  const int threads = std::max(1, at::get_num_threads());
  const int64_t parts = threads == 1 ? 1 : std::max<int64_t>(1, (4 * threads + base_units - 1) / base_units);
  const int64_t min_share = std::max<int64_t>(1, (8 + p - 1) / p);  // at least 8 query vectors a share
  // item i's units: for each of its chunks (from its first, item_start[i] / C) and KV head, item_shares[i]
  // units in a row from item_first[i]
  std::vector<Unit> units;
  std::vector<int64_t> item_first(I), item_shares(I);
  for (const int64_t i : order) {
    const int64_t A = item_start[i], n = it.tokens[i], rows = it.rows_start[i + 1] - it.rows_start[i];
    const int64_t share = std::max<int64_t>((rows + parts - 1) / parts, min_share);
    item_first[i] = static_cast<int64_t>(units.size());
    item_shares[i] = (rows + share - 1) / share;
    for (int64_t n0 = 0; n0 < n;) {
      const int64_t k = (A + n0) / C, n1 = std::min(n, (k + 1) * C - A);
      const bool resume = (A + n0) % C != 0;
      for (int64_t j = 0; j < g; ++j)
        for (int64_t r = it.rows_start[i]; r < it.rows_start[i + 1]; r += share)
          units.push_back(Unit{static_cast<int32_t>(i), static_cast<int32_t>(j), static_cast<int32_t>(n0),
                               static_cast<int32_t>(n1), static_cast<int32_t>(r),
                               static_cast<int32_t>(std::min<int64_t>(it.rows_start[i + 1], r + share)), k, resume});
      n0 = n1;
    }
  }
  const int64_t U = static_cast<int64_t>(units.size());
  std::vector<std::vector<int64_t>> deps(U);  // the unit groups a resuming unit waits for
  for (int64_t u = 0; u < U; ++u) {
    const Unit& un = units[u];
    if (!un.resume) continue;
    std::vector<int64_t> prev;
    for (int64_t r = un.r0; r < un.r1; ++r) {
      const int64_t row = it.rows[r], pi = row_item[row_count[row] + item_depth[un.item] - 1];
      if (std::find(prev.begin(), prev.end(), pi) == prev.end()) prev.push_back(pi);
    }
    for (const int64_t pi : prev) {  // its units on this chunk and head
      const int64_t c = un.chunk - item_start[pi] / C;
      TORCH_CHECK(c >= 0 && item_start[pi] + it.tokens[pi] > un.chunk * C, "item ", un.item,
                  " resumes a chunk its previous item does not reach");
      const int64_t first = item_first[pi] + (c * g + un.head) * item_shares[pi];
      for (int64_t v = first; v < first + item_shares[pi]; ++v) deps[u].push_back(v);
    }
  }
  // the states: acc [D] (unnormalized), running max and sum per (row, chunk, query head)
  const int64_t states = row_chunk0[num_rows] * h;
  std::vector<float> st_acc(states * D), st_mx(states), st_l(states * 8);
  std::unique_ptr<std::atomic<int>[]> status(new std::atomic<int>[U]);  // 0 waiting, 1 taken, 2 done
  for (int64_t u = 0; u < U; ++u) status[u].store(0, std::memory_order_relaxed);
  std::atomic<int64_t> first_open{0};  // units before it are all taken
  const int nt = std::max(1, std::min<int>(threads, static_cast<int>(U)));
#pragma omp parallel num_threads(nt)
  while (true) {
    int64_t u = -1;
    bool open = false;
    for (int64_t c = first_open.load(std::memory_order_acquire); c < U; ++c) {
      if (status[c].load(std::memory_order_acquire) != 0) continue;
      open = true;
      bool ready = true;
      for (const int64_t d : deps[c]) ready = ready && status[d].load(std::memory_order_acquire) == 2;
      int expected = 0;
      if (ready && status[c].compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
        u = c;
        break;
      }
    }
    if (u < 0) {
      if (!open) break;
      _mm_pause();  // the rest waits for units other threads are running
      continue;
    }
    {
      int64_t f = first_open.load(std::memory_order_relaxed);
      while (f < U && status[f].load(std::memory_order_acquire) != 0 && first_open.compare_exchange_weak(f, f + 1)) ++f;
    }
    {
      const Unit& un = units[u];
      const int64_t r0 = un.r0, r1 = un.r1, M = (r1 - r0) * p;
      thread_local std::vector<float> qs, acc, mx, l;
      qs.resize(M * D);  // the unit's query vectors, scaled: row r's heads j·p .. j·p + p − 1
      acc.resize(M * D);
      mx.resize(M);
      l.resize(M * 8);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t e = 0; e < p; ++e) {
          const int64_t row = it.rows[r], v = (r - r0) * p + e;
          const float* src = qp + (row * h + un.head * p + e) * D;
          float* dst = qs.data() + v * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
          const int64_t at = (row_chunk0[row] + un.chunk) * h + un.head * p + e;
          if (un.resume) {
            std::copy(&st_acc[at * D], &st_acc[(at + 1) * D], acc.data() + v * D);
            mx[v] = st_mx[at];
            std::copy(&st_l[at * 8], &st_l[(at + 1) * 8], l.data() + v * 8);
          } else {
            std::fill(acc.data() + v * D, acc.data() + (v + 1) * D, 0.f);
            mx[v] = -std::numeric_limits<float>::infinity();
            std::fill(l.data() + v * 8, l.data() + (v + 1) * 8, 0.f);
          }
        }
      attend_range(qs.data(), M, D, K + un.head * S * D, V + un.head * S * D, it.blocks + it.blocks_start[un.item], bs,
                   un.n0, un.n1, acc.data(), mx.data(), l.data());
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t e = 0; e < p; ++e) {
          const int64_t v = (r - r0) * p + e, at = (row_chunk0[it.rows[r]] + un.chunk) * h + un.head * p + e;
          std::copy(acc.data() + v * D, acc.data() + (v + 1) * D, &st_acc[at * D]);
          st_mx[at] = mx[v];
          std::copy(l.data() + v * 8, l.data() + (v + 1) * 8, &st_l[at * 8]);
        }
    }
    status[u].store(2, std::memory_order_release);
  }

  // each (row, head): its chunks' normalized outputs o_k = acc_k / l_k merged by log-sum-exp in chunk order
  at::parallel_for(0, num_rows * h, 8, [&](int64_t a, int64_t z) {
    std::vector<float> w, sums;
    for (int64_t rh = a; rh < z; ++rh) {
      const int64_t r = rh / h, hh = rh % h, k0 = row_chunk0[r], nk = row_chunk0[r + 1] - k0;
      float* dst = op + rh * D;
      if (nk == 1) {
        const int64_t at = k0 * h + hh;
        const float inv = 1.f / hsum(_mm256_loadu_ps(&st_l[at * 8]));
        for (int64_t d = 0; d < D; ++d) dst[d] = st_acc[at * D + d] * inv;
        continue;
      }
      w.resize(nk);
      sums.resize(nk);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t c = 0; c < nk; ++c) {
        const int64_t at = (k0 + c) * h + hh;
        sums[c] = hsum(_mm256_loadu_ps(&st_l[at * 8]));
        w[c] = st_mx[at] + std::log(sums[c]);  // the chunk's log-sum-exp
        m = std::max(m, w[c]);
      }
      float den = 0.f;
      for (int64_t c = 0; c < nk; ++c) den += (w[c] = std::exp(w[c] - m));
      std::fill(dst, dst + D, 0.f);
      for (int64_t c = 0; c < nk; ++c) {
        const int64_t at = (k0 + c) * h + hh;
        const float wk = w[c] / den, inv = 1.f / sums[c];
        const float* src = &st_acc[at * D];
        for (int64_t d = 0; d < D; ++d) dst[d] += wk * (src[d] * inv);
      }
    }
  });
}

// q_in: [T, (h + 2g)·D] (the q/k/v product's rows) when `cos` is given: rotary applied to q and k,
// k and v written to the cache at write_slots, attention for rows [0, num_rows). Otherwise q_in is
// [num_rows, h, D], already rotated, its K/V already in the cache. Returns o [num_rows, h·D].
template <typename KV>
torch::Tensor paged_attention_impl(const torch::Tensor& q_in, const std::optional<torch::Tensor>& cos_in,
                              const std::optional<torch::Tensor>& sin_in, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const std::optional<torch::Tensor>& slots_in,
                              int64_t h, int64_t num_rows, const torch::Tensor& rows_start, const torch::Tensor& rows,
                              const torch::Tensor& blocks_start, const torch::Tensor& blocks,
                              const torch::Tensor& tokens, int64_t bs, double scale_in, int64_t chunk_tokens) {
  const int64_t g = k_cache.size(0), S = k_cache.size(1), D = k_cache.size(2);
  TORCH_CHECK(h > 0 && g > 0 && h % g == 0, "num_heads (", h, ") must be a multiple of the cache's KV heads (", g, ")");
  TORCH_CHECK(D % 16 == 0 && D > 0, "head dim must be a multiple of 16, got ", D);
  TORCH_CHECK(bs > 0 && S % bs == 0, "block size must divide the cache's slots");
  const int64_t p = h / g;
  for (const auto* t : {&rows_start, &rows, &blocks_start, &blocks, &tokens})
    TORCH_CHECK(t->scalar_type() == torch::kInt32 && t->is_contiguous() && t->is_cpu() && t->dim() == 1,
                "plan tables must be contiguous int32 CPU vectors");
  const int64_t I = tokens.size(0);
  TORCH_CHECK(rows_start.size(0) == I + 1 && blocks_start.size(0) == I + 1, "plan tables disagree on the items");
  const Items it{rows_start.data_ptr<int32_t>(), rows.data_ptr<int32_t>(), blocks_start.data_ptr<int32_t>(),
                 blocks.data_ptr<int32_t>(), tokens.data_ptr<int32_t>(), I};
  const int64_t num_blocks = S / bs;
  // the plan is checked in full: a bad index would read or write outside the cache
  TORCH_CHECK(it.rows_start[0] == 0 && it.rows_start[I] == rows.size(0) && it.blocks_start[0] == 0 &&
                  it.blocks_start[I] == blocks.size(0), "plan offsets out of range");
  for (int64_t i = 0; i < I; ++i) {
    const int64_t r0 = it.rows_start[i], r1 = it.rows_start[i + 1], b0 = it.blocks_start[i], b1 = it.blocks_start[i + 1];
    TORCH_CHECK(r0 < r1 && b0 <= b1 && it.tokens[i] >= 1 && it.tokens[i] <= (b1 - b0) * bs,
                "item ", i, " needs rows and at most as many tokens as its blocks hold");
    for (int64_t r = r0; r < r1; ++r) TORCH_CHECK(it.rows[r] >= 0 && it.rows[r] < num_rows, "item row out of range");
    for (int64_t b = b0; b < b1; ++b) TORCH_CHECK(it.blocks[b] >= 0 && it.blocks[b] < num_blocks, "block id out of range");
  }
  const float scale = static_cast<float>(scale_in);
  KV* K = reinterpret_cast<KV*>(k_cache.data_ptr());
  KV* V = reinterpret_cast<KV*>(v_cache.data_ptr());

  torch::Tensor q;  // [num_rows, h, D] rotated queries
  if (cos_in.has_value()) {
    TORCH_CHECK(sin_in.has_value() && slots_in.has_value(), "rotary needs cos, sin and the write slots");
    const torch::Tensor qkv = q_in.contiguous(), c = cos_in->contiguous(), s = sin_in->contiguous(),
                        slots = slots_in->contiguous();
    const int64_t T = qkv.size(0);
    TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == torch::kFloat32 && qkv.is_cpu() && qkv.size(1) == (h + 2 * g) * D,
                "qkv must be float32 [T, (h + 2g)·D]");
    TORCH_CHECK(c.scalar_type() == torch::kFloat32 && s.scalar_type() == torch::kFloat32 && c.numel() == T * D &&
                    s.numel() == T * D && c.is_cpu() && s.is_cpu(), "cos / sin must be float32 [T, D]");
    TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == T && slots.is_cpu(), "write slots must be int64 [T]");
    TORCH_CHECK(num_rows <= T, "more attention rows than tokens");
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "write slot ", sl[t], " outside the cache");
    q = torch::empty({num_rows, h, D}, torch::kFloat32);
    const float *xp = qkv.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    const int64_t W = (h + 2 * g) * D;
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
      std::vector<float> tmp(D);
      for (int64_t t = t0; t < t1; ++t) {
        const float *x = xp + t * W, *ct = cp + t * D, *st = sp + t * D;
        if (t < num_rows)
          for (int64_t hh = 0; hh < h; ++hh) rope_row(x + hh * D, ct, st, D, qp + (t * h + hh) * D);
        for (int64_t j = 0; j < g; ++j) {
          rope_row(x + (h + j) * D, ct, st, D, tmp.data());
          store_row(tmp.data(), D, K + (j * S + sl[t]) * D);
          store_row(x + (h + g + j) * D, D, V + (j * S + sl[t]) * D);
        }
      }
    });
  } else {
    q = q_in.contiguous();
    TORCH_CHECK(q.dim() == 3 && q.size(0) == num_rows && q.size(1) == h && q.size(2) == D &&
                    q.scalar_type() == torch::kFloat32 && q.is_cpu(), "q must be float32 [rows, h, D]");
  }
  torch::Tensor o = torch::empty({num_rows, h * D}, torch::kFloat32);
  if (num_rows == 0) return o;
  TORCH_CHECK(I > 0, "the plan has ", num_rows, " rows and no item: every row must read at least one");

  const float* qp = q.data_ptr<float>();
  float* op = o.data_ptr<float>();
  // The chunks' states take (D + 9) floats per row, query head and chunk: a prefill chunk of 512 rows at
  // position 32k of an 8B shape would hold ~0.5 GB. Rows go in groups (consecutive row ids) whose states
  // fit the budget; a group reads its items' keys again, and rows never change each other's results, so
  // the output is the same bits whatever the grouping.
  const int64_t C = std::max<int64_t>(chunk_tokens, bs) / bs * bs;
  std::vector<int64_t> row_keys(num_rows, 0);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t r = it.rows_start[i]; r < it.rows_start[i + 1]; ++r) row_keys[it.rows[r]] += it.tokens[i];
  const int64_t budget = state_budget_bytes();
  std::vector<int64_t> group_end;
  for (int64_t r = 0, bytes = 0; r < num_rows; ++r) {
    const int64_t b = (row_keys[r] + C - 1) / C * h * (D + 9) * static_cast<int64_t>(sizeof(float));
    if (r > 0 && bytes + b > budget) {
      group_end.push_back(r);
      bytes = 0;
    }
    bytes += b;
  }
  group_end.push_back(num_rows);
  if (group_end.size() == 1) {
    attend_items<KV>(it, num_rows, qp, op, K, V, g, S, D, h, bs, scale, chunk_tokens);
    return o;
  }
  std::vector<int32_t> rs, rw, bst, blk, tk;
  for (size_t gi = 0, R0 = 0; gi < group_end.size(); R0 = group_end[gi++]) {
    const int64_t R1 = group_end[gi];
    rs.assign(1, 0);
    bst.assign(1, 0);
    rw.clear();
    blk.clear();
    tk.clear();
    for (int64_t i = 0; i < I; ++i) {  // the items these rows read, with only these rows
      const size_t before = rw.size();
      for (int64_t r = it.rows_start[i]; r < it.rows_start[i + 1]; ++r)
        if (it.rows[r] >= static_cast<int64_t>(R0) && it.rows[r] < R1) rw.push_back(it.rows[r] - static_cast<int32_t>(R0));
      if (rw.size() == before) continue;
      rs.push_back(static_cast<int32_t>(rw.size()));
      blk.insert(blk.end(), it.blocks + it.blocks_start[i], it.blocks + it.blocks_start[i + 1]);
      bst.push_back(static_cast<int32_t>(blk.size()));
      tk.push_back(it.tokens[i]);
    }
    const Items sub{rs.data(), rw.data(), bst.data(), blk.data(), tk.data(), static_cast<int64_t>(tk.size())};
    attend_items<KV>(sub, R1 - static_cast<int64_t>(R0), qp + R0 * h * D, op + R0 * h * D, K, V, g, S, D, h, bs, scale,
                     chunk_tokens);
  }
  return o;
}

torch::Tensor paged_attention(const torch::Tensor& q_in, const std::optional<torch::Tensor>& cos_in,
                              const std::optional<torch::Tensor>& sin_in, const torch::Tensor& k_cache,
                              const torch::Tensor& v_cache, const std::optional<torch::Tensor>& slots_in,
                              int64_t h, int64_t num_rows, const torch::Tensor& rows_start, const torch::Tensor& rows,
                              const torch::Tensor& blocks_start, const torch::Tensor& blocks,
                              const torch::Tensor& tokens, int64_t bs, double scale, int64_t chunk_tokens) {
  const auto kind = k_cache.scalar_type();
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  (kind == torch::kFloat32 || kind == torch::kFloat16 || kind == torch::kBFloat16) &&
                  v_cache.scalar_type() == kind && k_cache.is_cpu() && v_cache.is_cpu(),
              "K/V caches must be contiguous float32, float16 or bfloat16 CPU tensors [g, slots, D] of one shape and dtype");
  if (kind == torch::kBFloat16)
    return paged_attention_impl<Bf16>(q_in, cos_in, sin_in, k_cache, v_cache, slots_in, h, num_rows, rows_start, rows,
                                      blocks_start, blocks, tokens, bs, scale, chunk_tokens);
  if (kind == torch::kFloat16)
    return paged_attention_impl<Fp16>(q_in, cos_in, sin_in, k_cache, v_cache, slots_in, h, num_rows, rows_start, rows,
                                      blocks_start, blocks, tokens, bs, scale, chunk_tokens);
  return paged_attention_impl<float>(q_in, cos_in, sin_in, k_cache, v_cache, slots_in, h, num_rows, rows_start, rows,
                                     blocks_start, blocks, tokens, bs, scale, chunk_tokens);
}

}  // namespace

#ifndef FORKLM_EMBEDDED  // decode_stack.cpp compiles this file into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "rotary + K/V write (when cos is given) and decode attention over items of KV blocks -> o [rows, h*D]",
        py::call_guard<py::gil_scoped_release>());
  m.def("set_state_budget_bytes", [](int64_t b) { state_budget().store(std::max<int64_t>(b, 1)); },
        "the most bytes of chunk states one call keeps before it runs its rows in groups (default 256 MiB)");
  m.def("state_budget_bytes", &state_budget_bytes);
}
#endif
