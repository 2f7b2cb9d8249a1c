// Products of float32 activations with GGUF Q4_1 / Q5_1 / Q8_0 / K-quant weight blocks on x86 CPUs with
// AVX2, as integer dot products (the scheme llama.cpp uses on these CPUs, written here for PyTorch).
//
// Weights [N, K] keep the file's blocks of 32 values along K, their values and scales held in
// separate arrays (`Weights` below):
//   Q4_1  w = d·q + m, q in 0..15 (value j: low nibble of byte j, value j + 16: its high nibble)
//   Q5_1  w = d·q + m, q in 0..31: Q4_1's nibbles and a fifth bit per value (`high_bits`)
//   Q4_K  Q4_1's values with the K-quants' scales: per block d = ds·sc (ds fp16 per 8 blocks, sc a
//         6-bit integer per block, applied in integers: `tile_k`) and minimum m = dm·mq (dm fp16
//         per 8 blocks, mq 6 bits; formed exactly in float32 for `minima_terms`)
//   Q5_K  Q5_1's values with the K-quants' scales
//   Q6_K  w = ds·sc·q, q in −32..31 (4 low bits as Q4_1's nibbles, 2 high bits in q2), sc an int8
//         per 16 values under a float16 ds per 256 (`tile_q6`: q2 per pair of blocks)
//   Q3_K  w = ds·sc·q, q in −4..3 (the file's 2-bit fields and third-bit masks as stored), sc an int8
//         per 16 values (the file's 6-bit scale − 32) under a float16 ds per 256
//   Q2_K  w = ds·sc·q − dmin·mn, q in 0..3 (the file's 2-bit fields as stored), sc and mn 4 bits each
//         per 16 values (the file's byte), ds and dmin float16 per 256
//   Q8_0  w = d·q, q int8
//   IQ4_NL w = d·t[q], q in 0..15 (Q4_1's nibbles), t ggml's 16 non-linear int8 levels (`tile` with NL)
//   (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL files run these values in 8-output interleaved layouts,
//   `gemm_r8`; the plain Q4_1 / Q5_1 / Q8_0 / IQ4_NL layouts above serve the tests and older-build comparisons)
// Activations x [T, K] float32 are quantized per row and block of 32 (Q8):
//   dx = max|x| / 127, q = round_half_even(x · (1/dx)) in [-127, 127], sx = dx · Σq
// and y[t, o] = Σ_b (dw·dx)·Σ_i qw·qx  (+ Σ_b mw·sx for Q4_1, `minima_terms`). For K-quant weights the
// same rule runs over super-blocks of 256 (one dx per 256, the sums of each 16 q kept: the shape of
// ggml's Q8_K, not its rounding),
// so a super-block's sub-block scales apply in integers (`tile_s16`, `tile_q6`); so for Q4_K / Q5_K (`tile_k`).
//
// Batch invariance: row t's result depends on row t alone (per-row activation scales; a row's
// operations are the same whichever tile of rows it shares), so a sample's numbers never depend on
// the other rows of a step. Threads split the output columns, never a dot product.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "simd_math.h"

#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t QK = 32;
constexpr int QKK = 256;  // a K-quant super-block

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

using forklm::exp8;
using forklm::hsum;

// max |x| over n values (n a multiple of 8), and whether all are finite (8 lanes: max is exact in
// any order, so the scalar rule's result).
inline float block_amax(const float* x, int n, bool* finite) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 largest = _mm256_set1_ps(std::numeric_limits<float>::max());
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    amax = _mm256_max_ps(amax, a);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, largest, _CMP_NLE_UQ));  // NaN or infinite
  }
  *finite = _mm256_movemask_ps(bad) == 0;
  return forklm::hmax(amax);
}

// 8 floats x·id rounded half to even (the default rounding mode, as std::nearbyint) and clamped to
// [-127, 127], as int32.
inline __m256i round_clamp8(const float* x, __m256 id) {
  const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(127.f), _mm256_max_ps(_mm256_set1_ps(-127.f), r)));
}

// 32 int32 values (4 x 8, in order) as 32 int8 in order (each within [-127, 127]: no saturation).
inline void store_int8x32(int8_t* q, __m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

inline int hsum_int32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float scale_inverse(float dd) { return dd >= std::numeric_limits<float>::min() ? 1.f / dd : 0.f; }

// One row block of 32 floats -> 32 int8, its scale and scale·Σq (the rule `quantize_q8_reference`
// in block_gemm.py repeats value by value: amax / 127 in float32, its reciprocal, x·id rounded half to even). A block
// holding a NaN or an infinity gets d = s = NaN (the product's rows then come out NaN, as a dense
// product's would); a block whose scale is below FLT_MIN quantizes to zeros (1/d would overflow).
inline void quantize_block(const float* x, int8_t* q, float* d, float* s) {
  bool finite;
  const float amax = block_amax(x, QK, &finite);
  if (!finite) {
    std::memset(q, 0, QK);
    *d = *s = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float dd = amax / 127.f;
  const __m256 id = _mm256_set1_ps(scale_inverse(dd));
  const __m256i a = round_clamp8(x, id), b = round_clamp8(x + 8, id), c = round_clamp8(x + 16, id),
                e = round_clamp8(x + 24, id);
  store_int8x32(q, a, b, c, e);
  *d = dd;
  *s = dd * static_cast<float>(hsum_int32(_mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, e))));
}

// One row super-block of 256 floats -> 256 int8 (the same rule over 256 values: d = max|x| / 127,
// rounded half to even) and the sums of each 16 of them (K-quant weights' sub-blocks; Q8_K's bsums).
// Non-finite values: d = NaN, values and sums 0; d below FLT_MIN: zeros.
inline void quantize_super_block(const float* x, int8_t* q, float* d, int16_t* sums) {
  bool finite;
  const float amax = block_amax(x, QKK, &finite);
  if (!finite) {
    std::memset(q, 0, QKK);
    std::memset(sums, 0, QKK / 16 * sizeof(int16_t));
    *d = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  const float dd = amax / 127.f;
  const __m256 id = _mm256_set1_ps(scale_inverse(dd));
  for (int g = 0; g < QKK / 32; ++g) {  // 32 values: two sums of 16
    const float* xg = x + g * 32;
    const __m256i a = round_clamp8(xg, id), b = round_clamp8(xg + 8, id), c = round_clamp8(xg + 16, id),
                  e = round_clamp8(xg + 24, id);
    store_int8x32(q + g * 32, a, b, c, e);
    sums[2 * g] = static_cast<int16_t>(hsum_int32(_mm256_add_epi32(a, b)));
    sums[2 * g + 1] = static_cast<int16_t>(hsum_int32(_mm256_add_epi32(c, e)));
  }
  *d = dd;
}

// Quantized activation rows. Blocks of 32 (Q4_1 / Q5_1 / Q8_0 weights): q, d and s = d·Σq per block.
// Super-blocks of 256 (K-quant weights, `tile_s16` / `tile_q6` / `tile_k`): q, d per super-block, and the sums of
// each 16 values in `sums` (s unused).
struct QuantizedRows {
  torch::Tensor q, d, s;  // int8 [T, K]; float32 [T, K/32] (super-blocks: d [T, K/256], s empty)
  torch::Tensor sums;     // super-blocks only: int16 [T, K/16]
};

// What the kernel does to a row of x before quantizing it (so the op before a product needs no
// pass of its own):
//   PLAIN    the row as is                                         x [T, K]
//   RMSNORM  w ⊙ (x · 1/sqrt(mean(x²) + eps)) (transformers' order)  x [T, K], w [K]
//   SWIGLU   silu(g) ⊙ u for x = [g | u]                           x [T, 2K]
enum Prologue : int64_t { PLAIN = 0, RMSNORM = 1, SWIGLU = 2 };

// Σ x² of one row in a fixed order (8 lanes, lanes summed, then the tail).
inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float r = hsum(acc);
  for (; i < n; ++i) r = std::fma(x[i], x[i], r);
  return r;
}

void prologue_row(const float* x, int64_t K, Prologue mode, const float* w, float eps, float* out) {
  if (mode == RMSNORM) {
    const float r = 1.f / std::sqrt(sum_squares(x, K) / static_cast<float>(K) + eps);
    for (int64_t i = 0; i < K; ++i) out[i] = w[i] * (x[i] * r);
  } else {  // SWIGLU: silu(g)·u = g / (1 + exp(−g)) · u, eight at a time (`exp8`, ~1 ulp; a row of the
    // down product's 1536-8192 values took 1-3 µs a sample with the scalar exp: a decode step's rows
    // all fall to one thread here)
    const float* u = x + K;
    const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
    const auto eight = [&](const float* g8, const float* u8, float* o8) {
      const __m256 g = _mm256_loadu_ps(g8);
      const __m256 e = exp8(_mm256_xor_ps(g, sign));
      _mm256_storeu_ps(o8, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(u8)));
    };
    for (int64_t i = 0; i < K; i += 8) eight(x + i, u + i, out + i);  // K a multiple of 32 (`product_input`)
  }
}

// The rows of x after the prologue, quantized in blocks of 32 or (super) of 256, into q int8 [T, K],
// d float32 [T, nb], and s float32 [T, nb] (blocks of 32) or sums int16 [T, K/16] (super-blocks).
void quantize_rows_into(const torch::Tensor& x, int64_t K, Prologue mode, const float* w, float eps, bool super,
                        int8_t* qp, float* dp, float* sp, int16_t* gp) {
  const int64_t T = x.size(0), group = super ? QKK : QK, nb = K / group, stride = x.size(1);
  const auto block = [&](const float* src, int64_t t, int64_t b) {  // block b of row t
    if (super)
      quantize_super_block(src, qp + t * K + b * QKK, dp + t * nb + b, gp + t * (K / 16) + b * (QKK / 16));
    else
      quantize_block(src, qp + t * K + b * QK, dp + t * nb + b, sp + t * nb + b);
  };
  const float* xp = x.data_ptr<float>();
  if (mode == PLAIN) {
    at::parallel_for(0, T * nb, super ? 32 : 256, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) block(xp + (b / nb) * stride + (b % nb) * group, b / nb, b % nb);
    });
    return;
  }
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    thread_local std::vector<float> row;  // reused across calls (a decode step makes ~120)
    row.resize(K);
    for (int64_t t = t0; t < t1; ++t) {
      prologue_row(xp + t * stride, K, mode, w, eps, row.data());
      for (int64_t b = 0; b < nb; ++b) block(row.data() + b * group, t, b);
    }
  });
}

// Each block of 32's dx·Σ q (the K-quant minima terms' factor) from rows quantized per super-block
// (dx [T, K/256], sums of 16 [T, K/16]) -> out [T, K/32].
void block_sx_from_super_blocks(const float* dx, const int16_t* sums, int64_t T, int64_t K, float* out) {
  const int64_t nb = K / QK;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < nb; ++b) {
      const int16_t* s = sums + t * (K / 16) + 2 * b;
      out[t * nb + b] = dx[t * (nb / 8) + b / 8] * static_cast<float>(s[0] + s[1]);
    }
}

// The same as tensors (`quantize_q8`, `quantize_q8_k`: the tests' view of the activations' blocks).
QuantizedRows quantize_rows(const torch::Tensor& x, int64_t K, Prologue mode, const float* w, float eps,
                            bool super = false) {
  const int64_t T = x.size(0), nb = K / (super ? QKK : QK);
  QuantizedRows r{torch::empty({T, K}, torch::kInt8), torch::empty({T, nb}, torch::kFloat32),
                  torch::empty({super ? 0 : T, nb}, torch::kFloat32),
                  torch::empty({super ? T : 0, K / 16}, torch::kInt16)};
  quantize_rows_into(x, K, mode, w, eps, super, r.q.data_ptr<int8_t>(), r.d.data_ptr<float>(), r.s.data_ptr<float>(),
                     r.sums.data_ptr<int16_t>());
  return r;
}

// A product call's buffers for its activations, reused by the next call on the same thread (a decode
// step makes ~150 calls; fresh tensors and vectors for each cost several microseconds a call).
struct CallBuffers {
  std::vector<int8_t> q, pairs;
  std::vector<float> d, s, k_sx, dx_spread;
  std::vector<int16_t> sums;
  std::vector<int32_t> block_sums;  // the interleaved Q4_0 kernel's Σ q per block
};

// Gives a call's buffers back to the allocator when it ends if they grew past a decode step's needs
// (a long prompt's chunk on a wide matrix: tens of MB that would otherwise stay with the thread).
struct ReleaseLargeBuffers {
  CallBuffers& buf;
  ~ReleaseLargeBuffers() {
    if (buf.q.capacity() + buf.pairs.capacity() > (size_t{8} << 20)) buf = CallBuffers();
  }
};

// Weights as three arrays per matrix (the file's blocks split so scales load 8 at a time):
//   qs  uint8 [N, nb·16] (Q4_1: two values a byte) | int8 [N, K] (Q8_0)
//   d   fp16 [N, nb]     m  fp16 [⌈N/8⌉, nb, 8] (Q4_1 only: per group of 8 outputs, block by block,
//                        the 8 outputs' minima side by side; the last group padded with zeros)
//   qh  uint32 [N, nb] (Q5_1 / Q5_K only): the values' fifth bits, a block pair's words arranged as
//       the pair is read (`high_bits`)
// K-quant scales (`KS` below; nb a multiple of 8): d holds ds fp16 [N, nb/8] and sc uint8 [N, nb];
// m holds mq uint8 [⌈N/8⌉, nb, 8] and dm fp16 [⌈N/8⌉, nb/8, 8] (groups of 8 outputs as Q4_1's m):
// d_b = ds[b/8]·sc[b], m_b = dm[b/8]·mq[b] (dm holds the file's −dmin).
// Scales per 16 values (`Sub16` below): Q6_K qs as Q4_1's, q2 uint8 [N, nb·8], sc int8 [N, 2·nb], d ds fp16
// [N, nb/8]; Q3_K qs uint8 [N, nb·8] (per super-block the file's 64 bytes of 2-bit fields: value
// 128h + 32j + l at bits 2j of byte 32h + l), q2 uint8 [N, nb·4] (the file's 32 bytes of third-bit masks:
// that value's at bit 4h + j of byte l), sc int8 [N, 2·nb], d ds fp16 [N, nb/8]; Q2_K qs as Q3_K's, sc
// uint8 [N, 2·nb] (scale | min << 4), d fp16 [N, nb/8, 2] (ds, dmin per super-block).
struct Weights {
  const uint8_t* qs;
  const uint16_t* d;
  const uint16_t* m;  // nullptr for Q8_0
  int64_t nb;
  int64_t row_bytes;  // of qs
  const uint32_t* qh = nullptr;  // Q5_1 / Q5_K only
  const uint8_t* sc = nullptr;   // K-quant / IQ4_XS scales only ([N, nb]; Q6_K / Q3_K / Q2_K: [N, 2·nb], one per 16 values)
  const uint16_t* dm = nullptr;  // K-quant scales only
  const uint8_t* q2 = nullptr;   // Q6_K: [N, nb/2, 16] the values' bits 4-5 per block pair; Q3_K: the third-bit masks
  // K-quant minima formed once per chunk of outputs [o0, o0 + 64) (`expand_k_minima`): mf [8, nb, 8]
  // grouped as m (o0 a multiple of 8)
  const float* mf = nullptr;
  int64_t o0 = 0;
  bool scales_per_16 = false;  // Q6_K / Q3_K / Q2_K: sc holds 2·nb scales a row (IQ4_XS, also in tile_s16: nb)
};

// 32 bytes, byte i = 0xFF where bit i of `bits` is set, else 0.
inline __m256i bit_mask_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// 32 bytes, byte i = 0x10 where bit i of `bits` is set, else 0: the fifth bits of 32 values, to OR
// into their low 4 bits. Q5_1's words: for a block pair (b, b+1) read as `tile` reads Q4_1 pairs
// (bytes 0-15 values 0-15 of b, 16-31 values 0-15 of b+1; then values 16-31 of both), word b holds
// the fifth bits of the first read (bits 0-15 of block b's, then bits 0-15 of b+1's) and word b+1
// those of the second (bits 16-31 of b's, then of b+1's); a lone last block keeps its own word.
inline __m256i high_bits(uint32_t bits) { return _mm256_and_si256(bit_mask_bytes(bits), _mm256_set1_epi8(0x10)); }

// A tile's activation rows. mt: the rows' Q4_1 minima terms for a chunk of outputs (`minima_terms`):
// row j's term for output o at mt[j·mt_ld + o − mt_o0]; nullptr for Q8_0.
struct Acts {
  const int8_t* q;  // [T, K]
  const float* d;   // [T, nb]
  const float* s;   // [T, nb]
  int64_t K, nb;
  const float* mt = nullptr;
  int64_t mt_ld = 0, mt_o0 = 0;

  float minima_term(int j, int64_t o) const { return mt == nullptr ? 0.f : mt[j * mt_ld + o - mt_o0]; }
  Acts rows_from(int64_t t) const { return Acts{q + t * K, d + t * nb, s + t * nb, K, nb, mt ? mt + t * mt_ld : nullptr, mt_ld, mt_o0}; }
};

inline void halves_to_float(const uint16_t* h, float* f, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  for (; i < n; ++i) f[i] = half_to_float(h[i]);
}

// Two floats from p (unaligned) in lanes 0 and 1.
inline __m128 load_two(const float* p) { return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }

// 8 uint8 / int8 integers as floats.
inline __m256 u8_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 s8_to_float(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The K-quant minima of outputs [o0, o1) (o1 − o0 <= 64, o0 a multiple of 8) as floats, grouped as
// Q4_1's m: mf[((o − o0)/8·nb + b)·8 + o % 8] = dm·mq, each product exact in float32 (11 by 6
// significant bits), formed once per chunk instead of per tile and row (`minima_terms`).
inline void expand_k_minima(const Weights& w, int64_t o0, int64_t o1, float* mf) {
  const int64_t nb = w.nb, nsb = nb / 8;
  const uint8_t* mq = reinterpret_cast<const uint8_t*>(w.m);
  for (int64_t g = o0 / 8; g < (o1 + 7) / 8; ++g)
    for (int64_t b = 0; b < nb; ++b) {
      const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dm + (g * nsb + b / 8) * 8)));
      _mm256_storeu_ps(mf + ((g - o0 / 8) * nb + b) * 8, _mm256_mul_ps(dm, u8_to_float(mq + (g * nb + b) * 8)));
    }
}

// Output o's scale of block b.
inline float block_scale(const Weights& w, int64_t o, int64_t b) { return half_to_float(w.d[o * w.nb + b]); }

// Output o's scales of blocks b and b + 1 (b even) in lanes 0 and 1.
inline __m128 pair_scales(const Weights& w, int64_t o, int64_t b) {
  int32_t dpair;
  std::memcpy(&dpair, w.d + o * w.nb + b, sizeof dpair);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(dpair));
}

// IQ4_NL's 16 levels (ggml's kvalues_iq4nl).
constexpr int8_t IQ4_NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The levels in both 128-bit lanes, for a pshufb lookup.
inline __m256i iq4nl_levels() {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(IQ4_NL_LEVELS)));
}

// Block b of output o as 32 bytes: Q41 the unsigned 4-bit values (H5: with their fifth bits), NL
// IQ4_NL's int8 levels looked up from its nibbles, else Q8_0's int8 values.
template <bool Q41, bool H5 = false, bool NL = false>
inline __m256i load_weights(const Weights& w, int64_t o, int64_t b) {
  if constexpr (NL) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + o * w.row_bytes + b * 16));
    const __m256i idx = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
    return _mm256_shuffle_epi8(iq4nl_levels(), idx);
  } else if constexpr (Q41) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + o * w.row_bytes + b * 16));
    const __m256i low = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
    if constexpr (H5) return _mm256_or_si256(low, high_bits(w.qh[o * w.nb + b]));
    return low;
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + o * w.row_bytes + b * QK));
  }
}

// The `_vnni` build (block_gemm.py: CPUs with AVX512-VNNI and AVX512-VL) sums byte products with
// `vpdpbusd`; the AVX2 build with maddubs + madd. Both give the same integers (no int16 pair sum
// here can saturate: |u| <= 128, |s| <= 127 and u·s pairs stay below 2¹⁵), so the two builds'
// products are equal bit for bit. The VNNI build also runs the Q4_K / Q5_K / Q6_K tiles' integer sums
// on 512-bit vectors at two rows or more, two halves whose int32 lanes add up to the AVX2 build's (`k_super_block_512`,
// `q6_super_block_512`), and Q4_K / Q5_K in tiles of 8 rows (32 vector registers): the same integers;
// and the interleaved layouts two groups of 8 outputs to a 512-bit vector (`tile_r8_x2`,
// `tile_r8_signed_x2`), lane for lane `tile_r8`'s operations.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define FORKLM_VNNI 1
#else
#define FORKLM_VNNI 0
#endif

// The cache level a weight prefetch asks for. The quantized tiles ask for L1 (into L2 measured level
// on the Q4_1 / Q3_K steps of a Zen 4 EPYC, the 1B Q4_K one 2% slower). The bfloat16 / float16 tiles
// (`half_tile`: up to eight rows read side by side, the next tile's prefetched) ask for L2 where that
// measured faster on the same CPU, a step's products: the VNNI build at 1 / 8 / 32 rows 1.61x / 1.32x
// / 1.09x, the AVX2 build at one row 1.72x (at 8 / 32 rows it was 5-7% slower so: L1 there). The
// prefetches then leave the L1 miss buffers to the loads. (bench/results/block_kernel_ab_bf16_*.)
constexpr _mm_hint WEIGHT_PREFETCH = _MM_HINT_T0;
constexpr _mm_hint half_weight_prefetch(int rows) { return FORKLM_VNNI || rows == 1 ? _MM_HINT_T1 : _MM_HINT_T0; }

// Σ over each 4 consecutive bytes of u·s (u unsigned, s signed) added to the int32 lanes of acc.
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if FORKLM_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Σ over each 4 consecutive bytes of u1·s1 + u2·s2, as int32 lanes. AVX2: the two products summed in
// int16 (each lane ≤ 2·31·127·2 < 2¹⁵ for Q4_1's and Q5_1's values) and widened once.
inline __m256i dot2_u8s8(__m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#if FORKLM_VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#else
  const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
  return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

// acc + Σ over each pair of int16 lanes of a·b as int32 lanes (the per-16 scales of the K-quant tiles):
// `vpdpwssd` in the VNNI build, madd + add in the AVX2 one; the same integers (no pair here is -2¹⁵·-2¹⁵).
inline __m256i madd16_acc(__m256i acc, __m256i a, __m256i b) {
#if FORKLM_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// An empty asm on an accumulator: GCC may not reassociate the adds into it. Without it GCC sums a block's
// integer products as one tree at the end, spilling them to the stack on the AVX2 build (16 vector
// registers); the sums are exact integers either way, so the bits do not change, only the schedule.
inline void keep_order(__m256i& v) { asm("" : "+x"(v)); }

// 8 int32 partial sums of w·x over one block of 32.
template <bool Q41>
inline __m256i block_dot(__m256i wv, __m256i xv) {
  if constexpr (Q41) {
    return dot_u8s8(_mm256_setzero_si256(), wv, xv);  // q in 0..15 (unsigned) times int8
  } else {
    // |w| as unsigned times x carrying w's sign (|w| <= 128, |x| <= 127: no int16 overflow)
    return dot_u8s8(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
  }
}

// Outputs [first, first + count)'s weights into cache (values and scales), when they exist: a tile
// prefetches two tiles ahead (1.3x on a decode step's products, whose weights stream from memory).
inline void prefetch_outputs(const Weights& w, int64_t first, int64_t count, int64_t N) {
  if (first + count > N) return;
  const char* values = reinterpret_cast<const char*>(w.qs + first * w.row_bytes);
  for (int64_t off = 0; off < count * w.row_bytes; off += 64) _mm_prefetch(values + off, WEIGHT_PREFETCH);
  if (w.sc == nullptr) {
    const char* scales = reinterpret_cast<const char*>(w.d + first * w.nb);
    for (int64_t off = 0; off < count * w.nb * 2; off += 64) _mm_prefetch(scales + off, WEIGHT_PREFETCH);
  } else {  // K-quants: a 6-bit scale per block of 32 (Q6_K / Q3_K / Q2_K: a byte per 16 values)
    const int64_t per_row = w.scales_per_16 ? 2 * w.nb : w.nb;
    const char* scales = reinterpret_cast<const char*>(w.sc + first * per_row);
    for (int64_t off = 0; off < count * per_row; off += 64) _mm_prefetch(scales + off, WEIGHT_PREFETCH);
    // ds per super-block (Q2_K: ds and dmin side by side, the layout without q2 among those per 16)
    const int64_t d_per_row = w.scales_per_16 && w.q2 == nullptr ? w.nb / 4 : w.nb / 8;
    _mm_prefetch(reinterpret_cast<const char*>(w.d + first * d_per_row), WEIGHT_PREFETCH);
  }
  if (w.qh != nullptr) {
    const char* bits = reinterpret_cast<const char*>(w.qh + first * w.nb);
    for (int64_t off = 0; off < count * w.nb * 4; off += 64) _mm_prefetch(bits + off, WEIGHT_PREFETCH);
  }
  if (w.q2 != nullptr) {  // Q6_K: 8 bytes per block of 32, Q3_K: 4 (row_bytes: nb·16 and nb·8)
    const int64_t per_row = w.row_bytes / 2;
    const char* bits = reinterpret_cast<const char*>(w.q2 + first * per_row);
    for (int64_t off = 0; off < count * per_row; off += 64) _mm_prefetch(bits + off, WEIGHT_PREFETCH);
  }
}

// The Q4_1 minima terms mt[t, o − o0] = Σ_b m[b, o]·sx[t, b] for outputs [o0, o1) and T rows: one
// FMA chain over the blocks in order per (output, row), a group of 8 outputs to a vector (the same
// chain in the scalar path for a group's part), so a row's term never depends on the other rows, on
// the tile that reads it or on where a thread's outputs begin.
// m: fp16 [⌈N/8⌉, nb, 8] (`Weights`; K-quant scales: mq·dm, formed exactly); sx [T, nb]; mt [T, o1 − o0].
template <bool KS = false>
void minima_terms(const Weights& w, int64_t o0, int64_t o1, const float* sx, int64_t T, int64_t nb, float* mt) {
  const int64_t width = o1 - o0;
  const uint16_t* m = w.m;
  const auto group8 = [&](int64_t b, int64_t o) {  // o a multiple of 8
    if constexpr (KS) return _mm256_loadu_ps(w.mf + (((o - w.o0) >> 3) * nb + b) * 8);
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + ((o >> 3) * nb + b) * 8)));
  };
  const auto minimum = [&](int64_t b, int64_t o) {
    if constexpr (KS) return w.mf[(((o - w.o0) >> 3) * nb + b) * 8 + (o & 7)];
    return half_to_float(m[((o >> 3) * nb + b) * 8 + (o & 7)]);
  };
  const auto one = [&](const float* sxt, int64_t o) {
    float r = 0.f;
    for (int64_t b = 0; b < nb; ++b) r = std::fma(minimum(b, o), sxt[b], r);
    return r;
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* sxt = sx + t * nb;
    float* out = mt + t * width;
    int64_t o = o0;
    for (; o < o1 && (o & 7) != 0; ++o) out[o - o0] = one(sxt, o);
    for (; o + 64 <= o1; o += 64) {  // eight independent chains in flight (each output's chain as below)
      __m256 a[8];
      for (int g = 0; g < 8; ++g) a[g] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 s = _mm256_set1_ps(sxt[b]);
        for (int g = 0; g < 8; ++g) a[g] = _mm256_fmadd_ps(group8(b, o + 8 * g), s, a[g]);
      }
      for (int g = 0; g < 8; ++g) _mm256_storeu_ps(out + o - o0 + 8 * g, a[g]);
    }
    for (; o + 32 <= o1; o += 32) {  // four independent chains in flight
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t b = 0; b < nb; ++b) {
        const __m256 s = _mm256_set1_ps(sxt[b]);
        a0 = _mm256_fmadd_ps(group8(b, o), s, a0);
        a1 = _mm256_fmadd_ps(group8(b, o + 8), s, a1);
        a2 = _mm256_fmadd_ps(group8(b, o + 16), s, a2);
        a3 = _mm256_fmadd_ps(group8(b, o + 24), s, a3);
      }
      _mm256_storeu_ps(out + o - o0, a0);
      _mm256_storeu_ps(out + o - o0 + 8, a1);
      _mm256_storeu_ps(out + o - o0 + 16, a2);
      _mm256_storeu_ps(out + o - o0 + 24, a3);
    }
    for (; o + 8 <= o1; o += 8) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) acc = _mm256_fmadd_ps(group8(b, o), _mm256_set1_ps(sxt[b]), acc);
      _mm256_storeu_ps(out + o - o0, acc);
    }
    for (; o < o1; ++o) out[o - o0] = one(sxt, o);
  }
}

// The minima of outputs [o0, o1) into cache (the groups holding them are contiguous).
inline void prefetch_minima(const Weights& w, int64_t nb, int64_t o0, int64_t o1) {
  if (o0 >= o1) return;
  const int64_t bytes = w.dm == nullptr ? 2 : 1;  // per minimum (K-quants: mq; their dm is 8x smaller)
  const char* base = reinterpret_cast<const char*>(w.m);
  const char* end = base + ((o1 + 7) >> 3) * nb * 8 * bytes;
  for (const char* p = base + (o0 >> 3) * nb * 8 * bytes; p < end; p += 64) _mm_prefetch(p, WEIGHT_PREFETCH);
}

// Q8_0 (NL: IQ4_NL, its levels looked up as int8): y[j·N + o + i] for i < TO outputs, j < TN activation
// rows (Q4_1-type blocks run on `paired_tile` and `one_row_q4_1`, Q4_K / Q5_K on `tile_k`, Q6_K on `tile_q6`, Q3_K / Q2_K on `tile_s16`).
// scratch: >= TO·(TN + 1)·nb floats.
template <int TO, int TN, bool NL = false>
void tile(const Weights& w, int64_t o, const Acts& x, float* y, int64_t N, float* scratch) {
  const int64_t nb = w.nb;
  prefetch_outputs(w, o + 2 * TO, TO, N);
  __m256 acc[TO][TN];
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_setzero_ps();
  float* dw = scratch;                 // [TO, nb]
  float* sc = dw + TO * nb;            // [TO, TN, nb]: dw·dx per block
  for (int i = 0; i < TO; ++i) {
    halves_to_float(w.d + (o + i) * w.nb, dw + i * nb, w.nb);
    for (int j = 0; j < TN; ++j) {
      float* s = sc + (i * TN + j) * nb;
      const float* dxj = x.d + j * nb;
      for (int64_t b = 0; b < nb; ++b) s[b] = dw[i * nb + b] * dxj[b];
    }
  }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv[TO];
    for (int i = 0; i < TO; ++i) wv[i] = load_weights<false, false, NL>(w, o + i, b);
    for (int j = 0; j < TN; ++j) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + j * x.K + b * QK));
      for (int i = 0; i < TO; ++i) {
        const __m256 p = _mm256_cvtepi32_ps(block_dot<false>(wv[i], xv));
        acc[i][j] = _mm256_fmadd_ps(_mm256_broadcast_ss(sc + (i * TN + j) * nb + b), p, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) y[j * N + o + i] = hsum(acc[i][j]) + x.minima_term(j, o + i);
}

// Rows of activations as `paired_tile` reads them, prepared once per call: for blocks b, b+1 of each
// row their values paired as `pair_activations` lays them out, and their scales spread to the lanes
// of the pair's int32 sums (dx_b x4, dx_b+1 x4).
struct PairedActs {
  const int8_t* xp;   // [T, nb/2, 64]: row stride K bytes
  const float* dxe;   // [T, nb/2, 8]: row stride nb/2·8 floats
};

// Q4_1-type products of TO outputs and TN rows, two blocks at a time: one 32-byte load holds blocks
// b and b+1's values (16 bytes each); its low nibbles are values 0-15 of both, its high nibbles
// values 16-31, so the activations come paired the same way (`PairedActs`: low halves of blocks b
// and b+1, then high halves, prepared once per call), both products summed by dot2_u8s8: int32
// lanes 0-3 are block b's sums, 4-7 block b+1's, scaled by the output's spread d_w (converted once
// per pair) times the row's spread d_x. A row's operations are the same in every tile, and the
// same as `one_row_q4_1`'s, so no row count changes a result.
template <int TO, int TN, bool H5 = false>
void paired_tile(const Weights& w, int64_t o, const Acts& x, const PairedActs& xp, float* y, int64_t N) {
  const int64_t nb = w.nb, pairs = nb / 2;
  prefetch_outputs(w, o + 2 * TO, TO, N);
  __m256 acc[TO][TN];
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i pair_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t pr = 0; pr < pairs; ++pr) {
    __m256i wlo[TO], whi[TO];
    __m256 dwv[TO];
    for (int i = 0; i < TO; ++i) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + (o + i) * w.row_bytes + pr * QK));
      wlo[i] = _mm256_and_si256(v, low4);
      whi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (H5) {
        wlo[i] = _mm256_or_si256(wlo[i], high_bits(w.qh[(o + i) * nb + 2 * pr]));
        whi[i] = _mm256_or_si256(whi[i], high_bits(w.qh[(o + i) * nb + 2 * pr + 1]));
      }
      dwv[i] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair_scales(w, o + i, 2 * pr)), pair_idx);
    }
    for (int j = 0; j < TN; ++j) {
      const int8_t* xj = xp.xp + j * x.K + pr * 2 * QK;
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + QK));
      const __m256 dxv = _mm256_loadu_ps(xp.dxe + (j * pairs + pr) * 8);
      for (int i = 0; i < TO; ++i) {
        const __m256 p = _mm256_cvtepi32_ps(dot2_u8s8(wlo[i], xlo, whi[i], xhi));
        acc[i][j] = _mm256_fmadd_ps(_mm256_mul_ps(dwv[i], dxv), p, acc[i][j]);
      }
    }
  }
  if (nb % 2 == 1) {  // the last block alone
    const int64_t b = nb - 1;
    for (int i = 0; i < TO; ++i) {
      const __m256i wv = load_weights<true, H5>(w, o + i, b);
      const float dw = block_scale(w, o + i, b);
      for (int j = 0; j < TN; ++j) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + j * x.K + b * QK));
        const __m256 p = _mm256_cvtepi32_ps(block_dot<true>(wv, xv));
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[j * nb + b]), p, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) y[j * N + o + i] = hsum(acc[i][j]) + x.minima_term(j, o + i);
}

// A pshufb pattern over 8 int16 scales held in both 128-bit lanes: int16 lanes 0-7 get scale `low`,
// lanes 8-15 scale `high`.
inline __m256i pick_scales(int low, int high) {
  return _mm256_set_m128i(_mm_set1_epi16(static_cast<int16_t>(((2 * high + 1) << 8) | (2 * high))),
                          _mm_set1_epi16(static_cast<int16_t>(((2 * low + 1) << 8) | (2 * low))));
}

// int16 lanes 0-7 get scale 2p, lanes 8-15 scale 2p + 1 (the halves of block p's maddubs pair sums,
// whose scales these are).
inline __m256i pick_scale_pair(int p) { return pick_scales(2 * p, 2 * p + 1); }

// The layouts with a scale per 16 values (`tile_s16`; Q6_K: `tile_q6`).
// IQ4_XS rides along: its scale per 32 values is expanded to the pair of 16s at each super-block.
enum Sub16 { NO_SUB16 = 0, SUB16_Q6 = 6, SUB16_Q3 = 3, SUB16_Q2 = 2, SUB16_IQ4XS = 4 };

// Q6_K blocks 2·pr and 2·pr + 1 of output o as unsigned values q + 32 in 0..63, in the order
// `pair_activations` lays a row's activations out: lo = values 0-15 of the first block, then values
// 0-15 of the second; hi = values 16-31 of each. The low 4 bits as Q4_1's (one 32-byte load for both
// blocks); bits 4-5 from the pair's 16 bytes of q2 (byte k: at bits 0-1 / 2-3 those of value k of the
// first / second block, at bits 4-5 / 6-7 those of value 16 + k), held in both 128-bit lanes and
// shifted per lane to bits 4-5 (a 64-bit shift moves bits across bytes, but only into bits the mask drops).
inline void load_q6_pair(const Weights& w, int64_t o, int64_t pr, __m256i& lo, __m256i& hi) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + o * w.row_bytes + pr * QK));
  const __m256i b =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q2 + (o * w.nb + 2 * pr) * 8)));
  lo = _mm256_or_si256(_mm256_and_si256(v, low4),
                       _mm256_and_si256(_mm256_sllv_epi64(b, _mm256_setr_epi64x(4, 4, 2, 2)), bits45));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                       _mm256_and_si256(_mm256_srlv_epi64(b, _mm256_setr_epi64x(0, 0, 2, 2)), bits45));
}

// Q3_K / Q2_K block 4h + j of a super-block as 32 unsigned values (Q2_K q in 0..3, Q3_K q + 4 in
// 0..7): bits 2j of the half's 32 bytes of 2-bit fields, and (Q3_K) bit 4h + j of the mask bytes as 4.
template <int S16>
inline __m256i low_bit_values(__m256i fields, __m256i masks, int j, int bit) {
  const __m256i low = _mm256_and_si256(_mm256_srli_epi16(fields, 2 * j), _mm256_set1_epi8(3));
  if constexpr (S16 == SUB16_Q2) {
    return low;
  } else {
    const __m256i hit = _mm256_and_si256(masks, _mm256_set1_epi8(static_cast<char>(1 << bit)));  // 1 << bit or 0
    // moved to bit 2 within each byte (a masked bit never crosses into the next byte)
    const __m256i third = bit >= 2 ? _mm256_srli_epi16(hit, bit - 2) : _mm256_slli_epi16(hit, 2 - bit);
    return _mm256_or_si256(low, third);
  }
}

// Activation rows quantized in super-blocks of 256 (`quantize_super_block`), as `tile_s16` reads them
// (`tile_q6`: q holds the rows' paired values, `pair_activations`).
struct SuperActs {
  const int8_t* q;     // [T, K]
  const float* d;      // [T, K/256]
  const int16_t* sums; // [T, K/16]
  int64_t K;
  SuperActs rows_from(int64_t t) const { return SuperActs{q + t * K, d + t * (K / QKK), sums + t * (K / 16), K}; }
};

// Q3_K / Q2_K / IQ4_XS products of TO outputs and TN rows (Q6_K: `tile_q6`), as integers within each
// super-block of 256 (the scheme ggml runs these types with): per block of 32, maddubs of the unsigned
// values (`low_bit_values`: Q3_K q + 4 in 0..7, Q2_K q in 0..3) with the row's int8
// values gives int16 pair sums (<= 2·7·127: no saturation), madd with the sub-block scales sums
// them in int32; the offset comes off as 4·Σ sc·(the row's sums of 16) (Q3_K), also in integers; then
// one float step per super-block:
// acc += (ds·dx) · Σ (each int32 lane converted once: exact below 2²⁴, which only activations and
// weights at their extremes together exceed; the lanes of the offset term are other sub-blocks'
// than the products', so it cancels in the lanes' sum). Q2_K's minima: acc −= (dmin·dx) · Σ mn·sums
// (integers, exact). A row's operations are the same in every tile, so no row count changes a result.
template <int S16, int TO, int TN>
void tile_s16(const Weights& w, int64_t o, const SuperActs& x, float* y, int64_t N) {
  static_assert(S16 != SUB16_Q6, "Q6_K runs on tile_q6");
  const int64_t nb = w.nb, nsb = nb / 8;
  prefetch_outputs(w, o + 2 * TO, TO, N);
  __m256 acc[TO][TN];
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m256i sc16[TO], mn16[TO];
    float ds[TO], dmin[TO];
    for (int i = 0; i < TO; ++i) {
      if constexpr (S16 == SUB16_IQ4XS) {  // 8 scales (a byte per 32 values), each doubled: one per 16
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + (o + i) * nb + sb * 8));
        sc16[i] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(raw, raw));
        ds[i] = half_to_float(w.d[(o + i) * nsb + sb]);
        continue;
      }
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (o + i) * 2 * nb + sb * 16));
      if constexpr (S16 == SUB16_Q2) {
        const __m128i low4 = _mm_set1_epi8(0x0F);
        sc16[i] = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low4));
        mn16[i] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low4));
        ds[i] = half_to_float(w.d[((o + i) * nsb + sb) * 2]);
        dmin[i] = half_to_float(w.d[((o + i) * nsb + sb) * 2 + 1]);
      } else {
        sc16[i] = _mm256_cvtepi8_epi16(raw);
        ds[i] = half_to_float(w.d[(o + i) * nsb + sb]);
      }
    }
    __m256i isum[TO][TN];
    for (int i = 0; i < TO; ++i)
      for (int j = 0; j < TN; ++j) isum[i][j] = _mm256_setzero_si256();
    __m256i masks[TO];  // Q3_K: the super-block's third-bit masks (unused, zero, for the others)
    for (int i = 0; i < TO; ++i)
      masks[i] = S16 == SUB16_Q3
                     ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q2 + (o + i) * (w.row_bytes / 2) + sb * 32))
                     : _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {  // blocks 4h .. 4h + 3
      __m256i halves[TO], fields[TO];  // the half's 8 scales as int16 in both 128-bit lanes; its 2-bit fields
      for (int i = 0; i < TO; ++i) {
        halves[i] = h ? _mm256_permute2x128_si256(sc16[i], sc16[i], 0x11) : _mm256_permute2x128_si256(sc16[i], sc16[i], 0x00);
        if constexpr (S16 == SUB16_Q3 || S16 == SUB16_Q2)
          fields[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + (o + i) * w.row_bytes + sb * 64 + h * 32));
      }
      for (int jb = 0; jb < 4; ++jb) {
        const int b = 4 * h + jb;
        const __m256i pick = pick_scale_pair(jb);  // sub-blocks 2b, 2b + 1 of the half's 8
        __m256i wv[TO], scale[TO];  // IQ4_XS: wv the levels' magnitudes, sw the levels (their signs)
        [[maybe_unused]] __m256i sw[TO];
        for (int i = 0; i < TO; ++i) {
          if constexpr (S16 == SUB16_IQ4XS) {
            sw[i] = load_weights<false, false, true>(w, o + i, sb * 8 + b);
            wv[i] = _mm256_sign_epi8(sw[i], sw[i]);
          } else {
            wv[i] = low_bit_values<S16>(fields[i], masks[i], jb, b);
          }
          scale[i] = _mm256_shuffle_epi8(halves[i], pick);
        }
        for (int j = 0; j < TN; ++j) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + j * x.K + (sb * 8 + b) * QK));
          for (int i = 0; i < TO; ++i) {
            // IQ4_XS: |w| times x carrying w's sign (|w| <= 127, |x| <= 127: pair sums <= 32258)
            __m256i xs = xv;
            if constexpr (S16 == SUB16_IQ4XS) xs = _mm256_sign_epi8(xv, sw[i]);
            isum[i][j] = madd16_acc(isum[i][j], _mm256_maddubs_epi16(wv[i], xs), scale[i]);
          }
        }
      }
    }
    for (int j = 0; j < TN; ++j) {
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums + j * (x.K / 16) + sb * 16));
      const float dx = x.d[j * nsb + sb];
      for (int i = 0; i < TO; ++i) {
        if constexpr (S16 == SUB16_IQ4XS) {  // signed values: no offset
          acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(ds[i] * dx), _mm256_cvtepi32_ps(isum[i][j]), acc[i][j]);
        } else if constexpr (S16 == SUB16_Q2) {
          acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(ds[i] * dx), _mm256_cvtepi32_ps(isum[i][j]), acc[i][j]);
          acc[i][j] = _mm256_fnmadd_ps(_mm256_set1_ps(dmin[i] * dx), _mm256_cvtepi32_ps(_mm256_madd_epi16(sums, mn16[i])),
                                       acc[i][j]);
        } else {
          const __m256i total = _mm256_sub_epi32(isum[i][j], _mm256_slli_epi32(_mm256_madd_epi16(sums, sc16[i]), 2));  // Q3_K: 4·Σ
          acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(ds[i] * dx), _mm256_cvtepi32_ps(total), acc[i][j]);
        }
      }
    }
  }
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) y[j * N + o + i] = hsum(acc[i][j]);
}

template <int S16, int TO, int TN>
void tile_s16_rows(const Weights& w, int64_t o0, int64_t o1, const SuperActs& x, float* y, int64_t N) {
  int64_t o = o0;
  for (; o + TO <= o1; o += TO) tile_s16<S16, TO, TN>(w, o, x, y, N);
  for (; o < o1; ++o) tile_s16<S16, 1, TN>(w, o, x, y, N);
}

#if FORKLM_VNNI
// The low and high 256 bits of v added as int32 lanes.
inline __m256i fold_halves(__m512i v) {
  return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// `load_q6_pair`'s lo in the low 256 bits and hi in the high 256 bits of one vector.
inline __m512i load_q6_pair_512(const Weights& w, int64_t o, int64_t pr) {
  const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + o * w.row_bytes + pr * QK)));
  const __m512i b = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q2 + (o * w.nb + 2 * pr) * 8)));
  // low 4 bits: low nibbles (low half), high nibbles (high half); bits 4-5: `load_q6_pair`'s shifts as
  // rotations (what a rotation brings round lands outside bits 4-5 of each byte, which the mask drops)
  const __m512i low = _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4)), _mm512_set1_epi8(0x0F));
  const __m512i high = _mm512_and_si512(_mm512_rolv_epi64(b, _mm512_setr_epi64(4, 4, 2, 2, 0, 0, 62, 62)), _mm512_set1_epi8(0x30));
  return _mm512_or_si512(low, high);
}

// `tile_q6`'s integer sums of super-block sb in 512-bit vectors (the VNNI build): a pair's lo values
// in the low 256 bits and its hi values in the high 256 bits meet the row's 64 paired bytes in one
// maddubs, and one vpdpwssd applies both halves' scales. Lane l of the low half sums what `tile_q6`'s
// lane l sums from lo, lane l of the high half what it sums from hi: their sum (`fold_halves`, in
// int32) is the AVX2 build's integer, so both builds' products stay equal bit for bit.
template <int TO, int TN>
inline void q6_super_block_512(const Weights& w, int64_t o, const SuperActs& x, int64_t sb, const __m256i* sc16,
                               __m256i (*isum)[TN]) {
  __m512i wide[TO][TN];
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) wide[i][j] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {  // blocks 4h .. 4h + 3: sub-blocks 8h .. 8h + 7
    __m512i halves[TO];  // the half's 8 scales as int16 in each 128-bit lane
    for (int i = 0; i < TO; ++i)
      halves[i] = _mm512_broadcast_i32x4(h ? _mm256_extracti128_si256(sc16[i], 1) : _mm256_castsi256_si128(sc16[i]));
    for (int q = 0; q < 2; ++q) {  // the pair of blocks 4h + 2q, 4h + 2q + 1
      const int64_t pr = sb * 4 + 2 * h + q;
      const __m512i pick = _mm512_inserti64x4(_mm512_castsi256_si512(pick_scales(4 * q, 4 * q + 2)),
                                              pick_scales(4 * q + 1, 4 * q + 3), 1);
      __m512i wv[TO], sc[TO];
      for (int i = 0; i < TO; ++i) {
        wv[i] = load_q6_pair_512(w, o + i, pr);
        sc[i] = _mm512_shuffle_epi8(halves[i], pick);
      }
      for (int j = 0; j < TN; ++j) {
        const __m512i xv = _mm512_loadu_si512(x.q + j * x.K + pr * 2 * QK);  // the pair's low then high halves
        for (int i = 0; i < TO; ++i) wide[i][j] = _mm512_dpwssd_epi32(wide[i][j], _mm512_maddubs_epi16(wv[i], xv), sc[i]);
      }
    }
  }
  // the offset: − 32·Σ sc·(the row's sums of 16), in the same chain (`tile_q6` takes it off the AVX2 build's sums)
  for (int i = 0; i < TO; ++i) {
    const __m256i offset_scales = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sc16[i], 5));
    for (int j = 0; j < TN; ++j) {
      const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums + j * (x.K / 16) + sb * 16));
      isum[i][j] = _mm256_dpwssd_epi32(fold_halves(wide[i][j]), sums, offset_scales);
    }
  }
}
#endif

// Q6_K products of TO outputs and TN rows, in integers within each super-block of 256 as `tile_s16`
// runs the other types with scales per 16 values, but two blocks at a time: one pair (`load_q6_pair`)
// meets the row's paired activations (`pair_activations`: a 32-byte load each for the pair's low and
// high halves), maddubs gives int16 pair sums (<= 2·63·127: no saturation) whose lanes 0-7 / 8-15 are
// sub-blocks 4q / 4q + 2 (lo) and 4q + 1 / 4q + 3 (hi) of the half's 8, madd with those scales sums them
// in int32 (<= 8 · 2 · 16002 · 128 < 2³¹ a lane over a super-block); the offset comes off as 32·Σ sc·(the
// row's sums of 16), then one float step per super-block: acc += (ds·dx)·Σ (each int32 lane converted
// once: exact below 2²⁴, which only activations and weights at their extremes together exceed). A
// row's operations are the same in every tile, so no row count changes a result.
// x.q: the rows' paired activations.
template <int TO, int TN>
void tile_q6(const Weights& w, int64_t o, const SuperActs& x, float* y, int64_t N) {
  const int64_t nb = w.nb, nsb = nb / 8;
  prefetch_outputs(w, o + 2 * TO, TO, N);
  __m256 acc[TO][TN];
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m256i sc16[TO];
    float ds[TO];
    for (int i = 0; i < TO; ++i) {
      sc16[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + (o + i) * 2 * nb + sb * 16)));
      ds[i] = half_to_float(w.d[(o + i) * nsb + sb]);
    }
    __m256i isum[TO][TN];
#if FORKLM_VNNI  // (a lone row's products stream their weights: 256-bit vectors there)
    if constexpr (TN > 1) {
      q6_super_block_512<TO, TN>(w, o, x, sb, sc16, isum);
    } else
#endif
    {
      for (int i = 0; i < TO; ++i)
        for (int j = 0; j < TN; ++j) isum[i][j] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {  // blocks 4h .. 4h + 3: sub-blocks 8h .. 8h + 7
        __m256i halves[TO];  // the half's 8 scales as int16 in both 128-bit lanes
        for (int i = 0; i < TO; ++i)
          halves[i] = h ? _mm256_permute2x128_si256(sc16[i], sc16[i], 0x11) : _mm256_permute2x128_si256(sc16[i], sc16[i], 0x00);
        for (int q = 0; q < 2; ++q) {  // the pair of blocks 4h + 2q, 4h + 2q + 1
          const int64_t pr = sb * 4 + 2 * h + q;
          const __m256i pick_lo = pick_scales(4 * q, 4 * q + 2), pick_hi = pick_scales(4 * q + 1, 4 * q + 3);
          __m256i wlo[TO], whi[TO], slo[TO], shi[TO];
          for (int i = 0; i < TO; ++i) {
            load_q6_pair(w, o + i, pr, wlo[i], whi[i]);
            slo[i] = _mm256_shuffle_epi8(halves[i], pick_lo);
            shi[i] = _mm256_shuffle_epi8(halves[i], pick_hi);
          }
          for (int j = 0; j < TN; ++j) {
            const int8_t* xj = x.q + j * x.K + pr * 2 * QK;
            const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj));
            const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + QK));
            for (int i = 0; i < TO; ++i)
              isum[i][j] = madd16_acc(madd16_acc(isum[i][j], _mm256_maddubs_epi16(wlo[i], xlo), slo[i]),
                                      _mm256_maddubs_epi16(whi[i], xhi), shi[i]);
          }
        }
    }
    }
    for (int j = 0; j < TN; ++j) {
      const float dx = x.d[j * nsb + sb];
      for (int i = 0; i < TO; ++i) {
        __m256i total = isum[i][j];  // `q6_super_block_512` takes the offset off itself
        if (!FORKLM_VNNI || TN == 1) {
          const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sums + j * (x.K / 16) + sb * 16));
          total = _mm256_sub_epi32(total, _mm256_slli_epi32(_mm256_madd_epi16(sums, sc16[i]), 5));  // 32·Σ
        }
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(ds[i] * dx), _mm256_cvtepi32_ps(total), acc[i][j]);
      }
    }
  }
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) y[j * N + o + i] = hsum(acc[i][j]);
}

template <int TO, int TN>
void tile_q6_rows(const Weights& w, int64_t o0, int64_t o1, const SuperActs& x, float* y, int64_t N) {
  int64_t o = o0;
  for (; o + TO <= o1; o += TO) tile_q6<TO, TN>(w, o, x, y, N);
  for (; o < o1; ++o) tile_q6<1, TN>(w, o, x, y, N);
}

template <int TO, int TN, bool NL = false>
void tile_rows(const Weights& w, int64_t o0, int64_t o1, const Acts& x, float* y, int64_t N, float* scratch) {
  int64_t o = o0;
  for (; o + TO <= o1; o += TO) tile<TO, TN, NL>(w, o, x, y, N, scratch);
  for (; o < o1; ++o) tile<1, TN, NL>(w, o, x, y, N, scratch);
}

template <int TO, int TN, bool H5 = false>
void paired_tile_rows(const Weights& w, int64_t o0, int64_t o1, const Acts& x, const PairedActs& xp, float* y,
                      int64_t N) {
  int64_t o = o0;
  for (; o + TO <= o1; o += TO) paired_tile<TO, TN, H5>(w, o, x, xp, y, N);
  for (; o < o1; ++o) paired_tile<1, TN, H5>(w, o, x, xp, y, N);
}

// Activation rows for Q4_K / Q5_K weights: quantized in super-blocks of 256 (`quantize_super_block`),
// their values paired as `pair_activations` lays them out, and the chunk's minima terms.
struct KActs {
  const int8_t* xp;  // [T, K] paired
  const float* d;    // [T, K/256]
  int64_t K;
  const float* mt;   // row j's minima term of output o at mt[j·mt_ld + o − mt_o0]
  int64_t mt_ld, mt_o0;
  KActs rows_from(int64_t t) const { return KActs{xp + t * K, d + t * (K / QKK), K, mt + t * mt_ld, mt_ld, mt_o0}; }
};

#if FORKLM_VNNI
// `tile_k`'s integer sums of super-block sb in 512-bit vectors (the VNNI build): a block pair's low
// values (as `tile_k`'s wlo) in the low 256 bits and its high values (whi) in the high 256 bits meet
// the row's 64 paired bytes in one maddubs, and vpdpwssd applies the blocks' scales (the same per
// half); two pairs a step. Lane l of the low half then holds what `tile_k`'s lane l sums from the low
// values, lane l of the high half what it sums from the high ones: their sum (`fold_halves`, in
// int32) is the AVX2 build's integer, so both builds' products stay equal bit for bit.
template <int TO, int TN, bool H5>
inline void k_super_block_512(const Weights& w, int64_t o, const KActs& x, int64_t sb, const __m256i* sc8,
                              __m256i (*isum)[TN]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i nibble_shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);  // low half: low nibbles; high: high
  __m512i wide[TO][TN], sc8x4[TO];
  for (int i = 0; i < TO; ++i) {
    sc8x4[i] = _mm512_broadcast_i64x4(sc8[i]);
    for (int j = 0; j < TN; ++j) wide[i][j] = _mm512_setzero_si512();
  }
  for (int p = 0; p < 4; p += 2) {  // block pairs p and p + 1 of the super-block
    const int64_t pr = sb * 4 + p;
    const __m512i pick0 = _mm512_broadcast_i64x4(pick_scale_pair(p)), pick1 = _mm512_broadcast_i64x4(pick_scale_pair(p + 1));
    __m512i w0[TO], w1[TO], s0[TO], s1[TO];
    for (int i = 0; i < TO; ++i) {
      const __m512i v = _mm512_loadu_si512(w.qs + (o + i) * w.row_bytes + pr * QK);  // pairs pr and pr + 1
      w0[i] = _mm512_and_si512(_mm512_srlv_epi64(_mm512_shuffle_i64x2(v, v, 0x44), nibble_shift), low4);
      w1[i] = _mm512_and_si512(_mm512_srlv_epi64(_mm512_shuffle_i64x2(v, v, 0xEE), nibble_shift), low4);
      if constexpr (H5) {  // the fifth bits: one mask bit a value, in `high_bits`' order (words 2pr .. 2pr + 3)
        uint64_t m0, m1;
        std::memcpy(&m0, w.qh + (o + i) * w.nb + 2 * pr, 8);
        std::memcpy(&m1, w.qh + (o + i) * w.nb + 2 * pr + 2, 8);
        const __m512i bit4 = _mm512_set1_epi8(0x10);
        w0[i] = _mm512_or_si512(w0[i], _mm512_maskz_mov_epi8(_cvtu64_mask64(m0), bit4));
        w1[i] = _mm512_or_si512(w1[i], _mm512_maskz_mov_epi8(_cvtu64_mask64(m1), bit4));
      }
      s0[i] = _mm512_shuffle_epi8(sc8x4[i], pick0);
      s1[i] = _mm512_shuffle_epi8(sc8x4[i], pick1);
    }
    for (int j = 0; j < TN; ++j) {
      const int8_t* xj = x.xp + j * x.K + pr * 2 * QK;  // pair pr's low then high halves, then pair pr + 1's
      const __m512i x0 = _mm512_loadu_si512(xj), x1 = _mm512_loadu_si512(xj + 2 * QK);
      for (int i = 0; i < TO; ++i)
        wide[i][j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(wide[i][j], _mm512_maddubs_epi16(w0[i], x0), s0[i]),
                                         _mm512_maddubs_epi16(w1[i], x1), s1[i]);
    }
  }
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) isum[i][j] = fold_halves(wide[i][j]);
}
#endif

// Q4_K / Q5_K products of TO outputs and TN rows, in integers within each super-block of 256 (the
// scheme ggml runs K-quants with): a 32-byte load holds blocks b and b + 1's values (as `paired_tile`
// reads Q4_1), maddubs of both halves with the row's paired int8 values gives int16 sums (<= 2·2·31·127),
// madd with the blocks' 6-bit scales (lanes 0-7 block b's, 8-15 block b + 1's) sums them in int32
// (<= 4 pairs · 2 · 15748 · 63 < 2²⁴: converted to float exactly); then one float step per super-block, acc += (ds·dx) · Σ, and the
// minima term (`minima_terms` over the blocks' dm·mq and the row's dx·Σq per 32) at the end. A row's
// operations are the same in every tile, so no row count changes a result.
template <int TO, int TN, bool H5>
void tile_k(const Weights& w, int64_t o, const KActs& x, float* y, int64_t N) {
  const int64_t nb = w.nb, nsb = nb / 8;
  prefetch_outputs(w, o + 2 * TO, TO, N);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[TO][TN];
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m256i sc8[TO];  // the super-block's 8 block scales as int16, in both 128-bit lanes
    float ds[TO];
    for (int i = 0; i < TO; ++i) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sc + (o + i) * nb + sb * 8));
      sc8[i] = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(bytes));
      ds[i] = half_to_float(w.d[(o + i) * nsb + sb]);
    }
    __m256i isum[TO][TN];
#if FORKLM_VNNI  // (a lone row's products stream their weights: 256-bit vectors there)
    if constexpr (TN > 1) {
      k_super_block_512<TO, TN, H5>(w, o, x, sb, sc8, isum);
    } else
#endif
    {
      for (int i = 0; i < TO; ++i)
        for (int j = 0; j < TN; ++j) isum[i][j] = _mm256_setzero_si256();
      for (int p = 0; p < 4; ++p) {  // blocks 2p and 2p + 1 of the super-block
        const int64_t pr = sb * 4 + p;
        const __m256i pick = pick_scale_pair(p);  // blocks 2p, 2p + 1 of the super-block's 8
        __m256i wlo[TO], whi[TO], scale[TO];
        for (int i = 0; i < TO; ++i) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + (o + i) * w.row_bytes + pr * QK));
          wlo[i] = _mm256_and_si256(v, low4);
          whi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          if constexpr (H5) {
            wlo[i] = _mm256_or_si256(wlo[i], high_bits(w.qh[(o + i) * nb + 2 * pr]));
            whi[i] = _mm256_or_si256(whi[i], high_bits(w.qh[(o + i) * nb + 2 * pr + 1]));
          }
          scale[i] = _mm256_shuffle_epi8(sc8[i], pick);
        }
        for (int j = 0; j < TN; ++j) {
          const int8_t* xj = x.xp + j * x.K + pr * 2 * QK;
          const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj));
          const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + QK));
          for (int i = 0; i < TO; ++i) {
            const __m256i p16 = _mm256_add_epi16(_mm256_maddubs_epi16(wlo[i], xlo), _mm256_maddubs_epi16(whi[i], xhi));
            isum[i][j] = madd16_acc(isum[i][j], p16, scale[i]);
          }
        }
    }
    }
    for (int j = 0; j < TN; ++j) {
      const float dx = x.d[j * nsb + sb];
      for (int i = 0; i < TO; ++i)
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(ds[i] * dx), _mm256_cvtepi32_ps(isum[i][j]), acc[i][j]);
    }
  }
  for (int i = 0; i < TO; ++i)
    for (int j = 0; j < TN; ++j) y[j * N + o + i] = hsum(acc[i][j]) + x.mt[j * x.mt_ld + o + i - x.mt_o0];
}

template <int TO, int TN, bool H5>
void tile_k_rows(const Weights& w, int64_t o0, int64_t o1, const KActs& x, float* y, int64_t N) {
  int64_t o = o0;
  for (; o + TO <= o1; o += TO) tile_k<TO, TN, H5>(w, o, x, y, N);
  for (; o < o1; ++o) tile_k<1, TN, H5>(w, o, x, y, N);
}

// A lone activation row times Q4_1-type outputs [o0, o1): the operations of paired_tile<1, 1> (so
// the same bits), with each block pair's scale d_w·d_x formed as it is used from the float16 scales
// and the minima terms formed group by group as it goes (a decode step's products stream their
// weights from memory: no scratch passes). xp: [nb/2] pairs of 32 bytes (low halves of blocks b and
// b+1, then their high halves).
template <bool H5 = false, int TO = 1>
void one_row_q4_1(const Weights& w, int64_t o0, int64_t o1, const Acts& x, const int8_t* xp, float* y, int64_t N) {
  static_assert(TO == 1 || TO == 2 || TO == 4 || TO == 8, "a tile's outputs stay inside one group of 8");
  const int64_t nb = w.nb;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i pair_idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  float group_terms[8];  // without x.mt: the minima terms of o's group of 8 outputs, formed on entering it
  int64_t group = o0;
  int64_t o = o0;
  // TO outputs at a time while whole tiles fit inside a group of 8 (o0 is a multiple of 8), then one by one
  const auto run = [&](auto tile_outs) {
    constexpr int R = decltype(tile_outs)::value;
    if (x.mt == nullptr && (o == o0 || (o & 7) == 0)) {
      group = o;
      prefetch_minima(w, nb, std::min(o1, (o | 7) + 17), std::min(o1, (o | 7) + 25));  // two groups ahead
      minima_terms(w, o, std::min(o1, (o | 7) + 1), x.s, 1, nb, group_terms);
    }
    if (o + 3 * R <= N) {  // the weights two tiles ahead into cache, as `tile`
      const char* values = reinterpret_cast<const char*>(w.qs + (o + 2 * R) * w.row_bytes);
      for (int64_t off = 0; off < R * w.row_bytes; off += 64) _mm_prefetch(values + off, WEIGHT_PREFETCH);
      const char* scales = reinterpret_cast<const char*>(w.d + (o + 2 * R) * nb);
      for (int64_t off = 0; off < R * nb * 2; off += 64) _mm_prefetch(scales + off, WEIGHT_PREFETCH);
      if constexpr (H5)
        for (int64_t off = 0; off < R * nb * 4; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(w.qh + (o + 2 * R) * nb) + off, WEIGHT_PREFETCH);
    }
    __m256 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      const __m256i xlo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + b * QK));
      const __m256i xhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + b * QK + QK));
      const __m128 dx2 = load_two(x.d + b);
      for (int i = 0; i < R; ++i) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + (o + i) * w.row_bytes + b * 16));
        __m256i wlo = _mm256_and_si256(v, low4), whi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        if constexpr (H5) {
          wlo = _mm256_or_si256(wlo, high_bits(w.qh[(o + i) * nb + b]));
          whi = _mm256_or_si256(whi, high_bits(w.qh[(o + i) * nb + b + 1]));
        }
        const __m256 p = _mm256_cvtepi32_ps(dot2_u8s8(wlo, xlo, whi, xhi));
        const __m128 s2 = _mm_mul_ps(pair_scales(w, o + i, b), dx2);
        acc[i] = _mm256_fmadd_ps(_mm256_permutevar8x32_ps(_mm256_castps128_ps256(s2), pair_idx), p, acc[i]);
      }
    }
    for (; b < nb; ++b) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + b * QK));
      for (int i = 0; i < R; ++i) {
        const __m256 p = _mm256_cvtepi32_ps(block_dot<true>(load_weights<true, H5>(w, o + i, b), xv));
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(block_scale(w, o + i, b) * x.d[b]), p, acc[i]);
      }
    }
    for (int i = 0; i < R; ++i)
      y[o + i] = hsum(acc[i]) + (x.mt == nullptr ? group_terms[o + i - group] : x.minima_term(0, o + i));
    o += R;
  };
  while (o + TO <= o1) run(std::integral_constant<int, TO>{});
  while (o < o1) run(std::integral_constant<int, 1>{});
}

// The pairs `one_row_q4_1`, `tile_k` and `tile_q6` read: for blocks b, b+1 of the row, their low 16 bytes side by side, then
// their high 16 bytes (as `tile` permutes them).
void pair_activations(const int8_t* q, int64_t nb, int8_t* xp) {
  for (int64_t b = 0; b + 2 <= nb; b += 2) {
    const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * QK));
    const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (b + 1) * QK));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xp + b * QK), _mm256_permute2x128_si256(xa, xb, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xp + b * QK + QK), _mm256_permute2x128_si256(xa, xb, 0x31));
  }
}

constexpr int64_t ROWS_PER_CHUNK = 64;  // weight rows kept hot in cache while tiles of T pass over them

// f(c0, c1) over [begin, end) in chunks of `chunk`, the chunks handed to the threads as each frees up
// (OpenMP's dynamic schedule): a thread the machine runs slower takes fewer chunks instead of holding the
// others at the end (at::parallel_for splits the range in equal parts up front). Which thread runs a chunk
// changes no result: every output is computed by one thread, the same way.
template <typename F>
inline void parallel_chunks(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  const int64_t chunks = (end - begin + chunk - 1) / chunk;
  const int threads = at::get_num_threads();
  if (chunks <= 1 || threads == 1 || at::in_parallel_region()) {
    if (end > begin) f(begin, end);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < chunks; ++i) f(begin + i * chunk, std::min(end, begin + (i + 1) * chunk));
}

// Tile shapes (a row's operations are the same in any tile, so none changes a result): outputs per
// tile of 4 activation rows for Q4_1-type and Q8_0 blocks: AVX2 has 16 vector registers (2 x 4
// accumulators and the unpacked weights fill them); with AVX-512's 32 (the VNNI build) 4 x 4 tiles
// share each activation load twice as widely. K-quant tiles hold an integer and a float accumulator
// per (output, row): one output by 4 rows. A lone row (a decode step of one sample) takes one output
// at a time on most layouts: its products stream their weights from memory (two or four at a time
// were no faster on K-quants and IQ4_NL, and 1.5-1.8x slower on Q8_0 read where the file stored it).
constexpr int ROW_TILE_OUTS = FORKLM_VNNI ? 4 : 2;
// Q4_1-type outputs per tile of a lone row: on the AVX2 build two independent chains sharing the
// row's loads, each output's operations those of a tile of one (measured faster than one or four,
// 2026-11-27); the VNNI build keeps one (not measured there)
constexpr int ONE_ROW_Q41_OUTS = FORKLM_VNNI ? 1 : 2;
constexpr int64_t cmax(int64_t a, int64_t b) { return a > b ? a : b; }
// floats of scratch per block that `tile` needs (TO·(TN + 1)) for the largest tile `gemm` runs
constexpr int64_t SCRATCH_PER_BLOCK = cmax(cmax(ROW_TILE_OUTS * 5, 1 * 2), cmax(2 * 4, 4 * 3));

// A product call's activations and fusions, checked alike for every layout: x [T, K] (SWIGLU: [T, 2K])
// float32, the prologue, its RMSNorm weight [K], and (`checked_residual`) the residual [T, N].
struct ProductInput {
  torch::Tensor x, norm;  // norm: defined for RMSNORM only
  Prologue mode;
  int64_t T, K, nb;
  const float* norm_data() const { return mode == RMSNORM ? norm.data_ptr<float>() : nullptr; }
};

ProductInput product_input(const torch::Tensor& x_in, int64_t mode_in, const std::optional<torch::Tensor>& norm_weight) {
  ProductInput in;
  in.x = x_in.contiguous();
  const torch::Tensor& x = in.x;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_cpu(), "activations must be a float32 CPU matrix [T, K]");
  TORCH_CHECK(mode_in >= PLAIN && mode_in <= SWIGLU, "prologue must be 0 (plain), 1 (rms_norm) or 2 (swiglu)");
  in.mode = static_cast<Prologue>(mode_in);
  TORCH_CHECK(in.mode != SWIGLU || x.size(1) % 2 == 0, "swiglu needs [gate | up] rows of even width, got ", x.size(1));
  in.T = x.size(0), in.K = in.mode == SWIGLU ? x.size(1) / 2 : x.size(1), in.nb = in.K / QK;
  TORCH_CHECK(in.K % QK == 0, "K must be a multiple of 32, got ", in.K);
  if (in.mode == RMSNORM) {
    TORCH_CHECK(norm_weight.has_value(), "rms_norm prologue needs its weight");
    in.norm = norm_weight->contiguous();
    TORCH_CHECK(in.norm.scalar_type() == torch::kFloat32 && in.norm.is_cpu() && in.norm.numel() == in.K,
                "rms_norm weight must be float32 [", in.K, "]");
  }
  return in;
}

// The residual [T, n] float32 a product adds (undefined where none is given).
torch::Tensor checked_residual(const std::optional<torch::Tensor>& residual, int64_t T, int64_t n) {
  if (!residual.has_value()) return torch::Tensor();
  torch::Tensor res = residual->contiguous();
  TORCH_CHECK(res.scalar_type() == torch::kFloat32 && res.is_cpu() && res.dim() == 2 && res.size(0) == T && res.size(1) == n,
              "residual must be float32 [", T, ", ", n, "]");
  return res;
}

// Q41: Q4_1-type values (4 bits and a minimum); H5: a fifth bit (qh); KS: K-quant scales (sc, dm);
// S16: a layout with a scale per 16 values (`Sub16`): Q6_K (qs, q2 passed as qh, d: ds, sc), Q3_K
// (qs: the 2-bit plane, qh: the third bits, d: ds, sc), Q2_K (qs: the 2-bit plane, d: ds and dmin, sc);
// NL: IQ4_NL (qs nibbles as Q4_1's, d), run as Q8_0 on its looked-up levels.
template <bool Q41, bool H5 = false, bool KS = false, int S16 = NO_SUB16, bool NL = false>
torch::Tensor gemm(const torch::Tensor& x_in, const torch::Tensor& qs, const torch::Tensor& d,
                   const torch::Tensor& m, int64_t mode_in, const std::optional<torch::Tensor>& norm_weight,
                   double eps, const std::optional<torch::Tensor>& residual, const torch::Tensor& qh = torch::Tensor(),
                   const torch::Tensor& sc = torch::Tensor(), const torch::Tensor& dm = torch::Tensor()) {
  static_assert(Q41 || (!H5 && !KS), "fifth bits and K-quant scales belong to blocks with minima");
  static_assert(S16 == NO_SUB16 || (!Q41 && !H5 && !KS), "scales per 16 values are layouts of their own");
  constexpr bool S6 = S16 == SUB16_Q6, S3 = S16 == SUB16_Q3, S2 = S16 == SUB16_Q2, SX = S16 == SUB16_IQ4XS,
                 SUB = S16 != NO_SUB16;
  const ProductInput in = product_input(x_in, mode_in, norm_weight);
  const torch::Tensor& x = in.x;
  const Prologue mode = in.mode;
  const int64_t T = in.T, K = in.K, nb = in.nb, n = qs.size(0);
  static_assert(!NL || (!Q41 && S16 == NO_SUB16), "IQ4_NL is a layout of its own");
  const int64_t row_bytes = Q41 || S6 || NL || SX ? nb * 16 : S3 || S2 ? nb * 8 : K;
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.is_cpu() && qs.element_size() == 1 && qs.size(1) == row_bytes,
              "block values must be a contiguous 1-byte CPU matrix [N, ", row_bytes, "], got ", qs.sizes());
  if (SUB) {
    TORCH_CHECK(nb % 8 == 0, "K-quant blocks need K a multiple of 256, got ", K);
    if (S6)
      TORCH_CHECK(qh.defined() && qh.dim() == 2 && qh.scalar_type() == torch::kUInt8 && qh.is_contiguous() &&
                      qh.is_cpu() && qh.size(0) == n && qh.size(1) == nb * 8,
                  "Q6_K high bits q2 must be contiguous uint8 [N, K/4]");
    if (S3)
      TORCH_CHECK(qh.defined() && qh.dim() == 2 && qh.scalar_type() == torch::kUInt8 && qh.is_contiguous() &&
                      qh.is_cpu() && qh.size(0) == n && qh.size(1) == nb * 4,
                  "Q3_K third-bit masks qh must be contiguous uint8 [N, K/8]");
    TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.is_cpu() && d.size(0) == n &&
                    d.size(1) == (S2 ? nb / 4 : nb / 8),
                S2 ? "super-block scales (ds, dmin) must be contiguous float16 [N, K/128]"
                   : "super-block scales ds must be contiguous float16 [N, K/256]");
    TORCH_CHECK(sc.defined() && sc.dim() == 2 && sc.scalar_type() == (S2 ? torch::kUInt8 : torch::kInt8) &&
                    sc.is_contiguous() && sc.is_cpu() && sc.size(0) == n && sc.size(1) == (SX ? nb : 2 * nb),
                S2 ? "Q2_K sub-block scales and minima sc must be contiguous uint8 [N, K/16]"
                : SX ? "IQ4_XS block scales sc must be contiguous int8 [N, K/32]"
                     : "sub-block scales sc must be contiguous int8 [N, K/16]");
  } else if (KS) {
    TORCH_CHECK(nb % 8 == 0, "K-quant blocks need K a multiple of 256, got ", K);
    TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.is_cpu() && d.size(0) == n &&
                    d.size(1) == nb / 8,
                "super-block scales ds must be contiguous float16 [N, K/256]");
    TORCH_CHECK(sc.defined() && sc.dim() == 2 && sc.scalar_type() == torch::kUInt8 && sc.is_contiguous() && sc.is_cpu() &&
                    sc.size(0) == n && sc.size(1) == nb,
                "block scales sc must be contiguous uint8 [N, K/32]");
    TORCH_CHECK(m.dim() == 3 && m.scalar_type() == torch::kUInt8 && m.is_contiguous() && m.is_cpu() &&
                    m.size(0) == (n + 7) / 8 && m.size(1) == nb && m.size(2) == 8,
                "block minima mq must be contiguous uint8 [ceil(N/8), K/32, 8] (groups of 8 outputs)");
    TORCH_CHECK(dm.defined() && dm.dim() == 3 && dm.scalar_type() == torch::kFloat16 && dm.is_contiguous() && dm.is_cpu() &&
                    dm.size(0) == (n + 7) / 8 && dm.size(1) == nb / 8 && dm.size(2) == 8,
                "super-block minima scales dm must be contiguous float16 [ceil(N/8), K/256, 8]");
  } else {
    TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.is_cpu() && d.size(0) == n &&
                    d.size(1) == nb,
                "block scales d must be contiguous float16 [N, K/32]");
    if (Q41)
      TORCH_CHECK(m.dim() == 3 && m.scalar_type() == torch::kFloat16 && m.is_contiguous() && m.is_cpu() &&
                      m.size(0) == (n + 7) / 8 && m.size(1) == nb && m.size(2) == 8,
                  "block minima m must be contiguous float16 [ceil(N/8), K/32, 8] (groups of 8 outputs)");
  }
  if (H5)
    TORCH_CHECK(qh.defined() && qh.dim() == 2 && qh.scalar_type() == torch::kInt32 && qh.is_contiguous() && qh.is_cpu() &&
                    qh.size(0) == n && qh.size(1) == nb,
                "fifth bits qh must be contiguous int32 [N, K/32]");
  const torch::Tensor res = checked_residual(residual, T, n);
  torch::Tensor y = torch::empty({T, n}, torch::kFloat32);
  if (T == 0 || n == 0) return y;
  thread_local CallBuffers buf;
  const ReleaseLargeBuffers release{buf};
  const bool super_blocks = SUB || KS;
  const int64_t nbq = super_blocks ? K / QKK : nb;  // the activations' scales per row
  buf.q.resize(T * K), buf.d.resize(T * nbq), buf.s.resize(super_blocks ? 0 : T * nbq);
  buf.sums.resize(super_blocks ? T * (K / 16) : 0);
  quantize_rows_into(x, K, mode, in.norm_data(), static_cast<float>(eps),
                     super_blocks, buf.q.data(), buf.d.data(), buf.s.data(), buf.sums.data());
  Weights w_all{static_cast<const uint8_t*>(qs.data_ptr()), reinterpret_cast<const uint16_t*>(d.data_ptr()),
                Q41 ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr, nb, row_bytes,
                H5 ? reinterpret_cast<const uint32_t*>(qh.data_ptr()) : nullptr,
                KS || SUB ? static_cast<const uint8_t*>(sc.data_ptr()) : nullptr,
                KS ? reinterpret_cast<const uint16_t*>(dm.data_ptr()) : nullptr,
                S6 || S3 ? static_cast<const uint8_t*>(qh.data_ptr()) : nullptr};
  w_all.scales_per_16 = SUB && !SX;
  const int8_t* qx = buf.q.data();
  const float* dx = buf.d.data();
  const SuperActs super_rows{qx, dx, super_blocks ? buf.sums.data() : nullptr, K};
  // K-quants' minima terms take each block's dx·Σq from the super-block's dx and sums of 16
  std::vector<float>& k_sx = buf.k_sx;
  k_sx.resize(KS ? T * nb : 0);
  if constexpr (KS) block_sx_from_super_blocks(dx, super_rows.sums, T, K, k_sx.data());
  const float* sx = KS ? k_sx.data() : buf.s.data();
  float* yp = y.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  // Q4_1 / Q4_K / Q6_K rows' paired activations (`one_row_q4_1`'s lone last row; `paired_tile`'s rows with
  // their spread scales; `tile_k`'s, `tile_q6`'s), prepared once per call.
  const bool paired_rows = Q41 && !KS && T >= 2;
  const int64_t pairs = nb / 2;
  std::vector<int8_t>& xpairs = buf.pairs;
  std::vector<float>& dx_spread = buf.dx_spread;
  if (Q41 || S6) {
    xpairs.resize(T * K);
    for (int64_t t = 0; t < T; ++t) pair_activations(qx + t * K, nb, xpairs.data() + t * K);
  }
  if (paired_rows) {
    dx_spread.resize(T * pairs * 8);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t pr = 0; pr < pairs; ++pr)
        for (int k = 0; k < 8; ++k) dx_spread[(t * pairs + pr) * 8 + k] = dx[t * nb + 2 * pr + k / 4];
  }
  // the minima terms of a chunk's outputs for all rows, before its tiles; a lone row's Q4_1 / Q5_1
  // terms are formed by one_row_q4_1 group by group as it goes (a chunk pass ahead of a lone row's
  // products slowed them; K-quants take the chunk pass at every row count)
  const bool chunk_minima = Q41 && (KS || T != 1);
  // threads take the outputs in chunks at multiples of 8 (the minima's groups; any split gives the same bits)
  parallel_chunks(0, (n + 7) / 8, ROWS_PER_CHUNK / 8, [&](int64_t g0, int64_t g1) {
    const int64_t a = g0 * 8, z = std::min(n, g1 * 8);
    thread_local std::vector<float> scratch, minima, k_minima;  // this thread's, reused
    scratch.resize(SCRATCH_PER_BLOCK * nb);  // tile's scratch: TO·(TN + 1)·nb floats at most
    minima.resize(chunk_minima ? T * std::min<int64_t>(ROWS_PER_CHUNK, z - a) : 0);
    k_minima.resize(KS ? ROWS_PER_CHUNK * nb : 0);
    for (int64_t c0 = a; c0 < z; c0 += ROWS_PER_CHUNK) {
      const int64_t c1 = std::min(z, c0 + ROWS_PER_CHUNK);
      Weights w = w_all;  // K-quants: with this chunk's minima expanded
      if constexpr (KS) {
        expand_k_minima(w, c0, c1, k_minima.data());
        w.mf = k_minima.data(), w.o0 = c0;
      }
      if (chunk_minima) {
        prefetch_minima(w, nb, c1, std::min(z, c1 + ROWS_PER_CHUNK));  // the next chunk's
        minima_terms<KS>(w, c0, c1, sx, T, nb, minima.data());
      }
      const Acts all{qx, dx, sx, K, nb, chunk_minima ? minima.data() : nullptr, c1 - c0, c0};
      const auto pairs_from = [&](int64_t t) { return PairedActs{xpairs.data() + t * K, dx_spread.data() + t * pairs * 8}; };
      int64_t t = 0;
      if constexpr (S6) {
        const SuperActs paired{xpairs.data(), dx, super_rows.sums, K};  // (buf is thread_local: not named in here)
        for (; t + 4 <= T; t += 4)
          tile_q6_rows<1, 4>(w, c0, c1, paired.rows_from(t), yp + t * n, n);
        const SuperActs rest = paired.rows_from(t);
        switch (T - t) {
          case 3: tile_q6_rows<1, 3>(w, c0, c1, rest, yp + t * n, n); break;
          case 2: tile_q6_rows<2, 2>(w, c0, c1, rest, yp + t * n, n); break;
          case 1: tile_q6_rows<1, 1>(w, c0, c1, rest, yp + t * n, n); break;
          default: break;
        }
      } else if constexpr (SUB) {
        for (; t + 4 <= T; t += 4)
          tile_s16_rows<S16, 1, 4>(w, c0, c1, super_rows.rows_from(t), yp + t * n, n);
        const SuperActs rest = super_rows.rows_from(t);
        switch (T - t) {
          case 3: tile_s16_rows<S16, 1, 3>(w, c0, c1, rest, yp + t * n, n); break;
          case 2: tile_s16_rows<S16, 2, 2>(w, c0, c1, rest, yp + t * n, n); break;
          case 1: tile_s16_rows<S16, 1, 1>(w, c0, c1, rest, yp + t * n, n); break;
          default: break;
        }
      } else if constexpr (KS) {
        const KActs k_rows{xpairs.data(), dx, K, minima.data(), c1 - c0, c0};
        if constexpr (FORKLM_VNNI)  // 32 vector registers: 8 rows a tile
          for (; t + 8 <= T; t += 8) tile_k_rows<1, 8, H5>(w, c0, c1, k_rows.rows_from(t), yp + t * n, n);
        for (; t + 4 <= T; t += 4)
          tile_k_rows<1, 4, H5>(w, c0, c1, k_rows.rows_from(t), yp + t * n, n);
        const KActs rest = k_rows.rows_from(t);
        switch (T - t) {
          case 3: tile_k_rows<1, 3, H5>(w, c0, c1, rest, yp + t * n, n); break;
          case 2: tile_k_rows<2, 2, H5>(w, c0, c1, rest, yp + t * n, n); break;
          case 1: tile_k_rows<1, 1, H5>(w, c0, c1, rest, yp + t * n, n); break;
          default: break;
        }
      } else if constexpr (Q41) {
        for (; t + 4 <= T; t += 4)
          paired_tile_rows<ROW_TILE_OUTS, 4, H5>(w, c0, c1, all.rows_from(t), pairs_from(t), yp + t * n, n);
        switch (T - t) {
          case 3: paired_tile_rows<2, 3, H5>(w, c0, c1, all.rows_from(t), pairs_from(t), yp + t * n, n); break;
          case 2: paired_tile_rows<4, 2, H5>(w, c0, c1, all.rows_from(t), pairs_from(t), yp + t * n, n); break;
          case 1: one_row_q4_1<H5, ONE_ROW_Q41_OUTS>(w, c0, c1, all.rows_from(t), xpairs.data() + t * K, yp + t * n, n); break;
          default: break;
        }
      } else {  // Q8_0, IQ4_NL
        for (; t + 4 <= T; t += 4)
          tile_rows<ROW_TILE_OUTS, 4, NL>(w, c0, c1, all.rows_from(t), yp + t * n, n, scratch.data());
        const Acts rest = all.rows_from(t);
        switch (T - t) {
          case 3: tile_rows<2, 3, NL>(w, c0, c1, rest, yp + t * n, n, scratch.data()); break;
          case 2: tile_rows<4, 2, NL>(w, c0, c1, rest, yp + t * n, n, scratch.data()); break;
          case 1: tile_rows<1, 1, NL>(w, c0, c1, rest, yp + t * n, n, scratch.data()); break;
          default: break;
        }
      }
      if (rp != nullptr)  // y = residual + x·Wᵀ (one rounding, as `residual + product` would round)
        for (int64_t tt = 0; tt < T; ++tt)
          for (int64_t o = c0; o < c1; ++o) yp[tt * n + o] = rp[tt * n + o] + yp[tt * n + o];
    }
  });
  return y;
}

// ----------------------------------------------------------------------------- 4- and 5-bit blocks, 8 outputs interleaved
// Q4_0 / Q4_1 / Q5_0 / Q5_1 weights (what GGUF files and `quantize="int4"` load as; Q8_0 / IQ4_NL below,
// `tile_r8_signed`) repacked once at load
// with the blocks of 8 outputs side by side (`q4_0_r8`, `q4_1_r8`, `q5_0_r8`, `q5_1_r8`: the
// row-interleaved idea of llama.cpp's repacked Q4_0 and ik_llama.cpp's `_r8` types; this layout and its
// arithmetic are forklm's own; Q5's fifth bits: `tile_r8`):
//   qs uint8 [G, nb, 128]  G = ⌈N/8⌉ groups of 8 outputs; for group g and block b, 4 runs of 32 bytes:
//                          run j holds bytes 4j..4j+3 of each output's 16 (output 8g + r at 4r), i.e.
//                          in their low nibbles values 4j..4j+3, in their high nibbles 16+4j..16+4j+3
//   d  fp16 [G, nb, 8]     the 8 outputs' scales of block b side by side (the last group padded: 0)
//   m  fp16 [G, nb, 8]     q4_1_r8 only, their minima (Q4_0: w = d·(q − 8))
// A vector's 8 lanes are 8 outputs: a block takes 8 byte products of the unpacked nibbles against
// the activations' 4-byte groups broadcast, and no horizontal sum. Each (output, row) is one float
// chain over the blocks, the same whatever tile of rows it lands in:
//   acc = fma(d·dx_b, float(Σ q_w·q_x − 8·Σ q_x [Q4_0]), acc);  acc = fma(m, sx_b, acc) [Q4_1]
constexpr int64_t R8_BLOCK_BYTES = 128;
constexpr int64_t R8_Q8_BLOCK_BYTES = 256;  // q8_0_r8: 8 outputs' 32 int8 values a block
constexpr int64_t Q8_0_STORED_BYTES = 34;   // a GGUF Q8_0 block: float16 d, then 32 int8 values
// How far ahead of the block it reads a group's first tile of rows asks for the weights (a decode step
// streams them from memory; the groups lie one after another, so the stream runs on into the next).
// A burst of the whole group two groups ahead was 10-25% slower at 1-8 rows on a 1B step (by hand).
constexpr int64_t R8_PREFETCH_BYTES = 2048;

// Asks for the cache line `bytes` past p (the address formed as an integer: near the end of the
// weights it lies past them, where a prefetch is harmless but a pointer would not be valid C++).
inline void prefetch_ahead(const void* p, int64_t bytes) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(bytes)), WEIGHT_PREFETCH);
}

// Σ q of each block of 32 activations (Q4_0's −8·Σ q_x, in integers).
inline void block_sums(const int8_t* q, int64_t blocks, int32_t* out) {
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * QK));
    out[b] = hsum_int32(_mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16));
  }
}

// −32·Σ q of each 16 activations (interleaved Q6_K's −32·Σ q_x per sub-block, in integers; a tile's sums start
// from it): block b's halves at out[2b], out[2b + 1].
inline void half_block_sums(const int8_t* q, int64_t blocks, int32_t* out) {
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * QK));
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16));
    out[2 * b] = -32 * (lanes[0] + lanes[1] + lanes[2] + lanes[3]);
    out[2 * b + 1] = -32 * (lanes[4] + lanes[5] + lanes[6] + lanes[7]);
  }
}

// One group's block b into cache ahead of its tile (values R8_PREFETCH_BYTES ahead, the scales, minima
// and fifth bits as far in blocks): `tile_r8`'s layouts (w: block b's values). KS: the K-quants' scales,
// a byte per block in wsc / wmq and ds / dm per super-block of 8 blocks in wd / wm.
template <bool MIN, bool H5, bool KS = false>
inline void prefetch_r8_block(const uint8_t* w, const uint8_t* wh, const uint16_t* wd, const uint16_t* wm, int64_t b,
                              const uint8_t* wsc = nullptr, const uint8_t* wmq = nullptr) {
  prefetch_ahead(w, R8_PREFETCH_BYTES), prefetch_ahead(w, R8_PREFETCH_BYTES + 64);
  if constexpr (KS) {
    if (b % 8 == 0) prefetch_ahead(wsc + b * 8, R8_PREFETCH_BYTES / 16), prefetch_ahead(wmq + b * 8, R8_PREFETCH_BYTES / 16);
    if (b % 32 == 0) prefetch_ahead(wd + b, R8_PREFETCH_BYTES / 64), prefetch_ahead(wm + b, R8_PREFETCH_BYTES / 64);
  } else {
    if (b % 4 == 0) prefetch_ahead(wd + b * 8, R8_PREFETCH_BYTES / 8);
    if (MIN && b % 4 == 0) prefetch_ahead(wm + b * 8, R8_PREFETCH_BYTES / 8);
  }
  if (H5 && b % 2 == 0) prefetch_ahead(wh + b * 32, R8_PREFETCH_BYTES / 4);
}

// A group's 8 scales (or minima) of block b as floats: float16 per block in wd (KS false), or the
// K-quants' ds (float16 per super-block of 8 blocks, wd) times the block's 6-bit integer (a byte per block
// and output, wsc): exact in float32 (11 by 6 significant bits), the value `tile_k` and `minima_terms` form.
template <bool KS>
inline __m256 r8_block_scales(const uint16_t* wd, const uint8_t* wsc, int64_t b) {
  if constexpr (KS) {
    const __m256 ds = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b / 8 * 8)));
    const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + b * 8));
    return _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b * 8)));
  }
}

// 8 integer scales (one per output, as loaded into int32 lanes) as int16 pairs (s, s) per lane, for `vpmaddwd`.
inline __m256i scale_pairs(__m256i v) { return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16)); }

// The AVX2 build's K-quant interleaved tiles (Q4_K / Q5_K / Q6_K) take the rows' activations per super-block
// of 256 (one dx per 256, sums of q per 16: `quantize_super_block`, as the plain K layouts): each block's
// int16 sums meet its integer scales in `vpmaddwd`, the super-block's 8 blocks summed exactly in int32, then one
// float step a super-block. The VNNI build keeps dx per 32 (its `vpdpbusd` sums need no widening).
constexpr bool K_R8_SUPER_ACTIVATIONS = !FORKLM_VNNI;

// Such a tile's step at the end of a super-block (after block b, b % 8 == 7): rows [0, TN) take
// acc = fma(ds·dx, float(Σ), acc) from their int32 sums ksum (zeroed for the next), dx per super-block.
template <int TN>
inline void super_block_step(const uint16_t* wd, const float* dx, int64_t nb, int64_t b, __m256i* ksum, __m256* acc) {
  const __m256 ds = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b / 8 * 8)));
  for (int t = 0; t < TN; ++t) {
    acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(ds, _mm256_set1_ps(dx[t * (nb / 8) + b / 8])), _mm256_cvtepi32_ps(ksum[t]), acc[t]);
    ksum[t] = _mm256_setzero_si256();
  }
}

// The same for `tile_r8_signed`'s layouts (BYTES a block).
template <int64_t BYTES>
inline void prefetch_r8_signed_block(const uint8_t* w, const uint16_t* wd, int64_t b) {
  for (int64_t i = 0; i < BYTES; i += 64) prefetch_ahead(w, R8_PREFETCH_BYTES + i);
  if (b % 4 == 0) prefetch_ahead(wd + b * 8, R8_PREFETCH_BYTES * 16 / BYTES);
}

// Rows [0, TN) of `x` times the 8 outputs of one group: acc[t] lanes = outputs. H5: Q5_0 / Q5_1, the
// values' fifth bits in 32 bytes per block (`qh8`: byte 4r + k holds, at bit j, the fifth bit of value
// 4j + k of output r, at bit 4 + j that of value 16 + 4j + k), ORed into run j's nibbles as bit 4.
//   KS (Q4_K / Q5_K, with MIN): block b's scales ds·sc and minima dm·mq (`r8_block_scales`): wd / wm the
//   super-blocks' ds / dm, wsc / wmq the blocks' 6-bit sc / mq; the arithmetic of Q4_1 / Q5_1 from there.
//   K_R8_SUPER_ACTIVATIONS (the AVX2 build, KS): dx per super-block (row stride nb / 8), sx per block; the block's
//   int16 sums times its 6-bit scales summed in int32 over the super-block (<= 8·63·32·31·127 < 2^31), then
//   acc = fma(ds·dx, float(Σ), acc) once a super-block; the minima as above, a step per block.
template <bool MIN, bool H5, int TN, bool KS = false>
inline void tile_r8(const uint8_t* wq, const uint8_t* wh, const uint16_t* wd, const uint16_t* wm, int64_t nb,
                    const int8_t* xq, const float* dx, const float* sx, const int32_t* xs, int64_t K, __m256* acc,
                    bool prefetch, const uint8_t* wsc = nullptr, const uint8_t* wmq = nullptr) {
  constexpr bool SUPER = KS && K_R8_SUPER_ACTIVATIONS;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), bit4 = _mm256_set1_epi8(0x10);
  constexpr int32_t OFFSET = H5 ? 16 : 8;  // Q4_0: w = d·(q − 8); Q5_0: d·(q − 16)
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  __m256i ksum[SUPER ? TN : 1];  // SUPER: the super-block's Σ sc·Σ q·x per (output, row)
  for (int t = 0; t < (SUPER ? TN : 1); ++t) ksum[t] = _mm256_setzero_si256();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * R8_BLOCK_BYTES;
    if (prefetch) prefetch_r8_block<MIN, H5, KS>(w, wh, wd, wm, b, wsc, wmq);
    // the int16 sums' multipliers: ones, or (SUPER) the block's 6-bit scales
    const __m256i widen = SUPER ? scale_pairs(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + b * 8))))
                                : ones;
    __m256i fifth = _mm256_setzero_si256();
    if constexpr (H5) fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wh + b * 32));
    __m256i s[TN], isum[TN];
    for (int t = 0; t < TN; ++t) s[t] = isum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {  // 4-bit: |Σ| <= 8·2·15·127 < 2^15 in int16; 5-bit: two runs at a time
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (H5) {  // bit j / 4 + j of each byte to bit 4 (the masks drop what crosses bytes)
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(fifth, 4 - j), bit4));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_srli_epi16(fifth, j), bit4));
      }
      for (int t = 0; t < TN; ++t) {
        const int8_t* xb = xq + t * K + b * QK;
        int32_t a, c;
        std::memcpy(&a, xb + 4 * j, 4);
        std::memcpy(&c, xb + 16 + 4 * j, 4);
#if FORKLM_VNNI  // straight into int32 lanes: the same integers, two instructions instead of five
        isum[t] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(isum[t], lo, _mm256_set1_epi32(a)), hi, _mm256_set1_epi32(c));
#else
        if constexpr (H5) {  // (kept in order, these ran 1.2x slower: Q5_K, 32 rows, AVX2 EPYC, by hand)
          s[t] = _mm256_add_epi16(s[t], _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)),
                                                         _mm256_maddubs_epi16(hi, _mm256_set1_epi32(c))));
        } else {
          s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(a)));
          keep_order(s[t]);
          s[t] = _mm256_add_epi16(s[t], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(c)));
          keep_order(s[t]);
        }
#endif
      }
      if (!FORKLM_VNNI && H5 && j == 1)  // |Σ| <= 4·2·31·127 < 2^15: into int32 before the next two runs
        for (int t = 0; t < TN; ++t) isum[t] = _mm256_madd_epi16(s[t], widen), s[t] = _mm256_setzero_si256();
    }
    if constexpr (SUPER) {
      const __m256 m8 = r8_block_scales<KS>(wm, wmq, b);
      for (int t = 0; t < TN; ++t) {
        const __m256i sum = _mm256_madd_epi16(s[t], widen);
        ksum[t] = _mm256_add_epi32(ksum[t], H5 ? _mm256_add_epi32(isum[t], sum) : sum);
        acc[t] = _mm256_fmadd_ps(m8, _mm256_set1_ps(sx[t * nb + b]), acc[t]);
      }
      if (b % 8 == 7) super_block_step<TN>(wd, dx, nb, b, ksum, acc);
      continue;
    }
    const __m256 d8 = r8_block_scales<KS>(wd, wsc, b);
    __m256 m8 = _mm256_setzero_ps();
    if constexpr (MIN) m8 = r8_block_scales<KS>(wm, wmq, b);
    for (int t = 0; t < TN; ++t) {
      __m256i sum = FORKLM_VNNI ? isum[t]
                    : H5 ? _mm256_add_epi32(isum[t], _mm256_madd_epi16(s[t], ones)) : _mm256_madd_epi16(s[t], ones);
      if constexpr (!MIN) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(OFFSET * xs[t * nb + b]));
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx[t * nb + b])), _mm256_cvtepi32_ps(sum), acc[t]);
      if constexpr (MIN) acc[t] = _mm256_fmadd_ps(m8, _mm256_set1_ps(sx[t * nb + b]), acc[t]);
    }
  }
}

// Rows [0, TN) of `x` times the 8 outputs of one group of signed blocks: Q8_0 (NL false: 8 runs of 32
// bytes a block, run j = values 4j..4j+3 of each output as int8, output r at 4r) or IQ4_NL (NL: 4 runs of
// nibbles as Q4_0's, looked up as int8 levels; the low nibbles of run j are values 4j..4j+3, the high
// ones 16 + 4j..): acc[t] lanes = outputs. Each signed run r (Q8_0's run r; IQ4_NL's run r's low
// nibbles for r < 4, run r − 4's high ones after) meets the activations' bytes 4r..4r+3 broadcast:
// |w| (unsigned) times x carrying w's sign, 4 products summed into an int32 lane (|w| <= 128,
// |x| <= 127: no int16 pair saturates). The VNNI build instead reads x + 128 as unsigned bytes against
// the signed weights (`vpdpbusd`, no sign flips per row) and takes 128·Σ w (one chain per block, shared
// by the rows) back out: the same integers. One float chain per (output, row) over the blocks:
//   acc = fma(d·dx_b, float(Σ q_w·q_x), acc)
template <bool NL, int TN>
inline void tile_r8_signed(const uint8_t* wq, const uint16_t* wd, int64_t nb, const int8_t* xq, const float* dx,
                           int64_t K, __m256* acc, bool prefetch) {
  constexpr int64_t BYTES = NL ? R8_BLOCK_BYTES : R8_Q8_BLOCK_BYTES;
  const __m256i low4 = _mm256_set1_epi8(0x0F), levels = iq4nl_levels();
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * BYTES;
    if (prefetch) prefetch_r8_signed_block<BYTES>(w, wd, b);
    __m256i isum[TN];
    for (int t = 0; t < TN; ++t) isum[t] = _mm256_setzero_si256();
#if FORKLM_VNNI
    __m256i bias = _mm256_setzero_si256();  // 128·Σ w of each output's block, one chain shared by the rows
    const __m256i u128 = _mm256_set1_epi8(static_cast<char>(0x80));
#endif
    const auto run = [&](__m256i v, int r) {  // v: signed int8 values 4r..4r+3 of the 8 outputs
#if FORKLM_VNNI  // xq holds x + 128 (`gemm_r8`): unsigned bytes straight against the signed weights
      bias = _mm256_dpbusd_epi32(bias, u128, v);
      for (int t = 0; t < TN; ++t) {
        int32_t xb;
        std::memcpy(&xb, xq + t * K + b * QK + 4 * r, 4);
        isum[t] = _mm256_dpbusd_epi32(isum[t], _mm256_set1_epi32(xb), v);
      }
#else
      const __m256i a = _mm256_sign_epi8(v, v);
      for (int t = 0; t < TN; ++t) {
        int32_t xb;
        std::memcpy(&xb, xq + t * K + b * QK + 4 * r, 4);
        isum[t] = dot_u8s8(isum[t], a, _mm256_sign_epi8(_mm256_set1_epi32(xb), v));
      }
#endif
    };
    if constexpr (NL) {
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
        run(_mm256_shuffle_epi8(levels, _mm256_and_si256(v, low4)), j);
        run(_mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4)), 4 + j);
      }
    } else {
      for (int r = 0; r < 8; ++r) run(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * r)), r);
    }
#if FORKLM_VNNI
    for (int t = 0; t < TN; ++t) isum[t] = _mm256_sub_epi32(isum[t], bias);  // Σ (x + 128)·w − 128·Σ w = Σ x·w
#endif
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b * 8)));
    for (int t = 0; t < TN; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d8, _mm256_set1_ps(dx[t * nb + b])), _mm256_cvtepi32_ps(isum[t]), acc[t]);
  }
}

// Q6_K interleaved (q6_k_r8): rows [0, TN) of `x` times the 8 outputs of one group, acc[t] lanes = outputs.
// A block of 32 values holds two of Q6_K's sub-blocks of 16, each with its int8 scale under the super-block's
// float16 ds: values 0-15 (sub-block 2b) are run j's low nibbles (values 4j..4j+3, as q4_1_r8's), values 16-31
// (sub-block 2b + 1) its high nibbles; their bits 4-5 in 64 bytes a block (wh): byte 4r + k of the first 32 holds
// at bits 2j..2j+1 those of value 4j + k of output r, of the next 32 those of value 16 + 4j + k. The unsigned
// values u = q + 32 (0..63) meet the row's bytes (|Σ| of a sub-block <= 16·63·127 in int32; AVX2: int16 pairs
// <= 2·63·127 twice, widened every two runs), then Σ u·x − 32·Σ x per sub-block (xs16: the row's −32·Σ q per 16),
// and one float chain per (output, row): acc = fma(ds·sc_lo·dx, lo, acc), then the same for hi. wsc: int8
// [nb, 16] (a block's sub-block 2b scales for the 8 outputs, then 2b + 1's); wd: ds [nb / 8, 8].
inline __m256i q6_run_bits(__m256i planes, int j) {  // bits 2j..2j+1 of each byte at bits 4-5
  const __m256i v = j == 0 ? _mm256_slli_epi16(planes, 4) : j == 1 ? _mm256_slli_epi16(planes, 2)
                    : j == 2 ? planes : _mm256_srli_epi16(planes, 2);  // (what crosses bytes, the mask drops)
  return _mm256_and_si256(v, _mm256_set1_epi8(0x30));
}

// A group's 8 scales ds·sc of sub-block half h (0: values 0-15, 1: 16-31) of block b, exact in float32.
inline __m256 q6_r8_scales(const uint16_t* wd, const int8_t* wsc, int64_t b, int h) {
  const __m256 ds = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + b / 8 * 8)));
  const __m128i sc = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + b * 16 + 8 * h));
  return _mm256_mul_ps(ds, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
}

// Run j of a q6_k_r8 block: the low nibbles of its 32 bytes v with their bits 4-5 from the first 32 bytes of
// the planes (values 4j..4j+3 of the 8 outputs), or the high nibbles with the next 32 (16 + 4j..): 0..63.
inline __m256i q6_low_run(__m256i v, __m256i planes, int j) {
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), q6_run_bits(planes, j));
}
inline __m256i q6_high_run(__m256i v, __m256i planes, int j) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)), q6_run_bits(planes, j));
}

// Block b of one group into cache ahead of `tile_q6_r8` (w: its values, h: its bits 4-5).
inline void prefetch_q6_r8_block(const uint8_t* w, const uint8_t* h, const int8_t* wsc, int64_t b) {
  prefetch_ahead(w, R8_PREFETCH_BYTES), prefetch_ahead(w, R8_PREFETCH_BYTES + 64);
  prefetch_ahead(h, R8_PREFETCH_BYTES / 2);
  if (b % 4 == 0) prefetch_ahead(wsc + b * 16, R8_PREFETCH_BYTES / 8);
}

#if FORKLM_VNNI
template <int TN>
inline void tile_q6_r8(const uint8_t* wq, const uint8_t* wh, const uint16_t* wd, const int8_t* wsc, int64_t nb,
                       const int8_t* xq, const float* dx, const int32_t* xs16, int64_t K, __m256* acc, bool prefetch) {
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * R8_BLOCK_BYTES;
    const uint8_t* h = wh + b * 64;
    if (prefetch) prefetch_q6_r8_block(w, h, wsc, b);
    const __m256i pl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
    const __m256i ph = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32));
    __m256i lo_sum[TN], hi_sum[TN];
    for (int t = 0; t < TN; ++t)  // the sums start from −32·Σ q_x of their sub-block
      lo_sum[t] = _mm256_set1_epi32(xs16[t * 2 * nb + 2 * b]), hi_sum[t] = _mm256_set1_epi32(xs16[t * 2 * nb + 2 * b + 1]);
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      const __m256i lo = q6_low_run(v, pl, j), hi = q6_high_run(v, ph, j);
      for (int t = 0; t < TN; ++t) {
        const int8_t* xb = xq + t * K + b * QK;
        int32_t a, c;
        std::memcpy(&a, xb + 4 * j, 4);
        std::memcpy(&c, xb + 16 + 4 * j, 4);
        lo_sum[t] = _mm256_dpbusd_epi32(lo_sum[t], lo, _mm256_set1_epi32(a));
        hi_sum[t] = _mm256_dpbusd_epi32(hi_sum[t], hi, _mm256_set1_epi32(c));
      }
    }
    const __m256 dl = q6_r8_scales(wd, wsc, b, 0), dh = q6_r8_scales(wd, wsc, b, 1);
    for (int t = 0; t < TN; ++t) {
      const __m256 dxb = _mm256_set1_ps(dx[t * nb + b]);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dl, dxb), _mm256_cvtepi32_ps(lo_sum[t]), acc[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dh, dxb), _mm256_cvtepi32_ps(hi_sum[t]), acc[t]);
    }
  }
}
#else
// The AVX2 build (`K_R8_SUPER_ACTIVATIONS`): a block's 8 runs unpacked into registers once, then each row in
// turn; dx per super-block (row stride nb / 8) and xs16 the rows' int16 sums of q per 16 (row stride K / 16).
// Per row and block, exactly in int32: Σ over the two sub-blocks of sc·(Σ u·x − 32·Σ q_x) (the int16 pairs of two
// runs, <= 2·2·63·127 < 2^15, times sc in `vpmaddwd`; the −32·sc·Σ q_x terms of both sub-blocks in one more, from
// the row's two int16 sums as one int32), summed over the super-block's 8 blocks (|Σ| <= 8·(32·128·63·127 +
// 2·2032·4096) < 2^31); then acc = fma(ds·dx, float(Σ), acc) once a super-block.
template <int TN>
inline void tile_q6_r8(const uint8_t* wq, const uint8_t* wh, const uint16_t* wd, const int8_t* wsc, int64_t nb,
                       const int8_t* xq, const float* dx, const int16_t* xs16, int64_t K, __m256* acc, bool prefetch) {
  __m256i ksum[TN];
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps(), ksum[t] = _mm256_setzero_si256();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * R8_BLOCK_BYTES;
    const uint8_t* h = wh + b * 64;
    if (prefetch) prefetch_q6_r8_block(w, h, wsc, b);
    const __m256i pl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
    const __m256i ph = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 32));
    __m256i lo[4], hi[4];  // run j: values 4j..4j+3 (lo) and 16 + 4j.. (hi) of the 8 outputs, 0..63
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * j));
      lo[j] = q6_low_run(v, pl, j), hi[j] = q6_high_run(v, ph, j);
    }
    // the sub-blocks' scales as int16 pairs (sc, sc) per output lane, and (−32·sc_lo, −32·sc_hi)
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wsc + b * 16));
    const __m256i sc_lo = _mm256_cvtepi8_epi32(sc), sc_hi = _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8));
    const __m256i wl = scale_pairs(sc_lo), wh16 = scale_pairs(sc_hi);
    const __m256i off = _mm256_or_si256(
        _mm256_and_si256(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sc_lo, 5)), _mm256_set1_epi32(0xFFFF)),
        _mm256_slli_epi32(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sc_hi, 5)), 16));
    for (int t = 0; t < TN; ++t) {
      const int8_t* xb = xq + t * K + b * QK;
      const auto at = [xb](int i) { int32_t a; std::memcpy(&a, xb + i, 4); return _mm256_set1_epi32(a); };
      const auto pairs = [&](const __m256i* u, int i) {  // two runs' int16 pairs
        return _mm256_add_epi16(_mm256_maddubs_epi16(u[0], at(i)), _mm256_maddubs_epi16(u[1], at(i + 4)));
      };
      int32_t sums;  // the row's Σ q_x of sub-blocks 2b and 2b + 1, int16 each
      std::memcpy(&sums, xs16 + t * (K / 16) + 2 * b, 4);
      const __m256i l = _mm256_add_epi32(_mm256_madd_epi16(pairs(lo, 0), wl), _mm256_madd_epi16(pairs(lo + 2, 8), wl));
      const __m256i r = _mm256_add_epi32(_mm256_madd_epi16(pairs(hi, 16), wh16), _mm256_madd_epi16(pairs(hi + 2, 24), wh16));
      ksum[t] = _mm256_add_epi32(ksum[t], _mm256_add_epi32(_mm256_add_epi32(l, r),
                                                           _mm256_madd_epi16(_mm256_set1_epi32(sums), off)));
    }
    if (b % 8 == 7) super_block_step<TN>(wd, dx, nb, b, ksum, acc);
  }
}
#endif

#if FORKLM_VNNI
// Two 256-bit loads as the low and high halves of one vector.
inline __m512i load_halves(const void* lo, const void* hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), 1);
}

// 8 float16 values from lo and 8 from hi as 16 floats.
inline __m512 halves_to_float16(const uint16_t* lo, const uint16_t* hi) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1));
}

// `r8_block_scales` of groups g (low half) and g + 1 (high half), group g + 1's arrays `sblocks`·8 halves
// (wd) and nb·8 bytes (wsc) on: lane for lane the same floats.
template <bool KS>
inline __m512 r8_block_scales_x2(const uint16_t* wd, const uint8_t* wsc, int64_t b, int64_t nb, int64_t sblocks) {
  if constexpr (KS) {
    const __m512 ds = halves_to_float16(wd + b / 8 * 8, wd + (sblocks + b / 8) * 8);
    const __m128i sc = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + b * 8)),
                                          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + (nb + b) * 8)));
    return _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
  } else {
    return halves_to_float16(wd + b * 8, wd + (nb + b) * 8);
  }
}

// Run j of groups g (low half) and g + 1 (high half) of a 4- or 5-bit interleaved block (w: group g's block, group
// g + 1's `next` bytes on): its low nibbles (values 4j..4j+3 of each output) in lo, its high ones (16 + 4j..) in hi,
// H5: the fifth bits (`fifth`, both groups' 32 bytes) ORed in as bit 4 (the masks drop what crosses bytes).
template <bool H5>
inline void r8_run_values_x2(const uint8_t* w, int64_t next, __m512i fifth, int j, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  const __m512i v = load_halves(w + 32 * j, w + next + 32 * j);
  lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  if constexpr (H5) {
    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi16(fifth, 4 - j), bit4));
    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srli_epi16(fifth, j), bit4));
  }
}

// `tile_r8` over two groups at once (the VNNI build, two rows or more): the 16 outputs of groups g and
// g + 1 in the lanes of one 512-bit vector, group g's in the low half. Each lane's integers and float
// chain are `tile_r8`'s, so the same bits with half the instructions. wq, wh, wd, wm (wsc, wmq): group g's arrays.
template <bool MIN, bool H5, int TN, bool KS = false>
inline void tile_r8_x2(const uint8_t* wq, const uint8_t* wh, const uint16_t* wd, const uint16_t* wm, int64_t nb,
                       const int8_t* xq, const float* dx, const float* sx, const int32_t* xs, int64_t K, __m512* acc,
                       bool prefetch, const uint8_t* wsc = nullptr, const uint8_t* wmq = nullptr) {
  // group g + 1's values; its scales and minima sblocks·8 on (KS: bytes nb·8 on), fifth bits nb·32
  const int64_t next = nb * R8_BLOCK_BYTES, sblocks = KS ? nb / 8 : nb;
  constexpr int32_t OFFSET = H5 ? 16 : 8;  // Q4_0: w = d·(q − 8); Q5_0: d·(q − 16)
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * R8_BLOCK_BYTES;
    if (prefetch) {  // both groups' streams
      prefetch_r8_block<MIN, H5, KS>(w, wh, wd, wm, b, wsc, wmq);
      prefetch_r8_block<MIN, H5, KS>(w + next, H5 ? wh + nb * 32 : nullptr, wd + sblocks * 8,
                                     MIN ? wm + sblocks * 8 : nullptr, b, KS ? wsc + nb * 8 : nullptr,
                                     KS ? wmq + nb * 8 : nullptr);
    }
    __m512i fifth = _mm512_setzero_si512();
    if constexpr (H5) fifth = load_halves(wh + b * 32, wh + (nb + b) * 32);
    __m512i isum[TN];
    for (int t = 0; t < TN; ++t) isum[t] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      __m512i lo, hi;
      r8_run_values_x2<H5>(w, next, fifth, j, lo, hi);
      for (int t = 0; t < TN; ++t) {
        const int8_t* xb = xq + t * K + b * QK;
        int32_t a, c;
        std::memcpy(&a, xb + 4 * j, 4);
        std::memcpy(&c, xb + 16 + 4 * j, 4);
        isum[t] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[t], lo, _mm512_set1_epi32(a)), hi, _mm512_set1_epi32(c));
      }
    }
    const __m512 d16 = r8_block_scales_x2<KS>(wd, wsc, b, nb, sblocks);
    __m512 m16 = _mm512_setzero_ps();
    if constexpr (MIN) m16 = r8_block_scales_x2<KS>(wm, wmq, b, nb, sblocks);
    for (int t = 0; t < TN; ++t) {
      __m512i sum = isum[t];
      if constexpr (!MIN) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(OFFSET * xs[t * nb + b]));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(dx[t * nb + b])), _mm512_cvtepi32_ps(sum), acc[t]);
      if constexpr (MIN) acc[t] = _mm512_fmadd_ps(m16, _mm512_set1_ps(sx[t * nb + b]), acc[t]);
    }
  }
}

// `tile_r8_signed` over two groups at once (as `tile_r8_x2`): the same integers and float chains.
template <bool NL, int TN>
inline void tile_r8_signed_x2(const uint8_t* wq, const uint16_t* wd, int64_t nb, const int8_t* xq, const float* dx,
                              int64_t K, __m512* acc, bool prefetch) {
  constexpr int64_t BYTES = NL ? R8_BLOCK_BYTES : R8_Q8_BLOCK_BYTES;
  const int64_t next = nb * BYTES;
  const __m512i low4 = _mm512_set1_epi8(0x0F), levels = _mm512_broadcast_i32x4(_mm256_castsi256_si128(iq4nl_levels()));
  const __m512i u128 = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * BYTES;
    if (prefetch) prefetch_r8_signed_block<BYTES>(w, wd, b), prefetch_r8_signed_block<BYTES>(w + next, wd + nb * 8, b);  // both groups
    __m512i isum[TN];
    for (int t = 0; t < TN; ++t) isum[t] = _mm512_setzero_si512();
    __m512i bias = _mm512_setzero_si512();  // 128·Σ w of each output's block (xq holds x + 128: `gemm_r8`)
    const auto run = [&](__m512i v, int r) {  // v: signed int8 values 4r..4r+3 of the 16 outputs
      bias = _mm512_dpbusd_epi32(bias, u128, v);
      for (int t = 0; t < TN; ++t) {
        int32_t xb;
        std::memcpy(&xb, xq + t * K + b * QK + 4 * r, 4);
        isum[t] = _mm512_dpbusd_epi32(isum[t], _mm512_set1_epi32(xb), v);
      }
    };
    if constexpr (NL) {
      for (int j = 0; j < 4; ++j) {
        const __m512i v = load_halves(w + 32 * j, w + next + 32 * j);
        run(_mm512_shuffle_epi8(levels, _mm512_and_si512(v, low4)), j);
        run(_mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)), 4 + j);
      }
    } else {
      for (int r = 0; r < 8; ++r) run(load_halves(w + 32 * r, w + next + 32 * r), r);
    }
    const __m512 d16 = halves_to_float16(wd + b * 8, wd + (nb + b) * 8);
    for (int t = 0; t < TN; ++t)
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(dx[t * nb + b])),
                               _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[t], bias)), acc[t]);
  }
}
// `tile_q6_r8` over two groups at once (as `tile_r8_x2`): group g + 1's values nb·128 bytes on, its bits
// nb·64, its scales nb·16, its ds nb / 8 · 8 halves; lane for lane the same integers and float chains.
template <int TN>
inline void tile_q6_r8_x2(const uint8_t* wq, const uint8_t* wh, const uint16_t* wd, const int8_t* wsc, int64_t nb,
                          const int8_t* xq, const float* dx, const int32_t* xs16, int64_t K, __m512* acc, bool prefetch) {
  const int64_t next = nb * R8_BLOCK_BYTES, nsb = nb / 8;
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  for (int t = 0; t < TN; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * R8_BLOCK_BYTES;
    const uint8_t* h = wh + b * 64;
    if (prefetch)
      for (int64_t g = 0; g < 2; ++g) {
        prefetch_ahead(w + g * next, R8_PREFETCH_BYTES), prefetch_ahead(w + g * next, R8_PREFETCH_BYTES + 64);
        prefetch_ahead(h + g * nb * 64, R8_PREFETCH_BYTES / 2);
        if (b % 4 == 0) prefetch_ahead(wsc + (g * nb + b) * 16, R8_PREFETCH_BYTES / 8);
      }
    const __m512i pl = load_halves(h, h + nb * 64), ph = load_halves(h + 32, h + nb * 64 + 32);
    __m512i lo_sum[TN], hi_sum[TN];
    for (int t = 0; t < TN; ++t) lo_sum[t] = hi_sum[t] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const auto run_bits = [&](__m512i planes) {
        const __m512i v = j == 0 ? _mm512_slli_epi16(planes, 4) : j == 1 ? _mm512_slli_epi16(planes, 2)
                          : j == 2 ? planes : _mm512_srli_epi16(planes, 2);
        return _mm512_and_si512(v, bits45);
      };
      const __m512i v = load_halves(w + 32 * j, w + next + 32 * j);
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(v, low4), run_bits(pl));
      const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), run_bits(ph));
      for (int t = 0; t < TN; ++t) {
        const int8_t* xb = xq + t * K + b * QK;
        int32_t a, c;
        std::memcpy(&a, xb + 4 * j, 4);
        std::memcpy(&c, xb + 16 + 4 * j, 4);
        lo_sum[t] = _mm512_dpbusd_epi32(lo_sum[t], lo, _mm512_set1_epi32(a));
        hi_sum[t] = _mm512_dpbusd_epi32(hi_sum[t], hi, _mm512_set1_epi32(c));
      }
    }
    const __m512 ds = halves_to_float16(wd + b / 8 * 8, wd + (nsb + b / 8) * 8);
    const auto scales = [&](int half) {
      const __m128i sc = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + b * 16 + 8 * half)),
                                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wsc + (nb + b) * 16 + 8 * half)));
      return _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    };
    const __m512 dl = scales(0), dh = scales(1);
    for (int t = 0; t < TN; ++t) {
      const __m512 dxb = _mm512_set1_ps(dx[t * nb + b]);
      const __m512i sl = _mm512_add_epi32(lo_sum[t], _mm512_set1_epi32(xs16[t * 2 * nb + 2 * b]));
      const __m512i sh = _mm512_add_epi32(hi_sum[t], _mm512_set1_epi32(xs16[t * 2 * nb + 2 * b + 1]));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dl, dxb), _mm512_cvtepi32_ps(sl), acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dh, dxb), _mm512_cvtepi32_ps(sh), acc[t]);
    }
  }
}
#endif

// (in block_gemm.py's R8_KINDS order)
enum R8Layout { R8_Q4_0, R8_Q4_1, R8_Q5_0, R8_Q5_1, R8_Q8_0, R8_IQ4_NL, R8_Q4_K, R8_Q5_K, R8_Q6_K };

constexpr bool r8_has_k_scales(int L) { return L == R8_Q4_K || L == R8_Q5_K; }
constexpr bool r8_per_super_block(int L) { return r8_has_k_scales(L) || L == R8_Q6_K; }  // d: ds [G, nb / 8, 8]
constexpr bool r8_has_minima(int L) { return L == R8_Q4_1 || L == R8_Q5_1 || r8_has_k_scales(L); }
constexpr bool r8_has_fifth_bits(int L) { return L == R8_Q5_0 || L == R8_Q5_1 || L == R8_Q5_K; }
constexpr int64_t r8_block_bytes(int L) { return L == R8_Q8_0 ? R8_Q8_BLOCK_BYTES : R8_BLOCK_BYTES; }

// The arrays of interleaved weights with G groups of 8 outputs and nb blocks (qh: Q5 layouts' fifth bits, Q6_K's
// bits 4-5 [G, nb, 64] (with its int8 scales sc [G, nb, 16]), m:
// Q4_1 / Q5_1 / K only; the K layouts' d and m per super-block of 8 blocks, their sc and mq a byte per block),
// as `gemm_r8` and `dequantize_rows_r8` read them.
void check_r8_arrays(int L, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& d,
                     const torch::Tensor& m, int64_t G, int64_t nb, const torch::Tensor& sc = torch::Tensor(),
                     const torch::Tensor& mq = torch::Tensor()) {
  const int64_t bytes = r8_block_bytes(L);
  const bool ks = r8_has_k_scales(L), q6 = L == R8_Q6_K;
  TORCH_CHECK(!r8_per_super_block(L) || nb % 8 == 0, "K-quant blocks need K divisible by 256, got ", nb * QK);
  const int64_t sblocks = r8_per_super_block(L) ? nb / 8 : nb;  // rows of d and m per group
  if (q6)
    TORCH_CHECK(sc.defined() && sc.dim() == 3 && sc.scalar_type() == torch::kInt8 && sc.is_contiguous() && sc.is_cpu() &&
                    sc.size(0) == G && sc.size(1) == nb && sc.size(2) == 16 && qh.defined() && qh.dim() == 3 &&
                    qh.scalar_type() == torch::kUInt8 && qh.is_contiguous() && qh.is_cpu() && qh.size(0) == G &&
                    qh.size(1) == nb && qh.size(2) == 64,
                "interleaved Q6_K needs its high bits q2 uint8 [", G, ", ", nb, ", 64] and scales sc int8 [", G, ", ", nb, ", 16]");
  for (const torch::Tensor* t : {&sc, &mq})
    if (ks)
      TORCH_CHECK(t->defined() && t->dim() == 3 && t->scalar_type() == torch::kUInt8 && t->is_contiguous() && t->is_cpu() &&
                      t->size(0) == G && t->size(1) == nb && t->size(2) == 8,
                  "interleaved K-quant block scales and minima (sc, mq) must be contiguous uint8 [", G, ", ", nb, ", 8]");
  TORCH_CHECK(qs.dim() == 3 && qs.is_contiguous() && qs.is_cpu() && qs.element_size() == 1 && qs.size(0) == G &&
                  qs.size(1) == nb && qs.size(2) == bytes,
              "interleaved block values must be a contiguous 1-byte CPU tensor [", G, ", ", nb, ", ", bytes,
              "], got ", qs.sizes());
  TORCH_CHECK(d.dim() == 3 && d.scalar_type() == torch::kFloat16 && d.is_contiguous() && d.is_cpu() && d.size(0) == G &&
                  d.size(1) == sblocks && d.size(2) == 8,
              "interleaved block scales d must be contiguous float16 [", G, ", ", sblocks, ", 8]");
  if (r8_has_minima(L))
    TORCH_CHECK(m.defined() && m.dim() == 3 && m.scalar_type() == torch::kFloat16 && m.is_contiguous() && m.is_cpu() &&
                    m.size(0) == G && m.size(1) == sblocks && m.size(2) == 8,
                "interleaved block minima m must be contiguous float16 [", G, ", ", sblocks, ", 8]");
  if (r8_has_fifth_bits(L))
    TORCH_CHECK(qh.defined() && qh.dim() == 3 && qh.scalar_type() == torch::kUInt8 && qh.is_contiguous() &&
                    qh.is_cpu() && qh.size(0) == G && qh.size(1) == nb && qh.size(2) == 32,
                "interleaved fifth bits qh must be contiguous uint8 [", G, ", ", nb, ", 32]");
}

// ------------------------------------------------------------------------------------------ AMX tiles
// On CPUs with AMX-INT8 (Intel Sapphire Rapids and later) the VNNI build runs the interleaved layouts'
// products of AMX_MIN_ROWS to AMX_MAX_ROWS rows on the tile unit: per pair of groups (16 outputs) and block of 32,
// one tdpbsud (tdpbssd for the signed layouts) gives 16 rows x 16 outputs of Σ q_x·q_w in int32, the same
// integers `tile_r8_x2` / `tile_r8_signed_x2` sum with vpdpbusd, and each (output, row)'s float chain over
// the blocks is theirs lane for lane: so the same bits at every row count (tests: AMX on = off). Q6_K
// (scales per 16 values) keeps the vector tiles. The weights of a pair are unpacked once a call into B
// tiles (8 rows of 64 bytes a block: row r the 16 outputs' values 4r..4r+3, output j at 4j), which every
// tile of 16 rows then reads; rows past T read zero activations and are not stored.
// FORKLM_BLOCK_KERNEL_AMX=0 turns the tiles off (`set_amx` in a process, for the tests and A/B runs).
#if FORKLM_VNNI && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define FORKLM_AMX 1
#else
#define FORKLM_AMX 0
#endif
// Where the tiles win (scripts/ab_amx.py on the AMX Xeon, a step's products, 2026-12-01): 1.13-1.28x the
// vector tiles at 16 and 32 rows on SmolLM2's file, 1.14x on a 1B file's Q4_K at 32; at 4-8 rows 0.54-0.88x
// (a pair's weights unpacked for few rows), at 24 and 48-256 rows 0.80-0.94x. Fixed bounds (the same bits
// either way, so a row count's choice never shows in a sample).
constexpr int64_t AMX_MIN_ROWS = 16, AMX_MAX_ROWS = 32;
static_assert(AMX_MIN_ROWS >= 16, "the tiles hold 16 rows: a shorter product would leave rows of them unwritten");

#if FORKLM_AMX
#define FORKLM_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))

// AMX-TILE and the feature bit `feature` (cpuid leaf 7, EDX) in cpuid, and Linux's leave for this process to
// use the tile data (asked once).
bool amx_feature_granted(unsigned feature) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u) || !((d >> feature) & 1u)) return false;
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// AMX-TILE and AMX-INT8, the tile data granted (once).
bool amx_supported() {
  static const bool ok = amx_feature_granted(25);
  return ok;
}

std::atomic<int> amx_switch{-1};  // -1: not read yet; 0: off; 1: on

bool amx_on() {
  int s = amx_switch.load(std::memory_order_relaxed);
  if (s < 0) {
    const char* e = std::getenv("FORKLM_BLOCK_KERNEL_AMX");
    s = (e == nullptr || std::strcmp(e, "0") != 0) && amx_supported() ? 1 : 0;
    amx_switch.store(s, std::memory_order_relaxed);
  }
  return s == 1;
}

// tmm0-3: C, 16 rows x 16 int32 (four blocks' sums); tmm4 / tmm5: A, 16 rows x 32 bytes; tmm6 / tmm7: B,
// 8 rows x 64 bytes (two of each, alternating, so that loads run ahead of the products).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

FORKLM_AMX_TARGET inline void amx_configure() {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  c.rows[4] = c.rows[5] = 16, c.colsb[4] = c.colsb[5] = 32;
  c.rows[6] = c.rows[7] = 8, c.colsb[6] = c.colsb[7] = 64;
  asm volatile("" : : "r"(&c) : "memory");  // the whole config in memory (ldtilecfg's operand names 8 bytes)
  _tile_loadconfig(&c);
}

// Groups g and g + 1's blocks as B tiles, 512 bytes a block (`out`): the values `tile_r8_x2` /
// `tile_r8_signed_x2` form for vpdpbusd (the fifth bits ORed in, IQ4_NL's levels looked up), as rows.
template <int L>
FORKLM_AMX_TARGET void amx_b_tiles(const uint8_t* wq, const uint8_t* wh, int64_t nb, uint8_t* out) {
  constexpr bool H5 = r8_has_fifth_bits(L), NL = L == R8_IQ4_NL;
  constexpr int64_t BYTES = r8_block_bytes(L);
  const int64_t next = nb * BYTES;
  const __m512i levels = _mm512_broadcast_i32x4(_mm256_castsi256_si128(iq4nl_levels()));
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* w = wq + b * BYTES;
    uint8_t* o = out + b * 512;
    for (int64_t i = 0; i < BYTES; i += 64) prefetch_ahead(w, R8_PREFETCH_BYTES + i), prefetch_ahead(w + next, R8_PREFETCH_BYTES + i);  // (a thread's first pair)
    if constexpr (L == R8_Q8_0) {
      for (int r = 0; r < 8; ++r) _mm512_storeu_si512(o + 64 * r, load_halves(w + 32 * r, w + next + 32 * r));
    } else {
      __m512i fifth = _mm512_setzero_si512();
      if constexpr (H5) fifth = load_halves(wh + b * 32, wh + (nb + b) * 32);
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        r8_run_values_x2<H5>(w, next, fifth, j, lo, hi);
        if constexpr (NL) lo = _mm512_shuffle_epi8(levels, lo), hi = _mm512_shuffle_epi8(levels, hi);
        _mm512_storeu_si512(o + 64 * j, lo);
        _mm512_storeu_si512(o + 64 * (4 + j), hi);
      }
    }
  }
}

// What `amx_pairs` reads: `gemm_r8`'s arrays (group 0's pointers), the quantized rows (xq: T16 rows, those
// past T zero) and their scales, and y.
struct AmxProduct {
  const uint8_t *wq, *wh, *wsc, *wmq;
  const uint16_t *wd, *wm;
  const int8_t* xq;
  const float *dx, *sx, *rp;
  const int32_t* xs;
  float* yp;
  int64_t T, K, nb, n;
};

// Pairs [p0, p1) of groups (outputs 16·p0 ..) times every row, in tiles of 16 rows: four blocks' products
// (C tmm0-3) are stored while the four before them are scaled, so no load waits on a tile store.
template <int L>
FORKLM_AMX_TARGET void amx_pairs(const AmxProduct& a, int64_t p0, int64_t p1) {
  constexpr bool MIN = r8_has_minima(L), H5 = r8_has_fifth_bits(L), KS = r8_has_k_scales(L);
  constexpr bool SIGNED = L == R8_Q8_0 || L == R8_IQ4_NL;
  constexpr int32_t OFFSET = H5 ? 16 : 8;
  const int64_t nb = a.nb, K = a.K, T = a.T, n = a.n;
  const int64_t sblocks = KS ? nb / 8 : nb, group_bytes = nb * r8_block_bytes(L), quads = (nb + 3) / 4;
  thread_local std::vector<uint8_t> tiles;
  tiles.resize(static_cast<size_t>(nb) * 512);
  alignas(64) int32_t sums[2][4][256];
  amx_configure();
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t g = 2 * p;
    amx_b_tiles<L>(a.wq + g * group_bytes, H5 ? a.wh + g * nb * 32 : nullptr, nb, tiles.data());
    asm volatile("" : : : "memory");  // the B tiles stored before tileloadd (whose asm names no memory) reads them
    const uint16_t* wd = a.wd + g * sblocks * 8;
    const uint16_t* wm = MIN ? a.wm + g * sblocks * 8 : nullptr;
    const uint8_t* wsc = KS ? a.wsc + g * nb * 8 : nullptr;
    const uint8_t* wmq = KS ? a.wmq + g * nb * 8 : nullptr;
    const uint8_t* bt = tiles.data();
    for (int64_t t0 = 0; t0 < T; t0 += 16) {
      const int8_t* xa = a.xq + t0 * K;
      const int live = static_cast<int>(std::min<int64_t>(16, T - t0));
#define FORKLM_AMX_ISSUE(C, A, B, blk, out)                                      \
  do {                                                                           \
    _tile_loadd(A, xa + (blk) * QK, K);                                          \
    _tile_loadd(B, bt + (blk) * 512, 64);                                        \
    _tile_zero(C);                                                               \
    if constexpr (SIGNED) _tile_dpbssd(C, A, B); else _tile_dpbsud(C, A, B);     \
    _tile_stored(C, out, 64);                                                    \
  } while (0)
      const auto issue = [&](int64_t q) {  // blocks 4q .. 4q + 3 into sums[q % 2]
        int32_t(*out)[256] = sums[q & 1];
        const int64_t b = 4 * q;
        FORKLM_AMX_ISSUE(0, 4, 6, b, out[0]);
        if (b + 1 < nb) FORKLM_AMX_ISSUE(1, 5, 7, b + 1, out[1]);
        if (b + 2 < nb) FORKLM_AMX_ISSUE(2, 4, 6, b + 2, out[2]);
        if (b + 3 < nb) FORKLM_AMX_ISSUE(3, 5, 7, b + 3, out[3]);
      };
#undef FORKLM_AMX_ISSUE
      __m512 acc[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      // the next pair's weights come in from memory while this pair's first tile of rows is multiplied
      const uint8_t* ahead = t0 == 0 && p + 1 < p1 ? a.wq + (g + 2) * group_bytes : nullptr;
      issue(0);
      for (int64_t q = 0; q < quads; ++q) {
        if (q + 1 < quads) issue(q + 1);
        if (ahead != nullptr)
          for (int64_t i = 4 * q * r8_block_bytes(L); i < std::min(nb, 4 * q + 4) * r8_block_bytes(L); i += 64)
            prefetch_ahead(ahead, i), prefetch_ahead(ahead + group_bytes, i);
        for (int64_t b = 4 * q; b < std::min(nb, 4 * q + 4); ++b) {
          const int32_t* s = sums[q & 1][b - 4 * q];
          const __m512 d16 = r8_block_scales_x2<KS>(wd, wsc, b, nb, sblocks);
          __m512 m16 = _mm512_setzero_ps();
          if constexpr (MIN) m16 = r8_block_scales_x2<KS>(wm, wmq, b, nb, sblocks);
#pragma GCC unroll 16
          for (int i = 0; i < 16; ++i) {  // (rows past T: zero scales, never stored)
            const int64_t t = t0 + i;
            __m512i sum = _mm512_load_si512(s + 16 * i);
            if constexpr (!MIN && !SIGNED) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(OFFSET * a.xs[t * nb + b]));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(a.dx[t * nb + b])), _mm512_cvtepi32_ps(sum), acc[i]);
            if constexpr (MIN) acc[i] = _mm512_fmadd_ps(m16, _mm512_set1_ps(a.sx[t * nb + b]), acc[i]);
          }
        }
      }
      const int64_t o = g * 8, outs = std::min<int64_t>(16, n - o);
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        if (i >= live) break;
        const int64_t t = t0 + i;
        float* yo = a.yp + t * n + o;
        if (outs == 16) {
          __m512 v = acc[i];
          if (a.rp != nullptr) v = _mm512_add_ps(_mm512_loadu_ps(a.rp + t * n + o), v);
          _mm512_storeu_ps(yo, v);
        } else {
          alignas(64) float lanes[16];
          _mm512_store_ps(lanes, acc[i]);
          for (int64_t j = 0; j < outs; ++j) yo[j] = a.rp != nullptr ? a.rp[t * n + o + j] + lanes[j] : lanes[j];
        }
      }
    }
  }
  _tile_release();
}
void set_amx(bool on) { amx_switch.store(on && amx_supported() ? 1 : 0, std::memory_order_relaxed); }
#else
bool amx_supported() { return false; }
bool amx_on() { return false; }
void set_amx(bool) {}
#endif

// L: the layout (q4_0_r8, iq4_nl_r8, q8_0_r8: qs, d; q4_1_r8: qs, d, m; q5_0_r8: qs, qh, d; q5_1_r8: qs, qh, d, m;
// q4_k_r8: qs, d (ds), m (dm), sc, mq; q5_k_r8: and qh; q6_k_r8: qs, qh (bits 4-5), d (ds), sc (int8 per 16)).
// count: int64 [1] holding N (the last group may be padded).
template <int L>
torch::Tensor gemm_r8(const torch::Tensor& x_in, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& d,
                      const torch::Tensor& m, const torch::Tensor& count, int64_t mode_in,
                      const std::optional<torch::Tensor>& norm_weight, double eps,
                      const std::optional<torch::Tensor>& residual, const torch::Tensor& sc = torch::Tensor(),
                      const torch::Tensor& mq = torch::Tensor()) {
  constexpr bool MIN = r8_has_minima(L), H5 = r8_has_fifth_bits(L), KS = r8_has_k_scales(L), Q6 = L == R8_Q6_K;
  constexpr bool SIGNED = L == R8_Q8_0 || L == R8_IQ4_NL;
  constexpr int64_t BLOCK_BYTES = r8_block_bytes(L);
  const ProductInput in = product_input(x_in, mode_in, norm_weight);
  const torch::Tensor& x = in.x;
  const Prologue mode = in.mode;
  const int64_t T = in.T, K = in.K, nb = in.nb;
  TORCH_CHECK(count.dim() == 1 && count.numel() == 1 && count.scalar_type() == torch::kInt64 && count.is_cpu(),
              "interleaved weights need their output count N as a one-element int64 tensor");
  const int64_t n = *count.data_ptr<int64_t>(), G = (n + 7) / 8;
  check_r8_arrays(L, qs, qh, d, m, G, nb, sc, mq);
  const torch::Tensor res = checked_residual(residual, T, n);
  torch::Tensor y = torch::empty({T, n}, torch::kFloat32);
  if (T == 0 || n == 0) return y;
  thread_local CallBuffers buf;
  const ReleaseLargeBuffers release{buf};
  // the K-quant layouts on the AVX2 build: the rows quantized per super-block (`K_R8_SUPER_ACTIVATIONS`)
  constexpr bool SUPER = (KS || Q6) && K_R8_SUPER_ACTIVATIONS;
  const int64_t nbx = SUPER ? nb / 8 : nb;  // the activations' scales per row
  // s: dx·Σ q per block (SUPER: the minima terms' factor, formed from the super-blocks' below; Q6_K takes none)
  buf.q.resize(T * K), buf.d.resize(T * nbx), buf.s.resize(SUPER && Q6 ? 0 : T * nb);
  buf.sums.resize(SUPER ? T * (K / 16) : 0);
  quantize_rows_into(x, K, mode, in.norm_data(), static_cast<float>(eps), SUPER,
                     buf.q.data(), buf.d.data(), buf.s.data(), buf.sums.data());
  if constexpr (SUPER && KS) block_sx_from_super_blocks(buf.d.data(), buf.sums.data(), T, K, buf.s.data());
  std::vector<int32_t>& xs = buf.block_sums;
  xs.resize(MIN || SIGNED || SUPER ? 0 : Q6 ? 2 * T * nb : T * nb);
  if constexpr (Q6 && !SUPER)
    half_block_sums(buf.q.data(), T * nb, xs.data());
  else if constexpr (!MIN && !SIGNED && !Q6)
    block_sums(buf.q.data(), T * nb, xs.data());
  // AMX: pairs of groups on the tile unit (`amx_pairs`), the rows padded with zeros to a multiple of 16;
  // a last odd group on the vector tiles below
  const bool amx = FORKLM_AMX && !Q6 && T >= AMX_MIN_ROWS && T <= AMX_MAX_ROWS && G >= 2 && amx_on();
  const int64_t amx_groups = amx ? G / 2 * 2 : 0;
  if (amx) {  // (resize value-initializes: the padding rows are zeros)
    const int64_t T16 = (T + 15) / 16 * 16;
    buf.q.resize(T16 * K), buf.d.resize(T16 * nb), buf.s.resize(T16 * nb);
    if (!xs.empty()) xs.resize(T16 * nb);
  }
  const uint8_t* wq = static_cast<const uint8_t*>(qs.data_ptr());
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* wm = MIN ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr;
  const uint8_t* wh = H5 ? static_cast<const uint8_t*>(qh.data_ptr()) : nullptr;
  const uint8_t* wsc = KS ? sc.data_ptr<uint8_t>() : nullptr;
  const uint8_t* wmq = KS ? mq.data_ptr<uint8_t>() : nullptr;
  const int8_t* wsc6 = Q6 ? sc.data_ptr<int8_t>() : nullptr;  // Q6_K: int8 per 16 values
  const uint8_t* wh6 = Q6 ? static_cast<const uint8_t*>(qh.data_ptr()) : nullptr;  // Q6_K: bits 4-5, 64 bytes a block
  const int64_t sblocks = r8_per_super_block(L) ? nb / 8 : nb;  // a group's rows of d and m
  const int8_t* xq = buf.q.data();
  const float *dx = buf.d.data(), *sx = buf.s.data();
  const int32_t* xsp = xs.data();
  const int16_t* xsums = buf.sums.data();  // (`buf` is thread_local: read here, not on the worker threads)
  const auto q6_sums = [&](int64_t t) {  // row t's Q6_K sums per 16: −32·Σ q (int32), or (AVX2) Σ q (int16)
#if FORKLM_VNNI
    return xsp + 2 * t * nb;
#else
    return xsums + t * (K / 16);
#endif
  };
  float* yp = y.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
  const int64_t group_bytes = nb * BLOCK_BYTES;
  const auto store = [&](int64_t g, int64_t t, __m256 a) {  // y = residual + x·Wᵀ, one rounding
    const int64_t o = g * 8, live = std::min<int64_t>(8, n - o);
    float* yo = yp + t * n + o;
    if (live == 8) {
      if (rp != nullptr) a = _mm256_add_ps(_mm256_loadu_ps(rp + t * n + o), a);
      _mm256_storeu_ps(yo, a);
      return;
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, a);
    for (int64_t i = 0; i < live; ++i) yo[i] = rp != nullptr ? rp[t * n + o + i] + lanes[i] : lanes[i];
  };
#if FORKLM_AMX
  if (amx) {
    const AmxProduct a{wq, wh, wsc, wmq, wd, wm, buf.q.data(), dx, sx, rp, xsp, yp, T, K, nb, n};
    at::parallel_for(0, amx_groups / 2, 1, [&](int64_t p0, int64_t p1) { amx_pairs<L>(a, p0, p1); });
    if (amx_groups == G) return y;
  }
#endif
  // The VNNI build's signed tiles read x + 128 as unsigned bytes (`vpdpbusd` multiplies unsigned by
  // signed; |x| <= 127, so x + 128 is 1..255: the top bit flipped) and take 128·Σ w back out per block.
  if constexpr (SIGNED && FORKLM_VNNI)
    for (int64_t i = 0; i < T * K; ++i) buf.q[i] = static_cast<int8_t>(static_cast<uint8_t>(buf.q[i]) ^ 0x80u);
  // threads split the groups; a chunk of groups stays in cache while every tile of rows passes it
  constexpr int64_t GROUPS_PER_CHUNK = ROWS_PER_CHUNK / 8;
  parallel_chunks(amx_groups, G, GROUPS_PER_CHUNK, [&](int64_t g0, int64_t g1) {
    for (int64_t c0 = g0; c0 < g1; c0 += GROUPS_PER_CHUNK) {
      const int64_t c1 = std::min(g1, c0 + GROUPS_PER_CHUNK);
      const auto rows = [&](auto tile_rows, int64_t t) {
        constexpr int TN = decltype(tile_rows)::value;
        int64_t g = c0;
#if FORKLM_VNNI  // two groups a tile in 512-bit vectors (a lone row's products stream their weights: one group)
        if constexpr (TN > 1)
          for (; g + 2 <= c1; g += 2) {
            __m512 acc[TN];
            if constexpr (SIGNED)
              tile_r8_signed_x2<L == R8_IQ4_NL, TN>(wq + g * group_bytes, wd + g * nb * 8, nb, xq + t * K, dx + t * nb, K,
                                                    acc, t == 0);
            else if constexpr (Q6)
              tile_q6_r8_x2<TN>(wq + g * group_bytes, wh6 + g * nb * 64, wd + g * sblocks * 8, wsc6 + g * nb * 16, nb,
                                xq + t * K, dx + t * nb, xsp + 2 * t * nb, K, acc, t == 0);
            else
              tile_r8_x2<MIN, H5, TN, KS>(wq + g * group_bytes, H5 ? wh + g * nb * 32 : nullptr, wd + g * sblocks * 8,
                                          MIN ? wm + g * sblocks * 8 : nullptr, nb, xq + t * K, dx + t * nb, sx + t * nb,
                                          MIN ? nullptr : xsp + t * nb, K, acc, t == 0, KS ? wsc + g * nb * 8 : nullptr,
                                          KS ? wmq + g * nb * 8 : nullptr);
            for (int i = 0; i < TN; ++i) {
              store(g, t + i, _mm512_castps512_ps256(acc[i]));
              store(g + 1, t + i, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1)));
            }
          }
#endif
        for (; g < c1; ++g) {
          __m256 acc[TN];
          if constexpr (SIGNED)
            tile_r8_signed<L == R8_IQ4_NL, TN>(wq + g * group_bytes, wd + g * nb * 8, nb, xq + t * K, dx + t * nb, K, acc,
                                               t == 0);
          else if constexpr (Q6)
            tile_q6_r8<TN>(wq + g * group_bytes, wh6 + g * nb * 64, wd + g * sblocks * 8, wsc6 + g * nb * 16, nb,
                           xq + t * K, dx + t * nbx, q6_sums(t), K, acc, t == 0);
          else
            tile_r8<MIN, H5, TN, KS>(wq + g * group_bytes, H5 ? wh + g * nb * 32 : nullptr, wd + g * sblocks * 8,
                                     MIN ? wm + g * sblocks * 8 : nullptr, nb, xq + t * K, dx + t * nbx, sx + t * nb,
                                     MIN ? nullptr : xsp + t * nb, K, acc, t == 0, KS ? wsc + g * nb * 8 : nullptr,
                                     KS ? wmq + g * nb * 8 : nullptr);
          for (int i = 0; i < TN; ++i) store(g, t + i, acc[i]);
        }
      };
      int64_t t = 0;
#if FORKLM_VNNI  // 8 rows a tile: each weight vector unpacked once for 8 rows (measured faster on the 4- to 6-bit
                 // layouts at 8-32 rows; Q8_0 / IQ4_NL's signed tiles spill there and keep 4)
      if constexpr (!SIGNED)
        for (; t + 8 <= T; t += 8) rows(std::integral_constant<int, 8>{}, t);
#else  // Q6_K's tile unpacks a block once for all its rows (`tile_q6_r8`): 8 of them
      if constexpr (Q6)
        for (; t + 8 <= T; t += 8) rows(std::integral_constant<int, 8>{}, t);
#endif
      for (; t + 4 <= T; t += 4) rows(std::integral_constant<int, 4>{}, t);
      switch (T - t) {
        case 3: rows(std::integral_constant<int, 3>{}, t); break;
        case 2: rows(std::integral_constant<int, 2>{}, t); break;
        case 1: rows(std::integral_constant<int, 1>{}, t); break;
        default: break;
      }
    }
  });
  return y;
}

torch::Tensor gemm_q4_0_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& count,
                           int64_t prologue, const std::optional<torch::Tensor>& norm_weight, double eps,
                           const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q4_0>(x, qs, qs, d, d, count, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_q8_0_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& count,
                           int64_t prologue, const std::optional<torch::Tensor>& norm_weight, double eps,
                           const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q8_0>(x, qs, qs, d, d, count, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_iq4_nl_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                             const torch::Tensor& count, int64_t prologue, const std::optional<torch::Tensor>& norm_weight,
                             double eps, const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_IQ4_NL>(x, qs, qs, d, d, count, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_q4_1_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m,
                           const torch::Tensor& count, int64_t prologue, const std::optional<torch::Tensor>& norm_weight,
                           double eps, const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q4_1>(x, qs, qs, d, m, count, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_q5_0_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& d,
                           const torch::Tensor& count, int64_t prologue, const std::optional<torch::Tensor>& norm_weight,
                           double eps, const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q5_0>(x, qs, qh, d, d, count, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_q5_1_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& d,
                           const torch::Tensor& m, const torch::Tensor& count, int64_t prologue,
                           const std::optional<torch::Tensor>& norm_weight, double eps,
                           const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q5_1>(x, qs, qh, d, m, count, prologue, norm_weight, eps, residual);
}

// Q6_K interleaved (BlockWeights.kernel_arrays' order: qs, q2 the values' bits 4-5, ds, sc int8 per 16, count)
torch::Tensor gemm_q6_k_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& q2, const torch::Tensor& ds,
                           const torch::Tensor& sc, const torch::Tensor& count, int64_t prologue,
                           const std::optional<torch::Tensor>& norm_weight, double eps,
                           const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q6_K>(x, qs, q2, ds, ds, count, prologue, norm_weight, eps, residual, sc, sc);
}

// Q4_K / Q5_K interleaved (the arrays in BlockWeights.kernel_arrays' order: mq the blocks' 6-bit minima, dm the
// super-blocks' −dmin)
torch::Tensor gemm_q4_k_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& ds, const torch::Tensor& sc,
                           const torch::Tensor& mq, const torch::Tensor& dm, const torch::Tensor& count, int64_t prologue,
                           const std::optional<torch::Tensor>& norm_weight, double eps,
                           const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q4_K>(x, qs, qs, ds, dm, count, prologue, norm_weight, eps, residual, sc, mq);
}

torch::Tensor gemm_q5_k_r8(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& ds,
                           const torch::Tensor& sc, const torch::Tensor& mq, const torch::Tensor& dm, const torch::Tensor& count,
                           int64_t prologue, const std::optional<torch::Tensor>& norm_weight, double eps,
                           const std::optional<torch::Tensor>& residual) {
  return gemm_r8<R8_Q5_K>(x, qs, qh, ds, dm, count, prologue, norm_weight, eps, residual, sc, mq);
}

torch::Tensor gemm_q4_1(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                        const torch::Tensor& m, int64_t prologue, const std::optional<torch::Tensor>& norm_weight,
                        double eps, const std::optional<torch::Tensor>& residual) {
  return gemm<true>(x, qs, d, m, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_q5_1(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& d,
                        const torch::Tensor& m, int64_t prologue, const std::optional<torch::Tensor>& norm_weight,
                        double eps, const std::optional<torch::Tensor>& residual) {
  return gemm<true, true>(x, qs, d, m, prologue, norm_weight, eps, residual, qh);
}

torch::Tensor gemm_q4_k(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& ds, const torch::Tensor& sc,
                        const torch::Tensor& mq, const torch::Tensor& dm, int64_t prologue,
                        const std::optional<torch::Tensor>& norm_weight, double eps,
                        const std::optional<torch::Tensor>& residual) {
  return gemm<true, false, true>(x, qs, ds, mq, prologue, norm_weight, eps, residual, torch::Tensor(), sc, dm);
}

torch::Tensor gemm_q5_k(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& ds,
                        const torch::Tensor& sc, const torch::Tensor& mq, const torch::Tensor& dm, int64_t prologue,
                        const std::optional<torch::Tensor>& norm_weight, double eps,
                        const std::optional<torch::Tensor>& residual) {
  return gemm<true, true, true>(x, qs, ds, mq, prologue, norm_weight, eps, residual, qh, sc, dm);
}

torch::Tensor gemm_q6_k(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& q2, const torch::Tensor& ds,
                        const torch::Tensor& sc, int64_t prologue, const std::optional<torch::Tensor>& norm_weight,
                        double eps, const std::optional<torch::Tensor>& residual) {
  return gemm<false, false, false, SUB16_Q6>(x, qs, ds, ds, prologue, norm_weight, eps, residual, q2, sc);
}

torch::Tensor gemm_q3_k(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& ds,
                        const torch::Tensor& sc, int64_t prologue, const std::optional<torch::Tensor>& norm_weight,
                        double eps, const std::optional<torch::Tensor>& residual) {
  return gemm<false, false, false, SUB16_Q3>(x, qs, ds, ds, prologue, norm_weight, eps, residual, qh, sc);
}

torch::Tensor gemm_q2_k(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& sc,
                        int64_t prologue, const std::optional<torch::Tensor>& norm_weight, double eps,
                        const std::optional<torch::Tensor>& residual) {
  return gemm<false, false, false, SUB16_Q2>(x, qs, d, d, prologue, norm_weight, eps, residual, torch::Tensor(), sc);
}

torch::Tensor gemm_q8_0(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, int64_t prologue,
                        const std::optional<torch::Tensor>& norm_weight, double eps,
                        const std::optional<torch::Tensor>& residual) {
  return gemm<false>(x, qs, d, d, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_iq4_xs(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& sc,
                          int64_t prologue, const std::optional<torch::Tensor>& norm_weight, double eps,
                          const std::optional<torch::Tensor>& residual) {
  return gemm<false, false, false, SUB16_IQ4XS>(x, qs, d, d, prologue, norm_weight, eps, residual, torch::Tensor(), sc);
}

torch::Tensor gemm_iq4_nl(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d, int64_t prologue,
                          const std::optional<torch::Tensor>& norm_weight, double eps,
                          const std::optional<torch::Tensor>& residual) {
  return gemm<false, false, false, NO_SUB16, true>(x, qs, d, d, prologue, norm_weight, eps, residual);
}

std::vector<torch::Tensor> quantize_q8(const torch::Tensor& x_in) {
  const torch::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_cpu() && x.size(1) % QK == 0,
              "activations must be a float32 CPU matrix [T, K] with K a multiple of 32");
  QuantizedRows r = quantize_rows(x, x.size(1), PLAIN, nullptr, 0.f);
  return {r.q, r.d, r.s};
}

std::vector<torch::Tensor> quantize_q8_k(const torch::Tensor& x_in) {
  const torch::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_cpu() && x.size(1) % QKK == 0,
              "activations must be a float32 CPU matrix [T, K] with K a multiple of 256");
  QuantizedRows r = quantize_rows(x, x.size(1), PLAIN, nullptr, 0.f, true);
  return {r.q, r.d, r.sums};
}


// ---------------------------------------------------------------------------------------------
// Repacking at load: GGUF blocks as the file stores them -> the arrays above, every value as
// stored (no requantization). One pass over the stored bytes, rows split across threads; rows
// [row0, row0 + r) of the outputs are written. Returns the number of Q4_0 / Q5_0 blocks whose
// minimum (−8d / −16d) overflows float16 (the caller refuses the tensor).

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }
inline uint32_t load_u32(const uint8_t* p) { uint32_t v; std::memcpy(&v, p, 4); return v; }

// GGUF's fifth-bit words (bit j: value j of the block) -> the kernel's arrangement: per block pair
// (b, b+1), word b = low halves of both, word b+1 = high halves of both; a lone last block keeps its word.
inline void arrange_high_bits_row(uint32_t* w, int64_t nb) {
  for (int64_t b = 0; b + 1 < nb; b += 2) {
    const uint32_t lo = w[b], hi = w[b + 1];
    w[b] = (lo & 0xFFFFu) | (hi << 16);
    w[b + 1] = (lo >> 16) | (hi & 0xFFFF0000u);
  }
}

inline uint16_t scaled_half(uint16_t d, float factor, bool* overflow) {
  const float m = half_to_float(d) * factor;
  const uint16_t h = _cvtss_sh(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *overflow = !std::isfinite(half_to_float(h));
  return h;
}

enum class Stored { Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS, Unknown };

Stored stored_type(const std::string& t) {
  return t == "Q4_0" ? Stored::Q4_0 : t == "Q4_1" ? Stored::Q4_1 : t == "Q5_0" ? Stored::Q5_0
         : t == "Q5_1" ? Stored::Q5_1 : t == "Q8_0" ? Stored::Q8_0 : t == "Q4_K" ? Stored::Q4_K
         : t == "Q5_K" ? Stored::Q5_K : t == "Q6_K" ? Stored::Q6_K : t == "Q3_K" ? Stored::Q3_K
         : t == "Q2_K" ? Stored::Q2_K : t == "IQ4_NL" ? Stored::IQ4_NL : t == "IQ4_XS" ? Stored::IQ4_XS
         : Stored::Unknown;
}

// one row of Q4_0 / Q4_1 / Q5_0 / Q5_1 / IQ4_NL blocks (32 values each)
int64_t repack_legacy_row(Stored type, const uint8_t* src, int64_t nb, uint8_t* qs, uint16_t* d,
                          uint16_t* m, uint32_t* qh) {
  int64_t bad = 0;
  for (int64_t b = 0; b < nb; ++b) {
    bool over = false;
    if (type == Stored::Q4_1) {  // d, m, 16 bytes of nibbles
      const uint8_t* x = src + b * 20;
      d[b] = load_u16(x), m[b] = load_u16(x + 2);
      std::memcpy(qs + b * 16, x + 4, 16);
    } else if (type == Stored::IQ4_NL) {  // d, 16 bytes of level indices
      const uint8_t* x = src + b * 18;
      d[b] = load_u16(x);
      std::memcpy(qs + b * 16, x + 2, 16);
    } else if (type == Stored::Q4_0) {  // d, 16 bytes; w = d·(q − 8)
      const uint8_t* x = src + b * 18;
      d[b] = load_u16(x), m[b] = scaled_half(d[b], -8.f, &over);
      std::memcpy(qs + b * 16, x + 2, 16);
    } else if (type == Stored::Q5_0) {  // d, 4 bytes of fifth bits, 16 bytes; w = d·(q − 16)
      const uint8_t* x = src + b * 22;
      d[b] = load_u16(x), m[b] = scaled_half(d[b], -16.f, &over);
      qh[b] = load_u32(x + 2);
      std::memcpy(qs + b * 16, x + 6, 16);
    } else {  // Q5_1: d, m, 4 bytes of fifth bits, 16 bytes
      const uint8_t* x = src + b * 24;
      d[b] = load_u16(x), m[b] = load_u16(x + 2);
      qh[b] = load_u32(x + 4);
      std::memcpy(qs + b * 16, x + 8, 16);
    }
    bad += over;
  }
  if (qh != nullptr) arrange_high_bits_row(qh, nb);
  return bad;
}

// one row of Q4_K / Q5_K super-blocks (256 values: ds, dmin, 12 bytes of 6-bit scales and minima,
// [Q5_K: 32 bytes of fifth bits,] 128 bytes of nibbles), as ggml's dequantize_row_q4_K / q5_K read them
void repack_k_row(bool five, const uint8_t* src, int64_t nsb, uint8_t* qs, uint16_t* ds, uint16_t* dm,
                  uint8_t* sc, uint8_t* mq, uint32_t* qh) {
  const int64_t size = five ? 176 : 144;
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* x = src + s * size;
    ds[s] = load_u16(x);
    dm[s] = load_u16(x + 2) ^ 0x8000u;  // −dmin (exact)
    const uint8_t* p = x + 4;
    for (int j = 0; j < 4; ++j) {
      sc[s * 8 + j] = p[j] & 63, mq[s * 8 + j] = p[j + 4] & 63;
      sc[s * 8 + j + 4] = (p[j + 8] & 0x0F) | ((p[j] >> 6) << 4);
      mq[s * 8 + j + 4] = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
    }
    const uint8_t* hb = x + 16;  // Q5_K's fifth bits: value 64c + 32h + l's is bit 2c + h of hb[l]
    const uint8_t* q = x + (five ? 48 : 16);  // per 64 values: 32 bytes, low nibbles then high
    for (int c = 0; c < 4; ++c) {
      for (int h = 0; h < 2; ++h) {
        const int64_t blk = s * 8 + 2 * c + h;  // values 64c + 32h + l, l in 0..31
        uint8_t* out = qs + blk * 16;
        for (int j = 0; j < 16; ++j) {
          const uint8_t a = h ? q[32 * c + j] >> 4 : q[32 * c + j] & 0x0F;
          const uint8_t b = h ? q[32 * c + j + 16] >> 4 : q[32 * c + j + 16] & 0x0F;
          out[j] = a | (b << 4);
        }
        if (qh != nullptr) {
          uint32_t w = 0;
          if (five)
            for (int l = 0; l < 32; ++l) w |= uint32_t((hb[l] >> (2 * c + h)) & 1) << l;
          qh[blk] = w;
        }
      }
    }
  }
  if (qh != nullptr) arrange_high_bits_row(qh, nsb * 8);
}

// One Q6_K super-block's 256 values q + 32 (0..63) in order.
inline void q6_values(const uint8_t* x, uint8_t* v) {
  for (int half = 0; half < 2; ++half) {
    const uint8_t* ql = x + 64 * half;
    const uint8_t* qh = x + 128 + 32 * half;
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = ql[32 * (k & 1) + l];
        const uint8_t low = (k >> 1) ? byte >> 4 : byte & 0x0F;
        v[128 * half + 32 * k + l] = low | (((qh[l] >> (2 * k)) & 3) << 4);
      }
  }
}

// one row of Q6_K super-blocks (256 values: 128 bytes of low nibbles, 64 of 2-bit pairs, 16 int8
// scales, d), as ggml's dequantize_row_q6_K reads them: values q + 32 in 0..63
void repack_q6_k_row(const uint8_t* src, int64_t nsb, uint8_t* qs, uint8_t* q2, uint16_t* ds, int8_t* sc) {
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* x = src + s * 210;
    uint8_t v[256];
    q6_values(x, v);
    for (int blk = 0; blk < 8; ++blk) {
      const uint8_t* vb = v + 32 * blk;
      uint8_t* out = qs + (s * 8 + blk) * 16;
      for (int j = 0; j < 16; ++j) out[j] = (vb[j] & 0x0F) | ((vb[j + 16] & 0x0F) << 4);
    }
    for (int blk = 0; blk < 8; blk += 2) {  // bits 4-5 per pair of blocks, as `load_q6_pair` reads them
      const uint8_t *first = v + 32 * blk, *second = first + 32;
      uint8_t* planes = q2 + (s * 8 + blk) * 8;
      for (int k = 0; k < 16; ++k)
        planes[k] = (first[k] >> 4) | ((second[k] >> 4) << 2) | ((first[k + 16] >> 4) << 4) | ((second[k + 16] >> 4) << 6);
    }
    std::memcpy(sc + s * 16, x + 192, 16);
    ds[s] = load_u16(x + 208);
  }
}

// one row of Q3_K super-blocks (256 values: 32 bytes of third-bit masks, 64 of 2-bit fields, 12 of
// 6-bit scales, d), as ggml's dequantize_row_q3_K reads them: the masks and fields as stored, the
// scales less 32 as int8
void repack_q3_k_row(const uint8_t* src, int64_t nsb, uint8_t* qs, uint8_t* masks, uint16_t* ds, int8_t* sc) {
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* x = src + s * 110;
    const uint8_t* b = x + 96;
    std::memcpy(masks + s * 32, x, 32);
    std::memcpy(qs + s * 64, x + 32, 64);
    for (int i = 0; i < 16; ++i) {
      const int low = i < 8 ? b[i] & 0x0F : b[i - 8] >> 4, high = (b[8 + i % 4] >> (2 * (i / 4))) & 3;
      sc[s * 16 + i] = static_cast<int8_t>((low | (high << 4)) - 32);
    }
    ds[s] = load_u16(x + 108);
  }
}

// one row of Q2_K super-blocks (256 values: 16 bytes of 4-bit scale | min << 4, 64 of 2-bit fields, d,
// dmin), as ggml's dequantize_row_q2_K reads them: all as stored, d and dmin side by side
void repack_q2_k_row(const uint8_t* src, int64_t nsb, uint8_t* qs, uint16_t* d, uint8_t* sc) {
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* x = src + s * 84;
    std::memcpy(qs + s * 64, x + 16, 64);
    std::memcpy(sc + s * 16, x, 16);
    d[2 * s] = load_u16(x + 80), d[2 * s + 1] = load_u16(x + 82);
  }
}

// one row of IQ4_XS super-blocks (256 values: d, 2 high bits of 8 scales, their 4 low bits, 128 bytes of
// level indices), as ggml's dequantize_row_iq4_xs reads them: the indices as stored (per 32 values 16
// bytes, value j low, j + 16 high: IQ4_NL's order), each block's 6-bit scale − 32 as an int8
void repack_iq4_xs_row(const uint8_t* src, int64_t nsb, uint8_t* qs, uint16_t* d, int8_t* sc) {
  for (int64_t s = 0; s < nsb; ++s) {
    const uint8_t* x = src + s * 136;
    d[s] = load_u16(x);
    const int high = load_u16(x + 2);
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | (((high >> (2 * ib)) & 3) << 4);
      sc[s * 8 + ib] = static_cast<int8_t>(ls - 32);
    }
    std::memcpy(qs + s * 128, x + 8, 128);
  }
}

// 8 rows of 8 dwords -> their transpose: v[j] dword r = v_in[r] dword j (Q8_0's interleaved runs: run j holds
// values 4j..4j+3 of each of the group's 8 outputs).
inline void transpose_dwords_8x8(__m256i* v) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);      // r0[0] r1[0] r0[1] r1[1] | r0[4] r1[4] ..
    t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);  // r0[2] r1[2] r0[3] r1[3] | r0[6] ..
  }
  for (int i = 0; i < 2; ++i)
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm256_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);      // dword 2h (| 2h + 4) of 4 rows
      u[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);  // dword 2h + 1 (| 2h + 5)
    }
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
    v[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
  }
}

// Stored Q8_0 rows -> q8_0_r8 (qs [G, nb, 256], d [G, nb, 8]) for outputs [row0, row0 + r): output o is stored
// row order[o − row0] (order null: row o − row0). A group of 8 outputs all in the range goes by one 8x8 dword transpose per block (the
// values' 32-byte runs written whole); the outputs of a group the range cuts, one by one.
void repack_q8_0_r8(const uint8_t* src, int64_t bytes, int64_t nb, int64_t row0, int64_t r, const int64_t* order,
                    uint8_t* qs, uint16_t* d) {
  const auto source = [&](int64_t i) { return order != nullptr ? order[i] : i; };
  const int64_t g0 = row0 / 8, g1 = (row0 + r + 7) / 8;
  at::parallel_for(g0, g1, 8, [&](int64_t ga, int64_t gb) {
    for (int64_t g = ga; g < gb; ++g) {
      uint8_t* out = qs + g * nb * R8_Q8_BLOCK_BYTES;
      uint16_t* dout = d + g * nb * 8;
      if (g * 8 >= row0 && g * 8 + 8 <= row0 + r) {
        const uint8_t* rows[8];
        for (int k = 0; k < 8; ++k) rows[k] = src + source(g * 8 + k - row0) * bytes;
        for (int64_t b = 0; b < nb; ++b) {
          __m256i v[8];
          for (int k = 0; k < 8; ++k) {
            v[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[k] + b * Q8_0_STORED_BYTES + 2));
            dout[b * 8 + k] = load_u16(rows[k] + b * Q8_0_STORED_BYTES);
          }
          transpose_dwords_8x8(v);
          for (int j = 0; j < 8; ++j)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * R8_Q8_BLOCK_BYTES + 32 * j), v[j]);
        }
        continue;
      }
      for (int64_t o = std::max(g * 8, row0); o < std::min(g * 8 + 8, row0 + r); ++o) {
        const uint8_t* row = src + source(o - row0) * bytes;
        const int64_t lane = o % 8;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* block = row + b * Q8_0_STORED_BYTES;
          for (int j = 0; j < 8; ++j) std::memcpy(out + b * R8_Q8_BLOCK_BYTES + 32 * j + 4 * lane, block + 2 + 4 * j, 4);
          dout[b * 8 + lane] = load_u16(block);
        }
      }
    }
  });
}

template <typename T>
T* rows_of(const std::optional<torch::Tensor>& t, int64_t row0, const char* name, int64_t n) {
  TORCH_CHECK(t.has_value() && t->is_contiguous() && t->dim() >= 1 && t->size(0) == n, "repack: ", name,
              " must be a contiguous array with one row per output");
  return reinterpret_cast<T*>(t->data_ptr()) + row0 * (t->numel() / n);
}

// Block b of one output as q4_1's 16 bytes (`nibbles`) and GGUF's fifth-bit word (`fifth`, bit j: value j;
// none for 4-bit blocks) into its lane of the group's interleaved block: run j = bytes 4j..4j+3 at 32j + 4·lane
// (`out`: the group's block); qh8 (the group's block's 32 bytes): byte 4·lane + k holds at bit j the fifth bit
// of value 4j + k, at bit 4 + j that of value 16 + 4j + k.
inline void scatter_r8_lane(const uint8_t* nibbles, uint8_t* out, int64_t lane, const uint32_t* fifth, uint8_t* qh8) {
  for (int j = 0; j < 4; ++j) std::memcpy(out + 32 * j + 4 * lane, nibbles + 4 * j, 4);
  if (fifth != nullptr)
    for (int k = 0; k < 4; ++k) {
      uint8_t byte = 0;
      for (int j = 0; j < 4; ++j)
        byte |= static_cast<uint8_t>(((*fifth >> (4 * j + k)) & 1u) << j | ((*fifth >> (16 + 4 * j + k)) & 1u) << (4 + j));
      qh8[4 * lane + k] = byte;
    }
}

// Stored Q4_K / Q5_K rows -> q4_k_r8 / q5_k_r8 for outputs [row0, row0 + r) (output o is stored row
// order[o − row0], order null: row o − row0): each row's super-blocks as `repack_k_row` lays them out, then
// into output o's lanes of its group (qs [G, nb, 128], ds / dm fp16 [G, nsb, 8], sc / mq uint8 [G, nb, 8],
// qh8 uint8 [G, nb, 32] for Q5_K).
void repack_k_rows_r8(bool five, const uint8_t* src, int64_t bytes, int64_t nsb, int64_t row0, int64_t r,
                      const int64_t* order, uint8_t* qs, uint16_t* ds, uint16_t* dm, uint8_t* sc, uint8_t* mq, uint8_t* qh8) {
  const int64_t nb = nsb * 8;
  at::parallel_for(0, r, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row_qs(nb * 16), row_sc(nb), row_mq(nb);
    std::vector<uint16_t> row_ds(nsb), row_dm(nsb);
    std::vector<uint32_t> row_qh(five ? nb : 0);
    for (int64_t i = begin; i < end; ++i) {
      repack_k_row(five, src + (order != nullptr ? order[i] : i) * bytes, nsb, row_qs.data(), row_ds.data(),
                   row_dm.data(), row_sc.data(), row_mq.data(), five ? row_qh.data() : nullptr);
      if (five) arrange_high_bits_row(row_qh.data(), nb);  // back to GGUF's words (its own inverse)
      const int64_t o = row0 + i, g = o / 8, lane = o % 8;
      for (int64_t s = 0; s < nsb; ++s) ds[(g * nsb + s) * 8 + lane] = row_ds[s], dm[(g * nsb + s) * 8 + lane] = row_dm[s];
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = g * nb + b;
        scatter_r8_lane(row_qs.data() + b * 16, qs + at * R8_BLOCK_BYTES, lane, five ? &row_qh[b] : nullptr,
                        five ? qh8 + at * 32 : nullptr);
        sc[at * 8 + lane] = row_sc[b], mq[at * 8 + lane] = row_mq[b];
      }
    }
  });
}

// Stored Q6_K rows -> q6_k_r8 for outputs [row0, row0 + r) (order as `repack_k_rows_r8`): per block of 32 the
// values' low 4 bits as q4_1_r8's nibbles (qs [G, nb, 128]), their bits 4-5 in 64 bytes (q2 [G, nb, 64]: byte
// 4·lane + k of the first 32 holds at bits 2j those of value 4j + k, of the next 32 those of 16 + 4j + k), the
// scales of its two 16s (sc int8 [G, nb, 16]: the first 16's for the 8 outputs, then the second's), ds fp16 [G, nsb, 8].
void repack_q6_k_rows_r8(const uint8_t* src, int64_t bytes, int64_t nsb, int64_t row0, int64_t r, const int64_t* order,
                         uint8_t* qs, uint8_t* q2, uint16_t* ds, int8_t* sc) {
  const int64_t nb = nsb * 8;
  at::parallel_for(0, r, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = src + (order != nullptr ? order[i] : i) * bytes;
      const int64_t o = row0 + i, g = o / 8, lane = o % 8;
      for (int64_t s = 0; s < nsb; ++s) {
        const uint8_t* x = row + s * 210;
        uint8_t v[256];
        q6_values(x, v);
        ds[(g * nsb + s) * 8 + lane] = load_u16(x + 208);
        for (int blk = 0; blk < 8; ++blk) {
          const uint8_t* vb = v + 32 * blk;
          const int64_t at = g * nb + s * 8 + blk;
          uint8_t nibbles[16];
          for (int j = 0; j < 16; ++j) nibbles[j] = (vb[j] & 0x0F) | ((vb[j + 16] & 0x0F) << 4);
          scatter_r8_lane(nibbles, qs + at * R8_BLOCK_BYTES, lane, nullptr, nullptr);
          for (int k = 0; k < 4; ++k) {
            uint8_t first = 0, second = 0;
            for (int j = 0; j < 4; ++j)
              first |= ((vb[4 * j + k] >> 4) & 3) << (2 * j), second |= ((vb[16 + 4 * j + k] >> 4) & 3) << (2 * j);
            q2[at * 64 + 4 * lane + k] = first, q2[at * 64 + 32 + 4 * lane + k] = second;
          }
          for (int h = 0; h < 2; ++h) sc[at * 16 + 8 * h + lane] = static_cast<int8_t>(x[192 + 2 * blk + h]);
        }
      }
    }
  });
}

int64_t repack_rows(const std::string& type_name, const torch::Tensor& raw, int64_t row0, const torch::Tensor& qs,
                    const torch::Tensor& d, const std::optional<torch::Tensor>& m,
                    const std::optional<torch::Tensor>& qh, const std::optional<torch::Tensor>& sc,
                    const std::optional<torch::Tensor>& mq, const std::optional<torch::Tensor>& q2,
                    const std::optional<torch::Tensor>& order, int64_t outputs) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == torch::kUInt8 && raw.is_cpu() && raw.stride(1) == 1 &&
                  raw.stride(0) == raw.size(1),
              "repack: stored rows must be a contiguous uint8 CPU matrix");
  if (order.has_value())
    TORCH_CHECK(order->dim() == 1 && order->scalar_type() == torch::kInt64 && order->is_contiguous() && order->is_cpu(),
                "repack: the row order must be a contiguous int64 CPU vector");
  const Stored type = stored_type(type_name);
  // Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / IQ4_NL straight into the interleaved layouts (qs [G, nb, 128] (Q8_0:
  // 256), d fp16 [G, nb, 8]; Q4_0-Q5_1: m plain [N, nb]); `outputs` gives N
  const bool r8 = qs.dim() == 3;
  const bool five = type == Stored::Q5_0 || type == Stored::Q5_1;
  const bool signed8 = type == Stored::Q8_0 || type == Stored::IQ4_NL;  // (interleaved only)
  // Q4_K / Q5_K into q4_k_r8 / q5_k_r8: d / m the super-blocks' ds / dm [G, K/256, 8], sc / mq [G, K/32, 8]
  const bool k_r8 = r8 && (type == Stored::Q4_K || type == Stored::Q5_K);
  const bool q6_r8 = r8 && type == Stored::Q6_K;  // q2 the bits 4-5 [G, K/32, 64], sc int8 [G, K/32, 16]
  TORCH_CHECK(!r8 || signed8 || k_r8 || q6_r8 || ((type == Stored::Q4_0 || type == Stored::Q4_1 || five) && m.has_value() && m->dim() == 2),
              "repack: only Q4_0 / Q4_1 / Q5_0 / Q5_1 (with their minima m [N, K/32]), Q8_0, IQ4_NL, Q4_K, Q5_K and Q6_K "
              "blocks repack interleaved");
  TORCH_CHECK(r8 || type != Stored::Q8_0, "repack: Q8_0 blocks repack interleaved only");
  TORCH_CHECK(!r8 || outputs >= 0, "repack: interleaved blocks need the output count");
  if ((r8 ? outputs : qs.size(0)) == 0) {
    TORCH_CHECK((order.has_value() ? order->size(0) : raw.size(0)) == 0, "repack: rows given for 0 outputs");
    return 0;
  }
  const int64_t n = r8 ? outputs : qs.size(0), r = order.has_value() ? order->size(0) : raw.size(0), bytes = raw.size(1);
  TORCH_CHECK(!r8 || k_r8 || !m.has_value() || m->size(0) == n, "repack: m has ", m.has_value() ? m->size(0) : 0,
              " rows for ", n, " outputs");
  const int64_t* order_p = order.has_value() ? order->data_ptr<int64_t>() : nullptr;
  for (int64_t i = 0; order_p != nullptr && i < r; ++i)
    TORCH_CHECK(order_p[i] >= 0 && order_p[i] < raw.size(0), "repack: row order entry ", order_p[i], " outside the ",
                raw.size(0), " stored rows");
  TORCH_CHECK(row0 >= 0 && row0 + r <= n, "repack: rows ", row0, "..", row0 + r, " past the ", n, " outputs");
  static constexpr int64_t kBlockBytes[] = {18, 20, 22, 24, Q8_0_STORED_BYTES, 144, 176, 210, 110, 84, 18, 136, 0};
  const int64_t block_bytes = kBlockBytes[static_cast<int>(type)];
  TORCH_CHECK(block_bytes > 0, "repack: no block-kernel layout for GGUF type ", type_name);
  TORCH_CHECK(bytes % block_bytes == 0, "repack: a row of ", bytes, " bytes is not whole ", type_name, " blocks");
  const bool legacy = block_bytes <= 24, q6 = type == Stored::Q6_K;
  const bool q3 = type == Stored::Q3_K, q2k = type == Stored::Q2_K, xs = type == Stored::IQ4_XS;
  const int64_t blocks = bytes / block_bytes;  // per row: blocks of 32 (legacy) or super-blocks of 256
  const int64_t nb = legacy || type == Stored::Q8_0 ? blocks : blocks * 8;  // blocks of 32 per row
  const std::optional<torch::Tensor> qs_opt = qs, d_opt = d;
  const int64_t groups = (n + 7) / 8;
  // an interleaved array of the K layouts: [G, rows, width] of dtype
  const auto is = [&](const std::optional<torch::Tensor>& t, torch::ScalarType dtype, int64_t rows, int64_t width) {
    return t.has_value() && t->is_cpu() && t->is_contiguous() && t->scalar_type() == dtype && t->dim() == 3 &&
           t->size(0) == groups && t->size(1) == rows && t->size(2) == width;
  };
  if (k_r8) {
    const bool q5k = type == Stored::Q5_K;
    TORCH_CHECK(qs.is_cpu() && qs.is_contiguous() && qs.scalar_type() == torch::kUInt8 && qs.size(0) == groups &&
                    qs.size(1) == nb && qs.size(2) == R8_BLOCK_BYTES && is(d_opt, torch::kFloat16, blocks, 8) &&
                    is(m, torch::kFloat16, blocks, 8) && is(sc, torch::kUInt8, nb, 8) && is(mq, torch::kUInt8, nb, 8) &&
                    (!q5k || is(qh, torch::kUInt8, nb, 32)),
                "repack: interleaved ", type_name, " needs qs uint8 [", groups, ", ", nb, ", 128], d and m float16 [", groups,
                ", ", blocks, ", 8], sc and mq uint8 [", groups, ", ", nb, ", 8]", q5k ? " and qh uint8 [G, nb, 32]" : "");
    repack_k_rows_r8(q5k, raw.data_ptr<uint8_t>(), bytes, blocks, row0, r, order_p, qs.data_ptr<uint8_t>(),
                     reinterpret_cast<uint16_t*>(d.data_ptr()), reinterpret_cast<uint16_t*>(m->data_ptr()),
                     sc->data_ptr<uint8_t>(), mq->data_ptr<uint8_t>(), q5k ? qh->data_ptr<uint8_t>() : nullptr);
    return 0;
  }
  if (q6_r8) {
    TORCH_CHECK(is(qs_opt, torch::kUInt8, nb, R8_BLOCK_BYTES) && is(d_opt, torch::kFloat16, blocks, 8) &&
                    is(q2, torch::kUInt8, nb, 64) && is(sc, torch::kInt8, nb, 16),
                "repack: interleaved Q6_K needs qs uint8 [", groups, ", ", nb, ", 128], d float16 [", groups, ", ", blocks,
                ", 8], q2 uint8 [", groups, ", ", nb, ", 64] and sc int8 [", groups, ", ", nb, ", 16]");
    repack_q6_k_rows_r8(raw.data_ptr<uint8_t>(), bytes, blocks, row0, r, order_p, qs.data_ptr<uint8_t>(),
                        q2->data_ptr<uint8_t>(), reinterpret_cast<uint16_t*>(d.data_ptr()), sc->data_ptr<int8_t>());
    return 0;
  }
  const int64_t group_block_bytes = type == Stored::Q8_0 ? R8_Q8_BLOCK_BYTES : R8_BLOCK_BYTES;
  if (r8)
    TORCH_CHECK(qs.is_cpu() && d.is_cpu() && qs.is_contiguous() && qs.element_size() == 1 && qs.size(0) == groups && qs.size(1) == nb &&
                    qs.size(2) == group_block_bytes && d.is_contiguous() && d.scalar_type() == torch::kFloat16 &&
                    d.dim() == 3 && d.size(0) == groups && d.size(1) == nb && d.size(2) == 8,
                "repack: interleaved qs / d must be contiguous [", groups, ", ", nb, ", ", group_block_bytes,
                "] 1-byte / [", groups, ", ", nb, ", 8] float16");
  uint8_t* qs_p = r8 ? static_cast<uint8_t*>(qs.data_ptr()) : rows_of<uint8_t>(qs_opt, row0, "qs", n);
  uint16_t* d_p = r8 ? reinterpret_cast<uint16_t*>(d.data_ptr()) : rows_of<uint16_t>(d_opt, row0, "d", n);
  uint16_t* m_p = m.has_value() ? rows_of<uint16_t>(m, row0, "m", n) : nullptr;
  // interleaved fifth bits: uint8 [G, nb, 32] (`tile_r8`), zero where 4-bit parts share the run
  if (r8 && qh.has_value())
    TORCH_CHECK(qh->dim() == 3 && qh->scalar_type() == torch::kUInt8 && qh->is_contiguous() && qh->size(0) == groups &&
                    qh->size(1) == nb && qh->size(2) == 32,
                "repack: interleaved qh must be contiguous uint8 [", groups, ", ", nb, ", 32]");
  TORCH_CHECK(!(r8 && five) || qh.has_value(), "repack: ", type_name, " needs qh");
  uint8_t* qh8_p = r8 && qh.has_value() ? qh->data_ptr<uint8_t>() : nullptr;
  uint32_t* qh_p = qh.has_value() && !r8 ? rows_of<uint32_t>(qh, row0, "qh", n) : nullptr;
  TORCH_CHECK(r8 || qs.numel() / n == (q3 || q2k ? nb * 8 : nb * 16), "repack: qs has the wrong width");
  TORCH_CHECK(r8 || d.numel() / n == (q2k ? 2 * blocks : blocks), "repack: d has the wrong width");
  TORCH_CHECK(m_p != nullptr || q6 || q3 || q2k || xs || signed8, "repack: ", type_name, " needs m");
  TORCH_CHECK(qh_p != nullptr || qh8_p != nullptr || !(type == Stored::Q5_0 || type == Stored::Q5_1 || type == Stored::Q5_K),
              "repack: ", type_name, " needs qh");
  TORCH_CHECK(m_p == nullptr || m->numel() / n == blocks, "repack: m has the wrong width");
  TORCH_CHECK(qh_p == nullptr || qh->numel() / n == nb, "repack: qh has the wrong width");
  uint8_t *sc_p = nullptr, *mq_p = nullptr, *q2_p = nullptr;
  if (type == Stored::Q4_K || type == Stored::Q5_K) {
    sc_p = rows_of<uint8_t>(sc, row0, "sc", n), mq_p = rows_of<uint8_t>(mq, row0, "mq", n);
    TORCH_CHECK(sc->numel() / n == nb && mq->numel() / n == nb, "repack: sc / mq have the wrong width");
  } else if (q6) {
    sc_p = rows_of<uint8_t>(sc, row0, "sc", n), q2_p = rows_of<uint8_t>(q2, row0, "q2", n);
    TORCH_CHECK(sc->numel() / n == blocks * 16 && q2->numel() / n == nb * 8, "repack: sc / q2 have the wrong width");
  } else if (xs) {
    sc_p = rows_of<uint8_t>(sc, row0, "sc", n);
    TORCH_CHECK(sc->numel() / n == nb, "repack: sc has the wrong width");
  } else if (q3 || q2k) {
    sc_p = rows_of<uint8_t>(sc, row0, "sc", n);
    TORCH_CHECK(sc->numel() / n == blocks * 16, "repack: sc has the wrong width");
    if (q3) {
      q2_p = rows_of<uint8_t>(q2, row0, "q2 (third-bit masks)", n);
      TORCH_CHECK(q2->numel() / n == blocks * 32, "repack: q2 has the wrong width");
    }
  }
  const uint8_t* src = raw.data_ptr<uint8_t>();
  if (r8 && type == Stored::Q8_0) {
    repack_q8_0_r8(src, bytes, nb, row0, r, order_p, qs_p, d_p);
    return 0;
  }
  std::atomic<int64_t> bad{0};
  at::parallel_for(0, r, 64, [&](int64_t begin, int64_t end) {
    int64_t local = 0;
    for (int64_t i = begin; i < end; ++i) {
      const uint8_t* row = src + (order_p != nullptr ? order_p[i] : i) * bytes;
      if (r8) {  // the row's blocks as q4_1 rows are laid out, then into output o's lanes of its group
        thread_local std::vector<uint8_t> row_qs;
        thread_local std::vector<uint16_t> row_d;
        thread_local std::vector<uint32_t> row_qh;
        row_qs.resize(nb * 16), row_d.resize(nb), row_qh.resize(five ? nb : 0);
        local += repack_legacy_row(type, row, nb, row_qs.data(), row_d.data(), m_p != nullptr ? m_p + i * nb : nullptr,
                                   five ? row_qh.data() : nullptr);
        if (five) arrange_high_bits_row(row_qh.data(), nb);  // back to GGUF's words (its own inverse)
        const int64_t o = row0 + i, g = o / 8, lane = o % 8;
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t at = g * nb + b;
          scatter_r8_lane(row_qs.data() + b * 16, qs_p + at * R8_BLOCK_BYTES, lane, five ? &row_qh[b] : nullptr,
                          five ? qh8_p + at * 32 : nullptr);
          d_p[at * 8 + lane] = row_d[b];
        }
      } else if (legacy) {
        local += repack_legacy_row(type, row, nb, qs_p + i * nb * 16, d_p + i * nb,
                                   m_p ? m_p + i * nb : nullptr, qh_p ? qh_p + i * nb : nullptr);
      } else if (q6) {
        repack_q6_k_row(row, blocks, qs_p + i * nb * 16, q2_p + i * nb * 8, d_p + i * blocks,
                        reinterpret_cast<int8_t*>(sc_p) + i * blocks * 16);
      } else if (q3) {
        repack_q3_k_row(row, blocks, qs_p + i * nb * 8, q2_p + i * blocks * 32, d_p + i * blocks,
                        reinterpret_cast<int8_t*>(sc_p) + i * blocks * 16);
      } else if (q2k) {
        repack_q2_k_row(row, blocks, qs_p + i * nb * 8, d_p + i * 2 * blocks, sc_p + i * blocks * 16);
      } else if (xs) {
        repack_iq4_xs_row(row, blocks, qs_p + i * nb * 16, d_p + i * blocks, reinterpret_cast<int8_t*>(sc_p) + i * nb);
      } else {
        repack_k_row(type == Stored::Q5_K, row, blocks, qs_p + i * nb * 16, d_p + i * blocks, m_p + i * blocks,
                     sc_p + i * nb, mq_p + i * nb, qh_p ? qh_p + i * nb : nullptr);
      }
    }
    bad += local;
  });
  return bad.load();
}

// 16 float32 lanes, each an FMA chain over k ≡ lane (mod 16) in k order, summed as `hsum` of the two
// halves' sum: one 512-bit vector in the VNNI build, two 256-bit ones (lanes 0-7, 8-15) in the AVX2
// build (the same chains, so the same bits in both builds). The float products whose results must not
// depend on the rows beside them (`dense_tile`, `half_tile`) use this order. (Raw vector arrays, not a
// struct around them: GCC kept an array of such structs in memory, storing every chain each step.)
#if FORKLM_VNNI
using Chain = __m512;
constexpr int CHAIN_PARTS = 1;  // vectors a 16-lane chain
inline Chain chain_zero() { return _mm512_setzero_ps(); }
inline Chain chain_load(const float* p) { return _mm512_loadu_ps(p); }
template <bool BF16>
inline Chain chain_widen(const uint16_t* p) {  // 16 bfloat16 / float16 values widened exactly
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}
inline Chain chain_fma(Chain a, Chain b, Chain c) { return _mm512_fmadd_ps(a, b, c); }
inline float chain_sum(const Chain* c) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(c[0]), 1));  // (AVX512F, not DQ)
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(c[0]), hi));
}
#else
using Chain = __m256;
constexpr int CHAIN_PARTS = 2;
inline Chain chain_zero() { return _mm256_setzero_ps(); }
inline Chain chain_load(const float* p) { return _mm256_loadu_ps(p); }
template <bool BF16>
inline Chain chain_widen(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}
inline Chain chain_fma(Chain a, Chain b, Chain c) { return _mm256_fmadd_ps(a, b, c); }
inline float chain_sum(const Chain* c) { return hsum(_mm256_add_ps(c[0], c[1])); }
#endif
constexpr int CHAIN_STEP = 16 / CHAIN_PARTS;  // lanes a vector

// Dense float32 products whose every output is one dot product in a fixed order (`Chain`s over K
// ascending, their sum, then the tail in order), whatever the number of rows or the tile a row shares:
// y[t, b, n] = Σ_k x[t, b, k] · w[b, n, k]. PyTorch's float32 products pick other kernels for few
// rows (a row's result then depends on how many rows there are); the small float products around
// quantized ones (a router, DeepSeek's W_UK / W_UV) run here so that a sample never depends on n.
template <int R>
void dense_tile(const float* x, int64_t x_row, const float* w, int64_t K, int64_t n0, int64_t n1, float* y,
                int64_t y_row) {
  constexpr int P = CHAIN_PARTS;
  const int64_t K16 = K / 16 * 16;
  for (int64_t n = n0; n < n1; ++n) {
    const float* wn = w + n * K;
    Chain acc[R][P];
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < P; ++h) acc[r][h] = chain_zero();
    for (int64_t k = 0; k < K16; k += 16)
      for (int h = 0; h < P; ++h) {
        const Chain wv = chain_load(wn + k + h * CHAIN_STEP);
        for (int r = 0; r < R; ++r) acc[r][h] = chain_fma(chain_load(x + r * x_row + k + h * CHAIN_STEP), wv, acc[r][h]);
      }
    for (int r = 0; r < R; ++r) {
      float s = chain_sum(acc[r]);
      for (int64_t k = K16; k < K; ++k) s = std::fma(x[r * x_row + k], wn[k], s);
      y[r * y_row + n] = s;
    }
  }
}

torch::Tensor dense_rows(const torch::Tensor& x_in, const torch::Tensor& w_in) {
  const torch::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.is_cpu(), "x must be float32 CPU [T, B, K]");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat32 && w.is_cpu() && w.size(0) == x.size(1) &&
                  w.size(2) == x.size(2),
              "w must be float32 CPU [B, N, K] matching x [T, B, K], got ", w.sizes(), " and ", x.sizes());
  const int64_t T = x.size(0), B = x.size(1), K = x.size(2), N = w.size(1);
  torch::Tensor y = torch::empty({T, B, N}, torch::kFloat32);
  if (T == 0 || B == 0 || N == 0) return y;
  constexpr int64_t CHUNK = 16;  // outputs whose weights stay in cache while every row passes them
  const int64_t chunks = (N + CHUNK - 1) / CHUNK;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, B * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / chunks, n0 = (i % chunks) * CHUNK, n1 = std::min(N, n0 + CHUNK);
      const float* wb = wp + b * N * K;
      int64_t t = 0;
      for (; t + 4 <= T; t += 4)
        dense_tile<4>(xp + (t * B + b) * K, B * K, wb, K, n0, n1, yp + (t * B + b) * N, B * N);
      for (; t < T; ++t) dense_tile<1>(xp + (t * B + b) * K, B * K, wb, K, n0, n1, yp + (t * B + b) * N, B * N);
    }
  });
  return y;
}

// Float weights kept as stored, 16 bits a value (GGUF / Hugging Face bfloat16 or float16 matrices),
// times float32 activations in float32: each value widened exactly (bfloat16: its bits shifted up;
// float16: F16C), then `dense_tile`'s order (`Chain`: 16 FMA chains over k, their sum, the tail
// after); so a row's result depends on that row alone and equals `dense_rows` on the widened weights
// bit for bit, in both builds. TO outputs × R rows a tile (the chains side by side: a lone row runs 8
// outputs at once, enough chains to hide the FMA latency).
template <bool BF16>
inline float widen1(uint16_t h) {
  if constexpr (BF16) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return _cvtsh_ss(h);
  }
}

// Where a half matrix's row n starts: the rows of one matrix [N, K], or a table of each row's address
// (int64 [N]: the parts of a fused q/k/v or gate/up, each where the file maps it, rows in any order).
struct HalfRows {
  const uint16_t* base;
  const int64_t* table;  // null: row n at base + n·K
  int64_t K;
  const uint16_t* operator()(int64_t n) const {
    return table != nullptr ? reinterpret_cast<const uint16_t*>(table[n]) : base + n * K;
  }
};

// `ahead`: the first output of the tile that runs next on this thread and how many of its outputs to
// prefetch (0: none); their rows' bytes are prefetched a line at a time as this tile's are read (the
// rows of a wide LM head stream from memory at twice the rate then).
template <bool BF16, int R, int TO>
inline void half_tile(const float* x, int64_t K, const HalfRows& w, int64_t n, float* y, int64_t N, const float* res,
                      int64_t ahead, int64_t ahead_outs) {
  constexpr int P = CHAIN_PARTS;
  const int64_t K16 = K / 16 * 16;
  const uint16_t* wn[TO];
  for (int o = 0; o < TO; ++o) wn[o] = w(n + o);
  Chain acc[R][TO][P];
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < TO; ++o)
      for (int h = 0; h < P; ++h) acc[r][o][h] = chain_zero();
  const char* pf[TO];
  const int pfs = static_cast<int>(std::min<int64_t>(ahead_outs, TO));
  for (int o = 0; o < pfs; ++o) pf[o] = reinterpret_cast<const char*>(w(ahead + o));
  for (int64_t k = 0; k < K16; k += 16) {
    if ((k & 31) == 0)  // a line (32 values) of each next row per 32 values of this tile's
      for (int o = 0; o < pfs; ++o) _mm_prefetch(pf[o] + k * 2, half_weight_prefetch(R));
    for (int h = 0; h < P; ++h) {
      Chain xv[R];
      for (int r = 0; r < R; ++r) xv[r] = chain_load(x + r * K + k + h * CHAIN_STEP);
      for (int o = 0; o < TO; ++o) {
        const Chain wv = chain_widen<BF16>(wn[o] + k + h * CHAIN_STEP);
        for (int r = 0; r < R; ++r) acc[r][o][h] = chain_fma(xv[r], wv, acc[r][o][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int o = 0; o < TO; ++o) {
      float s = chain_sum(acc[r][o]);
      for (int64_t k = K16; k < K; ++k) s = std::fma(x[r * K + k], widen1<BF16>(wn[o][k]), s);
      float* yo = y + r * N + n + o;
      *yo = res != nullptr ? res[r * N + n + o] + s : s;  // residual + x·Wᵀ, one rounding
    }
}

// ------------------------------------------------------------------------------- AMX-BF16 tiles
// On CPUs with AMX-BF16 (Intel Sapphire Rapids and later) the VNNI build runs bfloat16 products
// (`gemm_half<true>`, K a multiple of 32) on the tile unit at every row count, so a row's bits never
// depend on how many rows share the product. Each activation is split exactly into three bfloat16
// parts, x = h + m + l (h = x rounded to bfloat16, m = the rest rounded, l = what remains: 8 + 8 + 8
// bits cover float32's 24), and tdpbf16ps adds w·h, then w·m, then w·l a block of 32 at a time into a
// float32 sum (bfloat16 products are exact in float32): a float32-class dot product of the stored weights
// with the float32 activations (tested against float64), in another order than the vector chains, so
// other last bits than `half_tile`'s. A tile is 16 outputs (A: 16 stored weight rows x 32 values, read
// where they lie at the matrix's stride) x up to 16 rows (B: the rows' parts in pairs, packed per call);
// where 16 rows of a table are not evenly spaced, or past N, they are copied to a scratch first.
// FORKLM_BLOCK_KERNEL_AMX=0 (`set_amx`) turns these tiles off as well as the integer ones.
#if FORKLM_AMX
#define FORKLM_AMX_BF16_TARGET __attribute__((target("amx-tile,amx-bf16")))

bool amx_bf16_supported() {  // AMX-TILE and AMX-BF16, the tile data granted
  static const bool ok = amx_feature_granted(22);
  return ok;
}
bool amx_bf16_on() { return amx_on() && amx_bf16_supported(); }

constexpr int BF16_PARTS = 3;  // h, m, l

// 16 float32 lanes rounded to bfloat16, to nearest even (finite values)
inline __m256i bf16_round(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16));
}
inline __m512 bf16_widen16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Rows x [T, K] as B tiles: per block of rows (16, the last T % 16), block of 32 values kt and part s,
// a tile of 16 pair-rows, pair-row p holding each row j's values 2p and 2p + 1 at 4j bytes (w·4 bytes a
// pair-row for a block of w rows). Block mb starts at mb · KT · 3 · 512 values (full blocks first).
void amx_bf16_pack(const float* x, int64_t T, int64_t K, uint16_t* out) {
  const int64_t KT = K / 32, blocks = (T + 15) / 16;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t mb = b0; mb < b1; ++mb) {
      const int64_t m0 = mb * 16, w = std::min<int64_t>(16, T - m0);
      uint32_t* blk = reinterpret_cast<uint32_t*>(out + mb * KT * BF16_PARTS * 512);
      for (int64_t j = 0; j < w; ++j) {
        const float* xr = x + (m0 + j) * K;
        for (int64_t kt = 0; kt < KT; ++kt) {
          alignas(64) uint16_t parts[BF16_PARTS][32];
          for (int half = 0; half < 2; ++half) {
            const __m512 v = _mm512_loadu_ps(xr + kt * 32 + half * 16);
            const __m256i h = bf16_round(v);
            const __m512 r = _mm512_sub_ps(v, bf16_widen16(h));  // exact
            const __m256i m = bf16_round(r);
            const __m256i l = bf16_round(_mm512_sub_ps(r, bf16_widen16(m)));  // exact: at most 8 bits left
            _mm256_store_si256(reinterpret_cast<__m256i*>(parts[0] + half * 16), h);
            _mm256_store_si256(reinterpret_cast<__m256i*>(parts[1] + half * 16), m);
            _mm256_store_si256(reinterpret_cast<__m256i*>(parts[2] + half * 16), l);
          }
          for (int s = 0; s < BF16_PARTS; ++s) {
            uint32_t* tile = blk + (kt * BF16_PARTS + s) * 16 * w;  // 16 pair-rows of w words
            const uint32_t* pairs = reinterpret_cast<const uint32_t*>(parts[s]);
            for (int p = 0; p < 16; ++p) tile[p * w + j] = pairs[p];
          }
        }
      }
    }
  });
}

// tmm0-3: C (outputs n-block x row block: 00, 01, 10, 11), 16 x w float32; tmm4 / tmm5: A, 16 weight rows
// x 32 values; tmm6 / tmm7: B, 16 pair-rows x w rows.
FORKLM_AMX_BF16_TARGET void amx_bf16_release() { _tile_release(); }
FORKLM_AMX_BF16_TARGET void amx_bf16_configure(int64_t w) {
  TileConfig c;
  for (int i = 0; i < 4; ++i) c.rows[i] = 16, c.colsb[i] = static_cast<uint16_t>(4 * w);
  c.rows[4] = c.rows[5] = 16, c.colsb[4] = c.colsb[5] = 64;
  c.rows[6] = c.rows[7] = 16, c.colsb[6] = c.colsb[7] = static_cast<uint16_t>(4 * w);
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// NB output blocks of 16 (A rows at a[i], a_stride bytes apart) times MB row blocks (b[i], w rows each):
// the sums over K into c[(i·MB + j)·256] (16 x 16 floats, w columns written).
// Blocks of 32 values kt0..kt1 of K; resume: the sums so far from c (a slice of K after another), else zero.
template <int NB, int MB>
FORKLM_AMX_BF16_TARGET void amx_bf16_tiles(const uint16_t* const* a, int64_t a_stride, const uint16_t* const* b,
                                           int64_t w, int64_t kt0, int64_t kt1, float* c, bool resume) {
  if (resume) {  // (float32 sums stored and loaded exactly: the same bits as one pass over K)
    _tile_loadd(0, c, 64);
    if constexpr (MB == 2) _tile_loadd(1, c + 256, 64);
    if constexpr (NB == 2) _tile_loadd(2, c + MB * 256, 64);
    if constexpr (NB == 2 && MB == 2) _tile_loadd(3, c + 3 * 256, 64);
  } else {
    _tile_zero(0);
    if constexpr (MB == 2) _tile_zero(1);
    if constexpr (NB == 2) _tile_zero(2);
    if constexpr (NB == 2 && MB == 2) _tile_zero(3);
  }
  const int64_t bt = 16 * 2 * w, bstride = 4 * w;  // a B tile's values, its pair-rows' bytes
  for (int64_t kt = kt0; kt < kt1; ++kt) {
    _tile_loadd(4, a[0] + kt * 32, a_stride);
    if constexpr (NB == 2) _tile_loadd(5, a[1] + kt * 32, a_stride);
    for (int s = 0; s < BF16_PARTS; ++s) {
      const int64_t off = (kt * BF16_PARTS + s) * bt;
      _tile_loadd(6, b[0] + off, bstride);
      if constexpr (MB == 2) _tile_loadd(7, b[1] + off, bstride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (MB == 2) _tile_dpbf16ps(1, 4, 7);
      if constexpr (NB == 2) _tile_dpbf16ps(2, 5, 6);
      if constexpr (NB == 2 && MB == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (MB == 2) _tile_stored(1, c + 256, 64);
  if constexpr (NB == 2) _tile_stored(2, c + MB * 256, 64);
  if constexpr (NB == 2 && MB == 2) _tile_stored(3, c + 3 * 256, 64);
}

// y [T, N] (+ residual) = rows xp [T, K] (after the prologue) times the bfloat16 rows w [N, K] transposed.
void amx_bf16_gemm(const float* xp, int64_t T, int64_t K, const HalfRows& w, int64_t N, float* y, const float* res) {
  const int64_t KT = K / 32, full = T / 16, tail = T % 16, blocks = full + (tail ? 1 : 0);
  thread_local std::vector<uint16_t> packed_buf;  // (the calling thread's; read by every worker)
  packed_buf.resize(blocks * KT * BF16_PARTS * 512);
  uint16_t* packed = packed_buf.data();
  amx_bf16_pack(xp, T, K, packed);
  const int64_t nblk = (N + 15) / 16;
  // threads split the outputs in chunks of 16-output blocks whose weights stay in L2 while every block
  // of rows passes them (~512 KB), at least 4 chunks a thread where there are outputs enough
  // K past 2,048 values runs in slices (the sums carried in float32 between them): a block pair of rows'
  // parts and the chunk's weights then stay in L2 together
  const int64_t KS = std::min<int64_t>(KT, 64), slices = (KT + KS - 1) / KS;
  int64_t chunk = std::max<int64_t>(2, (512 << 10) / (16 * KS * 32 * 2)) / 2 * 2;
  const int64_t want = 4 * at::get_num_threads();
  while (chunk > 2 && (nblk + chunk - 1) / chunk < want) chunk -= 2;
  const int64_t chunks = (nblk + chunk - 1) / chunk;
  const int64_t row_bytes = K * 2;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    thread_local std::vector<uint16_t> scratch;  // a chunk's blocks whose 16 rows are not evenly spaced, copied
    thread_local std::vector<const uint16_t*> a;  // the chunk's blocks' first rows
    a.resize(chunk);
    thread_local std::vector<float> sums;  // a sliced K's float32 sums: per pair of output blocks and block of rows
    alignas(64) float cbuf[4 * 256];
    int64_t configured = -1;
    const auto configure = [&](int64_t w) {
      if (configured != w) amx_bf16_configure(w), configured = w;
    };
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t nb0 = c * chunk, nb1 = std::min(nblk, nb0 + chunk);
      int64_t copies = 0;
      for (int64_t nb = nb0; nb < nb1; ++nb) {  // block nb's 16 rows: where they lie, else a copy
        const int64_t n0 = nb * 16, rows = std::min<int64_t>(16, N - n0);
        const uint16_t* first = w(n0);
        bool even = rows == 16;
        for (int64_t r = 1; even && r < 16; ++r) even = w(n0 + r) == first + r * K;
        if (even) {
          a[nb - nb0] = first;
          continue;
        }
        if (scratch.size() < static_cast<size_t>((copies + 1) * 16 * K)) scratch.resize((copies + 1) * 16 * K);
        uint16_t* s = scratch.data() + copies * 16 * K;
        for (int64_t r = 0; r < 16; ++r) {
          if (r < rows) std::memcpy(s + r * K, w(n0 + r), row_bytes);
          else std::memset(s + r * K, 0, row_bytes);
        }
        a[nb - nb0] = nullptr;  // resolved below
        copies++;
      }
      for (int64_t nb = nb0, copy = 0; nb < nb1; ++nb)  // (scratch may have moved while it grew)
        if (a[nb - nb0] == nullptr) a[nb - nb0] = scratch.data() + (copy++) * 16 * K;
      if (slices > 1) sums.resize(((nb1 - nb0 + 1) / 2) * blocks * 1024);
      for (int64_t ks = 0; ks < KT; ks += KS) {
        const int64_t kt1 = std::min(KT, ks + KS);
        const bool resume = ks > 0, last = kt1 == KT;
        // every block of rows (two at a time) past the chunk's outputs (two blocks at a time), whose weights
        // stay in cache from the first block of rows on
        for (int64_t mb = 0; mb < blocks;) {
          const int64_t wdt = mb < full ? 16 : tail;
          const int MBS = mb + 1 < full ? 2 : 1;  // two full blocks at once; the tail alone
          configure(wdt);
          const uint16_t* b[2] = {packed + mb * KT * BF16_PARTS * 512, packed + (mb + 1) * KT * BF16_PARTS * 512};
          for (int64_t nb = nb0; nb < nb1;) {
            const int NBS = nb + 1 < nb1 ? 2 : 1;
            const uint16_t* const* an = a.data() + (nb - nb0);
            float* cs = slices > 1 ? sums.data() + (((nb - nb0) / 2) * blocks + mb) * 1024 : cbuf;
            if (NBS == 2 && MBS == 2) amx_bf16_tiles<2, 2>(an, row_bytes, b, wdt, ks, kt1, cs, resume);
            else if (NBS == 2) amx_bf16_tiles<2, 1>(an, row_bytes, b, wdt, ks, kt1, cs, resume);
            else if (MBS == 2) amx_bf16_tiles<1, 2>(an, row_bytes, b, wdt, ks, kt1, cs, resume);
            else amx_bf16_tiles<1, 1>(an, row_bytes, b, wdt, ks, kt1, cs, resume);
            for (int i = 0; i < NBS && last; ++i) {
              const int64_t n0 = (nb + i) * 16, rows = std::min<int64_t>(16, N - n0);
              for (int j = 0; j < MBS; ++j) {
                const float* cc = cs + (i * MBS + j) * 256;
                for (int64_t t = 0; t < wdt; ++t) {
                  const int64_t row = (mb + j) * 16 + t;
                  float* yo = y + row * N + n0;
                  const float* ro = res != nullptr ? res + row * N + n0 : nullptr;
                  for (int64_t o = 0; o < rows; ++o) yo[o] = ro != nullptr ? ro[o] + cc[o * 16 + t] : cc[o * 16 + t];
                }
              }
            }
            nb += NBS;
          }
          mb += MBS;
        }
      }
    }
    if (configured >= 0) amx_bf16_release();
    if (scratch.capacity() > (size_t{4} << 20)) std::vector<uint16_t>().swap(scratch);
    if (sums.capacity() > (size_t{1} << 20)) std::vector<float>().swap(sums);
  });
  if (packed_buf.capacity() > (size_t{8} << 20)) std::vector<uint16_t>().swap(packed_buf);
}
#else
bool amx_bf16_supported() { return false; }
bool amx_bf16_on() { return false; }
#endif

// y [T, N] = prologue(x) [T, K] times w [N, K] (bfloat16 / float16 as stored) transposed, + residual.
template <bool BF16>
torch::Tensor gemm_half(const torch::Tensor& x_in, const torch::Tensor& w_in, int64_t mode_in,
                        const std::optional<torch::Tensor>& norm_weight, double eps,
                        const std::optional<torch::Tensor>& residual) {
  const ProductInput in = product_input(x_in, mode_in, norm_weight);
  const int64_t T = in.T, K = in.K;
  const auto want = BF16 ? torch::kBFloat16 : torch::kFloat16;
  const bool table = w_in.dim() == 1 && w_in.scalar_type() == torch::kInt64;
  TORCH_CHECK(w_in.is_cpu() && (table || (w_in.dim() == 2 && w_in.scalar_type() == want && w_in.size(1) == K)),
              BF16 ? "bfloat16" : "float16", " weights must be a CPU matrix [N, ", K,
              "] or an int64 table [N] of its rows' addresses, got ", w_in.scalar_type(), " ", w_in.sizes());
  const torch::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0);
  const HalfRows wr{table ? nullptr : reinterpret_cast<const uint16_t*>(w.data_ptr()),
                    table ? w.data_ptr<int64_t>() : nullptr, K};
  const torch::Tensor res = checked_residual(residual, T, N);
  torch::Tensor y = torch::empty({T, N}, torch::kFloat32);
  if (T == 0 || N == 0) return y;
  // the rows after the prologue (RMSNorm / SwiGLU, `prologue_row`), else x itself
  thread_local std::vector<float> rows_buf;
  const float* xp = in.x.data_ptr<float>();
  if (in.mode != PLAIN) {
    rows_buf.resize(T * K);
    float* rows = rows_buf.data();  // (the calling thread's buffer: thread_local names another in the workers)
    const int64_t stride = in.x.size(1);
    const float* src = xp;
    at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        prologue_row(src + t * stride, K, in.mode, in.norm_data(), static_cast<float>(eps), rows + t * K);
    });
    xp = rows;
  }
  float* yp = y.data_ptr<float>();
  const float* rp = res.defined() ? res.data_ptr<float>() : nullptr;
#if FORKLM_AMX
  if (BF16 && K % 32 == 0 && amx_bf16_on()) {  // a rule of the CPU and the shape, never of T
    amx_bf16_gemm(xp, T, K, wr, N, yp, rp);
    if (rows_buf.capacity() > (size_t{8} << 20)) std::vector<float>().swap(rows_buf);
    return y;
  }
#endif
  // threads split the outputs in chunks whose weights stay in cache while every tile of rows passes them
  constexpr int64_t CHUNK = 64;
  const int64_t chunks = (N + CHUNK - 1) / CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * CHUNK, n1 = std::min(N, n0 + CHUNK);
      const auto rows = [&](auto r_const, int64_t t) {
        constexpr int R = decltype(r_const)::value;
#if FORKLM_VNNI  // 32 vector registers: 16 chains of 4 rows x 4 outputs, one register each
        constexpr int TO = R == 1 ? 8 : R == 2 ? 6 : 4;
#else  // 16 vector registers, two a chain
        constexpr int TO = R == 1 ? 4 : R == 2 ? 2 : 1;
#endif
        const float* xr = xp + t * K;
        float* yr = yp + t * N;
        const float* rr = rp != nullptr ? rp + t * N : nullptr;
        int64_t n = n0;
        // the next tile's weights prefetched where they come from memory (this chunk's first pass of rows;
        // later rows find them in cache), up to the end of this thread's outputs
        const int64_t n_end = t == 0 ? std::min(N, c1 * CHUNK) : 0;
        const auto live = [&](int64_t next, int64_t outs) { return std::max<int64_t>(0, std::min(outs, n_end - next)); };
        for (; n + TO <= n1; n += TO) half_tile<BF16, R, TO>(xr, K, wr, n, yr, N, rr, n + TO, live(n + TO, TO));
        for (; n < n1; ++n) half_tile<BF16, R, 1>(xr, K, wr, n, yr, N, rr, n + 1, live(n + 1, 1));
      };
      int64_t t = 0;
      for (; t + 4 <= T; t += 4) rows(std::integral_constant<int, 4>{}, t);
      for (; t + 2 <= T; t += 2) rows(std::integral_constant<int, 2>{}, t);
      if (t < T) rows(std::integral_constant<int, 1>{}, t);
    }
  });
  if (rows_buf.capacity() > (size_t{8} << 20)) std::vector<float>().swap(rows_buf);  // a long prompt's chunk
  return y;
}

torch::Tensor gemm_bf16(const torch::Tensor& x, const torch::Tensor& w, int64_t prologue,
                        const std::optional<torch::Tensor>& norm_weight, double eps,
                        const std::optional<torch::Tensor>& residual) {
  return gemm_half<true>(x, w, prologue, norm_weight, eps, residual);
}

torch::Tensor gemm_f16(const torch::Tensor& x, const torch::Tensor& w, int64_t prologue,
                       const std::optional<torch::Tensor>& norm_weight, double eps,
                       const std::optional<torch::Tensor>& residual) {
  return gemm_half<false>(x, w, prologue, norm_weight, eps, residual);
}

// Rows `ids` of weights in an interleaved layout (`gemm_r8`'s arrays), float32 [R, K]: an embedding
// lookup in a table the LM head reads. Each value as block_gemm.py's `dequantize_rows` forms it (the
// arithmetic of gguf's numpy dequantization): w = float(q)·d, then + m where the layout has minima
// (Q4_1 / Q5_1: the stored m; Q4_0 / Q5_0: m = −8d / −16d; Q4_K / Q5_K: d = ds·sc, m = dm·mq, each exact),
// q the 4- or 5-bit value, IQ4_NL's level or Q8_0's int8; Q6_K: w = float(q − 32)·(ds·sc), sc the value's 16's.
// Reads only the rows' lanes (a decode step looks up one row per sample: the same
// lookup as tensor operations cost 80-260 µs a step).
torch::Tensor dequantize_rows_r8(int64_t layout, const torch::Tensor& qs, const std::optional<torch::Tensor>& qh_in,
                                 const torch::Tensor& d, const std::optional<torch::Tensor>& m_in, int64_t n,
                                 const torch::Tensor& ids_in, const std::optional<torch::Tensor>& sc_in,
                                 const std::optional<torch::Tensor>& mq_in) {
  const torch::Tensor qh = qh_in.value_or(torch::Tensor()), m = m_in.value_or(torch::Tensor());
  const torch::Tensor sc = sc_in.value_or(torch::Tensor()), mq = mq_in.value_or(torch::Tensor());
  TORCH_CHECK(layout >= R8_Q4_0 && layout <= R8_Q6_K, "unknown interleaved layout ", layout);
  const R8Layout L = static_cast<R8Layout>(layout);
  const bool q8 = L == R8_Q8_0, nl = L == R8_IQ4_NL, h5 = r8_has_fifth_bits(L), minima = r8_has_minima(L);
  const bool ks = r8_has_k_scales(L);
  const bool q6 = L == R8_Q6_K;  // w = ds·sc·(q − 32), q the nibble and bits 4-5 (qh), sc per 16 values
  const bool adds_m = !q8 && !nl && !q6;  // Q4_1 / Q5_1: the stored m; Q4_0 / Q5_0: −8d / −16d
  const int64_t block_bytes = r8_block_bytes(L), G = (n + 7) / 8;
  TORCH_CHECK(qs.dim() == 3, "interleaved block values must be a 3-dimensional tensor [G, nb, ", block_bytes, "]");
  const int64_t nb = qs.size(1), K = nb * QK;
  check_r8_arrays(L, qs, qh, d, m, G, nb, sc, mq);
  const int64_t sblocks = r8_per_super_block(L) ? nb / 8 : nb;
  TORCH_CHECK(ids_in.dim() == 1 && at::isIntegralType(ids_in.scalar_type(), /*includeBool=*/false),
              "ids must be a one-dimensional integer tensor, got ", ids_in.scalar_type(), " ", ids_in.sizes());
  const torch::Tensor ids = ids_in.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t R = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK_INDEX(ip[r] >= 0 && ip[r] < n, "weight row ", ip[r], " asked of ", n);  // IndexError
  torch::Tensor out = torch::empty({R, K}, torch::kFloat32);
  const uint8_t* wq = static_cast<const uint8_t*>(qs.data_ptr());
  const uint8_t* wh = h5 ? qh.data_ptr<uint8_t>() : nullptr;
  const uint16_t* wd = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* wm = minima ? reinterpret_cast<const uint16_t*>(m.data_ptr()) : nullptr;
  const uint8_t* wsc = ks ? sc.data_ptr<uint8_t>() : nullptr;
  const uint8_t* wmq = ks ? mq.data_ptr<uint8_t>() : nullptr;
  const int8_t* wsc6 = q6 ? sc.data_ptr<int8_t>() : nullptr;
  const uint8_t* wh6 = q6 ? qh.data_ptr<uint8_t>() : nullptr;
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = ip[r] / 8, lane = ip[r] % 8;
    float* row = op + r * K;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = g * nb + b, sat = ks || q6 ? g * sblocks + b / 8 : at;  // (K layouts: d, m per super-block)
      // K layouts: ds·sc and dm·mq, exact in float32 (`r8_block_scales`)
      const float db = _cvtsh_ss(wd[sat * 8 + lane]) * (ks ? static_cast<float>(wsc[at * 8 + lane]) : 1.f);
      const float mb = minima ? _cvtsh_ss(wm[sat * 8 + lane]) * (ks ? static_cast<float>(wmq[at * 8 + lane]) : 1.f)
                       : h5 ? -16 * db : -8 * db;  // (used where adds_m)
      const uint8_t* w = wq + at * block_bytes;
      float q[QK];
      if (q8) {  // run j: values 4j..4j+3 of output `lane` at bytes 4·lane
        for (int j = 0; j < 8; ++j)
          for (int k = 0; k < 4; ++k) q[4 * j + k] = static_cast<int8_t>(w[32 * j + 4 * lane + k]);
      } else {  // run j: values 4j..4j+3 in the low nibbles, 16 + 4j.. in the high ones
        for (int j = 0; j < 4; ++j)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = w[32 * j + 4 * lane + k];
            int lo = byte & 0x0F, hi = byte >> 4;
            if (h5) {  // byte 4·lane + k of qh: bit j the fifth bit of value 4j + k, bit 4 + j that of 16 + 4j + k
              const uint8_t bits = wh[at * 32 + 4 * lane + k];
              lo |= ((bits >> j) & 1) << 4, hi |= ((bits >> (4 + j)) & 1) << 4;
            }
            if (q6) {  // bits 4-5: byte 4·lane + k of the block's first 32 (values 4j + k) / next 32 (16 + 4j + k), bits 2j
              lo |= ((wh6[at * 64 + 4 * lane + k] >> (2 * j)) & 3) << 4, lo -= 32;
              hi |= ((wh6[at * 64 + 32 + 4 * lane + k] >> (2 * j)) & 3) << 4, hi -= 32;
            }
            q[4 * j + k] = nl ? IQ4_NL_LEVELS[lo] : lo;
            q[16 + 4 * j + k] = nl ? IQ4_NL_LEVELS[hi] : hi;
          }
      }
      for (int i = 0; i < QK; ++i) {  // (Q6_K: ds·sc of the value's 16, exact)
        const float v = q[i] * (q6 ? _cvtsh_ss(wd[sat * 8 + lane]) * static_cast<float>(wsc6[at * 16 + 8 * (i / 16) + lane]) : db);  // (built with -ffp-contract=off: two roundings, as numpy's)
        row[b * QK + i] = adds_m ? v + mb : v;
      }
    }
  }
  return out;
}
}  // namespace

#ifndef FORKLM_EMBEDDED  // decode_stack.cpp compiles this file into its own module
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("amx_supported", &amx_supported, "whether this build runs AMX tiles on this CPU (AMX-INT8, Linux's leave)");
  m.def("amx_enabled", &amx_on, "whether products of AMX_MIN_ROWS to AMX_MAX_ROWS rows run on the AMX tiles");
  m.def("set_amx", &set_amx, "turn the AMX tiles on (where supported) or off in this process");
  m.def("amx_bf16_enabled", &amx_bf16_on, "whether bfloat16 products (K a multiple of 32) run on the AMX-BF16 tiles");
  m.attr("AMX_MIN_ROWS") = AMX_MIN_ROWS;
  m.attr("AMX_MAX_ROWS") = AMX_MAX_ROWS;
  m.def("gemm_q4_1", &gemm_q4_1, "y [T, N] = x [T, K] float32 times Q4_1 weights (qs [N, K/2], d fp16 [N, K/32], m fp16 [ceil(N/8), K/32, 8])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q4_0_r8", &gemm_q4_0_r8, "y [T, N] = x [T, K] float32 times Q4_0 weights, 8 outputs interleaved "
        "(qs uint8 [ceil(N/8), K/32, 128], d fp16 [ceil(N/8), K/32, 8], count int64 [1]: N)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q5_0_r8", &gemm_q5_0_r8, "y [T, N] = x [T, K] float32 times Q5_0 weights, 8 outputs interleaved "
        "(qs uint8 [ceil(N/8), K/32, 128] low 4 bits, qh uint8 [ceil(N/8), K/32, 32] fifth bits, d fp16 "
        "[ceil(N/8), K/32, 8], count int64 [1]: N)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q5_1_r8", &gemm_q5_1_r8, "y [T, N] = x [T, K] float32 times Q5_1 weights, 8 outputs interleaved "
        "(gemm_q5_0_r8's arrays and the minima m fp16 [ceil(N/8), K/32, 8])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q4_k_r8", &gemm_q4_k_r8, "y [T, N] = x [T, K] float32 times Q4_K weights, 8 outputs interleaved "
        "(qs uint8 [ceil(N/8), K/32, 128], ds fp16 [ceil(N/8), K/256, 8], sc / mq uint8 [ceil(N/8), K/32, 8], "
        "dm fp16 [ceil(N/8), K/256, 8], count int64 [1]: N)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q6_k_r8", &gemm_q6_k_r8, "y [T, N] = x [T, K] float32 times Q6_K weights, 8 outputs interleaved "
        "(qs uint8 [ceil(N/8), K/32, 128] the low 4 bits, q2 uint8 [ceil(N/8), K/32, 64] bits 4-5, ds fp16 "
        "[ceil(N/8), K/256, 8], sc int8 [ceil(N/8), K/32, 16], count int64 [1]: N)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q5_k_r8", &gemm_q5_k_r8, "y [T, N] = x [T, K] float32 times Q5_K weights, 8 outputs interleaved "
        "(gemm_q4_k_r8's arrays and qh uint8 [ceil(N/8), K/32, 32] after qs)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q8_0_r8", &gemm_q8_0_r8, "y [T, N] = x [T, K] float32 times Q8_0 weights, 8 outputs interleaved "
        "(qs int8 [ceil(N/8), K/32, 256], d fp16 [ceil(N/8), K/32, 8], count int64 [1] holding N)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_iq4_nl_r8", &gemm_iq4_nl_r8, "y [T, N] = x [T, K] float32 times IQ4_NL weights, 8 outputs interleaved "
        "(gemm_q4_0_r8's arrays, the nibbles level indices)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q4_1_r8", &gemm_q4_1_r8, "y [T, N] = x [T, K] float32 times Q4_1 weights, 8 outputs interleaved "
        "(gemm_q4_0_r8's arrays and the minima m fp16 [ceil(N/8), K/32, 8])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q5_1", &gemm_q5_1, "y [T, N] = x [T, K] float32 times Q5_1 weights (Q4_1's arrays and the fifth bits qh int32 [N, K/32])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q4_k", &gemm_q4_k, "y [T, N] = x [T, K] float32 times Q4_K values in Q4_1's layout with K-quant scales (ds fp16 [N, K/256], sc uint8 [N, K/32], mq uint8 [ceil(N/8), K/32, 8], dm fp16 [ceil(N/8), K/256, 8])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q5_k", &gemm_q5_k, "y [T, N] = x [T, K] float32 times Q5_K values (gemm_q4_k's arrays and the fifth bits qh int32 [N, K/32])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q6_k", &gemm_q6_k, "y [T, N] = x [T, K] float32 times Q6_K values (qs uint8 [N, K/2] low nibbles as Q4_1's, q2 uint8 [N, K/4] bits 4-5, ds fp16 [N, K/256], sc int8 [N, K/16])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q3_k", &gemm_q3_k, "y [T, N] = x [T, K] float32 times Q3_K values (qs uint8 [N, K/4] the file's 2-bit fields, qh uint8 [N, K/8] its third-bit masks, ds fp16 [N, K/256], sc int8 [N, K/16])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q2_k", &gemm_q2_k, "y [T, N] = x [T, K] float32 times Q2_K values (qs uint8 [N, K/4] the file's 2-bit fields, d fp16 [N, K/128] (ds, dmin) per 256, sc uint8 [N, K/16] scale | min << 4)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_q8_0", &gemm_q8_0, "y [T, N] = x [T, K] float32 times Q8_0 weights (qs int8 [N, K], d fp16 [N, K/32])",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_iq4_xs", &gemm_iq4_xs, "y [T, N] = x [T, K] float32 times IQ4_XS weights (qs uint8 [N, K/2] nibbles as "
        "Q4_1's, d fp16 [N, K/256], sc int8 [N, K/32] the 6-bit scales - 32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemm_iq4_nl", &gemm_iq4_nl, "y [T, N] = x [T, K] float32 times IQ4_NL weights (qs uint8 [N, K/2] nibbles as Q4_1's, d fp16 [N, K/32])",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_rows_r8", &dequantize_rows_r8,
        "rows ids of interleaved weights (layout: 0 q4_0_r8, 1 q4_1_r8, 2 q5_0_r8, 3 q5_1_r8, 4 q8_0_r8, 5 iq4_nl_r8, "
        "6 q4_k_r8, 7 q5_k_r8, 8 q6_k_r8; qs, qh, d, m (Q4_K / Q5_K: ds, dm, then sc, mq; Q6_K: qh its bits 4-5 [G, nb, 64], "
        "d ds, m None, sc int8 [G, nb, 16], mq None) as gemm_r8 takes them, n outputs) as float32 [len(ids), K]",
        py::arg("layout"), py::arg("qs"), py::arg("qh"), py::arg("d"), py::arg("m"), py::arg("n"), py::arg("ids"),
        py::arg("sc") = py::none(), py::arg("mq") = py::none());
  m.def("gemm_bf16", &gemm_bf16, "y [T, N] = x [T, K] float32 times bfloat16 weights [N, K] as stored (or an int64 table [N] of their rows' "
        "addresses), in float32 "
        "(each output dense_rows' order on the widened weights)", py::call_guard<py::gil_scoped_release>());
  m.def("gemm_f16", &gemm_f16, "y [T, N] = x [T, K] float32 times float16 weights [N, K] as stored (or an int64 table [N] of their rows' "
        "addresses), in float32 "
        "(each output dense_rows' order on the widened weights)", py::call_guard<py::gil_scoped_release>());
  m.def("dense_rows", &dense_rows, "y [T, B, N] = per b, x [T, B, K] times w [B, N, K] transposed, float32; each "
        "output one dot product in a fixed order whatever T", py::call_guard<py::gil_scoped_release>());
  m.def("repack_rows", &repack_rows,
        "GGUF blocks (uint8 [r, row bytes], type by name; with order int64 [r']: rows order[i] of them) -> rows "
        "row0.. of the kernel's arrays; returns the number of Q4_0 / Q5_0 blocks whose minimum overflows float16",
        py::arg("type"), py::arg("raw"), py::arg("row0"), py::arg("qs"), py::arg("d"), py::arg("m") = py::none(),
        py::arg("qh") = py::none(), py::arg("sc") = py::none(), py::arg("mq") = py::none(),
        py::arg("q2") = py::none(), py::arg("order") = py::none(), py::arg("outputs") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_q8", &quantize_q8, "x [T, K] float32 -> (q int8 [T, K], d [T, K/32], d*sum(q) [T, K/32])",
        py::call_guard<py::gil_scoped_release>());
  m.def("quantize_q8_k", &quantize_q8_k, "x [T, K] float32 -> (q int8 [T, K], d [T, K/256], sums of 16 int16 [T, K/16])",
        py::call_guard<py::gil_scoped_release>());
}
#endif
