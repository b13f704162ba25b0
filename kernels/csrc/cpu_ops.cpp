// Native CPU kernels for the engine's CPU path, registered as torch.ops.loraplex_cpu.*
// (built on first use by kernels/cpu_ops.py). Each op has the semantics of the plain
// torch code it replaces (named per op); tests/kernels/test_cpu_ops.py compares them.
//
// Why native code: on a CPU the torch path spends most of a decode step gathering
// every sequence's K/V blocks into one dense buffer before two batched matmuls, and
// a prefill step in single-purpose elementwise passes (silu, mul, add, pow, mean...)
// over tensors far larger than cache. These kernels read each K/V block once where it
// lies and fuse each elementwise chain into one pass.
//
// Floating point: math is fp32 whatever the storage dtype; every place where the torch
// code rounds to a half-precision dtype rounds here too. The build disables fp
// contraction (-ffp-contract=off) so fp32 elementwise results match torch bit for bit
// where both evaluate the same expression.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using at::Tensor;

#define FORCE_INLINE inline __attribute__((always_inline))

// Storage <-> fp32. bf16 uses plain bit operations (round to nearest even, NaN kept
// quiet, as c10::BFloat16 does) so that loops over it vectorize; c10's own conversion
// is a branchy scalar function.
inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

inline uint16_t float_to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return (bits & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

template <typename T>
inline float load_f(const T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_bits_to_float(*reinterpret_cast<const uint16_t*>(p));
  } else {
    return static_cast<float>(*p);
  }
}

template <typename T>
inline void store_f(T* p, float value) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    *reinterpret_cast<uint16_t*>(p) = float_to_bf16_bits(value);
  } else {
    *p = static_cast<T>(value);
  }
}

// Rounds an fp32 value to the storage dtype and back (identity for float).
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16_bits_to_float(float_to_bf16_bits(x));
  } else {
    return static_cast<float>(static_cast<T>(x));
  }
}

// exp(x) for x in [-87, 88], vectorizable (no libm call): x = n ln2 + r with
// |r| <= ln2 / 2, e^r from a degree-6 minimax polynomial in fused multiply-adds, 2^n
// from the exponent bits. Relative error about 2e-7 (a couple of fp32 ulps).
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to nearest even
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  float r = std::fma(-n, 0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r + 1.0f);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// src[0..n) as floats: `src` itself for float, else converted into `tmp`.
template <typename T>
inline const float* as_floats(const T* src, float* tmp, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      tmp[i] = load_f(src + i);
    }
    return tmp;
  }
}

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// ---------------------------------------------------------------- decode attention

// Where one (sequence, kv head) work item reads and writes; shared by both variants.
// How far ahead (in bytes of K) the decode K pass requests blocks: one block arrives
// while about this much is scored.
constexpr int64_t kPrefetchBytes = 8192;

template <typename T>
struct DecodeItem {
  const float* query;     // [G, Dh] fp32, already scaled
  const T* query_bf16;    // [G, Dh] as stored, unscaled (read by the bf16 dot path)
  float scale;
  const T* k_data;        // K of block 0, kv head 0
  const T* v_data;
  const int64_t* table;
  int64_t len, kv_head, num_kv_heads, block_size, head_dim, groups, score_stride;
  int64_t prefetch_blocks;  // how many blocks ahead the K pass requests K
  float* scores;          // [G, score_stride]
  float* acc;             // [G, Dh]
  float* block_tmp;       // [B * Dh] conversion buffer

  const T* block_ptr(const T* base, int64_t start) const {
    const int64_t block = table[start / block_size];
    return base + (block * num_kv_heads + kv_head) * block_size * head_dim;
  }
  // A sequence's blocks lie anywhere in the cache, so the hardware prefetcher cannot
  // follow them; the passes request them in software, spread over the work so each
  // request has about a pass to arrive:
  // - K pass, block b: K block b + prefetch_blocks and V block b of this item;
  // - V pass, block b: K block b of the next item (`next`, null for the last item of
  //   a thread), then its K blocks past this item's length.
  // Each is forced inline: GCC deems a function whose only effect is a prefetch "pure"
  // and deletes calls to it (GCC 12 emitted no prefetch at all for the earlier,
  // out-of-line version).
  FORCE_INLINE void prefetch_block(const T* base, int64_t start, int locality_l1) const {
    if (start < len) {
      const char* p = reinterpret_cast<const char*>(block_ptr(base, start));
      const int64_t bytes = std::min(block_size, len - start) * head_dim * int64_t(sizeof(T));
      for (int64_t offset = 0; offset < bytes; offset += 64) {
        if (locality_l1) {
          __builtin_prefetch(p + offset, 0, 3);
        } else {
          __builtin_prefetch(p + offset, 0, 2);
        }
      }
    }
  }
  FORCE_INLINE void prefetch_in_k_pass(int64_t start) const {
    prefetch_block(k_data, start + prefetch_blocks * block_size, 1);
    prefetch_block(v_data, start, 0);
  }
  FORCE_INLINE void prefetch_in_v_pass(const DecodeItem* next, int64_t start) const {
    if (next != nullptr) {
      next->prefetch_block(next->k_data, start, 0);
    }
  }
  FORCE_INLINE void prefetch_after_v_pass(const DecodeItem* next) const {
    if (next != nullptr) {
      next->prefetch_keys_from(len);
    }
  }
  // K blocks from row `start` to the end, towards L2 (a thread's first item, or the rows
  // of the next item that the V pass did not reach).
  FORCE_INLINE void prefetch_keys_from(int64_t start) const {
    for (; start < len; start += block_size) {
      prefetch_block(k_data, start, 0);
    }
  }
};

// Softmax over each query row's first `len` scores, in place; returns nothing but
// leaves 1 / sum in inv_sum[g].
inline void softmax_rows(float* scores, int64_t groups, int64_t stride, int64_t len,
                         float* inv_sum) {
  for (int64_t g = 0; g < groups; ++g) {
    float* row = scores + g * stride;
    float peak = row[0];
    for (int64_t t = 1; t < len; ++t) {
      peak = std::max(peak, row[t]);
    }
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      row[t] = fast_exp(row[t] - peak);
      sum += row[t];
    }
    inv_sum[g] = 1.0f / sum;
  }
}

#if defined(__AVX512F__)
// fast_exp of 16 lanes, bit for bit (rounding to nearest even and scaling by 2^n are
// exact either way).
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// softmax_rows for one row of `len` scores (its buffer padded to a multiple of 16).
inline void softmax_row(float* row, int64_t len, float* inv_sum) {
#if defined(__AVX512F__)
  const int64_t full = len / 16 * 16;
  __m512 peak16 = _mm512_set1_ps(row[0]);
  for (int64_t t = 0; t < full; t += 16) {
    peak16 = _mm512_max_ps(peak16, _mm512_loadu_ps(row + t));
  }
  float peak = _mm512_reduce_max_ps(peak16);
  for (int64_t t = full; t < len; ++t) {
    peak = std::max(peak, row[t]);
  }
  const __m512 peak_v = _mm512_set1_ps(peak);
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t t = 0; t < full; t += 16) {
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_loadu_ps(row + t), peak_v));
    _mm512_storeu_ps(row + t, e);
    sum16 = _mm512_add_ps(sum16, e);
  }
  float sum = _mm512_reduce_add_ps(sum16);
  for (int64_t t = full; t < len; ++t) {
    row[t] = fast_exp(row[t] - peak);
    sum += row[t];
  }
  *inv_sum = 1.0f / sum;
#else
  softmax_rows(row, 1, len, len, inv_sum);
#endif
}

// Portable variant: any head_dim, auto-vectorized loops.
template <typename T>
void attend_generic(const DecodeItem<T>& it, const DecodeItem<T>* next, float* inv_sum) {
  const int64_t D = it.head_dim;
  for (int64_t start = 0; start < it.len; start += it.block_size) {
    const int64_t rows = std::min(it.block_size, it.len - start);
    it.prefetch_in_k_pass(start);
    const float* keys = as_floats(it.block_ptr(it.k_data, start), it.block_tmp, rows * D);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < it.groups; ++g) {
        const float* qg = it.query + g * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t e = 0; e < D; ++e) {
          dot += qg[e] * keys[r * D + e];
        }
        it.scores[g * it.score_stride + start + r] = dot;
      }
    }
  }
  for (int64_t g = 0; g < it.groups; ++g) {
    softmax_row(it.scores + g * it.score_stride, it.len, inv_sum + g);
  }
  std::fill(it.acc, it.acc + it.groups * D, 0.0f);
  for (int64_t start = 0; start < it.len; start += it.block_size) {
    const int64_t rows = std::min(it.block_size, it.len - start);
    it.prefetch_in_v_pass(next, start);
    const float* values = as_floats(it.block_ptr(it.v_data, start), it.block_tmp, rows * D);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < it.groups; ++g) {
        const float p = it.scores[g * it.score_stride + start + r];
        float* ag = it.acc + g * D;
#pragma omp simd
        for (int64_t e = 0; e < D; ++e) {
          ag[e] += p * values[r * D + e];
        }
      }
    }
  }
}

#if defined(__AVX512F__)
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// 16 vectors -> one vector whose lane r holds the sum of v[r]'s 16 lanes: a transpose
// and add tree (45 operations for 16 sums, against 16 horizontal reductions).
FORCE_INLINE __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 quads[4];  // 128-bit lane j of quads[i]: rows 4i .. 4i + 3 over lane j of the input
  for (int i = 0; i < 4; ++i) {
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  }
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88),
                       _mm512_shuffle_f32x4(low, high, 0xDD));
}

// Scores of up to 16 consecutive K rows (`rows` of them, from `keys`) against query row
// `g`, written to scores[g][first ..]. bf16 on a CPU with AVX512-BF16: the unscaled
// bf16 query times the bf16 keys in pairs (exact products, fp32 sums), then * scale;
// otherwise the pre-scaled fp32 query times keys widened to fp32.
template <typename T, int CHUNKS>
FORCE_INLINE void score_rows(const DecodeItem<T>& it, int64_t g, const T* keys, int64_t rows,
                             int64_t first) {
  constexpr int64_t D = 16 * CHUNKS;
  __m512 dots[16];
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    __m512bh q[CHUNKS / 2];
    for (int c = 0; c < CHUNKS / 2; ++c) {
      q[c] = (__m512bh)_mm512_loadu_si512(it.query_bf16 + g * D + 32 * c);
    }
    for (int r = 0; r < 16; ++r) {
      dots[r] = _mm512_setzero_ps();
      if (r < rows) {
        for (int c = 0; c < CHUNKS / 2; ++c) {
          dots[r] = _mm512_dpbf16_ps(
              dots[r], q[c], (__m512bh)_mm512_loadu_si512(keys + r * D + 32 * c));
        }
      }
    }
    const __m512 scores = _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(it.scale));
    _mm512_mask_storeu_ps(it.scores + g * it.score_stride + first,
                          static_cast<__mmask16>((1u << rows) - 1), scores);
    return;
  }
#endif
  const float* qg = it.query + g * D;
  for (int r = 0; r < 16; ++r) {
    dots[r] = _mm512_setzero_ps();
    if (r < rows) {
      for (int c = 0; c < CHUNKS; ++c) {
        dots[r] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), load16(keys + r * D + 16 * c),
                                  dots[r]);
      }
    }
  }
  _mm512_mask_storeu_ps(it.scores + g * it.score_stride + first,
                        static_cast<__mmask16>((1u << rows) - 1), sum_lanes16(dots));
}

// V rows [start, start + rows) added into query rows g0 .. g0 + count - 1 (count <= GT),
// whose GT x CHUNKS accumulators stay in registers over the whole pass.
template <typename T, int CHUNKS, int GT>
FORCE_INLINE void add_values_rows(const DecodeItem<T>& it, const DecodeItem<T>* next,
                                  int64_t g0, int64_t count) {
  constexpr int64_t D = 16 * CHUNKS;
  __m512 acc[GT][CHUNKS];
  for (int g = 0; g < GT; ++g) {
    for (int c = 0; c < CHUNKS; ++c) {
      acc[g][c] = _mm512_setzero_ps();
    }
  }
  for (int64_t start = 0; start < it.len; start += it.block_size) {
    const int64_t rows = std::min(it.block_size, it.len - start);
    if (g0 == 0) {
      it.prefetch_in_v_pass(next, start);
    }
    const T* values = it.block_ptr(it.v_data, start);
    for (int64_t r = 0; r < rows; ++r) {
      __m512 p[GT];
      for (int g = 0; g < GT; ++g) {
        if (g < count) {
          p[g] = _mm512_set1_ps(it.scores[(g0 + g) * it.score_stride + start + r]);
        }
      }
      for (int c = 0; c < CHUNKS; ++c) {
        const __m512 v = load16(values + r * D + 16 * c);
        for (int g = 0; g < GT; ++g) {
          if (g < count) {
            acc[g][c] = _mm512_fmadd_ps(p[g], v, acc[g][c]);
          }
        }
      }
    }
  }
  for (int g = 0; g < GT; ++g) {
    if (g < count) {
      for (int c = 0; c < CHUNKS; ++c) {
        _mm512_storeu_ps(it.acc + (g0 + g) * D + 16 * c, acc[g][c]);
      }
    }
  }
}

// AVX-512 variant for head_dim = 16 * CHUNKS. Scores: each K block is scored 16 rows at
// a time against each query row (no horizontal sum per dot). Values: each V row is
// widened once and added into up to GT query rows' register accumulators.
template <typename T, int CHUNKS>
void attend_avx512(const DecodeItem<T>& it, const DecodeItem<T>* next, float* inv_sum) {
  constexpr int GT = CHUNKS <= 4 ? 6 : 3;
  for (int64_t start = 0; start < it.len; start += it.block_size) {
    const int64_t rows = std::min(it.block_size, it.len - start);
    it.prefetch_in_k_pass(start);
    const T* keys = it.block_ptr(it.k_data, start);
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      const int64_t n = std::min<int64_t>(16, rows - r0);
      for (int64_t g = 0; g < it.groups; ++g) {
        score_rows<T, CHUNKS>(it, g, keys + r0 * 16 * CHUNKS, n, start + r0);
      }
    }
  }
  for (int64_t g = 0; g < it.groups; ++g) {
    softmax_row(it.scores + g * it.score_stride, it.len, inv_sum + g);
  }
  for (int64_t g0 = 0; g0 < it.groups; g0 += GT) {
    add_values_rows<T, CHUNKS, GT>(it, next, g0, std::min<int64_t>(GT, it.groups - g0));
  }
}
#endif

template <typename T>
void attend(const DecodeItem<T>& it, const DecodeItem<T>* next, float* inv_sum) {
#if defined(__AVX512F__)
  switch (it.head_dim) {
    case 64:
      attend_avx512<T, 4>(it, next, inv_sum);
      break;
    case 128:
      attend_avx512<T, 8>(it, next, inv_sum);
      break;
    default:
      attend_generic(it, next, inv_sum);
  }
#else
  attend_generic(it, next, inv_sum);
#endif
  it.prefetch_after_v_pass(next);
}

template <typename T>
void decode_attention_kernel(
    const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
    const Tensor& seq_lens, double scale, Tensor& out) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), num_kv_heads = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3);
  const int64_t groups = num_heads / num_kv_heads, width = block_tables.size(1);
  const int64_t q_seq_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t out_seq_stride = out.stride(0), out_head_stride = out.stride(1);
  const int64_t block_elems = block_size * head_dim;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = kv_cache.data_ptr<T>();
  const T* v_data = k_data + num_blocks * num_kv_heads * block_elems;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= width * block_size,
                "seq_lens[", s, "] = ", lens[s], " outside 1..", width * block_size);
    max_len = std::max(max_len, lens[s]);
  }
  const float fscale = static_cast<float>(scale);
  const int64_t block_bytes = block_elems * int64_t(sizeof(T));
  const int64_t prefetch_blocks = std::clamp<int64_t>(kPrefetchBytes / block_bytes, 1, 8);
  const int64_t score_stride = (max_len + 15) / 16 * 16;
  // One work item = one (sequence, kv head): its G query heads share every K/V row.
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(groups * head_dim), acc(groups * head_dim);
    std::vector<T> query_raw(groups * head_dim);
    std::vector<float> scores(groups * score_stride), block_tmp(block_elems), inv_sum(groups);
    const auto item_at = [&](int64_t item) {
      const int64_t seq = item / num_kv_heads;
      return DecodeItem<T>{query.data(), query_raw.data(), fscale, k_data, v_data,
                           tables + seq * width, lens[seq], item % num_kv_heads, num_kv_heads,
                           block_size, head_dim, groups, score_stride, prefetch_blocks,
                           scores.data(), acc.data(), block_tmp.data()};
    };
    if (begin < end) {
      item_at(begin).prefetch_keys_from(0);
    }
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = q_data + seq * q_seq_stride + (kv_head * groups + g) * q_head_stride;
        for (int64_t e = 0; e < head_dim; ++e) {
          query_raw[g * head_dim + e] = src[e];
          query[g * head_dim + e] = load_f(src + e) * fscale;
        }
      }
      const DecodeItem<T> it = item_at(item);
      if (item + 1 < end) {
        const DecodeItem<T> next = item_at(item + 1);
        attend(it, &next, inv_sum.data());
      } else {
        attend(it, static_cast<const DecodeItem<T>*>(nullptr), inv_sum.data());
      }
      for (int64_t g = 0; g < groups; ++g) {
        T* dst = out_data + seq * out_seq_stride + (kv_head * groups + g) * out_head_stride;
        for (int64_t e = 0; e < head_dim; ++e) {
          store_f(dst + e, acc[g * head_dim + e] * inv_sum[g]);
        }
      }
    }
  });
}

// Semantics: out[d, h] = softmax(scale * q[d, h] . K_d[:, h // G]) @ V_d[:, h // G] over
// keys 0 .. seq_lens[d] - 1 of sequence d, read through block_tables[d].
// q [D, H, Dh] (last dim contiguous, any row / head stride); kv_cache [2, N, Hkv, B, Dh]
// contiguous; block_tables [D, W] int64; seq_lens [D] int64 in 1 .. W * B;
// out [D, H, Dh] (last dim contiguous), written in place.
// Torch equivalent: kernels/torch_paged_attention.py decode_attention.
void paged_decode_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
                            const Tensor& seq_lens, double scale, Tensor out) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 &&
                  seq_lens.dim() == 1,
              "expected q [D, H, Dh], kv_cache [2, N, Hkv, B, Dh], block_tables [D, W], "
              "seq_lens [D]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block_tables and seq_lens must be int64");
  TORCH_CHECK(q.size(1) % kv_cache.size(2) == 0, "query heads not a multiple of kv heads");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && out.sizes() == q.sizes(), "shape mismatch");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "one block table row and one length per query");
  if (q.size(0) == 0) {
    return;
  }
  const Tensor tables = block_tables.contiguous();
  const Tensor lens = seq_lens.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode_attention_kernel<scalar_t>(q, kv_cache, tables, lens, scale, out);
  });
}

// ---------------------------------------------------------------- prefill attention

// A prefill chunk's tokens of one sequence share its block table and see growing
// prefixes of the same keys. Read as decodes (one work item per token), each K row is
// dotted with G query rows and each dot ends in a horizontal sum. Here a work item is a
// tile of up to kPrefillTile consecutive tokens of one sequence and one kv head: each K
// block is transposed once into [Dh, B] and every query row of the tile takes its B
// scores at once (a broadcast query element times a row of B keys: no horizontal
// sums), then each V row is added into every row of the tile that sees it.
constexpr int64_t kPrefillTile = 16;
constexpr int64_t kScoreRows = 8;  // query rows scored together (independent FMA chains)
constexpr int64_t kLanes = 16;     // keys scored together (one AVX-512 register)

// Where one tile reads and writes (fp32 scratch of its thread).
struct PrefillTile {
  const float* query;     // [rows_padded, Dh], scaled; padding rows are 0
  float* scores;          // [rows_padded, stride]
  float* acc;             // [rows, Dh]
  float* keys_t;          // [Dh, keys_stride]: one K block transposed, 0 past its rows
  const int64_t* row_len; // keys each row sees
  int64_t rows, rows_padded, stride, head_dim, keys_stride;
};

// scores[r, start + j] = query[r] . K[j] for the block in keys_t, j < keys_stride.
void score_block_generic(const PrefillTile& t, int64_t start) {
  for (int64_t r = 0; r < t.rows; ++r) {
    if (t.row_len[r] <= start) {
      continue;
    }
    float* out = t.scores + r * t.stride + start;
    const float* qr = t.query + r * t.head_dim;
    for (int64_t j = 0; j < t.keys_stride; ++j) {
      out[j] = 0.0f;
    }
    for (int64_t e = 0; e < t.head_dim; ++e) {
      const float qe = qr[e];
      const float* kt = t.keys_t + e * t.keys_stride;
#pragma omp simd
      for (int64_t j = 0; j < t.keys_stride; ++j) {
        out[j] += qe * kt[j];
      }
    }
  }
}

// acc[r] += sum_j scores[r, start + j] * V[j] over the keys row r sees in this block.
void add_values_generic(const PrefillTile& t, int64_t start, int64_t valid, const float* values) {
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t seen = std::min(valid, t.row_len[r] - start);
    const float* probs = t.scores + r * t.stride + start;
    float* ar = t.acc + r * t.head_dim;
    for (int64_t j = 0; j < seen; ++j) {
      const float p = probs[j];
      const float* vj = values + j * t.head_dim;
#pragma omp simd
      for (int64_t e = 0; e < t.head_dim; ++e) {
        ar[e] += p * vj[e];
      }
    }
  }
}

#if defined(__AVX512F__)
// score_block_generic for head_dim = 16 * CHUNKS: kScoreRows rows at a time, each a
// chain of Dh fused multiply-adds of a broadcast query element and 16 keys.
template <int CHUNKS>
void score_block_avx512(const PrefillTile& t, int64_t start) {
  constexpr int64_t D = 16 * CHUNKS;
  for (int64_t r0 = 0; r0 < t.rows; r0 += kScoreRows) {
    if (t.row_len[r0] <= start && t.row_len[std::min(r0 + kScoreRows, t.rows) - 1] <= start) {
      continue;
    }
    const float* q0 = t.query + r0 * D;
    for (int64_t j0 = 0; j0 < t.keys_stride; j0 += kLanes) {
      __m512 acc[kScoreRows];
      for (int64_t i = 0; i < kScoreRows; ++i) {
        acc[i] = _mm512_setzero_ps();
      }
      for (int64_t e = 0; e < D; ++e) {
        const __m512 kt = _mm512_loadu_ps(t.keys_t + e * t.keys_stride + j0);
        for (int64_t i = 0; i < kScoreRows; ++i) {
          acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q0[i * D + e]), kt, acc[i]);
        }
      }
      for (int64_t i = 0; i < kScoreRows; ++i) {
        _mm512_storeu_ps(t.scores + (r0 + i) * t.stride + start + j0, acc[i]);
      }
    }
  }
}

// add_values_generic for head_dim = 16 * CHUNKS: each row's accumulator in registers.
template <typename T, int CHUNKS>
void add_values_avx512(const PrefillTile& t, int64_t start, int64_t valid, const T* values) {
  constexpr int64_t D = 16 * CHUNKS;
  for (int64_t r = 0; r < t.rows; ++r) {
    const int64_t seen = std::min(valid, t.row_len[r] - start);
    if (seen <= 0) {
      continue;
    }
    const float* probs = t.scores + r * t.stride + start;
    float* ar = t.acc + r * D;
    __m512 acc[CHUNKS];
    for (int c = 0; c < CHUNKS; ++c) {
      acc[c] = _mm512_loadu_ps(ar + 16 * c);
    }
    for (int64_t j = 0; j < seen; ++j) {
      const __m512 p = _mm512_set1_ps(probs[j]);
      for (int c = 0; c < CHUNKS; ++c) {
        acc[c] = _mm512_fmadd_ps(p, load16(values + j * D + 16 * c), acc[c]);
      }
    }
    for (int c = 0; c < CHUNKS; ++c) {
      _mm512_storeu_ps(ar + 16 * c, acc[c]);
    }
  }
}
#endif

void score_block(const PrefillTile& t, int64_t start) {
#if defined(__AVX512F__)
  if (t.keys_stride % kLanes == 0 && t.rows_padded % kScoreRows == 0) {
    switch (t.head_dim) {
      case 64:
        return score_block_avx512<4>(t, start);
      case 128:
        return score_block_avx512<8>(t, start);
    }
  }
#endif
  score_block_generic(t, start);
}

template <typename T>
void add_values(const PrefillTile& t, int64_t start, int64_t valid, const T* block,
                float* block_tmp) {
#if defined(__AVX512F__)
  switch (t.head_dim) {
    case 64:
      return add_values_avx512<T, 4>(t, start, valid, block);
    case 128:
      return add_values_avx512<T, 8>(t, start, valid, block);
  }
#endif
  add_values_generic(t, start, valid, as_floats(block, block_tmp, valid * t.head_dim));
}

template <typename T>
void prefill_attention_kernel(const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
                              const Tensor& query_lens, const Tensor& seq_lens, double scale,
                              Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), num_kv_heads = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3);
  const int64_t groups = num_heads / num_kv_heads, width = block_tables.size(1);
  const int64_t num_seqs = query_lens.size(0);
  const int64_t block_elems = block_size * head_dim;
  const T* q_data = q.data_ptr<T>();
  const T* k_base = kv_cache.data_ptr<T>();
  const T* v_base = k_base + num_blocks * num_kv_heads * block_elems;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* qlens = query_lens.data_ptr<int64_t>();
  const int64_t* slens = seq_lens.data_ptr<int64_t>();
  T* out_data = out.data_ptr<T>();
  // Work items: (tile, kv head); a tile is up to kPrefillTile tokens of one sequence.
  std::vector<int64_t> item_seq, item_first, first_token(num_seqs);
  int64_t tokens = 0, max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(qlens[s] >= 1 && qlens[s] <= slens[s] && slens[s] <= width * block_size,
                "prefill ", s, ": query_len ", qlens[s], ", seq_len ", slens[s],
                " (at most ", width * block_size, ")");
    first_token[s] = tokens;
    for (int64_t t = 0; t < qlens[s]; t += kPrefillTile) {
      item_seq.push_back(s);
      item_first.push_back(t);
    }
    tokens += qlens[s];
    max_len = std::max(max_len, slens[s]);
  }
  TORCH_CHECK(tokens == q.size(0), "query_lens sum to ", tokens, " but q has ", q.size(0),
              " tokens");
  const float fscale = static_cast<float>(scale);
  const int64_t keys_stride = (block_size + kLanes - 1) / kLanes * kLanes;
  const int64_t stride = (max_len + block_size - 1) / block_size * block_size + keys_stride;
  const int64_t max_rows = kPrefillTile * groups;
  const int64_t rows_capacity = (max_rows + kScoreRows - 1) / kScoreRows * kScoreRows;
  const int64_t num_items = static_cast<int64_t>(item_seq.size()) * num_kv_heads;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(rows_capacity * head_dim), acc(max_rows * head_dim);
    std::vector<float> scores(rows_capacity * stride), inv_sum(max_rows);
    std::vector<float> keys_t(head_dim * keys_stride), block_tmp(block_elems);
    std::vector<int64_t> row_len(rows_capacity);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t seq = item_seq[tile], first = item_first[tile];
      const int64_t count = std::min(kPrefillTile, qlens[seq] - first);
      const int64_t rows = count * groups;
      const int64_t rows_padded = (rows + kScoreRows - 1) / kScoreRows * kScoreRows;
      const int64_t* table = tables + seq * width;
      // Row r = i * G + g: token first + i of the chunk, query head kv_head * G + g; it
      // sees keys 0 .. its position. Padding rows see none.
      for (int64_t i = 0; i < count; ++i) {
        const int64_t token = first_token[seq] + first + i;
        const int64_t len = slens[seq] - qlens[seq] + first + i + 1;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = i * groups + g;
          row_len[r] = len;
          const T* src = q_data + token * q.stride(0) + (kv_head * groups + g) * q.stride(1);
          for (int64_t e = 0; e < head_dim; ++e) {
            query[r * head_dim + e] = load_f(src + e) * fscale;
          }
        }
      }
      std::fill(query.begin() + rows * head_dim, query.begin() + rows_padded * head_dim, 0.0f);
      std::fill(row_len.begin() + rows, row_len.begin() + rows_padded, int64_t{0});
      const PrefillTile t{query.data(), scores.data(), acc.data(), keys_t.data(), row_len.data(),
                          rows, rows_padded, stride, head_dim, keys_stride};
      const int64_t tile_len = row_len[rows - 1];
      for (int64_t start = 0; start < tile_len; start += block_size) {
        const int64_t valid = std::min(block_size, tile_len - start);
        const T* block =
            k_base + (table[start / block_size] * num_kv_heads + kv_head) * block_elems;
        const float* keys = as_floats(block, block_tmp.data(), valid * head_dim);
        for (int64_t e = 0; e < head_dim; ++e) {
          float* kt = keys_t.data() + e * keys_stride;
          for (int64_t j = 0; j < keys_stride; ++j) {
            kt[j] = j < valid ? keys[j * head_dim + e] : 0.0f;
          }
        }
        score_block(t, start);
      }
      for (int64_t r = 0; r < rows; ++r) {
        softmax_row(scores.data() + r * stride, row_len[r], inv_sum.data() + r);
      }
      std::fill(acc.begin(), acc.begin() + rows * head_dim, 0.0f);
      for (int64_t start = 0; start < tile_len; start += block_size) {
        const int64_t valid = std::min(block_size, tile_len - start);
        const T* block =
            v_base + (table[start / block_size] * num_kv_heads + kv_head) * block_elems;
        add_values<T>(t, start, valid, block, block_tmp.data());
      }
      for (int64_t i = 0; i < count; ++i) {
        const int64_t token = first_token[seq] + first + i;
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t r = i * groups + g;
          T* dst = out_data + token * out.stride(0) + (kv_head * groups + g) * out.stride(1);
          for (int64_t e = 0; e < head_dim; ++e) {
            store_f(dst + e, acc[r * head_dim + e] * inv_sum[r]);
          }
        }
      }
    }
  });
}

// Semantics: for the prefill chunk of sequence p (query_lens[p] tokens, the last at
// position seq_lens[p] - 1; chunks in order, their tokens contiguous in q), token i of
// the chunk at position a = seq_lens[p] - query_lens[p] + i:
//   out[t, h] = softmax(scale * q[t, h] . K_p[0..a, h // G]) @ V_p[0..a, h // G]
// with every K/V already in the cache, read through block_tables[p]. The same as
// paged_decode_attention over each token as a decode of length a + 1, up to fp32
// summation order.
// q [Tp, H, Dh] (last dim contiguous); kv_cache [2, N, Hkv, B, Dh] contiguous;
// block_tables [P, W], query_lens / seq_lens [P] int64; out [Tp, H, Dh] (last dim
// contiguous), written in place.
void paged_prefill_attention(const Tensor& q, const Tensor& kv_cache, const Tensor& block_tables,
                             const Tensor& query_lens, const Tensor& seq_lens, double scale,
                             Tensor out) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && block_tables.dim() == 2 &&
                  query_lens.dim() == 1 && seq_lens.dim() == 1,
              "expected q [Tp, H, Dh], kv_cache [2, N, Hkv, B, Dh], block_tables [P, W], "
              "query_lens / seq_lens [P]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need a contiguous last dim");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, kv_cache and out must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_lens.scalar_type() == at::kLong &&
                  seq_lens.scalar_type() == at::kLong,
              "block_tables, query_lens and seq_lens must be int64");
  TORCH_CHECK(q.size(1) % kv_cache.size(2) == 0, "query heads not a multiple of kv heads");
  TORCH_CHECK(q.size(2) == kv_cache.size(4) && out.sizes() == q.sizes(), "shape mismatch");
  TORCH_CHECK(block_tables.size(0) == query_lens.size(0) && seq_lens.size(0) == query_lens.size(0),
              "one block table row, query length and sequence length per prefill");
  if (q.size(0) == 0) {
    return;
  }
  const Tensor tables = block_tables.contiguous();
  const Tensor qlens = query_lens.contiguous();
  const Tensor slens = seq_lens.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill", [&] {
    prefill_attention_kernel<scalar_t>(q, kv_cache, tables, qlens, slens, scale, out);
  });
}

// ---------------------------------------------------------------- RMSNorm + residual

template <typename T>
void rms_norm_kernel(const Tensor& x, const T* residual, const Tensor& weight, double eps,
                     Tensor& out, T* residual_out) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* x_data = x.data_ptr<T>();
  const T* w_data = weight.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden), w(hidden);
    for (int64_t i = 0; i < hidden; ++i) {
      w[i] = load_f(w_data + i);
    }
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x_data + row * hidden;
      float squares = 0.0f;
      if (residual != nullptr) {
        const T* rr = residual + row * hidden;
        T* ro = residual_out + row * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          const float sum = round_to<T>(load_f(rr + i) + load_f(xr + i));
          store_f(ro + i, sum);
          h[i] = sum;
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          h[i] = load_f(xr + i);
        }
      }
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) {
        squares += h[i] * h[i];
      }
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(hidden) + feps);
      T* o = out_data + row * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) {
        store_f(o + i, w[i] * round_to<T>(h[i] * inv));
      }
    }
  });
}

// Semantics (the torch reference: TorchLayerKernels.rms_norm):
//   s = residual + x (rounded to the dtype; s = x without residual), h = float(s),
//   out = weight * dtype(h / sqrt(mean(h^2) + eps)),  residual_out = s
// x, residual, out, residual_out [T, hidden] contiguous, weight [hidden]; one dtype.
// residual_out is required exactly when residual is given.
void rms_norm(const Tensor& x, const c10::optional<Tensor>& residual, const Tensor& weight,
              double eps, Tensor out, c10::optional<Tensor> residual_out) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  const auto matches_x = [&](const Tensor& t) {
    return t.sizes() == x.sizes() && t.is_contiguous() && t.scalar_type() == x.scalar_type();
  };
  TORCH_CHECK(matches_x(out), "out must match x");
  const bool has_residual = residual.has_value() && residual->defined();
  TORCH_CHECK(has_residual == (residual_out.has_value() && residual_out->defined()),
              "residual_out is required exactly when residual is given");
  if (has_residual) {
    TORCH_CHECK(matches_x(*residual) && matches_x(*residual_out), "residual must match x");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(x, has_residual ? residual->data_ptr<scalar_t>() : nullptr, weight,
                              eps, out,
                              has_residual ? residual_out->data_ptr<scalar_t>() : nullptr);
  });
}

// ---------------------------------------------------------------- SiLU and mul

#if defined(__AVX512F__)
// 16 fp32 lanes rounded to nearest even in T's precision, as T's bit pattern in the low
// 16 bits of each lane (bf16, fp16) or as fp32 (float).
template <typename T>
FORCE_INLINE __m512i narrow16(__m512 x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AVX512BF16__)
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
#endif
  } else {
    return _mm512_cvtepu16_epi32(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// x rounded to T's precision, as fp32 (round_to<T> of 16 lanes).
template <typename T>
FORCE_INLINE __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(narrow16<T>(x), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(narrow16<T>(x)));
  }
}

// 16 fp32 lanes stored as T (store_f of 16 lanes).
template <typename T>
FORCE_INLINE void store16(T* p, __m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, x);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(narrow16<T>(x)));
  }
}
#endif

template <typename T>
void silu_and_mul_kernel(const Tensor& x, Tensor& out) {
  const int64_t rows = x.size(0), width = out.size(1);
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T* gate = x_data + row * 2 * width;
      const T* up = gate + width;
      T* o = out_data + row * width;
      int64_t i = 0;
#if defined(__AVX512F__)
      // 16 lanes of the loop below, bit for bit
      for (; i + 16 <= width; i += 16) {
        const __m512 g = load16(gate + i);
        const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store16(o + i, _mm512_mul_ps(silu, load16(up + i)));
      }
#endif
      for (; i < width; ++i) {
        const float g = load_f(gate + i);
        const float silu = round_to<T>(g / (1.0f + fast_exp(-g)));
        store_f(o + i, silu * load_f(up + i));
      }
    }
  });
}

// Semantics: gate, up = x.chunk(2, -1); out = silu(gate) * up with silu rounded to the
// dtype first (F.silu(gate) * up). x [T, 2I] contiguous -> out [T, I].
Tensor silu_and_mul(const Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "x must be a contiguous [T, 2I] tensor");
  Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_kernel<scalar_t>(x, out);
  });
  return out;
}

// ---------------------------------------------------------------- rotary + KV write

template <typename T>
inline void rotate_head(T* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = load_f(x + i), x2 = load_f(x + i + half);
    const float first = round_to<T>(x1 * cos[i]) - round_to<T>(x2 * sin[i]);
    const float second = round_to<T>(x2 * cos[i]) + round_to<T>(x1 * sin[i]);
    store_f(x + i, first);
    store_f(x + i + half, second);
  }
}

template <typename T>
void rotary_write_kv_kernel(Tensor& q, Tensor& k, const Tensor& v, const Tensor& cos,
                            const Tensor& sin, Tensor& kv_cache, const Tensor& slots) {
  const int64_t tokens = q.size(0), num_heads = q.size(1), num_kv_heads = k.size(1);
  const int64_t head_dim = q.size(2), half = head_dim / 2;
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(3);
  T* q_data = q.data_ptr<T>();
  T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  const T* cos_data = cos.data_ptr<T>();
  const T* sin_data = sin.data_ptr<T>();
  T* cache = kv_cache.data_ptr<T>();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  const int64_t value_offset = num_blocks * num_kv_heads * block_size * head_dim;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        c[i] = load_f(cos_data + t * cos.stride(0) + i);
        s[i] = load_f(sin_data + t * sin.stride(0) + i);
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        rotate_head(q_data + t * q.stride(0) + h * q.stride(1), c.data(), s.data(), half);
      }
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rotate_head(k_data + t * k.stride(0) + h * k.stride(1), c.data(), s.data(), half);
      }
      const int64_t slot = slot_data[t];
      if (slot < 0) {
        continue;
      }
      const int64_t block = slot / block_size, row = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = ((block * num_kv_heads + h) * block_size + row) * head_dim;
        std::memcpy(cache + dst, k_data + t * k.stride(0) + h * k.stride(1),
                    head_dim * sizeof(T));
        std::memcpy(cache + value_offset + dst, v_data + t * v.stride(0) + h * v.stride(1),
                    head_dim * sizeof(T));
      }
    }
  });
}

// Semantics: in place, for each token t and head, with x1 / x2 the halves of the head
// and c = cos[t], s = sin[t] (rounded products, as in platform/layers/rotary.py):
//   x <- cat(x1 * c - x2 * s, x2 * c + x1 * s)   for every head of q[t] and k[t]
// then (slot = slot_mapping[t] >= 0) kv_cache[0, slot // B, :, slot % B] = k[t] (rotated)
// and kv_cache[1, slot // B, :, slot % B] = v[t]; a negative slot skips the write.
// q [T, H, Dh], k / v [T, Hkv, Dh] with contiguous last dims (views into the fused qkv
// output are fine); cos / sin [T, Dh/2] (any row stride); kv_cache [2, N, Hkv, B, Dh]
// contiguous; slot_mapping [T] int64.
void rotary_write_kv(Tensor q, Tensor k, const Tensor& v, const Tensor& cos, const Tensor& sin,
                     Tensor kv_cache, const Tensor& slot_mapping) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && kv_cache.dim() == 5,
              "expected q [T, H, Dh], k / v [T, Hkv, Dh], kv_cache [2, N, Hkv, B, Dh]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && cos.stride(1) == 1 &&
                  sin.stride(1) == 1,
              "q, k, v, cos and sin need a contiguous last dim");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2),
              "q / k / v shapes disagree");
  TORCH_CHECK(kv_cache.size(2) == k.size(1) && kv_cache.size(4) == k.size(2),
              "kv_cache heads / head_dim disagree with k");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) &&
                  cos.size(1) * 2 == q.size(2),
              "cos / sin must be [T, Dh/2]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == q.size(0) &&
                  slot_mapping.scalar_type() == at::kLong,
              "slot_mapping must be [T] int64");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype &&
                  cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  kv_cache.scalar_type() == dtype,
              "q, k, v, cos, sin and kv_cache must share a dtype");
  const Tensor slots = slot_mapping.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "rotary_write_kv", [&] {
    rotary_write_kv_kernel<scalar_t>(q, k, v, cos, sin, kv_cache, slots);
  });
}

// ---------------------------------------------------------------- LoRA

// Work item: up to kLoraItem consecutive tokens of one slot (decodes come sorted by slot,
// prefill chunks are long runs of one slot). Within an item the shrink takes kLoraBlock
// tokens per pass over each A row, and the expand takes kLoraBlock tokens along their
// output rows in kLoraChunk-column chunks, accumulating in registers (the slot's B,
// re-read by each block, stays in L2). With AVX-512 both sums use fused multiply-adds (intrinsics,
// which -ffp-contract=off leaves alone), as the GEMMs of the torch path do; the order of
// each token's sum never depends on the other tokens of its block.
constexpr int64_t kLoraItem = 64;
constexpr int64_t kLoraBlock = 8;
constexpr int64_t kLoraChunk = 32;
// A rows per shrink tile: kLoraBlock x kLoraShrinkRows accumulators, kLoraShrinkRows A
// loads and kLoraBlock x loads, in 28 of AVX-512's 32 vector registers.
constexpr int64_t kLoraShrinkRows = 3;
// How far ahead the LoRA kernel asks for its slots' weights: A rows run on into the next
// rows (an adapter's rows are contiguous), B columns into the chunks after this one. A
// step's adapters come from memory (30 layers of 8 slots outgrow the caches): asking
// ahead took 30 layers of 8 cold rank-8 slots at the decode shape from 8.95 to 7.0 ms.
constexpr int64_t kLoraPrefetchFloats = 512;
constexpr int64_t kLoraPrefetchChunks = 4;

// For a full kLoraBlock x kLoraChunk tile: acc[i][j] = sum_r y[i * y_stride + r] *
// columns[r * column_stride + j], summed in r's order from 0 with fused multiply-adds,
// then out[i * out_stride + j] = T(out + T(acc)). With AVX-512 the tile stays in vector
// registers from the first product to the store (constant trip counts); the partial
// tiles of the kernel compute the same sums and roundings one lane at a time.
template <typename T>
inline void expand_block_add(T* out, int64_t out_stride, const float* y, int64_t y_stride,
                             const float* columns, int64_t column_stride, int64_t used) {
#if defined(__AVX512F__)
  static_assert(kLoraChunk == 32, "two 16-float vectors per row");
  __m512 lo[kLoraBlock], hi[kLoraBlock];
  for (int64_t i = 0; i < kLoraBlock; ++i) {
    lo[i] = _mm512_setzero_ps();
    hi[i] = _mm512_setzero_ps();
  }
  for (int64_t r = 0; r < used; ++r) {
    const float* column = columns + r * column_stride;
    const __m512 c_lo = _mm512_loadu_ps(column), c_hi = _mm512_loadu_ps(column + 16);
    for (int64_t i = 0; i < kLoraBlock; ++i) {
      const __m512 yr = _mm512_set1_ps(y[i * y_stride + r]);
      lo[i] = _mm512_fmadd_ps(yr, c_lo, lo[i]);
      hi[i] = _mm512_fmadd_ps(yr, c_hi, hi[i]);
    }
  }
  for (int64_t i = 0; i < kLoraBlock; ++i) {
    T* row = out + i * out_stride;
    store16(row, _mm512_add_ps(load16(row), round16<T>(lo[i])));
    store16(row + 16, _mm512_add_ps(load16(row + 16), round16<T>(hi[i])));
  }
#else
  float acc[kLoraBlock][kLoraChunk] = {};
  for (int64_t r = 0; r < used; ++r) {
    const float* column = columns + r * column_stride;
    for (int64_t i = 0; i < kLoraBlock; ++i) {
      const float yr = y[i * y_stride + r];
#pragma omp simd
      for (int64_t j = 0; j < kLoraChunk; ++j) {
        acc[i][j] += yr * column[j];
      }
    }
  }
  for (int64_t i = 0; i < kLoraBlock; ++i) {
    T* row = out + i * out_stride;
#pragma omp simd
    for (int64_t j = 0; j < kLoraChunk; ++j) {
      store_f(row + j, round_to<T>(load_f(row + j) + round_to<T>(acc[i][j])));
    }
  }
#endif
}

// y[m + i * y_stride] = rows[m] . xs[i] for the M <= kLoraShrinkRows A rows (rows[m] at
// row + m * row_stride) and the N <= kLoraBlock token rows xs. With AVX-512 the N x M dot
// products run side by side, one accumulator each (N and M are compile-time constants so
// they stay in registers): per 16 features M A loads and N x loads feed N * M fused
// multiply-adds, and none waits on its own previous sum. Every dot is summed in the same
// order (16 lanes along the features, the lanes' reduction, the scalar tail) whatever N
// and M are, so a token's result never depends on the rest of the batch or the tiling.
template <int64_t N, int64_t M>
void shrink_tile(const float* row, int64_t row_stride, const float* const* xs,
                 int64_t in_features, float* y, int64_t y_stride) {
#if defined(__AVX512F__)
  __m512 acc[N][M];
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t m = 0; m < M; ++m) {
      acc[i][m] = _mm512_setzero_ps();
    }
  }
  int64_t done = 0;
  for (; done + 16 <= in_features; done += 16) {
    __m512 a[M];
    for (int64_t m = 0; m < M; ++m) {
      const float* rm = row + m * row_stride + done;
      _mm_prefetch(reinterpret_cast<const char*>(rm + kLoraPrefetchFloats), _MM_HINT_T0);
      a[m] = _mm512_loadu_ps(rm);
    }
    for (int64_t i = 0; i < N; ++i) {
      const __m512 xi = _mm512_loadu_ps(xs[i] + done);
      for (int64_t m = 0; m < M; ++m) {
        acc[i][m] = _mm512_fmadd_ps(a[m], xi, acc[i][m]);
      }
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    for (int64_t m = 0; m < M; ++m) {
      const float* rm = row + m * row_stride;
      float dot = _mm512_reduce_add_ps(acc[i][m]);
      for (int64_t k = done; k < in_features; ++k) {
        dot = std::fma(rm[k], xs[i][k], dot);
      }
      y[i * y_stride + m] = dot;
    }
  }
#else
  for (int64_t i = 0; i < N; ++i) {
    const float* xi = xs[i];
    for (int64_t m = 0; m < M; ++m) {
      const float* rm = row + m * row_stride;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < in_features; ++k) {
        dot += rm[k] * xi[k];
      }
      y[i * y_stride + m] = dot;
    }
  }
#endif
}

template <int64_t M, int64_t... Ns>
void shrink_tiles_of(std::integer_sequence<int64_t, Ns...>, int64_t n, const float* row,
                     int64_t row_stride, const float* const* xs, int64_t in_features,
                     float* y, int64_t y_stride) {
  ((n == Ns + 1 ? shrink_tile<Ns + 1, M>(row, row_stride, xs, in_features, y, y_stride)
                : void()),
   ...);
}

// y[r + i * y_stride] = A row r . xs[i] for the `rows` A rows from `row` (row_stride
// apart) and n in 1 .. kLoraBlock token rows, kLoraShrinkRows rows per tile.
inline void shrink_rows(int64_t n, int64_t rows, const float* row, int64_t row_stride,
                        const float* const* xs, int64_t in_features, float* y,
                        int64_t y_stride) {
  using Tokens = std::make_integer_sequence<int64_t, kLoraBlock>;
  int64_t r = 0;
  for (; r + kLoraShrinkRows <= rows; r += kLoraShrinkRows) {
    shrink_tiles_of<kLoraShrinkRows>(Tokens{}, n, row + r * row_stride, row_stride, xs,
                                     in_features, y + r, y_stride);
  }
  for (; r < rows; ++r) {
    shrink_tiles_of<1>(Tokens{}, n, row + r * row_stride, row_stride, xs, in_features,
                       y + r, y_stride);
  }
}

// acc + y * column as the expand computes it: fused where the full tiles fuse it, so
// a token's delta does not depend on whether its tile was full.
inline float expand_madd(float y, float column, float acc) {
#if defined(__AVX512F__)
  return std::fma(y, column, acc);
#else
  return acc + y * column;
#endif
}

// The rank columns [first, last) of a slot that can be nonzero in output columns
// [o0, o0 + n): B is block-diagonal, slice s's outputs (up to slice_ends[s]) reading only
// its columns s * slice_rank .. (s + 1) * slice_rank. Skipping the zero blocks adds
// nothing a product would have added but 0.
inline std::pair<int64_t, int64_t> expand_columns(at::IntArrayRef slice_ends, int64_t o0,
                                                  int64_t n, int64_t slice_rank,
                                                  int64_t used) {
  const int64_t slices = static_cast<int64_t>(slice_ends.size());
  int64_t lo = 0;
  while (lo < slices - 1 && slice_ends[lo] <= o0) {
    ++lo;
  }
  int64_t hi = lo;
  while (hi < slices - 1 && slice_ends[hi] < o0 + n) {
    ++hi;
  }
  return {std::min(used, lo * slice_rank), std::min(used, (hi + 1) * slice_rank)};
}

template <typename T>
void lora_add_kernel(Tensor& out, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b,
                     const int64_t* slots, const int64_t* ranks, at::IntArrayRef slice_ends) {
  const int64_t num_slices = static_cast<int64_t>(slice_ends.size());
  const int64_t tokens = x.size(0), in_features = x.size(1), out_features = out.size(1);
  const int64_t width = lora_a.size(1);
  const T* x_data = x.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  const float* a_data = lora_a.data_ptr<float>();
  const float* b_data = lora_b.data_ptr<float>();
  const int64_t a_slot = lora_a.stride(0), a_row = lora_a.stride(1);
  const int64_t b_slot = lora_b.stride(0), b_col = lora_b.stride(2);
  // Items of at most item_len tokens: a step whose tokens share few adapters (all of a
  // decode batch on one) still gives every thread two items or more. Each thread then
  // reads that slot's weights; a token's delta is the same whatever its item.
  const int64_t shares = 2 * static_cast<int64_t>(at::get_num_threads());
  const int64_t per_share = (tokens + shares - 1) / shares;
  const int64_t item_len = std::clamp((per_share + kLoraBlock - 1) / kLoraBlock * kLoraBlock,
                                      kLoraBlock, kLoraItem);
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t t = 0; t < tokens;) {
    int64_t end = t + 1;
    while (end < tokens && end - t < item_len && slots[end] == slots[t]) {
      ++end;
    }
    if (slots[t] >= 0) {
      items.emplace_back(t, end);
    }
    t = end;
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x_tmp(kLoraBlock * in_features), y(kLoraItem * width);
    for (int64_t item = begin; item < end; ++item) {
      const auto [first, last] = items[item];
      const int64_t count = last - first, slot = slots[first];
      const int64_t slice_rank = ranks == nullptr ? width / num_slices : ranks[slot];
      const int64_t used = std::min(width, num_slices * slice_rank);
      // Shrink: y[i, r] = A[slot, r] . x[first + i]
      for (int64_t b0 = 0; b0 < count; b0 += kLoraBlock) {
        const int64_t n = std::min(kLoraBlock, count - b0);
        const float* xs[kLoraBlock];
        for (int64_t i = 0; i < n; ++i) {
          xs[i] = as_floats(x_data + (first + b0 + i) * x.stride(0),
                            x_tmp.data() + i * in_features, in_features);
        }
        shrink_rows(n, used, a_data + slot * a_slot, a_row, xs, in_features,
                    y.data() + b0 * width, width);
      }
      // Expand: out[first + i, o] += sum_r y[i, r] * B[slot, o, r], kLoraBlock tokens
      // at a time along their whole output rows (the rows stream through the cache in
      // order; the slot's B, re-read by each block, stays in L2).
      const float* b_slot_data = b_data + slot * b_slot;
      for (int64_t b0 = 0; b0 < count; b0 += kLoraBlock) {
        const int64_t m = std::min(kLoraBlock, count - b0);
        const float* yb = y.data() + b0 * width;
        for (int64_t o0 = 0; o0 < out_features; o0 += kLoraChunk) {
          const int64_t n = std::min(kLoraChunk, out_features - o0);
          const auto [r0, r1] = expand_columns(slice_ends, o0, n, slice_rank, used);
#if defined(__AVX512F__)
          if (b0 == 0 && o0 + kLoraPrefetchChunks * kLoraChunk < out_features) {
            for (int64_t r = r0; r < r1; ++r) {
              const float* ahead =
                  b_slot_data + r * b_col + o0 + kLoraPrefetchChunks * kLoraChunk;
              _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(ahead + 16), _MM_HINT_T0);
            }
          }
#endif
          T* out_block = out_data + (first + b0) * out.stride(0) + o0;
          if (m == kLoraBlock && n == kLoraChunk) {
            expand_block_add(out_block, out.stride(0), yb + r0, width,
                             b_slot_data + r0 * b_col + o0, b_col, r1 - r0);
            continue;
          }
          float acc[kLoraBlock][kLoraChunk] = {};
          for (int64_t r = r0; r < r1; ++r) {
            const float* column = b_slot_data + r * b_col + o0;  // B[slot, o0 :, r]
            for (int64_t i = 0; i < m; ++i) {
              const float yr = yb[i * width + r];
#pragma omp simd
              for (int64_t j = 0; j < n; ++j) {
                acc[i][j] = expand_madd(yr, column[j], acc[i][j]);
              }
            }
          }
          for (int64_t i = 0; i < m; ++i) {
            T* ot = out_block + i * out.stride(0);
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) {
              store_f(ot + j, round_to<T>(load_f(ot + j) + round_to<T>(acc[i][j])));
            }
          }
        }
      }
    }
  });
}

// Semantics (kernels/lora.py, per token): for each t with s = token_slots[t] >= 0 and
// w = min(R, S * slot_ranks[s]) (w = R when slot_ranks is empty), S = len(slice_ends):
//   y = lora_a[s, :w] @ x[t];   out[t] += dtype(lora_b[s, :, :w] @ y)
// where lora_b[s] is block-diagonal by slice (kernels/lora.py): outputs below
// slice_ends[i] (and from slice_ends[i - 1]) read only columns i * w / S .. (i + 1) * w / S,
// and the zero blocks are skipped. slice_ends: increasing, the last = out's width.
// x [T, in] and out [T, out] in the model dtype (contiguous last dims); lora_a
// [L, R, in] fp32 with a contiguous last dim; lora_b [L, out, R] fp32 stored rank-major
// (stride(1) == 1: each column B[s, :, r] is contiguous); token_slots [T] int64,
// slot_ranks [L] int64 or empty. `out` is updated in place.
void lora_add(Tensor out, const Tensor& x, const Tensor& lora_a, const Tensor& lora_b,
               const Tensor& token_slots, const Tensor& slot_ranks, at::IntArrayRef slice_ends) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3,
              "expected x [T, in], out [T, out], lora_a [L, R, in], lora_b [L, out, R]");
  TORCH_CHECK(x.size(0) == out.size(0) && token_slots.numel() == x.size(0),
              "x, out and token_slots disagree on the token count");
  TORCH_CHECK(lora_a.size(2) == x.size(1) && lora_b.size(1) == out.size(1) &&
                  lora_a.size(1) == lora_b.size(2) && lora_a.size(0) == lora_b.size(0),
              "lora_a / lora_b shapes disagree with x / out");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && lora_a.stride(2) == 1,
              "x, out and lora_a need a contiguous last dim");
  TORCH_CHECK(lora_b.stride(1) == 1, "lora_b must be stored rank-major (stride(1) == 1)");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat,
              "lora_a and lora_b must be float32");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "x and out must share a dtype");
  TORCH_CHECK(token_slots.scalar_type() == at::kLong && slot_ranks.scalar_type() == at::kLong,
              "token_slots and slot_ranks must be int64");
  TORCH_CHECK(!slice_ends.empty() && slice_ends.back() == out.size(1),
              "slice_ends: one per slice, the last = out's width");
  for (size_t i = 0; i < slice_ends.size(); ++i) {
    TORCH_CHECK(slice_ends[i] > (i == 0 ? 0 : slice_ends[i - 1]), "slice_ends must increase");
  }
  TORCH_CHECK(lora_a.size(1) % static_cast<int64_t>(slice_ends.size()) == 0,
              "lora_a's rank columns: the same number per slice");
  const bool has_ranks = slot_ranks.numel() > 0;
  TORCH_CHECK(!has_ranks || slot_ranks.numel() == lora_a.size(0), "one rank per slot");
  const Tensor slots = token_slots.contiguous();
  const Tensor ranks = slot_ranks.contiguous();
  const int64_t* slot_data = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.numel(); ++t) {
    TORCH_CHECK(slot_data[t] < lora_a.size(0), "token_slots[", t, "] = ", slot_data[t],
                " but there are ", lora_a.size(0), " slots");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_add", [&] {
    lora_add_kernel<scalar_t>(out, x, lora_a, lora_b, slot_data,
                               has_ranks ? ranks.data_ptr<int64_t>() : nullptr, slice_ends);
  });
}

// ---------------------------------------------------------------- int8 projections

// One row: a = max |x| / 127 (1 if 0), q = round-half-even(x / a) in [-127, 127].
// Rounding adds and subtracts 1.5 * 2^23, which rounds any |value| < 2^22 to an
// integer in the default rounding mode (|x / a| <= 127 here) without a libm call.
template <typename T>
inline float quantize_row_int8(const T* x, const float* input_scales, int8_t* q, int64_t width) {
  constexpr float kRound = 12582912.0f;
  // x[k] * input_scales[k] in fp32 (x[k] without input scales)
  const auto value = [&](int64_t k) {
    return input_scales != nullptr ? load_f(x + k) * input_scales[k] : load_f(x + k);
  };
#if defined(__AVX512F__)
  const auto value16 = [&](int64_t k) {
    return input_scales != nullptr ? _mm512_mul_ps(load16(x + k), _mm512_loadu_ps(input_scales + k))
                                   : load16(x + k);
  };
#endif
  int64_t i = 0;
  float peak = 0.0f;
#if defined(__AVX512F__)
  __m512 peaks = _mm512_setzero_ps();
  for (; i + 16 <= width; i += 16) peaks = _mm512_max_ps(peaks, _mm512_abs_ps(value16(i)));
  peak = _mm512_reduce_max_ps(peaks);
#endif
  for (int64_t j = i; j < width; ++j) peak = std::max(peak, std::fabs(value(j)));
  float scale = peak / 127.0f;
  if (!(scale > 0.0f)) scale = 1.0f;
  i = 0;
#if defined(__AVX512F__)
  const __m512 scales = _mm512_set1_ps(scale), rounder = _mm512_set1_ps(kRound);
  const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
  for (; i + 16 <= width; i += 16) {
    __m512 r = _mm512_div_ps(value16(i), scales);
    r = _mm512_sub_ps(_mm512_add_ps(r, rounder), rounder);
    r = _mm512_min_ps(top, _mm512_max_ps(bottom, r));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
  }
#endif
  for (int64_t j = i; j < width; ++j) {
    const float r = (value(j) / scale + kRound) - kRound;
    q[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  return scale;
}

// The optional per-channel input scales [K] fp32 of an int8 op (nullptr: none).
const float* input_scales_of(const c10::optional<Tensor>& input_scales, int64_t width) {
  if (!input_scales.has_value() || !input_scales->defined()) {
    return nullptr;
  }
  TORCH_CHECK(input_scales->scalar_type() == at::kFloat && input_scales->is_contiguous() &&
                  input_scales->numel() == width, "input_scales must be [K] float32");
  return input_scales->data_ptr<float>();
}

template <typename T>
void quantize_rows_int8_kernel(const Tensor& x, const float* input_scales, Tensor& out,
                               Tensor& scales) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* x_data = x.data_ptr<T>();
  int8_t* q_data = out.data_ptr<int8_t>();
  float* scale_data = scales.data_ptr<float>();
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      scale_data[row] = quantize_row_int8(x_data + row * width, input_scales,
                                          q_data + row * width, width);
    }
  });
}

// Semantics: per row t of x [T, K] (contiguous), with v = x[t] * input_scales (fp32,
// per channel; v = x[t] without input_scales [K] float32): a = max_k |v[k]| / 127 (1 if
// that is 0), q[t, k] = round-half-even(v[k] / a) clamped to [-127, 127]; writes q into
// `out` [T, K] int8 and a into `scales` [T, 1] float32 (kernels/int8_matmul.py's torch
// path, in fp32).
void quantize_rows_int8(const Tensor& x, const c10::optional<Tensor>& input_scales, Tensor& out,
                        Tensor& scales) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, K] tensor");
  TORCH_CHECK(out.scalar_type() == at::kChar && out.is_contiguous() &&
                  out.sizes() == x.sizes(), "out must be a contiguous int8 tensor of x's shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == x.size(0), "scales must be a contiguous [T, 1] float32");
  const float* channel = input_scales_of(input_scales, x.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_int8", [&] {
    quantize_rows_int8_kernel<scalar_t>(x, channel, out, scales);
  });
}

template <typename T>
void dequantize_int32_kernel(const Tensor& acc, const Tensor& row_scales,
                             const Tensor& col_scales, const Tensor& bias, bool has_bias,
                             Tensor& out) {
  const int64_t rows = acc.size(0), width = acc.size(1);
  const int32_t* acc_data = acc.data_ptr<int32_t>();
  const float* row_data = row_scales.data_ptr<float>();
  const float* col_data = col_scales.data_ptr<float>();
  const T* bias_data = has_bias ? bias.data_ptr<T>() : nullptr;
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int32_t* a = acc_data + row * width;
      T* o = out_data + row * width;
      const float rs = row_data[row];
      if (has_bias) {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          const float v = static_cast<float>(a[i]) * rs * col_data[i];
          store_f(o + i, round_to<T>(v) + load_f(bias_data + i));
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) {
          store_f(o + i, static_cast<float>(a[i]) * rs * col_data[i]);
        }
      }
    }
  });
}

// Semantics: out[t, n] = dtype(float(acc[t, n]) * row_scales[t] * col_scales[n]), then
// + bias[n] in the dtype when given. acc [T, N] int32, row_scales [T, 1] and
// col_scales [N] float32, bias [N] and out [T, N] in the output dtype (contiguous).
void dequantize_int32(const Tensor& acc, const Tensor& row_scales, const Tensor& col_scales,
                      const c10::optional<Tensor>& bias, Tensor& out) {
  check_cpu(acc, "acc");
  TORCH_CHECK(acc.dim() == 2 && acc.is_contiguous() && acc.scalar_type() == at::kInt,
              "acc must be a contiguous [T, N] int32 tensor");
  TORCH_CHECK(row_scales.scalar_type() == at::kFloat && row_scales.is_contiguous() &&
                  row_scales.numel() == acc.size(0), "row_scales must be [T, 1] float32");
  TORCH_CHECK(col_scales.scalar_type() == at::kFloat && col_scales.is_contiguous() &&
                  col_scales.numel() == acc.size(1), "col_scales must be [N] float32");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == acc.sizes(), "out must match acc");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == acc.size(1) &&
                    bias->scalar_type() == out.scalar_type(), "bias must be [N] in out's dtype");
  }
  const Tensor bias_tensor = has_bias ? *bias : Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_int32", [&] {
    dequantize_int32_kernel<scalar_t>(acc, row_scales, col_scales, bias_tensor, has_bias, out);
  });
}

// ---------------------------------------------------------------- int8 rows (VNNI)

// Rows times an int8 weight, with the activations quantized per row as
// quantize_rows_int8 does, the int32 products rescaled in registers. The weight is packed
// in blocks of 16 output channels by 4 inputs ([ceil(N/16), ceil(K/4), 16, 4], zero
// padded), the layout of one VNNI instruction: u8 activations (q + 128) times s8 weights,
// 4 products summed into each int32 lane. The + 128 is taken back with the weight's
// column sums: acc - 128 * sum_k w[n, k].
//
// A tile is MR rows by NB blocks, MR * NB accumulators in registers over the whole K:
// 8 x 3 from 8 rows on (each 64-byte weight step feeds 8 rows from L1; 24 products per
// 3 weight loads and 8 broadcasts), 4 x 6 / 2 x 6 / 1 x 6 below (decode at a small
// batch, where reading the weight from memory is the cost). Threads split the output
// channels by tiles; a thread runs every row group through its tile while the tile's
// weight stays in L1 (docs/benchmarks.md, "Int8 tiles").
constexpr int64_t kVnniChannels = 16;
constexpr int64_t kVnniWideRows = 8;  // from this many rows on, tiles are 8 rows x 3 blocks

// The next tile's weight lines [first, end) (64 bytes each) that one row group requests
// into L2 while it multiplies, `per_step` of them per 4-input step; none where next is null.
struct NextTile {
  const int8_t* next = nullptr;
  int64_t first = 0, end = 0, per_step = 0;
};

// Rows [0, MR) of xu (stride x_stride, u8) times blocks [0, NB) of w (each k4s steps of
// 64 bytes, consecutive), rescaled into out (stride out_stride) per the Semantics below.
template <int MR, int NB, typename T>
FORCE_INLINE void int8_tile(const uint8_t* xu, int64_t x_stride, const int8_t* w, int64_t k4s,
                            const float* row_scales, const int32_t* sums, const float* scales,
                            const T* bias, int64_t n0, int64_t n_out, T* out, int64_t out_stride,
                            const NextTile& ahead) {
  int32_t acc[MR][NB][kVnniChannels];
#if defined(__AVX512VNNI__)
  __m512i v[MR][NB];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NB; ++j) {
      v[m][j] = _mm512_setzero_si512();
    }
  }
  for (int64_t k4 = 0; k4 < k4s; ++k4) {
    __m512i wv[NB];
    for (int j = 0; j < NB; ++j) {
      wv[j] = _mm512_loadu_si512(w + (j * k4s + k4) * 64);
    }
    for (int64_t p = 0; p < ahead.per_step; ++p) {
      const int64_t line = ahead.first + k4 * ahead.per_step + p;
      if (line < ahead.end) {
        __builtin_prefetch(ahead.next + line * 64, 0, 2);
      }
    }
    for (int m = 0; m < MR; ++m) {
      int32_t four;
      std::memcpy(&four, xu + m * x_stride + 4 * k4, sizeof(four));
      const __m512i a = _mm512_set1_epi32(four);
      for (int j = 0; j < NB; ++j) {
        v[m][j] = _mm512_dpbusd_epi32(v[m][j], a, wv[j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NB; ++j) {
      _mm512_storeu_si512(acc[m][j], v[m][j]);
    }
  }
#else
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < NB; ++j) {
      for (int64_t c = 0; c < kVnniChannels; ++c) {
        int32_t sum = 0;
        for (int64_t k4 = 0; k4 < k4s; ++k4) {
          const int8_t* wb = w + (j * k4s + k4) * 64 + c * 4;
          const uint8_t* xb = xu + m * x_stride + 4 * k4;
          for (int e = 0; e < 4; ++e) {
            sum += static_cast<int32_t>(xb[e]) * static_cast<int32_t>(wb[e]);
          }
        }
        acc[m][j][c] = sum;
      }
    }
  }
#endif
  for (int m = 0; m < MR; ++m) {
    const float rs = row_scales[m];
    T* o = out + m * out_stride;
    for (int j = 0; j < NB; ++j) {
      const int64_t first = n0 + j * kVnniChannels;
      const int64_t valid = std::min<int64_t>(kVnniChannels, n_out - first);
      int64_t c = 0;
#if defined(__AVX512F__)
      if (valid == kVnniChannels) {  // the loop below in 16 lanes, bit for bit
        const __m512i sums16 = _mm512_loadu_si512(sums + first);
        const __m512i product =
            _mm512_sub_epi32(_mm512_loadu_si512(acc[m][j]), _mm512_slli_epi32(sums16, 7));
        const __m512 value = _mm512_mul_ps(
            _mm512_mul_ps(_mm512_cvtepi32_ps(product), _mm512_set1_ps(rs)),
            _mm512_loadu_ps(scales + first));
        if (bias != nullptr) {
          store16(o + first, _mm512_add_ps(round16<T>(value), load16(bias + first)));
        } else {
          store16(o + first, value);
        }
        c = kVnniChannels;
      }
#endif
      for (; c < valid; ++c) {
        const int64_t n = first + c;
        const int32_t product = acc[m][j][c] - sums[n] * 128;
        const float value = static_cast<float>(product) * rs * scales[n];
        if (bias != nullptr) {
          store_f(o + n, round_to<T>(value) + load_f(bias + n));
        } else {
          store_f(o + n, value);
        }
      }
    }
  }
}

// Blocks [0, NB) of one tile for every row: row groups of MR, then the rest by 4, 2, 1.
// `next` (null for a thread's last tile) is the tile the thread multiplies after this one,
// `next_lines` 64-byte lines long: the row groups after the first (which reads this
// tile from memory; the only one where there is one) request it into L2, in equal
// shares, so that it is on its way while this tile runs from L1 (docs/benchmarks.md,
// "Int8 tiles": 8% at 64 rows, 20% at one row against a fixed prefetch distance).
template <int MR, int NB, typename T>
void int8_tile_rows(const uint8_t* xu, int64_t padded, const int8_t* w, int64_t k4s, int64_t rows,
                    const float* row_scales, const int32_t* sums, const float* scales,
                    const T* bias, int64_t n0, int64_t n_out, T* out, const int8_t* next,
                    int64_t next_lines) {
  int64_t groups = rows / MR;
  for (int64_t left = rows % MR, size = MR / 2; size >= 1; size /= 2) {
    groups += left / size;
    left %= size;
  }
  const int64_t sharing = groups > 1 ? groups - 1 : 1;
  const int64_t share = (next_lines + sharing - 1) / sharing;
  int64_t group = 0;
  const auto ahead = [&]() {
    NextTile tile;
    const int64_t index = groups > 1 ? group - 1 : group;
    if (next != nullptr && index >= 0) {
      tile.next = next;
      tile.first = index * share;
      tile.end = std::min(next_lines, tile.first + share);
      tile.per_step = (share + k4s - 1) / k4s;
    }
    ++group;
    return tile;
  };
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) {
    int8_tile<MR, NB>(xu + m * padded, padded, w, k4s, row_scales + m, sums, scales, bias, n0,
                      n_out, out + m * n_out, n_out, ahead());
  }
  if constexpr (MR > 4) {
    for (; m + 4 <= rows; m += 4) {
      int8_tile<4, NB>(xu + m * padded, padded, w, k4s, row_scales + m, sums, scales, bias, n0,
                       n_out, out + m * n_out, n_out, ahead());
    }
  }
  if constexpr (MR > 2) {
    for (; m + 2 <= rows; m += 2) {
      int8_tile<2, NB>(xu + m * padded, padded, w, k4s, row_scales + m, sums, scales, bias, n0,
                       n_out, out + m * n_out, n_out, ahead());
    }
  }
  for (; m < rows; ++m) {
    int8_tile<1, NB>(xu + m * padded, padded, w, k4s, row_scales + m, sums, scales, bias, n0,
                     n_out, out + m * n_out, n_out, ahead());
  }
}

// f(std::integral_constant<int, count>{}) for a runtime count in [1, MAX].
template <int MAX, typename F>
FORCE_INLINE void with_block_count(int64_t count, const F& f) {
  if constexpr (MAX == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (count == MAX) {
    f(std::integral_constant<int, MAX>{});
  } else {
    with_block_count<MAX - 1>(count, f);
  }
}

// Every tile of NB blocks (the last one narrower) in parallel over the output channels.
template <int MR, int NB, typename T>
void int8_tiles(const uint8_t* xu, int64_t padded, const int8_t* w, int64_t k4s, int64_t blocks,
                int64_t rows, const float* row_scales, const int32_t* sums, const float* scales,
                const T* bias, int64_t n_out, T* out) {
  const int64_t tiles = (blocks + NB - 1) / NB;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t block0 = tile * NB;
      const int8_t* wt = w + block0 * k4s * 64;
      const int64_t n0 = block0 * kVnniChannels;
      const int64_t next_blocks = tile + 1 < end ? std::min<int64_t>(NB, blocks - block0 - NB) : 0;
      const int8_t* next = next_blocks > 0 ? wt + NB * k4s * 64 : nullptr;
      const auto run = [&](auto width) {
        int8_tile_rows<MR, decltype(width)::value>(xu, padded, wt, k4s, rows, row_scales, sums,
                                                   scales, bias, n0, n_out, out, next,
                                                   next_blocks * k4s);
      };
      with_block_count<NB>(std::min<int64_t>(NB, blocks - block0), run);
    }
  });
}

template <typename T>
void int8_linear_rows_kernel(const Tensor& x, const float* input_scales, const Tensor& packed,
                             const Tensor& col_sums, const Tensor& col_scales, const T* bias,
                             Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1), n_out = out.size(1);
  const int64_t blocks = packed.size(0), k4s = packed.size(1), padded = 4 * k4s;
  const T* x_data = x.data_ptr<T>();
  // Quantized rows padded with quantized zeros, then + 128 as bytes (q ^ 0x80).
  std::vector<uint8_t> xu(rows * padded, 0);
  std::vector<float> row_scales(rows);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* row = xu.data() + t * padded;
      row_scales[t] = quantize_row_int8(x_data + t * width, input_scales,
                                        reinterpret_cast<int8_t*>(row), width);
      for (int64_t k = 0; k < padded; ++k) {
        row[k] ^= 0x80u;
      }
    }
  });
  const int8_t* w = packed.data_ptr<int8_t>();
  const int32_t* sums = col_sums.data_ptr<int32_t>();
  const float* scales = col_scales.data_ptr<float>();
  T* out_data = out.data_ptr<T>();
  if (rows >= kVnniWideRows) {
    int8_tiles<8, 3>(xu.data(), padded, w, k4s, blocks, rows, row_scales.data(), sums, scales,
                     bias, n_out, out_data);
  } else {
    int8_tiles<4, 6>(xu.data(), padded, w, k4s, blocks, rows, row_scales.data(), sums, scales,
                     bias, n_out, out_data);
  }
}

// Semantics: per row t of x [T, K] (contiguous), quantized as quantize_rows_int8 does
// (with its optional per-channel input_scales): q[t], a;
// out[t, n] = dtype(float(sum_k q[t, k] * w[n, k]) * a * col_scales[n]), then + bias[n]
// in the dtype when given (dequantize_int32): bit for bit the int32 product of
// quantize_rows_int8 + torch._int_mm + dequantize_int32. w [N, K] int8 is given packed
// ([ceil(N/16), ceil(K/4), 16, 4], zero padded; kernels/int8_matmul.py pack_vnni) with
// col_sums [N] int32 = sum_k w[n, k]; col_scales [N] fp32; out [T, N] in x's dtype.
void int8_linear_rows(const Tensor& x, const c10::optional<Tensor>& input_scales,
                      const Tensor& packed, const Tensor& col_sums, const Tensor& col_scales,
                      const c10::optional<Tensor>& bias, Tensor out) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, K] tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kChar &&
                  packed.size(2) == kVnniChannels && packed.size(3) == 4 &&
                  4 * packed.size(1) >= x.size(1) && 4 * (packed.size(1) - 1) < x.size(1),
              "packed must be a contiguous [ceil(N/16), ceil(K/4), 16, 4] int8 tensor");
  const int64_t n_out = out.dim() == 2 ? out.size(1) : -1;
  TORCH_CHECK(out.is_contiguous() && n_out >= 0 && out.size(0) == x.size(0) &&
                  out.scalar_type() == x.scalar_type() &&
                  (n_out + kVnniChannels - 1) / kVnniChannels == packed.size(0),
              "out must be a contiguous [T, N] tensor in x's dtype");
  TORCH_CHECK(col_sums.scalar_type() == at::kInt && col_sums.is_contiguous() &&
                  col_sums.numel() == n_out, "col_sums must be [N] int32");
  TORCH_CHECK(col_scales.scalar_type() == at::kFloat && col_scales.is_contiguous() &&
                  col_scales.numel() == n_out, "col_scales must be [N] float32");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == n_out &&
                    bias->scalar_type() == out.scalar_type(), "bias must be [N] in x's dtype");
  }
  if (x.size(0) == 0) {
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear_rows", [&] {
    const scalar_t* bias_data = has_bias ? bias->data_ptr<scalar_t>() : nullptr;
    int8_linear_rows_kernel<scalar_t>(x, input_scales_of(input_scales, x.size(1)), packed,
                                      col_sums, col_scales, bias_data, out);
  });
}

// ---------------------------------------------------------------- int4 dequantize

template <typename T>
void dequantize_int4_kernel(const Tensor& packed, const float* scales, const int8_t* zeros,
                            int64_t group_size, int64_t groups, Tensor& out) {
  const int64_t rows = out.size(0), width = out.size(1), words = packed.size(1);
  const int32_t* packed_data = packed.data_ptr<int32_t>();
  T* out_data = out.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int32_t* row = packed_data + n * words;
      T* o = out_data + n * width;
      for (int64_t g = 0; g < groups; ++g) {
        const float scale = scales[n * groups + g];
        const float offset = 8.0f + (zeros != nullptr ? zeros[n * groups + g] : 0);
        const int64_t stop = std::min(width, (g + 1) * group_size);
        int64_t k = g * group_size;
#if defined(__AVX512F__)
        if (k % 8 == 0) {  // 16 values (two words) at a time, bit for bit the loop below
          const __m512i shifts = _mm512_set_epi32(28, 24, 20, 16, 12, 8, 4, 0, 28, 24, 20, 16,
                                                  12, 8, 4, 0);
          const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
          const __m512 offsets = _mm512_set1_ps(offset), scales16 = _mm512_set1_ps(scale);
          for (; k + 16 <= stop; k += 16) {
            // lanes 0-7 the word of values k .. k + 7, lanes 8-15 the next one
            const __m512i words = _mm512_permutexvar_epi32(
                halves, _mm512_castsi128_si512(
                            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + (k >> 3)))));
            const __m512i nibbles =
                _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(15));
            store16(o + k, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(nibbles), offsets),
                                         scales16));
          }
        }
#endif
        for (; k < stop; ++k) {
          const uint32_t word = static_cast<uint32_t>(row[k >> 3]);
          const float nibble = static_cast<float>((word >> (4 * (k & 7))) & 15u);
          store_f(o + k, (nibble - offset) * scale);
        }
      }
    }
  });
}

// Semantics: out[n, k] = dtype((q[n, k] - zeros[n, k / g]) * scales[n, k / g]) in fp32,
// with q[n, k] = ((packed[n, k / 8] >> 4 (k % 8)) & 15) - 8 (kernels/int4_matmul.py's
// pack_int4 layout) and zeros 0 where not given: packed [N, ceil(K / 8)] int32; scales
// [N, G] fp32 and zeros [N, G] int8 with G = ceil(K / g); out [N, K] float32, bf16 or
// fp16.
void dequantize_int4(const Tensor& packed, const Tensor& scales, const c10::optional<Tensor>& zeros,
                     int64_t group_size, Tensor out) {
  check_cpu(packed, "packed");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous(), "out must be a contiguous [N, K] tensor");
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1");
  const int64_t rows = out.size(0), width = out.size(1);
  const int64_t groups = (width + group_size - 1) / group_size;
  TORCH_CHECK(packed.dim() == 2 && packed.is_contiguous() && packed.scalar_type() == at::kInt &&
                  packed.size(0) == rows && packed.size(1) == (width + 7) / 8,
              "packed must be a contiguous [N, ceil(K / 8)] int32 tensor");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.numel() == rows * groups, "scales must be [N, ceil(K / g)] float32");
  const bool has_zeros = zeros.has_value() && zeros->defined();
  if (has_zeros) {
    TORCH_CHECK(zeros->is_contiguous() && zeros->scalar_type() == at::kChar &&
                    zeros->numel() == rows * groups, "zeros must be [N, ceil(K / g)] int8");
  }
  const int8_t* zero_data = has_zeros ? zeros->data_ptr<int8_t>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequantize_int4", [&] {
    dequantize_int4_kernel<scalar_t>(packed, scales.data_ptr<float>(), zero_data, group_size,
                                     groups, out);
  });
}

// ---------------------------------------------------------------- greedy tokens

// One row's (first index of its maximum, whether that maximum is finite and the row
// holds no NaN).
template <typename T>
std::pair<int64_t, bool> row_argmax(const T* row, int64_t width) {
  float peak = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 peak16 = _mm512_set1_ps(peak);
  __mmask16 unordered = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 v = load16(row + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    peak16 = _mm512_max_ps(peak16, v);
  }
  peak = _mm512_reduce_max_ps(peak16);
  nan = unordered != 0;
#endif
  for (; i < width; ++i) {
    const float v = load_f(row + i);
    nan = nan || std::isnan(v);
    peak = std::max(peak, v);
  }
  if (nan || !std::isfinite(peak)) {
    return {0, false};
  }
  i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(peak);
  for (; i + 16 <= width; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(load16(row + i), target, _CMP_EQ_OQ);
    if (hit != 0) {
      return {i + __builtin_ctz(static_cast<unsigned>(hit)), true};
    }
  }
#endif
  for (; i < width; ++i) {
    if (load_f(row + i) == peak) {
      return {i, true};
    }
  }
  return {0, false};
}

// Semantics: for each row s of logits [S, V] (last dim contiguous), out[0, s] = the
// first index of the row's maximum (torch.max(logits, -1).indices) and out[1, s] = 1
// where that maximum is finite and the row holds no NaN, else 0 (out[0, s] then 0).
// out [2, S] int64, written in place.
void greedy_tokens(const Tensor& logits, Tensor out) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [S, V], last dim contiguous");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == 2 && out.size(1) == logits.size(0),
              "out must be a contiguous [2, S] int64 tensor");
  const int64_t rows = logits.size(0), width = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(width > 0, "logits must have at least one column");
  int64_t* tokens = out.data_ptr<int64_t>();
  int64_t* finite = tokens + rows;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "greedy", [&] {
    const scalar_t* data = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t s = begin; s < end; ++s) {
        const auto [token, ok] = row_argmax(data + s * stride, width);
        tokens[s] = token;
        finite[s] = ok ? 1 : 0;
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY(loraplex_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("paged_prefill_attention(Tensor q, Tensor kv_cache, Tensor block_tables, "
        "Tensor query_lens, Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, Tensor(a!) out, "
        "Tensor(b!)? residual_out) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("greedy_tokens(Tensor logits, Tensor(a!) out) -> ()");
  m.def("int8_linear_rows(Tensor x, Tensor? input_scales, Tensor packed, Tensor col_sums, "
        "Tensor col_scales, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("rotary_write_kv(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(c!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor lora_a, Tensor lora_b, "
        "Tensor token_slots, Tensor slot_ranks, int[] slice_ends) -> ()");
  m.def("quantize_rows_int8(Tensor x, Tensor? input_scales, Tensor(a!) out, Tensor(b!) scales) -> ()");
  m.def("dequantize_int32(Tensor acc, Tensor row_scales, Tensor col_scales, Tensor? bias, "
        "Tensor(a!) out) -> ()");
  m.def("dequantize_int4(Tensor packed, Tensor scales, Tensor? zeros, int group_size, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(loraplex_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("greedy_tokens", &greedy_tokens);
  m.impl("int8_linear_rows", &int8_linear_rows);
  m.impl("rotary_write_kv", &rotary_write_kv);
  m.impl("lora_add", &lora_add);
  m.impl("quantize_rows_int8", &quantize_rows_int8);
  m.impl("dequantize_int32", &dequantize_int32);
  m.impl("dequantize_int4", &dequantize_int4);
}
