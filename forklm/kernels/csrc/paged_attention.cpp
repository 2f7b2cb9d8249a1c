// Decode attention over the paged KV cache on x86 CPUs with AVX2 (float32 arithmetic over a float32,
// float16 or bfloat16 cache), as one call per layer:
// rotary embedding of the new tokens' q and k, their K/V written into the cache, and every decode
// row's attention over its KV segments, merged exactly by log-sum-exp.
//
// Work comes as items (the plan of kernels/segment_attention.py, for CPUs): an item is a run of KV
// blocks holding `tokens` tokens, read by a set of rows. A shared prompt is one item listing every
// sample that shares it (its K/V read once for all of them: the rows' p = h / g query heads of a KV
// head are M = rows·p query vectors against the same keys, the bifurcated product); each row's own
// tail is an item of its own. Long items are split along the keys into chunks (units of work for
// the threads); every unit (item, KV head, chunk) yields per query vector a normalized partial
// output and its log-sum-exp, and each (row, head) merges its partials in a fixed order:
//   lse = log Σ exp(lse_u),  o = Σ exp(lse_u − lse) o_u            (docs/design.md)
// Inside a unit, keys go in pieces of consecutive slots (up to 64) with an online softmax:
//   S = (scale·Q) Kᵀ [M, n], m' = max(m, rowmax S), P = exp(S − m'), l = l·e^(m−m') + ΣP,
//   acc = acc·e^(m−m') + P V.
// Rotary: out[i] = x[i]·cos[i] + x[(i + D/2) mod D]·sin_signed[i] with sin_signed = [−sin₁, sin₂],
// two products and a sum each rounded (built with -ffp-contract=off): bit for bit the model's
// `apply_rope` in PyTorch.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include "simd_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t PIECE = 64;  // keys per piece of the online softmax (consecutive slots)

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

struct Unit {
  int32_t item, head, n0, n1;  // KV head `head`, keys [n0, n1) of the item
  int64_t part;                // first partial vector of the unit (M of them)
};

// S[m, 0:NP] = Q[m] · Kt[:, 0:NP] for MR query rows, Kt [D, NP] (NP a multiple of 16).
template <int MR>
inline void scores_tile(const float* q, int64_t D, const float* kt, int64_t NP, float* s) {
  for (int64_t n = 0; n < NP; n += 16) {
    __m256 a0[MR], a1[MR];
    for (int i = 0; i < MR; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m256 k0 = _mm256_loadu_ps(kt + d * NP + n), k1 = _mm256_loadu_ps(kt + d * NP + n + 8);
      for (int i = 0; i < MR; ++i) {
        const __m256 qb = _mm256_broadcast_ss(q + i * D + d);
        a0[i] = _mm256_fmadd_ps(qb, k0, a0[i]);
        a1[i] = _mm256_fmadd_ps(qb, k1, a1[i]);
      }
    }
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(s + i * NP + n, a0[i]);
      _mm256_storeu_ps(s + i * NP + n + 8, a1[i]);
    }
  }
}

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

// S[m, j] = Q[m] · K[j] for all M query rows against n keys (rows D apart), straight from the cache
// (no transposed copy: for few query rows the copy would cost more than the products). Four keys at
// a time per query row: four independent FMA chains, reduced into the four scores with two hadds.
template <typename T>
inline void scores_direct(const float* q, int64_t M, int64_t D, const T* kp, int64_t n, int64_t NP, float* s) {
  for (int64_t m = 0; m < M; ++m) {
    const float* qm = q + m * D;
    float* sm = s + m * NP;
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      const T* k = kp + j * D;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(qm + d);
        a0 = _mm256_fmadd_ps(qv, load8(k + d), a0);
        a1 = _mm256_fmadd_ps(qv, load8(k + D + d), a1);
        a2 = _mm256_fmadd_ps(qv, load8(k + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(qv, load8(k + 3 * D + d), a3);
      }
      // hadd twice: lanes [a0 a1 a2 a3] of the low half plus those of the high half
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
      _mm_storeu_ps(sm + j, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
    for (; j < n; ++j) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qm + d), load8(kp + j * D + d), a);
      sm[j] = hsum(a);
    }
  }
}

#if defined(__AVX512F__)
// The 512-bit forms of scores_tile and pv_tile (the build with AVX-512, on CPUs with AVX512-VNNI: the
// block kernel's VNNI build rule): 16 lanes a vector, up to 4 vectors across. Each score is the same
// FMA chain over d and each value the same chain over the keys, in the same order, as the 256-bit
// tiles': the same bits, with half the instructions.
template <int MR, int NV>
inline void scores_tile512_cols(const float* q, int64_t D, const float* kt, int64_t NP, float* s, int64_t n) {
  __m512 a[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int k = 0; k < NV; ++k) a[i][k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[NV];
    for (int k = 0; k < NV; ++k) kv[k] = _mm512_loadu_ps(kt + d * NP + n + 16 * k);
    for (int i = 0; i < MR; ++i) {
      const __m512 qb = _mm512_set1_ps(q[i * D + d]);
      for (int k = 0; k < NV; ++k) a[i][k] = _mm512_fmadd_ps(qb, kv[k], a[i][k]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int k = 0; k < NV; ++k) _mm512_storeu_ps(s + i * NP + n + 16 * k, a[i][k]);
}

// S[m, 0:NP] = Q[m] · Kt[:, 0:NP] for MR <= 6 query rows (MR·4 accumulators, 4 keys' vectors, a broadcast).
template <int MR>
inline void scores_tile512(const float* q, int64_t D, const float* kt, int64_t NP, float* s) {
  int64_t n = 0;
  for (; n + 64 <= NP; n += 64) scores_tile512_cols<MR, 4>(q, D, kt, NP, s, n);
  switch ((NP - n) / 16) {
    case 3: scores_tile512_cols<MR, 3>(q, D, kt, NP, s, n); break;
    case 2: scores_tile512_cols<MR, 2>(q, D, kt, NP, s, n); break;
    case 1: scores_tile512_cols<MR, 1>(q, D, kt, NP, s, n); break;
    default: break;
  }
}

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

constexpr int64_t DIRECT_MAX_ROWS = 24;  // up to this many query rows a unit scores keys straight from the cache

// Kt[d, j] = K[j, d] for the piece's n keys (rows D apart), zero columns j in [n, NP): 8 x 8 blocks
// transposed in registers (the values as stored, widened to float32 exactly).
template <typename T>
inline void transpose_piece(const T* kp, int64_t n, int64_t NP, int64_t D, float* kt) {
  for (int64_t j = 0; j < NP; j += 8)
    for (int64_t d = 0; d < D; d += 8) {
      __m256 r[8];
      for (int k = 0; k < 8; ++k) r[k] = j + k < n ? load8(kp + (j + k) * D + d) : _mm256_setzero_ps();
      const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
      const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
      const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
      const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
      const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
      const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
      const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
      const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
      float* o = kt + d * NP + j;
      _mm256_storeu_ps(o + 0 * NP, _mm256_permute2f128_ps(u0, u4, 0x20));
      _mm256_storeu_ps(o + 1 * NP, _mm256_permute2f128_ps(u1, u5, 0x20));
      _mm256_storeu_ps(o + 2 * NP, _mm256_permute2f128_ps(u2, u6, 0x20));
      _mm256_storeu_ps(o + 3 * NP, _mm256_permute2f128_ps(u3, u7, 0x20));
      _mm256_storeu_ps(o + 4 * NP, _mm256_permute2f128_ps(u0, u4, 0x31));
      _mm256_storeu_ps(o + 5 * NP, _mm256_permute2f128_ps(u1, u5, 0x31));
      _mm256_storeu_ps(o + 6 * NP, _mm256_permute2f128_ps(u2, u6, 0x31));
      _mm256_storeu_ps(o + 7 * NP, _mm256_permute2f128_ps(u3, u7, 0x31));
    }
}

// The piece's n value rows as float32 (exact widening of a float16 cache), converted once for all
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

// One unit: M = rows·p query vectors (scaled, [M, D]) over keys [n0, n1) of the item in KV head j.
// Writes the normalized output [M, D] and the log-sum-exp [M].
template <typename T>
void attend_unit(const float* q, int64_t M, int64_t D, const T* K, const T* V, const int32_t* blocks,
                 int64_t bs, int64_t n0, int64_t n1, float* out, float* lse) {
  thread_local std::vector<float> kt, s, acc, mx, l, vf;
  kt.resize(D * PIECE);
  s.resize(M * PIECE);
  acc.assign(M * D, 0.f);
  mx.assign(M, -std::numeric_limits<float>::infinity());
  l.assign(M, 0.f);
  int64_t t = n0;
  while (t < n1) {
    // a piece: keys in consecutive slots (blocks adjacent in the pool), at most PIECE of them
    const int64_t slot0 = static_cast<int64_t>(blocks[t / bs]) * bs + t % bs;
    int64_t n = std::min(bs - t % bs, n1 - t);
    while (n < PIECE && t + n < n1 && static_cast<int64_t>(blocks[(t + n) / bs]) * bs == slot0 + n)
      n += std::min(bs, n1 - t - n);
    n = std::min(n, PIECE);
    const int64_t NP = (n + 15) / 16 * 16;
    const T* kp = K + slot0 * D;
    float* sp = s.data();
    if (M <= DIRECT_MAX_ROWS) {
      scores_direct(q, M, D, kp, n, NP, sp);
    } else {
      transpose_piece(kp, n, NP, D, kt.data());  // Kᵀ of the piece, zero columns past n
      by_rows(M, [&](auto mr, int64_t m) {
        constexpr int MR = decltype(mr)::value;
#if defined(__AVX512F__)
        scores_tile512<MR>(q + m * D, D, kt.data(), NP, sp + m * NP);
#else
        scores_tile<MR>(q + m * D, D, kt.data(), NP, sp + m * NP);
#endif
      });
    }
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t m = 0; m < M; ++m) {
      float* row = sp + m * NP;
      for (int64_t j = n; j < NP; ++j) row[j] = -std::numeric_limits<float>::infinity();
      __m256 vmax = ninf;
      for (int64_t j = 0; j < NP; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + j));
      const float rmax = hmax(vmax);  // a NaN score spreads through P below
      const float m_new = std::max(mx[m], rmax);
      const float alpha = std::exp(mx[m] - m_new);  // mx = -inf at first: 0
      const __m256 mb = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < NP; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mb));
        _mm256_storeu_ps(row + j, e);
        sum = _mm256_add_ps(sum, e);
      }
      l[m] = l[m] * alpha + hsum(sum);
      mx[m] = m_new;
      if (alpha != 1.f) {
        const __m256 ab = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(&acc[m * D + d], _mm256_mul_ps(ab, _mm256_loadu_ps(&acc[m * D + d])));
      }
    }
    // value rows read by every row tile: widened once for the many-row units (faster at many query
    // rows; a few rows take the direct path: float16 rows widened as read)
    const auto pv = [&](const auto* vp) {
      by_rows(M, [&](auto mr, int64_t m) { pv_tile<decltype(mr)::value>(sp + m * NP, NP, n, vp, D, &acc[m * D]); });
    };
    const T* vraw = V + slot0 * D;
    if (M > DIRECT_MAX_ROWS) {
#if defined(__AVX512F__)
      const float* vw = widen_piece(vraw, n, D, vf);
      by_rows(M, [&](auto mr, int64_t m) { pv_tile512<decltype(mr)::value>(sp + m * NP, NP, n, vw, D, &acc[m * D]); });
#else
      pv(widen_piece(vraw, n, D, vf));
#endif
    } else {
      pv(vraw);
    }
    t += n;
  }
  for (int64_t m = 0; m < M; ++m) {
    const float inv = 1.f / l[m];
    for (int64_t d = 0; d < D; ++d) out[m * D + d] = acc[m * D + d] * inv;
    lse[m] = mx[m] + std::log(l[m]);
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

  // units of work: (item, KV head, chunk of keys)
  std::vector<Unit> units;
  std::vector<int64_t> item_unit(I + 1), item_chunks(I);
  const int64_t chunk = std::max<int64_t>(chunk_tokens, bs) / bs * bs;
  int64_t parts = 0;
  for (int64_t i = 0; i < I; ++i) {
    item_unit[i] = static_cast<int64_t>(units.size());
    const int64_t M = (it.rows_start[i + 1] - it.rows_start[i]) * p, n = it.tokens[i];
    item_chunks[i] = (n + chunk - 1) / chunk;
    for (int64_t j = 0; j < g; ++j)
      for (int64_t n0 = 0; n0 < n; n0 += chunk) {
        units.push_back(Unit{static_cast<int32_t>(i), static_cast<int32_t>(j), static_cast<int32_t>(n0),
                             static_cast<int32_t>(std::min(n, n0 + chunk)), parts});
        parts += M;
      }
  }
  item_unit[I] = static_cast<int64_t>(units.size());
  std::vector<float> part_o(parts * D), part_lse(parts);
  const float* qp = q.data_ptr<float>();
  const int64_t U = static_cast<int64_t>(units.size());
  const int nt = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(U)));
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
  for (int64_t u = 0; u < U; ++u) {
    const Unit& un = units[u];
    const int64_t r0 = it.rows_start[un.item], r1 = it.rows_start[un.item + 1], M = (r1 - r0) * p;
    thread_local std::vector<float> qs;
    qs.resize(M * D);  // the unit's query vectors, scaled: row r's heads j·p .. j·p + p − 1
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t e = 0; e < p; ++e) {
        const float* src = qp + (static_cast<int64_t>(it.rows[r]) * h + un.head * p + e) * D;
        float* dst = qs.data() + ((r - r0) * p + e) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
      }
    attend_unit(qs.data(), M, D, K + un.head * S * D, V + un.head * S * D, it.blocks + it.blocks_start[un.item], bs,
                un.n0, un.n1, part_o.data() + un.part * D, part_lse.data() + un.part);
  }

  // each row's items, in item order (the merge order)
  std::vector<int64_t> row_count(num_rows + 1, 0);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t r = it.rows_start[i]; r < it.rows_start[i + 1]; ++r) ++row_count[it.rows[r] + 1];
  for (int64_t r = 0; r < num_rows; ++r) row_count[r + 1] += row_count[r];
  std::vector<int64_t> fill(row_count.begin(), row_count.end() - 1), row_item(row_count[num_rows]), row_pos(row_count[num_rows]);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t r = it.rows_start[i]; r < it.rows_start[i + 1]; ++r) {
      const int64_t at = fill[it.rows[r]]++;
      row_item[at] = i;
      row_pos[at] = r - it.rows_start[i];
    }
  for (int64_t r = 0; r < num_rows; ++r) TORCH_CHECK(row_count[r + 1] > row_count[r], "row ", r, " reads no item");
  float* op = o.data_ptr<float>();
  at::parallel_for(0, num_rows * h, 8, [&](int64_t a, int64_t z) {
    std::vector<int64_t> idx;
    std::vector<float> w;
    for (int64_t rh = a; rh < z; ++rh) {
      const int64_t r = rh / h, hh = rh % h, j = hh / p, e = hh % p;
      idx.clear();
      for (int64_t at = row_count[r]; at < row_count[r + 1]; ++at) {
        const int64_t i = row_item[at];
        const int64_t first = item_unit[i] + j * item_chunks[i];
        for (int64_t c = 0; c < item_chunks[i]; ++c) idx.push_back(units[first + c].part + row_pos[at] * p + e);
      }
      float* dst = op + rh * D;
      if (idx.size() == 1) {
        std::copy(part_o.data() + idx[0] * D, part_o.data() + (idx[0] + 1) * D, dst);
        continue;
      }
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t k : idx) m = std::max(m, part_lse[k]);
      w.assign(idx.size(), 0.f);
      float den = 0.f;
      for (size_t k = 0; k < idx.size(); ++k) den += (w[k] = std::exp(part_lse[idx[k]] - m));
      std::fill(dst, dst + D, 0.f);
      for (size_t k = 0; k < idx.size(); ++k) {
        const float wk = w[k] / den;
        const float* src = part_o.data() + idx[k] * D;
        for (int64_t d = 0; d < D; ++d) dst[d] += wk * src[d];
      }
    }
  });
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
}
#endif
