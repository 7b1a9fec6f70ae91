// Vectorised CPU kernels for where MLX's Linux CPU backend spends a forward:
// it evaluates exp/power one scalar at a time (~6-15 ns per element; SwiGLU
// and the attention softmax), a batched decode's attention is ~100 tiny GEMM
// calls per layer (here: one pass over each row's blocks of the KV pool), and
// OpenBLAS re-packs every weight matrix on every call (the linear layers; see
// "packed in 16-column panels" below). Each op here
// is an MLX primitive, so it stays lazy and runs on the stream it was created
// on.
//
// Built by scripts/build_native.py against the installed MLX (headers, libmlx
// and nanobind domain "mlx", so mx.array passes straight through). Python
// falls back to meshlm/model/cpu_kernels.py's MLX versions when it is absent.

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <sys/mman.h>
#include <unistd.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MESHLM_AVX2 1
#else
#define MESHLM_AVX2 0
#endif
#if MESHLM_AVX2 && defined(__AVX512F__)
#define MESHLM_AVX512 1
#else
#define MESHLM_AVX512 0
#endif

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace nb = nanobind;
namespace mx = mlx::core;

namespace {

constexpr float LOG2E = 1.4426950408889634f;

// Whether the kernels use their 512-bit versions: on where the build has them, unless turned off (the
// 256-bit ones stay selectable, so tests cover both on a machine with AVX-512). Read when a kernel runs.
std::atomic<bool>& wide_kernels() {
  static std::atomic<bool> on{MESHLM_AVX512};
  return on;
}

// Whether the few-row GEMM kernel and the paged decode prefetch in software what they read next
// (gemm_few_rows, prefetch_row): on Intel cores, where each is 12-17 % faster with it; off elsewhere, as
// on the AMD EPYC VM, where the GEMM's was slower. Settable, so tests run both paths on any machine.
std::atomic<bool>& software_prefetch() {
  static std::atomic<bool> on{__builtin_cpu_is("intel") != 0};
  return on;
}

// 2^x, relative error ~2e-7 (Cephes exp2f polynomial on [-0.5, 0.5]); inputs
// below -64 give exactly 0. Branch-free so the loops around it vectorise.
// Why 0 below -64: a softmax weight under 2^-64 of the row's largest changes
// no float32 sum, while one near 2^-126 (every masked key) turns subnormal once
// normalised, and Intel cores multiply subnormals through microcode assists:
// a causal prefill's attention ran 20x slower on a Xeon (docs/BENCHMARKS.md).
inline float exp2_fast(float x) {
  float keep = x >= -64.0f ? 1.0f : 0.0f;
  x = std::min(std::max(x, -64.0f), 127.0f);
  float whole = std::nearbyint(x);
  float f = x - whole;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(whole) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale * keep;
}

// Not inlined (nor rms_norm_kernel, rope_kernel): the fused decode layer calls them too, and its outputs
// are the unfused ops' bit for bit only if both run the same machine code (a reduction inlined elsewhere
// may be vectorised another way).
#define MESHLM_SHARED_KERNEL __attribute__((noinline))
MESHLM_SHARED_KERNEL void swiglu_kernel(const float* __restrict g, const float* __restrict x, float* __restrict out,
                                        size_t n) {
#pragma omp simd
  for (size_t i = 0; i < n; ++i) {
    out[i] = g[i] * x[i] / (1.0f + exp2_fast(-g[i] * LOG2E));
  }
}

// RMSNorm over rows of D: x * rsqrt(mean(x^2) + eps) * w, the order mx.fast.rms_norm's CPU fallback
// uses (which is ~6 MLX ops and nodes per call; a decode step of the demo model has 61 of them).
MESHLM_SHARED_KERNEL void rms_norm_kernel(const float* __restrict x, const float* __restrict w, float* __restrict out,
                                          int64_t rows, int64_t D, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * D;
    float* o = out + r * D;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t d = 0; d < D; ++d) ss += xr[d] * xr[d];
    float inv = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = (xr[d] * inv) * w[d];
  }
}

// RoPE with one position per token: x[t, h] (D values, contiguous) at x + t * xs_t + h * xs_h,
// positions (T,); out token-major (T, H, D). The first `dims` of each head rotate by angle
// position * scale * inv_freq[i] (pairs (i, i + dims/2), or (2i, 2i+1) when `traditional`); the rest
// pass through. mx.fast.rope's CPU fallback builds ~40 MLX ops per call.
MESHLM_SHARED_KERNEL void rope_kernel(const float* __restrict x, int64_t xs_t, int64_t xs_h,
                                      const int32_t* __restrict positions, const float* __restrict inv_freq,
                                      float* __restrict out, int64_t rows, int64_t H, int64_t D, int64_t dims,
                                      bool traditional, float scale) {
  const int64_t half = dims / 2;
  std::vector<float> c(half), s(half);
  for (int64_t r = 0; r < rows; ++r) {
    float p = static_cast<float>(positions[r]) * scale;
    for (int64_t i = 0; i < half; ++i) {
      float theta = p * inv_freq[i];
      c[i] = std::cos(theta);
      s[i] = std::sin(theta);
    }
    for (int64_t h = 0; h < H; ++h) {
      const float* xi = x + r * xs_t + h * xs_h;
      float* o = out + (r * H + h) * D;
      if (traditional) {
        for (int64_t i = 0; i < half; ++i) {
          float a = xi[2 * i], b = xi[2 * i + 1];
          o[2 * i] = a * c[i] - b * s[i];
          o[2 * i + 1] = a * s[i] + b * c[i];
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          float a = xi[i], b = xi[i + half];
          o[i] = a * c[i] - b * s[i];
          o[i + half] = a * s[i] + b * c[i];
        }
      }
      std::copy(xi + dims, xi + D, o + dims);
    }
  }
}

// The largest of n floats (-inf for none). GCC leaves `omp simd reduction(max)` over std::max scalar: one
// vmaxss after another, 4 cycles each, which made the max ~half of a long row's softmax (the causal
// prefill's rows of thousands of keys). A max is exact in any order, so the lanes change no result.
float row_max(const float* __restrict x, int64_t n) {
  float m = -INFINITY;
  int64_t i = 0;
#if MESHLM_AVX512
  __m512 a = _mm512_set1_ps(-INFINITY), b = a, c = a, d = a;
  for (; i + 64 <= n; i += 64) {
    a = _mm512_max_ps(a, _mm512_loadu_ps(x + i));
    b = _mm512_max_ps(b, _mm512_loadu_ps(x + i + 16));
    c = _mm512_max_ps(c, _mm512_loadu_ps(x + i + 32));
    d = _mm512_max_ps(d, _mm512_loadu_ps(x + i + 48));
  }
  for (; i + 16 <= n; i += 16) a = _mm512_max_ps(a, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a, b), _mm512_max_ps(c, d)));
#elif MESHLM_AVX2
  __m256 a = _mm256_set1_ps(-INFINITY), b = a;
  for (; i + 16 <= n; i += 16) {
    a = _mm256_max_ps(a, _mm256_loadu_ps(x + i));
    b = _mm256_max_ps(b, _mm256_loadu_ps(x + i + 8));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(a, b));
  for (float v : lanes) m = std::max(m, v);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Rows of base-2 scores -> probabilities (each row sums to 1).
// Softmax over each row of base-2 scores; with `lse`, also each row's log2-sum-exp (max + log2(sum)),
// for merging partial attentions over disjoint keys without a second pass over the scores.
void softmax2_kernel(const float* __restrict s, float* __restrict out, size_t rows, size_t n,
                     float* __restrict lse = nullptr) {
  for (size_t r = 0; r < rows; ++r) {
    const float* row = s + r * n;
    float* o = out + r * n;
    float m = row_max(row, static_cast<int64_t>(n));
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (size_t i = 0; i < n; ++i) {
      o[i] = exp2_fast(row[i] - m);
      sum += o[i];
    }
    float inv = 1.0f / sum;
#pragma omp simd
    for (size_t i = 0; i < n; ++i) o[i] *= inv;
    if (lse) lse[r] = m + std::log2(sum);
  }
}

#if MESHLM_AVX2
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// scores[s] = q . keys[s] for D a multiple of 16.
void head_scores(const float* __restrict q, const float* __restrict kh, int64_t kstride, int64_t S, int64_t D,
                 float* __restrict scores) {
  for (int64_t s = 0; s < S; ++s) {
    const float* kr = kh + s * kstride;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(kr + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(kr + d + 8), a1);
    }
    scores[s] = hsum(_mm256_add_ps(a0, a1));
  }
}

#if MESHLM_AVX512
inline __m256 fold(__m512 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// The eight lane sums of a0..a7 as one vector, by a tree of adds: ~3 operations a sum, where one
// _mm512_reduce_add_ps per key took ~8 in a chain.
inline __m256 sum8(__m512 a0, __m512 a1, __m512 a2, __m512 a3, __m512 a4, __m512 a5, __m512 a6, __m512 a7) {
  __m256 h01 = _mm256_hadd_ps(fold(a0), fold(a1)), h23 = _mm256_hadd_ps(fold(a2), fold(a3));
  __m256 h45 = _mm256_hadd_ps(fold(a4), fold(a5)), h67 = _mm256_hadd_ps(fold(a6), fold(a7));
  __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);  // per 128-bit lane: 4 partial sums
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// How far ahead the paged decode's 512-bit kernels prefetch, in rows of the head they read. Each block's
// rows are a few KiB of a scattered block, whose 4 KiB pages the hardware prefetchers do not cross. On
// the Xeon VM (2026-11-28, docs/BENCHMARKS.md), 30 demo layers (3 KV heads of 64): one 3,900-key row
// 12.2 -> 10.1 ms with 8 rows, 9.7 with 16; 16 rows of 250 keys 12.0 -> 10.3 (16: 10.0); but 8 KV heads of
// 128, 4 rows of 2,000 keys, 27.0 -> 26.9 with 8 and 30.6 with 16, and a pipeline stage's 8 heads of 64
// the same with 8 rows.
constexpr int64_t DECODE_PREFETCH_ROWS = 8;

// Prefetch a head's row `row` of a block of S rows `stride` floats apart (`bytes` of it), or of the row's
// next block `next` (null: the row's last block) past its end.
inline void prefetch_row(const float* block, int64_t S, const float* next, int64_t stride, int64_t row,
                         int64_t bytes) {
  const float* a = row < S ? block + row * stride : next != nullptr ? next + (row - S) * stride : nullptr;
  if (a == nullptr) return;
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(a) + o, _MM_HINT_T0);
}

// o[j][0:DV*16] += sum_s p[j][s] * values[s][0:DV*16] for the NQ query heads of one KV head at once: each
// value row is loaded once for all of them (one block of a paged row; p rows pstride apart). The same
// multiply-adds in the same order per element as one head at a time, so the same result.
// `next`, `prefetch`: the head's next block, and whether to prefetch its rows ahead (prefetch_row).
template <int NQ, int DV>
inline void weighted_values_multi(const float* __restrict p, int64_t pstride, const float* __restrict vh,
                                  int64_t vstride, int64_t S, float* __restrict o, int64_t ostride,
                                  const float* next = nullptr, bool prefetch = false) {
  static_assert(NQ * DV <= 16);
  __m512 acc[NQ][DV];
#pragma GCC unroll 16
  for (int j = 0; j < NQ; ++j) {
#pragma GCC unroll 16
    for (int d = 0; d < DV; ++d) acc[j][d] = _mm512_loadu_ps(o + j * ostride + 16 * d);
  }
  for (int64_t s = 0; s < S; ++s) {
    const float* vr = vh + s * vstride;
    if (prefetch) prefetch_row(vh, S, next, vstride, s + DECODE_PREFETCH_ROWS, DV * 64);
    __m512 v[DV];
#pragma GCC unroll 16
    for (int d = 0; d < DV; ++d) v[d] = _mm512_loadu_ps(vr + 16 * d);
#pragma GCC unroll 16
    for (int j = 0; j < NQ; ++j) {
      __m512 w = _mm512_set1_ps(p[j * pstride + s]);
#pragma GCC unroll 16
      for (int d = 0; d < DV; ++d) acc[j][d] = _mm512_fmadd_ps(w, v[d], acc[j][d]);
    }
  }
#pragma GCC unroll 16
  for (int j = 0; j < NQ; ++j) {
#pragma GCC unroll 16
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(o + j * ostride + 16 * d, acc[j][d]);
  }
}

// All r query heads' values of one block, in groups as wide as the registers allow (D 64 or 128); false:
// another head size, which the caller handles one head at a time.
inline bool weighted_values_heads(const float* p, int64_t pstride, int64_t r, const float* vb, int64_t vstride,
                                  int64_t n, float* o, int64_t D, const float* next = nullptr,
                                  bool prefetch = false) {
  // Query heads j.. as one group of NQ. The first group reads each row first: it prefetches, and the
  // others find the rows in L1.
  auto group = [&]<int NQ, int DV>(int64_t j) {
    weighted_values_multi<NQ, DV>(p + j * pstride, pstride, vb, vstride, n, o + j * D, D, next, prefetch && j == 0);
  };
  if (D == 64) {
    int64_t j = 0;
    for (; j + 4 <= r; j += 4) group.template operator()<4, 4>(j);
    switch (r - j) {
      case 3: group.template operator()<3, 4>(j); break;
      case 2: group.template operator()<2, 4>(j); break;
      case 1: group.template operator()<1, 4>(j); break;
    }
    return true;
  }
  if (D == 128) {
    int64_t j = 0;
    for (; j + 2 <= r; j += 2) group.template operator()<2, 8>(j);
    if (j < r) group.template operator()<1, 8>(j);
    return true;
  }
  return false;
}

// scores[s] = q . keys[s] for D a multiple of 16, eight keys at a time: eight independent FMA chains keep
// both FMA units busy, where head_scores' one key at a time waits on its chain of dependent FMAs and its
// horizontal sum (~4x slower per key on a Xeon).
// `next`, `prefetch`: as weighted_values_multi's.
void head_scores_512(const float* __restrict q, const float* __restrict kh, int64_t kstride, int64_t S, int64_t D,
                     float* __restrict scores, const float* next = nullptr, bool prefetch = false) {
  int64_t s = 0;
  for (; s + 8 <= S; s += 8) {
    const float* kr = kh + s * kstride;
    for (int64_t i = 0; prefetch && i < 8; ++i) {
      prefetch_row(kh, S, next, kstride, s + DECODE_PREFETCH_ROWS + i, D * 4);
    }
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < D; d += 16) {
      __m512 qv = _mm512_loadu_ps(q + d);
      a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + d), a0);
      a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + kstride + d), a1);
      a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + 2 * kstride + d), a2);
      a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + 3 * kstride + d), a3);
      a4 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + 4 * kstride + d), a4);
      a5 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + 5 * kstride + d), a5);
      a6 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + 6 * kstride + d), a6);
      a7 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kr + 7 * kstride + d), a7);
    }
    _mm256_storeu_ps(scores + s, sum8(a0, a1, a2, a3, a4, a5, a6, a7));
  }
  for (; s < S; ++s) {
    const float* kr = kh + s * kstride;
    __m512 a = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(kr + d), a);
    scores[s] = _mm512_reduce_add_ps(a);
  }
}
#endif

// out[0:64] += sum_s p[s] * values[s][0:64] (no scaling): one block of a paged row at a time.
void weighted_values_64_acc(const float* __restrict p, const float* __restrict vh, int64_t vstride, int64_t S,
                            float* __restrict out) {
  __m256 c0 = _mm256_loadu_ps(out), c1 = _mm256_loadu_ps(out + 8), c2 = _mm256_loadu_ps(out + 16),
         c3 = _mm256_loadu_ps(out + 24), c4 = _mm256_loadu_ps(out + 32), c5 = _mm256_loadu_ps(out + 40),
         c6 = _mm256_loadu_ps(out + 48), c7 = _mm256_loadu_ps(out + 56);
  for (int64_t s = 0; s < S; ++s) {
    if (p[s] == 0.0f) continue;
    const float* vr = vh + s * vstride;
    __m256 w = _mm256_broadcast_ss(p + s);
    c0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), c0);
    c1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), c1);
    c2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), c2);
    c3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), c3);
    c4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 32), c4);
    c5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 40), c5);
    c6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 48), c6);
    c7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 56), c7);
  }
  _mm256_storeu_ps(out, c0);
  _mm256_storeu_ps(out + 8, c1);
  _mm256_storeu_ps(out + 16, c2);
  _mm256_storeu_ps(out + 24, c3);
  _mm256_storeu_ps(out + 32, c4);
  _mm256_storeu_ps(out + 40, c5);
  _mm256_storeu_ps(out + 48, c6);
  _mm256_storeu_ps(out + 56, c7);
}

#endif

// Base-2 softmax of one row of scores in place (every key counts: a paged row's keys are exactly its
// length); returns 1 / sum. The max is a vector reduction: its scalar loop took ~13 % of the kernel.
float softmax_row(float* __restrict sc, int64_t S, float* max_sum = nullptr) {
  float m = row_max(sc, S);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t s = 0; s < S; ++s) {
    float p = exp2_fast(sc[s] - m);
    sc[s] = p;
    sum += p;
  }
  if (max_sum) max_sum[0] = m, max_sum[1] = sum;
  return sum > 0.0f ? 1.0f / sum : 0.0f;
}

// Paged decode: one query position per row against the row's blocks of a KV pool. q (R, Hk, r, D)
// pre-scaled by scale*log2(e); pools (slots, Hk, D) with rows of D contiguous; tables (R, max_blocks)
// of block ids, lengths (R,) of keys per row. A block id outside the pool (which the runner refuses
// before it builds the op) reads nothing: the row's output is zeros, never a stray read.
struct PagedShape {
  int64_t R, Hk, r, D, slots, max_blocks, block_size;
  int64_t ks[2], vs[2];  // element strides of the pools on Hk, slot
  float q_scale;  // applied to q here: a separate multiply is one more graph node per layer
  bool wide = false;  // the 512-bit scores (wide_kernels)
  bool prefetch = false;  // the 512-bit kernels prefetch the rows they read next (software_prefetch)
};

// Where a chunk of a long row's keys leaves its partial attention (see paged_decode).
struct DecodeChunk {
  float* out = nullptr;      // (R, count, Hk, r, D) unnormalised outputs; null: the whole row, normalised
  float* max_sum = nullptr;  // (R, count, Hk, r, 2) each head's max score and sum of weights
  int64_t keys = 0, index = 0, count = 0;  // keys a chunk, this chunk, chunks a row at most
};

// One item of a paged decode: row b's query heads of KV heads h0..h1 (a row's KV heads are independent,
// so the GEMM threads share a step's items: one decode row of the demo model has 3 heads, a 6-token
// verify 18). The pools are token-major, a slot's KV heads side by side, so the item walks each block
// once for all its heads: one KV head at a time read a block's keys as 256-byte pieces 2 KB apart and
// left the rest of each line pair to L3, which the other stage's weight stream evicts on a shared
// machine. Per head the same multiply-adds in the same order as one head an item, so the same result.
// `lse`, where given (whole rows only): each query head's natural log-sum-exp, (R, Hk, r); -inf for a row
// with no keys, whose output is zeros (a partial attention, merged with others by log-sum-exp).
void paged_decode_item(const PagedShape& sh, const float* q, const float* k, const float* v,
                       const int32_t* tables, const int32_t* lengths, float* out, int64_t b, int64_t h0,
                       int64_t h1, const DecodeChunk& chunk = {}, float* lse = nullptr) {
  const int64_t r = sh.r, D = sh.D, bs = sh.block_size, pool_blocks = sh.slots / bs, G = h1 - h0, n_q = G * r;
  thread_local std::vector<float> scores, qbuf, inv;  // per thread: no allocation per item
  int64_t row_len = std::max<int64_t>(0, std::min<int64_t>(lengths[b], sh.max_blocks * bs));
  const int32_t* table = tables + b * sh.max_blocks;
  bool valid = row_len > 0;
  for (int64_t j = 0; j * bs < row_len; ++j) valid = valid && table[j] >= 0 && table[j] < pool_blocks;
  float* oh = out + (b * sh.Hk + h0) * r * D;  // (G, r, D): the item's heads are adjacent in out
  float* lh = lse && !chunk.out ? lse + (b * sh.Hk + h0) * r : nullptr;  // (G, r), like oh
  if (!valid) {
    if (!chunk.out) std::fill(oh, oh + n_q * D, 0.0f);  // a chunk's part stays zeros, and so does the merge
    if (lh) std::fill(lh, lh + n_q, -std::numeric_limits<float>::infinity());
    return;
  }
  // A chunk of a long row: its keys [first, first + len) only, its output unnormalised in the chunk's
  // place, with each head's max and sum for the merge (paged_decode).
  int64_t first = chunk.out ? chunk.index * chunk.keys : 0;
  int64_t len = chunk.out ? std::min(chunk.keys, row_len - first) : row_len;
  table += first / bs;
  if (chunk.out) oh = chunk.out + ((b * chunk.count + chunk.index) * sh.Hk + h0) * r * D;
  if (static_cast<int64_t>(scores.size()) < n_q * len) scores.resize(n_q * len);
  if (static_cast<int64_t>(qbuf.size()) < n_q * D) qbuf.resize(n_q * D);
  if (static_cast<int64_t>(inv.size()) < n_q) inv.resize(n_q);
  // The r query heads sharing a KV head go through its blocks together: each block's keys and
  // values are read from memory once and reused from L1 by every query head (one query head at a
  // time read a long row's keys r times from beyond L2).
  const float* qsrc = q + (b * sh.Hk + h0) * r * D;
#pragma omp simd
  for (int64_t i = 0; i < n_q * D; ++i) qbuf[i] = qsrc[i] * sh.q_scale;
  // Head g's rows of block blk of the pool (strides st), or null past the item's last block.
  auto head_block = [&](const float* pool, const int64_t* st, int64_t g, int64_t blk) -> const float* {
    return blk * bs < len ? pool + (h0 + g) * st[0] + static_cast<int64_t>(table[blk]) * bs * st[1] : nullptr;
  };
  for (int64_t blk = 0; blk * bs < len; ++blk) {
    int64_t n = std::min(bs, len - blk * bs);
    for (int64_t g = 0; g < G; ++g) {
      const float* kb = head_block(k, sh.ks, g, blk), *kn = head_block(k, sh.ks, g, blk + 1);
      for (int64_t j = 0; j < r; ++j) {
        const float* qj = qbuf.data() + (g * r + j) * D;
        float* sc = scores.data() + (g * r + j) * len + blk * bs;
#if MESHLM_AVX512
        if (sh.wide && D % 16 == 0) {
          head_scores_512(qj, kb, sh.ks[1], n, D, sc, kn, sh.prefetch && j == 0);
          continue;
        }
#endif
#if MESHLM_AVX2
        if (D % 64 == 0) {
          head_scores(qj, kb, sh.ks[1], n, D, sc);
          continue;
        }
#endif
        for (int64_t s = 0; s < n; ++s) {
          const float* kr = kb + s * sh.ks[1];
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qj[d] * kr[d];
          sc[s] = dot;
        }
      }
    }
  }
  for (int64_t i = 0; i < n_q; ++i) {  // a chunk keeps each head's max and sum instead of normalising
    float whole[2] = {0.0f, 0.0f};
    float* max_sum = chunk.out ? chunk.max_sum + (((b * chunk.count + chunk.index) * sh.Hk + h0) * r + i) * 2
                               : lh ? whole : nullptr;
    inv[i] = softmax_row(scores.data() + i * len, len, max_sum);
    if (lh) lh[i] = (whole[0] + std::log2(whole[1])) / LOG2E;  // base-2 scores: ln(sum e^x) = that * ln 2
  }
  std::fill(oh, oh + n_q * D, 0.0f);
  for (int64_t blk = 0; blk * bs < len; ++blk) {
    int64_t n = std::min(bs, len - blk * bs);
    for (int64_t g = 0; g < G; ++g) {
      const float* vb = head_block(v, sh.vs, g, blk);
      const float* pg = scores.data() + g * r * len + blk * bs;
      float* og = oh + g * r * D;
#if MESHLM_AVX512
      if (sh.wide &&
          weighted_values_heads(pg, len, r, vb, sh.vs[1], n, og, D, head_block(v, sh.vs, g, blk + 1), sh.prefetch)) {
        continue;
      }
#endif
      for (int64_t j = 0; j < r; ++j) {
        const float* p = pg + j * len;
        float* o = og + j * D;
#if MESHLM_AVX2
        if (D % 64 == 0) {
          for (int64_t d = 0; d < D; d += 64) weighted_values_64_acc(p, vb + d, sh.vs[1], n, o + d);
          continue;
        }
#endif
        for (int64_t s = 0; s < n; ++s) {
          if (p[s] == 0.0f) continue;
          const float* vr = vb + s * sh.vs[1];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p[s] * vr[d];
        }
      }
    }
  }
  if (chunk.out) return;
  for (int64_t i = 0; i < n_q; ++i) {
    float* o = oh + i * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv[i];
  }
}

// Calls fn(i0, i1) over [0, n) in chunks shared by the calling thread and the GEMM pool's helper
// (defined with the pool, below).
void parallel_items(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn);
int gemm_threads();

constexpr int64_t DECODE_CHUNK_KEYS = 512;  // keys a chunk of a long decode row (rounded to whole blocks)

// Every row of a paged decode, as items of whole rows, or of some of a row's KV heads where whole rows
// would leave a GEMM thread idle (a step of one or two rows).
// `lse`, where given: each query head's natural log-sum-exp (R, H), -inf for a row with no keys (see
// paged_decode_item).
void paged_decode(const PagedShape& sh, const float* q, const float* k, const float* v, const int32_t* tables,
                  const int32_t* lengths, float* out, float* lse = nullptr) {
  int threads = gemm_threads();
  int64_t want = threads < 2 ? 1 : 4 * threads;  // items enough to balance the threads' shares
  int64_t per_row = std::clamp<int64_t>((want + sh.R - 1) / sh.R, 1, sh.Hk);
  int64_t G = (sh.Hk + per_row - 1) / per_row;  // KV heads an item
  per_row = (sh.Hk + G - 1) / G;
  // A row longer than DECODE_CHUNK_KEYS goes as equal chunks of whole blocks, each an item of all its KV
  // heads, merged after. Items of one KV head left a thread idle for a third of a long row's attention
  // (3 heads on 2 threads) and read a third of each line of the token-major pools: the demo model's 30
  // layers of one 3,900-key row took 20.0 ms, now 12.3 (700 keys: 1.83 -> 1.28 ms; 2026-11-28). Whether
  // and where a row is cut depends on its length alone, so its output is the same bits in any batch and
  // on any number of threads; shorter rows are computed as they were.
  const int64_t bs = sh.block_size, keys = std::max<int64_t>(1, DECODE_CHUNK_KEYS / bs) * bs;
  const int64_t count = (sh.max_blocks * bs + keys - 1) / keys;
  std::vector<int64_t> chunks(sh.R), per_chunk(sh.R), first(sh.R + 1, 0);
  bool split = false;
  for (int64_t b = 0; b < sh.R; ++b) {
    int64_t len = std::clamp<int64_t>(lengths[b], 0, sh.max_blocks * bs);
    chunks[b] = len > keys ? (len + keys - 1) / keys : 1;
    per_chunk[b] = ((len + chunks[b] - 1) / chunks[b] + bs - 1) / bs * bs;
    chunks[b] = std::max<int64_t>(1, (len + per_chunk[b] - 1) / std::max<int64_t>(1, per_chunk[b]));
    split = split || chunks[b] > 1;
    first[b + 1] = first[b] + (chunks[b] > 1 ? chunks[b] : per_row);
  }
  std::vector<float> part, max_sum;
  if (split) {
    part.resize(static_cast<size_t>(sh.R * count * sh.Hk * sh.r * sh.D));
    max_sum.resize(static_cast<size_t>(sh.R * count * sh.Hk * sh.r * 2));
  }
  parallel_items(first[sh.R], 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t b = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1, local = i - first[b];
      if (chunks[b] > 1) {
        paged_decode_item(sh, q, k, v, tables, lengths, out, b, 0, sh.Hk,
                          {part.data(), max_sum.data(), per_chunk[b], local, count});
        continue;
      }
      int64_t h0 = local * G;
      paged_decode_item(sh, q, k, v, tables, lengths, out, b, h0, std::min(h0 + G, sh.Hk), {}, lse);
    }
  });
  for (int64_t b = 0; b < sh.R; ++b) {  // chunks merged in order: max, rescaled sums, rescaled outputs
    if (chunks[b] < 2) continue;
    for (int64_t i = 0; i < sh.Hk * sh.r; ++i) {
      auto at = [&](int64_t c) { return (b * count + c) * sh.Hk * sh.r + i; };
      float m = -INFINITY, total = 0.0f;
      for (int64_t c = 0; c < chunks[b]; ++c) m = std::max(m, max_sum[at(c) * 2]);
      float* o = out + (b * sh.Hk * sh.r + i) * sh.D;
      std::fill(o, o + sh.D, 0.0f);
      for (int64_t c = 0; c < chunks[b]; ++c) {
        float w = std::exp2(max_sum[at(c) * 2] - m);
        total += max_sum[at(c) * 2 + 1] * w;
        const float* oc = part.data() + at(c) * sh.D;
        for (int64_t d = 0; d < sh.D; ++d) o[d] += oc[d] * w;
      }
      float inv = total > 0.0f ? 1.0f / total : 0.0f;
      for (int64_t d = 0; d < sh.D; ++d) o[d] *= inv;
      if (lse) lse[b * sh.Hk * sh.r + i] = total > 0.0f ? (m + std::log2(total)) / LOG2E
                                                        : -std::numeric_limits<float>::infinity();
    }
  }
}

// A primitive's input, taken as MLX evaluated it. Inputs are not wrapped in Contiguous nodes when the
// graph is built: every node costs the thread that builds and schedules the graph (a decode step of
// the demo model built ~4,300 of them, and that, not arithmetic, set its time). Almost every input is
// row-major already; a strided view is gathered into a scratch copy inside the task, when its elements
// exist (eval_cpu runs before the producing task has).
template <typename T>
struct In {
  const T* p;
  bool contiguous;
  std::vector<int64_t> shape, strides;

  explicit In(const mx::array& a) : p(a.data<T>()), contiguous(a.flags().row_contiguous) {
    if (!contiguous) {
      shape.assign(a.shape().begin(), a.shape().end());
      strides.assign(a.strides().begin(), a.strides().end());
    }
  }

  const T* get(std::vector<T>& scratch) const {
    if (contiguous) return p;
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    scratch.resize(n);
    std::vector<int64_t> idx(shape.size(), 0);
    for (size_t i = 0; i < n; ++i) {
      int64_t off = 0;
      for (size_t k = 0; k < shape.size(); ++k) off += idx[k] * strides[k];
      scratch[i] = p[off];
      for (size_t k = shape.size(); k-- > 0;) {
        if (++idx[k] < shape[k]) break;
        idx[k] = 0;
      }
    }
    return scratch.data();
  }
};

class CpuOnly : public mx::UnaryPrimitive {
 public:
  using mx::UnaryPrimitive::UnaryPrimitive;
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("meshlm cpu_ops run on the CPU only");
  }
};

// The same for primitives of several outputs.
class CpuOnlyOutputs : public mx::Primitive {
 public:
  using mx::Primitive::Primitive;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("meshlm cpu_ops run on the CPU only");
  }
};

class SwiGLU : public CpuOnly {
 public:
  using CpuOnly::CpuOnly;
  const char* name() const override { return "MeshlmSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([g = In<float>(in[0]), x = In<float>(in[1]), o = out.data<float>(), n = out.size()]() {
      std::vector<float> gs, xs;
      swiglu_kernel(g.get(gs), x.get(xs), o, n);
    });
  }
};

class Softmax2 : public CpuOnly {
 public:
  using CpuOnly::CpuOnly;
  const char* name() const override { return "MeshlmSoftmax2"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    size_t n = out.shape().back();
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([s = In<float>(in[0]), o = out.data<float>(), rows = out.size() / n, n]() {
      std::vector<float> ss;
      softmax2_kernel(s.get(ss), o, rows, n);
    });
  }
};

class Softmax2Lse : public CpuOnlyOutputs {
 public:
  using CpuOnlyOutputs::CpuOnlyOutputs;
  const char* name() const override { return "MeshlmSoftmax2Lse"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    auto &out = outs[0], &lse = outs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    lse.set_data(mx::allocator::malloc(lse.nbytes()));
    size_t n = out.shape().back();
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([s = In<float>(in[0]), o = out.data<float>(), l = lse.data<float>(), rows = out.size() / n, n]() {
      std::vector<float> ss;
      softmax2_kernel(s.get(ss), o, rows, n, l);
    });
  }
};

// One query per row against its blocks of the pools (paged_decode); with `lse`, a second output holds each
// query head's log-sum-exp: a context-parallel rank's partial over some of a sequence's keys, for merging
// with the other ranks'.
class PagedDecodeAttention : public CpuOnlyOutputs {
 public:
  PagedDecodeAttention(mx::Stream s, int block_size, float q_scale, bool lse)
      : CpuOnlyOutputs(s), block_size_(block_size), q_scale_(q_scale), lse_(lse) {}
  const char* name() const override { return lse_ ? "MeshlmPagedDecodePartial" : "MeshlmPagedDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedDecodeAttention&>(other);
    return block_size_ == o.block_size_ && q_scale_ == o.q_scale_ && lse_ == o.lse_;
  }
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    const auto &q = in[0], &k = in[1], &v = in[2], &tables = in[3], &lengths = in[4];
    int64_t Hk = k.shape(1), D = k.shape(2);  // q is (R, Hk, r, D) or (R, H, D): the same row-major layout
    PagedShape sh{q.shape(0), Hk, static_cast<int64_t>(q.size()) / (q.shape(0) * Hk * D), D, k.shape(0),
                  tables.shape(1), block_size_, {k.strides()[1], k.strides()[0]}, {v.strides()[1], v.strides()[0]},
                  q_scale_, wide_kernels().load(), software_prefetch().load()};
    for (auto& o : outs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([sh, qp = In<float>(q), kp = k.data<float>(), vp = v.data<float>(), tp = In<int32_t>(tables),
                  lp = In<int32_t>(lengths), o = outs[0].data<float>(), l = lse_ ? outs[1].data<float>() : nullptr]() {
      std::vector<float> qs;
      std::vector<int32_t> ts, ls;
      const float* qv = qp.get(qs);
      const int32_t *tv = tp.get(ts), *lv = lp.get(ls);
      paged_decode(sh, qv, kp, vp, tv, lv, o, l);
    });
  }

 private:
  int block_size_;
  float q_scale_;
  bool lse_;
};

class RmsNorm : public CpuOnly {
 public:
  RmsNorm(mx::Stream s, float eps) : CpuOnly(s), eps_(eps) {}
  const char* name() const override { return "MeshlmRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    int64_t D = out.shape().back();
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([x = In<float>(in[0]), w = In<float>(in[1]), o = out.data<float>(), rows = out.size() / D, D,
                  eps = eps_]() {
      std::vector<float> xs, ws;
      rms_norm_kernel(x.get(xs), w.get(ws), o, static_cast<int64_t>(rows), D, eps);
    });
  }

 private:
  float eps_;
};

class Rope : public CpuOnly {
 public:
  Rope(mx::Stream s, int dims, bool traditional, float scale)
      : CpuOnly(s), dims_(dims), traditional_(traditional), scale_(scale) {}
  const char* name() const override { return "MeshlmRope"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }
  // x (1, H, T, D), mlx-lm's head-major view of the projection's token-major rows, read in place
  // (any strides with D contiguous); the output has the same shape stored token-major, as MLX's transpose
  // of a (1, T, H, D) array would be, so neither side needs a transpose node or a copy.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const auto& x = in[0];
    int64_t H = x.shape(1), T = x.shape(2), D = x.shape(3);
    mx::array::Flags flags = out.flags();
    flags.contiguous = true;
    flags.row_contiguous = T == 1 || H == 1;
    flags.col_contiguous = false;
    out.set_data(mx::allocator::malloc(out.nbytes()), out.size(), mx::Strides{T * H * D, D, H * D, 1}, flags);
    bool direct = x.strides()[3] == 1;
    int64_t xs_h = direct ? x.strides()[1] : T * D, xs_t = direct ? x.strides()[2] : D;
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([xi = In<float>(x), direct, xs_t, xs_h, pos = In<int32_t>(in[1]), f = In<float>(in[2]),
                  o = out.data<float>(), T, H, D, dims = dims_, trad = traditional_, scale = scale_]() {
      std::vector<float> xs, fs;
      std::vector<int32_t> ps;
      const float* xp = direct ? xi.p : xi.get(xs);
      rope_kernel(xp, xs_t, xs_h, pos.get(ps), f.get(fs), o, T, H, D, dims, trad, scale);
    });
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

// A pool written by a node as that node's output: the pool's own buffer when MLX can donate it (nothing
// else holds it: the store dropped it), else a fresh buffer that the task first copies the pool into,
// as MLX's scatter does. Returns what to copy, if anything.
std::optional<In<float>> pool_output(const mx::array& pool, mx::array& out) {
  if (pool.is_donatable() && pool.flags().row_contiguous) {
    out.copy_shared_buffer(pool);
    return std::nullopt;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return In<float>(pool);
}

// Inside the task: the copy pool_output asked for, of the pool's n floats.
void copy_pool(const std::optional<In<float>>& src, float* out, size_t n) {
  if (!src) return;
  std::vector<float> scratch;
  std::memcpy(out, src->get(scratch), n * sizeof(float));
}

// A step's new K or V rows written into a pool: pool (S, Hk, D); rows (1, Hk, T, D) in any strides
// (mlx-lm's head-major view of the projection's token-major output); slots (T,). The pool's buffer is
// updated in place when MLX can donate it (the store drops its reference before the step runs), else
// copied first, as MLX's scatter does. One node, where `pool[slots] = rows` built six per pool and layer
// (squeezes, a transpose, a broadcast, a reshape, the scatter). Slots outside the pool (which the
// runner refuses first) are skipped, never a stray write.
class KVWrite : public CpuOnly {
 public:
  using CpuOnly::CpuOnly;
  const char* name() const override { return "MeshlmKVWrite"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }  // each writes its own pool
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const auto &pool = in[0], &slots = in[1], &rows = in[2];
    int64_t S = pool.shape(0), Hk = pool.shape(1), D = pool.shape(2), T = rows.shape(2);
    int64_t sh = rows.strides()[1], st = rows.strides()[2], sd = rows.strides()[3];
    auto src = pool_output(pool, out);  // first: out's buffer is set here
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([src = std::move(src), sl = In<int32_t>(slots), r = rows.data<float>(), o = out.data<float>(), S, Hk,
                  D, T, sh, st, sd]() {
      copy_pool(src, o, static_cast<size_t>(S * Hk * D));
      std::vector<int32_t> ss;
      const int32_t* sp = sl.get(ss);
      for (int64_t t = 0; t < T; ++t) {
        int64_t slot = sp[t];
        if (slot < 0 || slot >= S) continue;
        for (int64_t h = 0; h < Hk; ++h) {
          const float* x = r + h * sh + t * st;
          float* dst = o + (slot * Hk + h) * D;
          if (sd == 1) {
            std::memcpy(dst, x, static_cast<size_t>(D) * sizeof(float));
          } else {
            for (int64_t d = 0; d < D; ++d) dst[d] = x[d * sd];
          }
        }
      }
    });
  }
};

// ---- Zeros whose pages the kernel supplies on first write ---------------------
//
// A KV pool reserved at its whole budget this way costs resident memory only
// for the blocks written, and never has to grow: growing by copy stalled every
// stream for seconds at GiB sizes (fresh pages fault slowly, and the copy
// needs old and new at once). The page-aligned interior is handed back with
// MADV_DONTNEED, which for private anonymous memory (malloc's heap and its
// mmaps) means zero-filled on the next touch; the partial pages at either end
// are cleared by hand.
void zero_untouched(char* p, size_t n) {
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  uintptr_t a = reinterpret_cast<uintptr_t>(p), e = a + n;
  uintptr_t lo = (a + page - 1) / page * page, hi = e / page * page;
  if (hi <= lo || madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED) != 0) {
    std::memset(p, 0, n);
    return;
  }
  std::memset(p, 0, lo - a);
  std::memset(reinterpret_cast<void*>(hi), 0, e - hi);
}

class UntouchedZeros : public CpuOnly {
 public:
  using CpuOnly::CpuOnly;
  const char* name() const override { return "MeshlmUntouchedZeros"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }  // each is its own buffer
  void eval_cpu(const std::vector<mx::array>&, mx::array& out) override {
    // Asked of the system first: MLX's CPU allocator counts a failed malloc's size as active memory for
    // good (and hands back a null buffer). A refused 4 PiB pool left the process "over its memory limit"
    // for ever, and MLX's eval then spun, holding the GIL, whenever a task was pending: the test run hung.
    auto refused = [&out]() {
      return std::runtime_error("untouched_zeros: cannot reserve " + std::to_string(out.nbytes()) + " bytes");
    };
    void* probe = std::malloc(out.nbytes());
    if (probe == nullptr) throw refused();
    std::free(probe);
    auto data = mx::allocator::malloc(out.nbytes());
    if (data.buffer().ptr() == nullptr) throw refused();  // refused between the two: the count is off, not the error
    out.set_data(std::move(data));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([p = out.data<char>(), n = out.nbytes()]() { zero_untouched(p, n); });
  }
};

mx::Stream current_stream() { return mx::to_stream(mx::StreamOrDevice{}); }

const mx::array& require_float32(const mx::array& a) {
  if (a.dtype() != mx::float32) throw std::invalid_argument("meshlm cpu_ops take float32 arrays");
  return a;
}

// An input handed over as it is: an evaluated row-major array (a weight), or a lazy one that `In`
// reads as MLX produces it. Only an evaluated strided view gets a Contiguous node here.
mx::array float32_input(const mx::array& a, mx::Stream s) {
  require_float32(a);
  return a.is_available() && !a.flags().row_contiguous ? mx::contiguous(a, false, s) : a;
}


// A weight a kernel reads in place (no scratch copy: the packed GEMM's panels): row-major for certain,
// float32, bfloat16 or float16 (the 16-bit ones widened to float32 in the kernel).
mx::array panel_weight(const mx::array& a, mx::Stream s) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::bfloat16 && a.dtype() != mx::float16) {
    throw std::invalid_argument("meshlm packed weights are float32, bfloat16 or float16");
  }
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, s);
}

mx::array swiglu(const mx::array& gate, const mx::array& x) {
  if (gate.shape() != x.shape()) throw std::invalid_argument("swiglu: gate and x shapes differ");
  auto s = current_stream();
  auto g = float32_input(gate, s), xc = float32_input(x, s);
  return mx::array(g.shape(), mx::float32, std::make_shared<SwiGLU>(s), {g, xc});
}

std::vector<mx::array> softmax2_lse(const mx::array& scores) {
  if (scores.ndim() < 1) throw std::invalid_argument("softmax2_lse: scores need a last axis");
  auto s = current_stream();
  auto sc = float32_input(scores, s);
  auto rows = sc.shape();
  rows.pop_back();
  return mx::array::make_arrays({sc.shape(), rows}, {mx::float32, mx::float32}, std::make_shared<Softmax2Lse>(s),
                                {sc});
}

mx::array softmax2(const mx::array& scores) {
  if (scores.ndim() < 1) throw std::invalid_argument("softmax2: scores need a last axis");
  auto s = current_stream();
  auto sc = float32_input(scores, s);
  return mx::array(sc.shape(), mx::float32, std::make_shared<Softmax2>(s), {sc});
}

// The KV pools are read in place (never copied) as long as each row of D
// values is contiguous.
mx::array rows_contiguous(const mx::array& a, mx::Stream s) {
  return require_float32(a).strides().back() == 1 ? a : mx::contiguous(a, false, s);
}

// The inputs of a paged decode, checked and as its primitives take them.
std::vector<mx::array> paged_inputs(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                                    const mx::array& tables, const mx::array& lengths, int block_size) {
  // Hk, D and R of at least 1: the kernel divides q's size by them (an empty batch was a SIGFPE).
  bool pools = k_pool.ndim() == 3 && k_pool.shape(1) > 0 && k_pool.shape(2) > 0 && v_pool.shape() == k_pool.shape();
  bool grouped = pools && q.ndim() == 4 && q.shape(1) == k_pool.shape(1) && q.shape(3) == k_pool.shape(2);
  bool flat = pools && q.ndim() == 3 && q.shape(1) % k_pool.shape(1) == 0 && q.shape(2) == k_pool.shape(2);
  if (!(grouped || flat)) {
    throw std::invalid_argument("paged_decode_attention: q (R, Hk, r, D) or (R, H, D), pools (slots, Hk, D)");
  }
  if (q.shape(0) < 1) throw std::invalid_argument("paged_decode_attention: no rows (R = 0)");
  if (block_size < 1 || k_pool.shape(0) % block_size != 0) {
    throw std::invalid_argument("paged_decode_attention: the pools must hold whole blocks");
  }
  if (tables.ndim() != 2 || tables.shape(0) != q.shape(0) || lengths.ndim() != 1 || lengths.shape(0) != q.shape(0)) {
    throw std::invalid_argument("paged_decode_attention: tables (R, max_blocks) and lengths (R,)");
  }
  auto s = current_stream();
  return {float32_input(q, s), rows_contiguous(k_pool, s), rows_contiguous(v_pool, s),
          mx::astype(tables, mx::int32, s), mx::astype(lengths, mx::int32, s)};
}

mx::array paged_decode_attention(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                                 const mx::array& tables, const mx::array& lengths, int block_size,
                                 float q_scale) {
  auto inputs = paged_inputs(q, k_pool, v_pool, tables, lengths, block_size);
  return mx::array::make_arrays({q.shape()}, {mx::float32},
                                std::make_shared<PagedDecodeAttention>(current_stream(), block_size, q_scale, false),
                                inputs)[0];
}

std::vector<mx::array> paged_decode_partial(const mx::array& q, const mx::array& k_pool, const mx::array& v_pool,
                                            const mx::array& tables, const mx::array& lengths, int block_size,
                                            float q_scale) {
  if (q.ndim() != 3) throw std::invalid_argument("paged_decode_partial: q (R, H, D)");
  auto inputs = paged_inputs(q, k_pool, v_pool, tables, lengths, block_size);
  return mx::array::make_arrays({q.shape(), {q.shape(0), q.shape(1)}}, {mx::float32, mx::float32},
                                std::make_shared<PagedDecodeAttention>(current_stream(), block_size, q_scale, true),
                                inputs);
}


// ---- Linear layers with weights packed in 16-column panels ------------------
//
// OpenBLAS 0.3.21 re-packs the whole weight matrix on every call and has no
// matrix-vector path for one-row GEMMs, so a decode step at small batch reads
// the weights more than once at less than the machine's bandwidth. Weights
// packed once at load as (N/16, K, 16) panels are streamed sequentially by a
// 6x16 register-blocked FMA kernel instead. Prefills use it too: measured on
// the demo model, it beat OpenBLAS there as well (a 6 x 170-token prefill
// 2.8-3.0 s vs 3.1-3.3 s), and an unpacked copy per call for OpenBLAS cost
// more than either.

constexpr int PANEL = 16;
constexpr int64_t PREFETCH_BYTES = 2048;  // of panel ahead; prefetches never fault past the end

// Panels hold float32, or a 16-bit type where every weight of the layer is exactly one (a checkpoint
// stored in bf16 or fp16 and widened at load): half the bytes to stream per decode step, and the same
// products, since the kernel widens each weight in a register (bfloat16: a shift; float16: F16C's
// conversion, exact) before the float32 FMA. Distinct types, so each picks its own widening.
struct bf16_t {
  uint16_t bits;
};
struct f16_t {
  uint16_t bits;
};
enum class PanelType { f32, bf16, f16 };

PanelType panel_type(const mx::array& w) {
  return w.dtype() == mx::bfloat16 ? PanelType::bf16 : w.dtype() == mx::float16 ? PanelType::f16 : PanelType::f32;
}

#if MESHLM_AVX2
template <typename W>
constexpr int64_t PREFETCH_LINES = PREFETCH_BYTES / (PANEL * sizeof(W));

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const f16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

template <int MR, typename W>
inline void gemm_micro(const float* __restrict x, int64_t ldx, const W* __restrict w, const float* bias,
                       float* __restrict c, int64_t ldc, int64_t K) {
  // Named accumulators: GCC spills an array of __m256 to the stack on every iteration.
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00, c31 = c00,
         c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  for (int64_t k = 0; k < K; ++k) {
    // Each k is one 64-byte line of the panel. With 2+ rows the FMAs between lines keep too few loads
    // in flight for the hardware prefetcher: prefetching 2 KiB ahead took a 4-row pass over 64 MiB of
    // weights from 5.1 to 3.0 ms, a 16-row one from 10.1 to 7.7 (one core, 2026-11-24); one row
    // streams at full bandwidth without it, and the extra instruction slowed it by ~10 %.
    if constexpr (MR > 1) _mm_prefetch(reinterpret_cast<const char*>(w + PANEL * (k + PREFETCH_LINES<W>)), _MM_HINT_T0);
    __m256 b0 = load8(w + PANEL * k), b1 = load8(w + PANEL * k + 8);
    auto row = [&](int r, __m256& lo, __m256& hi) {
      __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      lo = _mm256_fmadd_ps(a, b0, lo);
      hi = _mm256_fmadd_ps(a, b1, hi);
    };
    row(0, c00, c01);
    if constexpr (MR > 1) row(1, c10, c11);
    if constexpr (MR > 2) row(2, c20, c21);
    if constexpr (MR > 3) row(3, c30, c31);
    if constexpr (MR > 4) row(4, c40, c41);
    if constexpr (MR > 5) row(5, c50, c51);
  }
  __m256 bias0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  __m256 bias1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  auto store = [&](int r, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(c + r * ldc, _mm256_add_ps(lo, bias0));
    _mm256_storeu_ps(c + r * ldc + 8, _mm256_add_ps(hi, bias1));
  };
  store(0, c00, c01);
  if constexpr (MR > 1) store(1, c10, c11);
  if constexpr (MR > 2) store(2, c20, c21);
  if constexpr (MR > 3) store(3, c30, c31);
  if constexpr (MR > 4) store(4, c40, c41);
  if constexpr (MR > 5) store(5, c50, c51);
}

#if MESHLM_AVX512
// Two panels (32 columns) at once in 512-bit registers: a panel's 16 columns are one register, so a
// core with two 512-bit FMA units does twice the multiply-adds per cycle of the 256-bit kernel above
// (measured on a Xeon: 246 against 133 GFLOP/s of peak FMA throughput), and two panel lines per k
// against MR broadcasts keep the loads behind the FMAs.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const f16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int MR, typename W>
inline void gemm_micro_512x2(const float* __restrict x, int64_t ldx, const W* __restrict w0,
                             const W* __restrict w1, const float* bias0, const float* bias1,
                             float* __restrict c0, int64_t ldc0, float* __restrict c1, int64_t ldc1, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0,
         b4 = a0, a5 = a0, b5 = a0, a6 = a0, b6 = a0, a7 = a0, b7 = a0, a8 = a0, b8 = a0, a9 = a0, b9 = a0,
         a10 = a0, b10 = a0, a11 = a0, b11 = a0;
  for (int64_t k = 0; k < K; ++k) {
    // As the 256-bit kernel's, and here a 16-bit panel (widened between loads) needs it at one row too:
    // the demo model's 121 one-row GEMMs on two threads took 6.7 ms with it against 7.1 (40 against
    // 38 GB/s; one thread 9.6 against 10.8 ms, 2026-11-26). The 256-bit kernel's did not move.
    if constexpr (MR > 1 || sizeof(W) == 2) {
      _mm_prefetch(reinterpret_cast<const char*>(w0 + PANEL * (k + PREFETCH_LINES<W>)), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w1 + PANEL * (k + PREFETCH_LINES<W>)), _MM_HINT_T0);
    }
    __m512 p0 = load16(w0 + PANEL * k), p1 = load16(w1 + PANEL * k);
    auto row = [&](int r, __m512& lo, __m512& hi) {
      __m512 v = _mm512_set1_ps(x[r * ldx + k]);
      lo = _mm512_fmadd_ps(v, p0, lo);
      hi = _mm512_fmadd_ps(v, p1, hi);
    };
    row(0, a0, b0);
    if constexpr (MR > 1) row(1, a1, b1);
    if constexpr (MR > 2) row(2, a2, b2);
    if constexpr (MR > 3) row(3, a3, b3);
    if constexpr (MR > 4) row(4, a4, b4);
    if constexpr (MR > 5) row(5, a5, b5);
    if constexpr (MR > 6) row(6, a6, b6);
    if constexpr (MR > 7) row(7, a7, b7);
    if constexpr (MR > 8) row(8, a8, b8);
    if constexpr (MR > 9) row(9, a9, b9);
    if constexpr (MR > 10) row(10, a10, b10);
    if constexpr (MR > 11) row(11, a11, b11);
  }
  __m512 bias_lo = bias0 ? _mm512_loadu_ps(bias0) : _mm512_setzero_ps();
  __m512 bias_hi = bias1 ? _mm512_loadu_ps(bias1) : _mm512_setzero_ps();
  auto store = [&](int r, __m512 lo, __m512 hi) {
    _mm512_storeu_ps(c0 + r * ldc0, _mm512_add_ps(lo, bias_lo));
    _mm512_storeu_ps(c1 + r * ldc1, _mm512_add_ps(hi, bias_hi));
  };
  store(0, a0, b0);
  if constexpr (MR > 1) store(1, a1, b1);
  if constexpr (MR > 2) store(2, a2, b2);
  if constexpr (MR > 3) store(3, a3, b3);
  if constexpr (MR > 4) store(4, a4, b4);
  if constexpr (MR > 5) store(5, a5, b5);
  if constexpr (MR > 6) store(6, a6, b6);
  if constexpr (MR > 7) store(7, a7, b7);
  if constexpr (MR > 8) store(8, a8, b8);
  if constexpr (MR > 9) store(9, a9, b9);
  if constexpr (MR > 10) store(10, a10, b10);
  if constexpr (MR > 11) store(11, a11, b11);
}
#endif

constexpr int MAX_SPLITS = 4;

// x @ W for one weight whose panels may go to up to MAX_SPLITS outputs: panels [ends[j-1], ends[j]) are
// output j's columns (a fused q/k/v projection, or gate and up). One output: ends[0] = N / 16.
struct GemmArgs {
  const float* x;     // (M, K)
  const void* w;      // (N/16, K, 16), of `type`
  const float* bias;  // (N) or null
  float* out[MAX_SPLITS];  // (M, N_j) each
  int64_t ends[MAX_SPLITS];  // cumulative panels per output
  int splits;
  int64_t M, K;
  bool wide = false;  // the 512-bit micro-kernel (wide_kernels)
  bool prefetch = false;  // the few-row kernel's software prefetch (software_prefetch)
  PanelType type = PanelType::f32;
};

// Panel p's place: its weights, bias, and first output column with that output's row stride.
template <typename W>
struct PanelOut {
  const W* w;
  const float* bias;
  float* c;
  int64_t ldc;
};

template <typename W>
PanelOut<W> panel_out(const GemmArgs& g, int64_t p) {
  int j = 0;
  while (p >= g.ends[j]) ++j;
  int64_t first = j ? g.ends[j - 1] : 0;
  return {static_cast<const W*>(g.w) + p * g.K * PANEL, g.bias ? g.bias + p * PANEL : nullptr,
          g.out[j] + (p - first) * PANEL, (g.ends[j] - first) * PANEL};
}

// Each micro-kernel instantiated for every row count up to its pass, indexed by rows: a GEMM runs full
// passes and then its remaining rows through the same table.
template <typename W>
using Micro256 = void (*)(const float*, int64_t, const W*, const float*, float*, int64_t, int64_t);
constexpr int64_t ROWS_256 = 6;
template <typename W>
constexpr Micro256<W> MICRO_256[ROWS_256 + 1] = {nullptr, gemm_micro<1, W>, gemm_micro<2, W>, gemm_micro<3, W>,
                                                 gemm_micro<4, W>, gemm_micro<5, W>, gemm_micro<6, W>};

#if MESHLM_AVX512
template <typename W>
using Micro512 = void (*)(const float*, int64_t, const W*, const W*, const float*, const float*, float*,
                          int64_t, float*, int64_t, int64_t);
// Rows a pass: 24 accumulators of the 32 registers, two more for the panel lines. A GEMM of up to 12 rows
// (a speculative verify of up to 11 drafts) is one pass over the weights; more rows take further passes,
// which read the panel pair from L2. 12 rows a pass were as fast as 8 or faster at every size measured:
// the demo model's 13-row GEMMs cost 1.3x its 8-row ones in two 8-row passes, and the 72M llama's
// prefill-sized ones (32-80 rows, one core) took 3-6 % less time than in 8-row passes (2026-11-25).
constexpr int64_t ROWS_512 = 12;
template <typename W>
constexpr Micro512<W> MICRO_512[ROWS_512 + 1] = {
    nullptr,                 gemm_micro_512x2<1, W>,  gemm_micro_512x2<2, W>,  gemm_micro_512x2<3, W>,
    gemm_micro_512x2<4, W>,  gemm_micro_512x2<5, W>,  gemm_micro_512x2<6, W>,  gemm_micro_512x2<7, W>,
    gemm_micro_512x2<8, W>,  gemm_micro_512x2<9, W>,  gemm_micro_512x2<10, W>, gemm_micro_512x2<11, W>,
    gemm_micro_512x2<12, W>};

// A few rows (a decode step of one to eight sequences, a short speculative verify): NP panels at once, NP
// weight streams and MR * NP independent FMA chains where the pair kernel has two streams. PF > 0: each
// stream is prefetched PF bytes ahead, once a 64-byte line (software_prefetch says where). Each column
// sums over k in the same order as in every other kernel here, so a row's outputs are the same bits
// whatever its batch. Measured in one process, alternating with the pair kernel through a scratch switch
// (2026-11-27, the AMD VM; docs/BENCHMARKS.md): a one-row decode step of the demo model (16-bit panels)
// 11.8 -> 10.9 ms on two threads, 17.6 -> 15.3 on one; the demo model's GEMMs at 2 and 3 rows 9 % and 8 %
// faster on two threads (12 % and 14 % on one), at 4 and 6 rows 2-7 %. At 7 and 8 rows (a pipeline
// stage's micro-batch of 16 streams), three panels at once against the pair kernel, alternating in one
// process (2026-11-28, the Xeon VM): a 72M llama stage's GEMMs on one core (float32) 11.5 -> 11.0 and
// 10.9 -> 10.6 ms, the demo model's on two (float16) 11.1 -> 10.7 and 11.9 -> 11.2 ms.
constexpr int64_t FEW_ROWS = 8;  // up to this many rows take `gemm_few_rows`; more, the pair kernel's passes

// Panels a few-row GEMM takes at once: eight for up to three rows (8 * 3 of the 32 registers accumulate),
// four up to six, three up to eight.
constexpr int64_t few_row_panels(int64_t rows) { return rows <= 3 ? 8 : rows <= 6 ? 4 : 3; }

// The few-row kernel's software prefetch distance where it prefetches. On the Xeon VM (2026-11-28,
// docs/BENCHMARKS.md), forward-only demo decode steps alternating in one process: 1 row 12.1 ms without,
// 10.7 with 512 bytes or 1 KiB, 10.9 with 2 KiB, 11.1 with 4 KiB; 2 to 6 rows 10-14 % faster with 1 KiB.
// On the AMD EPYC VM a prefetch every other line made the one-row step slower (11.1 -> 12.4 ms).
constexpr int FEW_ROWS_PREFETCH_BYTES = 1024;

template <int MR, int NP, typename W, int PF>
void gemm_few_rows(const float* __restrict x, int64_t ldx, const PanelOut<W>* o, int64_t K) {
  const W* w[NP];
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) w[j] = o[j].w;
  __m512 acc[MR * NP];  // fully unrolled below, so these stay in registers
#pragma GCC unroll 32
  for (int i = 0; i < MR * NP; ++i) acc[i] = _mm512_setzero_ps();
  constexpr int64_t LINE_K = 64 / (PANEL * static_cast<int64_t>(sizeof(W)));  // k steps a 64-byte line holds
  for (int64_t k = 0; k < K; ++k) {
    if constexpr (PF > 0) {
      if (k % LINE_K == 0) {
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) _mm_prefetch(reinterpret_cast<const char*>(w[j] + PANEL * k) + PF, _MM_HINT_T0);
      }
    }
    __m512 v[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) v[r] = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      __m512 panel = load16(w[j] + PANEL * k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) acc[r * NP + j] = _mm512_fmadd_ps(v[r], panel, acc[r * NP + j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NP; ++j) {
    __m512 bias = o[j].bias ? _mm512_loadu_ps(o[j].bias) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(o[j].c + r * o[j].ldc, _mm512_add_ps(acc[r * NP + j], bias));
  }
}

// The kernel for g.M rows, few_row_panels(g.M) panels at once; false for more than FEW_ROWS rows.
template <typename W, int PF, int MR = 1>
bool few_rows_of(const GemmArgs& g, const PanelOut<W>* o) {
  if constexpr (MR > FEW_ROWS) {
    return false;
  } else {
    if (g.M != MR) return few_rows_of<W, PF, MR + 1>(g, o);
    gemm_few_rows<MR, few_row_panels(MR), W, PF>(g.x, g.K, o, g.K);
    return true;
  }
}

// Panels [p, p + few_row_panels(M)) of a GEMM of at most FEW_ROWS rows; false when fewer are left.
template <typename W>
bool packed_gemm_few_rows(const GemmArgs& g, int64_t p, int64_t p1) {
  int64_t np = few_row_panels(g.M);
  if (p + np > p1) return false;
  PanelOut<W> o[8];
  for (int64_t j = 0; j < np; ++j) o[j] = panel_out<W>(g, p + j);
  return g.prefetch ? few_rows_of<W, FEW_ROWS_PREFETCH_BYTES>(g, o) : few_rows_of<W, 0>(g, o);
}

template <typename W>
void packed_gemm_pair(const GemmArgs& g, const PanelOut<W>& a, const PanelOut<W>& b) {
  for (int64_t i = 0; i < g.M; i += ROWS_512) {
    MICRO_512<W>[std::min(ROWS_512, g.M - i)](g.x + i * g.K, g.K, a.w, b.w, a.bias, b.bias, a.c + i * a.ldc,
                                              a.ldc, b.c + i * b.ldc, b.ldc, g.K);
  }
}
#endif

template <typename W>
void packed_gemm_panels_of(const GemmArgs& g, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
#if MESHLM_AVX512
    if (g.wide && g.M <= FEW_ROWS && packed_gemm_few_rows<W>(g, p, p1)) {
      p += few_row_panels(g.M) - 1;
      continue;
    }
    if (g.wide && p + 1 < p1) {
      packed_gemm_pair<W>(g, panel_out<W>(g, p), panel_out<W>(g, p + 1));
      ++p;
      continue;
    }
#endif
    auto [w, bias, c, ldc] = panel_out<W>(g, p);
    for (int64_t i = 0; i < g.M; i += ROWS_256) {
      MICRO_256<W>[std::min(ROWS_256, g.M - i)](g.x + i * g.K, g.K, w, bias, c + i * ldc, ldc, g.K);
    }
  }
}

void packed_gemm_panels(const GemmArgs& g, int64_t p0, int64_t p1) {
  switch (g.type) {
    case PanelType::bf16:
      packed_gemm_panels_of<bf16_t>(g, p0, p1);
      break;
    case PanelType::f16:
      packed_gemm_panels_of<f16_t>(g, p0, p1);
      break;
    default:
      packed_gemm_panels_of<float>(g, p0, p1);
  }
}

// The GEMM threads: the calling stream thread and threads - 1 helpers share each GEMM's panels (or a
// job's items). Each walks its own part of the panels in order, a chunk at a time, then takes chunks of
// the others' rest: when a helper is descheduled (cores shared with OpenBLAS and a second stream) the
// others do its work instead of waiting for it. One counter for all once dealt the chunks out in turn,
// so each thread's reads jumped every chunk and the prefetchers restarted: parts were 2-3 % faster on
// the demo model's decode steps on two threads, 1 and 16 rows (docs/BENCHMARKS.md), and let the chunks
// shrink, which shortens the wait for another thread's last one. Between calls the helpers spin briefly
// (a decode step issues ~200 GEMMs a fraction of a millisecond apart), then sleep on a futex so an idle
// server does not burn its cores.
class GemmPool {
 public:
  static constexpr int MAX_THREADS = 64;

  void run(GemmArgs g, int64_t panels) {
    std::unique_lock<std::mutex> busy(use_, std::try_to_lock);  // a second stream runs its GEMM alone
    g.wide = wide_kernels().load();
    g.prefetch = software_prefetch().load();
    int threads = threads_.load();  // once a job: set_threads may run meanwhile, from Python
    if (threads < 2 || panels < 2 * CHUNK || !busy.owns_lock()) {
      packed_gemm_panels(g, 0, panels);
      return;
    }
    post(threads, g, panels, chunk(g), nullptr);
  }
  // Any other job of independent items (the paged decode's rows and KV heads), shared the same way.
  void run_items(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(use_, std::try_to_lock);
    int threads = threads_.load();
    if (threads < 2 || n < 2 || !busy.owns_lock()) {
      fn(0, n);
      return;
    }
    post(threads, GemmArgs{}, n, std::max<int64_t>(1, chunk), &fn);
  }
  void set_threads(int n) { threads_.store(std::clamp(n, 1, MAX_THREADS)); }
  int threads() const { return threads_.load(); }

 private:
  static constexpr int64_t CHUNK = 2;  // panels per grab: one call of the 512-bit micro-kernel
  // A few-row GEMM's grab is one call of its kernel.
  static int64_t chunk(const GemmArgs& g) {
#if MESHLM_AVX512
    if (g.wide && g.M <= FEW_ROWS) return few_row_panels(g.M);
#endif
    return CHUNK;
  }
  static constexpr int64_t MIN_CHUNKS = 4;  // a thread beyond the second joins a job only with this many
  static constexpr int PREPARING = 0;  // posted_ while the caller writes a job (tickets start at 1)
  static constexpr int SPIN = 2000;  // pause instructions (~20-50 us) before sleeping; longer spins slowed batch-16 decode

  struct alignas(64) Helper {  // a line each: a helper's announcements stay in its cache
    std::atomic<int> inside{0};  // the ticket of the job it is looking at, or 0
  };
  struct alignas(64) Part {  // a line each: each thread's own grabs stay in its cache
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };

  // Hands the job to the helpers and works on it beside them; returns once all are done.
  //
  // The job's fields are written only while no helper can be in work(): posted_ first says "none"
  // (PREPARING), then the caller waits until no helper is inside. A helper that announces itself
  // after that wait re-reads posted_ and sees PREPARING (or the new ticket, whose job is complete), never
  // the old ticket: it once could, and then worked on a job being written, the caller returning while
  // it still ran a paged decode's items against a function that had gone out of scope (a SIGSEGV).
  // Helpers start here, under the caller's lock, the first time a job wants them.
  void post(int threads, const GemmArgs& g, int64_t items, int64_t chunk,
            const std::function<void(int64_t, int64_t)>* fn) {
    posted_.store(PREPARING);
    for (auto& h : helpers_) {
      while (h->inside.load() != 0) _mm_pause();  // a late helper may still be looking at the last job
    }
    while (static_cast<int>(helpers_.size()) < threads - 1) {
      int index = static_cast<int>(helpers_.size());
      helpers_.push_back(std::make_unique<Helper>());
      std::thread([this, index, h = helpers_.back().get()] { loop(index + 1, *h); }).detach();
    }
    job_ = g;
    fn_ = fn;
    chunk_ = chunk;
    int64_t chunks = (items + chunk - 1) / chunk;
    // Two threads for any job worth posting; more only with MIN_CHUNKS each: on a many-core machine
    // a small GEMM split 64 ways would cost more in hand-offs and counters than its reads.
    active_ = static_cast<int>(std::clamp<int64_t>(chunks / MIN_CHUNKS, 2, threads));
    for (int t = 0; t < active_; ++t) {  // thread t's part: chunks [t * chunks / T, (t + 1) * chunks / T)
      parts_[t].next.store(t * chunks / active_ * chunk);
      parts_[t].end = t + 1 == active_ ? items : (t + 1) * chunks / active_ * chunk;
    }
    tickets_ = tickets_ == std::numeric_limits<int>::max() ? 1 : tickets_ + 1;  // never PREPARING (a server
    int ticket = tickets_;                                                         // runs ~10^4 GEMMs a second)
    posted_.store(ticket);
    posted_.notify_all();
    work(0);
    for (int t = 1; t < active_; ++t) {
      while (helpers_[t - 1]->inside.load() == ticket) _mm_pause();  // its last chunk
    }
  }

  // `own`: 0 the caller, t the helper of thread t. Its own part first, then the others' in turn.
  void work(int own) {
    for (int k = 0; k < active_; ++k) {
      Part& part = parts_[(own + k) % active_];
      for (;;) {
        int64_t p0 = part.next.fetch_add(chunk_);
        if (p0 >= part.end) break;
        int64_t p1 = std::min(p0 + chunk_, part.end);
        if (fn_ != nullptr) {
          (*fn_)(p0, p1);
        } else {
          packed_gemm_panels(job_, p0, p1);
        }
      }
    }
  }
  void loop(int thread, Helper& me) {
    int seen = 0;
    for (;;) {
      int ticket = posted_.load();
      for (int spin = 0; (ticket == seen || ticket == PREPARING) && spin < SPIN; ++spin) {
        _mm_pause();
        ticket = posted_.load();
      }
      if (ticket == seen || ticket == PREPARING) {
        posted_.wait(ticket);
        continue;
      }
      seen = ticket;
      // Announce, then re-check (both sequentially consistent): either the caller sees us inside and
      // waits, or we see that it has moved on and stay out of the next job's set-up. A helper beyond the
      // job's threads (set_threads lowered) only announces itself.
      me.inside.store(ticket);
      if (posted_.load() == ticket && thread < active_) work(thread);
      me.inside.store(0);
    }
  }

  std::atomic<int> posted_{0};
  std::vector<std::unique_ptr<Helper>> helpers_;  // grows only; helper t's thread is thread t + 1
  Part parts_[MAX_THREADS];
  int active_ = 1;  // threads in the job posted last
  GemmArgs job_{};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;  // set: the job is this, not a GEMM
  int64_t chunk_ = CHUNK;  // how many items a grab takes
  int tickets_ = 0;
  std::atomic<int> threads_{1};
  std::mutex use_;
};

GemmPool& gemm_pool() {
  static GemmPool* pool = new GemmPool();  // never destroyed: its detached threads outlive static destructors
  return *pool;
}

void parallel_items(int64_t n, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  gemm_pool().run_items(n, chunk, fn);
}

int gemm_threads() { return gemm_pool().threads(); }

// Runs `g` on the GEMM threads inside the stream's task, x (and the bias) read as MLX produced them.
void dispatch_gemm(mx::Stream s, GemmArgs g, const mx::array& x, const mx::array* bias, int64_t panels) {
  std::optional<In<float>> b;
  if (bias) b.emplace(*bias);
  auto& enc = mx::cpu::get_command_encoder(s);
  enc.dispatch([g, xi = In<float>(x), b = std::move(b), panels]() mutable {
    std::vector<float> xs, bs;
    g.x = xi.get(xs);
    if (b) g.bias = b->get(bs);
    gemm_pool().run(g, panels);
  });
}

// ---- Causal attention of a prefill chunk -----------------------------------------------------
//
// A prompt's chunk attends as the last T of its S positions: query i sees keys 0 .. S - T + i. As MLX ops
// (cpu_kernels.attention) that was a matmul, a mask select, the softmax and a second matmul per block of
// 128 queries, each block slicing its keys into a copy: ~40 GFLOP/s, so a 4,096-token prompt of the demo
// model spent ~12 of its ~18 s in attention. Here each KV head's keys are packed once as 16-key panels
// (D x 16, the packed GEMM's layout with keys for columns) and its values as 16-dimension panels (S x 16),
// and each block of up to 12 query rows (its queries times the query heads that share the KV head) runs
// the packed GEMM's micro-kernels twice: scores over the keys it can see, then the probabilities times
// the values. The masked keys are never computed: a row's softmax stops at its last visible key and its
// probabilities beyond are zeros.
struct CausalShape {
  int64_t T, S, H, Hk, D;
  std::array<int64_t, 3> qs, ks, vs;  // element strides of q (T, H, D), k and v (S, Hk, D)
  float q_scale;                      // scale * log2(e): scores in base 2
  bool wide;
};

constexpr int64_t CAUSAL_ROWS = 12;  // query rows a block: one pass of the 512-bit micro-kernel

// c[i][0 : 16 * np] = x[i] @ the np panels (K x 16 each, `pstride` floats apart) for rows i < M; np even.
void panels_gemm(const float* x, int64_t ldx, int64_t M, const float* w, int64_t pstride, int64_t np, float* c,
                 int64_t ldc, int64_t K, bool wide) {
#if MESHLM_AVX512
  if (wide) {
    for (int64_t p = 0; p < np; p += 2) {
      for (int64_t i = 0; i < M; i += ROWS_512) {
        MICRO_512<float>[std::min(ROWS_512, M - i)](x + i * ldx, ldx, w + p * pstride, w + (p + 1) * pstride,
                                                    nullptr, nullptr, c + i * ldc + p * PANEL, ldc,
                                                    c + i * ldc + (p + 1) * PANEL, ldc, K);
      }
    }
    return;
  }
#endif
  for (int64_t p = 0; p < np; ++p) {
    for (int64_t i = 0; i < M; i += ROWS_256) {
      MICRO_256<float>[std::min(ROWS_256, M - i)](x + i * ldx, ldx, w + p * pstride, nullptr,
                                                  c + i * ldc + p * PANEL, ldc, K);
    }
  }
}

// `counts`: query t sees keys [0, counts[t]) (null: the causal chunk's S - T + t + 1); `lse`: (T, H) each
// query's natural log-sum-exp, -inf (and a zero output) where it sees no key (null: not wanted).
// The causal attention's packed keys and values, `floats` of them, uninitialised: the calling thread's
// buffer, kept between calls (a fresh buffer of tens of MB is page faults on every call: ~20 % of the kernel's
// time against 18,000 keys). It grows to the largest call's need and is returned once SHRINK_CALLS calls in a
// row needed under a quarter of it: a step that alternates short rows with a long chunk keeps it, where
// releasing it at the first short call re-took it on every layer (74 -> 223 ms a long call, 60K keys).
constexpr int SHRINK_CALLS = 256;

float* packed_scratch(size_t floats) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local size_t size = 0;
  thread_local int small_calls = 0;
  small_calls = floats < size / 4 ? small_calls + 1 : 0;
  if (floats > size || small_calls >= SHRINK_CALLS) {
    buffer.reset();  // returned before the next is taken
    buffer = std::make_unique_for_overwrite<float[]>(floats);
    size = floats;
    small_calls = 0;
  }
  return buffer.get();
}

// `slots`: key s is row slots[s] of k and v (pools of `pool_rows` rows; null: row s); a slot outside the pools
// (never, from meshlm's block tables) gives zeros, as the paged decode's bad tables do.
void causal_attention_kernel(const CausalShape& sh, const float* q, const float* k, const float* v, float* out,
                             const int32_t* counts = nullptr, float* lse = nullptr, const int32_t* slots = nullptr,
                             int64_t pool_rows = 0) {
  const int64_t r = sh.H / sh.Hk, D = sh.D, S = sh.S, T = sh.T;
  const int64_t S_pad = (S + 2 * PANEL - 1) / (2 * PANEL) * (2 * PANEL);  // keys: whole panel pairs
  const int64_t D_pad = (D + 2 * PANEL - 1) / (2 * PANEL) * (2 * PANEL);
  const int64_t heads = std::min(r, CAUSAL_ROWS);            // query heads a block
  const int64_t groups = (r + heads - 1) / heads;             // blocks of heads per KV head
  const int64_t per_block = std::max<int64_t>(1, CAUSAL_ROWS / heads);  // queries a block
  const int64_t blocks = (T + per_block - 1) / per_block;
  if (slots != nullptr && !std::all_of(slots, slots + S, [&](int32_t i) { return i >= 0 && i < pool_rows; })) {
    std::fill(out, out + T * sh.H * D, 0.0f);
    if (lse != nullptr) std::fill(lse, lse + T * sh.H, -std::numeric_limits<float>::infinity());
    return;
  }
  // Packed, every KV head at once: kp[h][p][d][j] = key p * 16 + j, dimension d; vp[h][c][s][j] = value s,
  // dimension c * 16 + j. One pass over the keys reads each token's row of every head together: packed
  // head by head, each pass read an eighth of each row's lines at a stride the prefetchers missed, and a
  // 1-query chunk against 18,000 keys spent ~85 ms a layer packing here (the 72M llama; ~18 ms a call now).
  const int64_t k_head = S_pad * D, v_head = D_pad * S_pad;
  float* const kp_all = packed_scratch(static_cast<size_t>(sh.Hk * (k_head + v_head)));
  float* const vp_all = kp_all + sh.Hk * k_head;
  parallel_items(S_pad / PANEL, 8, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t j = 0; j < PANEL; ++j) {
        const int64_t s = p * PANEL + j;
        for (int64_t h = 0; h < sh.Hk; ++h) {
          float* kd = kp_all + h * k_head + p * D * PANEL + j;
          float* vd = vp_all + h * v_head + s * PANEL;
          if (s >= S) {
            for (int64_t d = 0; d < D; ++d) kd[d * PANEL] = 0.0f;
            for (int64_t c = 0; c < D_pad / PANEL; ++c) std::fill_n(vd + c * S_pad * PANEL, PANEL, 0.0f);
            continue;
          }
          const int64_t row = slots != nullptr ? slots[s] : s;  // the pools read in place: no gather first
          const float* krow = k + row * sh.ks[0] + h * sh.ks[1];
          const float* vrow = v + row * sh.vs[0] + h * sh.vs[1];
          for (int64_t d = 0; d < D; ++d) kd[d * PANEL] = krow[d * sh.ks[2]];
          for (int64_t d = 0; d < D_pad; ++d) {
            vd[(d / PANEL) * S_pad * PANEL + d % PANEL] = d < D ? vrow[d * sh.vs[2]] : 0.0f;
          }
        }
      }
    }
  });
  for (int64_t h = 0; h < sh.Hk; ++h) {
    const float* kp = kp_all + h * k_head;
    const float* vp = vp_all + h * v_head;
    parallel_items(groups * blocks, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> x(CAUSAL_ROWS * D), sc, o(CAUSAL_ROWS * D_pad);
      for (int64_t item = i0; item < i1; ++item) {
        int64_t g0 = (item / blocks) * heads, g1 = std::min(g0 + heads, r), ng = g1 - g0;
        int64_t t0 = (item % blocks) * per_block, t1 = std::min(t0 + per_block, T), rows = (t1 - t0) * ng;
        for (int64_t t = t0; t < t1; ++t) {  // rows query-major: (t, g) at (t - t0) * ng + g - g0
          for (int64_t g = g0; g < g1; ++g) {
            const float* src = q + t * sh.qs[0] + (h * r + g) * sh.qs[1];
            float* dst = x.data() + ((t - t0) * ng + g - g0) * D;
            for (int64_t d = 0; d < D; ++d) dst[d] = src[d * sh.qs[2]] * sh.q_scale;
          }
        }
        auto sees = [&](int64_t t) -> int64_t {
          return counts ? std::clamp<int64_t>(counts[t], 0, S) : S - T + t + 1;
        };
        int64_t seen = 0;  // keys the block's queries see at most
        for (int64_t t = t0; t < t1; ++t) seen = std::max(seen, sees(t));
        int64_t width = (seen + 2 * PANEL - 1) / (2 * PANEL) * (2 * PANEL);
        sc.resize(static_cast<size_t>(rows * width));
        panels_gemm(x.data(), D, rows, kp, D * PANEL, width / PANEL, sc.data(), width, D, sh.wide);
        float inv[CAUSAL_ROWS];  // each row's 1 / sum: applied to its output, not to its `width` weights
        for (int64_t i = 0; i < rows; ++i) {
          float* row = sc.data() + i * width;
          int64_t t = t0 + i / ng, n = sees(t);
          float max_sum[2] = {0.0f, 0.0f};
          inv[i] = n > 0 ? softmax_row(row, n, max_sum) : 0.0f;
          std::fill(row + n, row + width, 0.0f);
          if (lse != nullptr) {  // scores are in base 2: ln(sum e^x) = (max + log2(sum)) * ln 2
            lse[t * sh.H + h * r + g0 + i % ng] = n > 0 ? (max_sum[0] + std::log2(max_sum[1])) / LOG2E
                                                         : -std::numeric_limits<float>::infinity();
          }
        }
        panels_gemm(sc.data(), width, rows, vp, S_pad * PANEL, D_pad / PANEL, o.data(), D_pad, width, sh.wide);
        for (int64_t i = 0; i < rows; ++i) {
          int64_t t = t0 + i / ng, g = g0 + i % ng;
          const float* src = o.data() + i * D_pad;
          float* dst = out + (t * sh.H + h * r + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv[i];
        }
      }
    });
  }
}

// The kernel's shape of q (T, H, D) and k, v (S, Hk, D), as a primitive's inputs hold them.
CausalShape causal_shape(const mx::array& q, const mx::array& k, const mx::array& v, float q_scale) {
  auto strides = [](const mx::array& a) {
    return std::array<int64_t, 3>{a.strides()[0], a.strides()[1], a.strides()[2]};
  };
  return {q.shape(0), k.shape(0), q.shape(1), k.shape(1), q.shape(2), strides(q), strides(k), strides(v), q_scale,
          wide_kernels().load()};
}

class CausalAttention : public CpuOnly {
 public:
  CausalAttention(mx::Stream s, float q_scale) : CpuOnly(s), q_scale_(q_scale) {}
  const char* name() const override { return "MeshlmCausalAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return q_scale_ == static_cast<const CausalAttention&>(other).q_scale_;
  }
  // Inputs q, k, v, and with a fourth (slots (S,) int32) k and v are pools read at those rows.
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const auto &q = in[0], &k = in[1], &v = in[2];
    CausalShape sh = causal_shape(q, k, v, q_scale_);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    if (in.size() == 4) {
      sh.S = in[3].shape(0);
      enc.dispatch([sh, qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(), o = out.data<float>(),
                    si = In<int32_t>(in[3]), rows = k.shape(0)]() {
        std::vector<int32_t> scratch;
        causal_attention_kernel(sh, qp, kp, vp, o, nullptr, nullptr, si.get(scratch), rows);
      });
      return;
    }
    enc.dispatch([sh, qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(), o = out.data<float>()]() {
      causal_attention_kernel(sh, qp, kp, vp, o);
    });
  }

 private:
  float q_scale_;
};

// A ring step's attention of position-sorted queries to position-sorted keys (context parallelism):
// query t sees the first counts[t] keys. Outputs: (T, H, D), and (T, H) log-sum-exps for the merge.
class CausalPartial : public CpuOnlyOutputs {
 public:
  CausalPartial(mx::Stream s, float q_scale) : CpuOnlyOutputs(s), q_scale_(q_scale) {}
  const char* name() const override { return "MeshlmCausalPartial"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return q_scale_ == static_cast<const CausalPartial&>(other).q_scale_;
  }
  // Inputs q, k, v, counts, and with a fifth (slots (S,) int32) k and v are pools read at those rows.
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    const auto &q = in[0], &k = in[1], &v = in[2];
    CausalShape sh = causal_shape(q, k, v, q_scale_);
    const bool paged = in.size() == 5;
    if (paged) sh.S = in[4].shape(0);
    for (auto& o : outs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([sh, qp = q.data<float>(), kp = k.data<float>(), vp = v.data<float>(), ci = In<int32_t>(in[3]),
                  o = outs[0].data<float>(), l = outs[1].data<float>(), si = In<int32_t>(in[paged ? 4 : 3]), paged,
                  rows = k.shape(0)]() {
      std::vector<int32_t> cs, ss;
      causal_attention_kernel(sh, qp, kp, vp, o, ci.get(cs), l, paged ? si.get(ss) : nullptr, rows);
    });
  }

 private:
  float q_scale_;
};

class PackedLinear : public CpuOnly {
 public:
  PackedLinear(mx::Stream s, bool has_bias) : CpuOnly(s), has_bias_(has_bias) {}
  const char* name() const override { return "MeshlmPackedLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return has_bias_ == static_cast<const PackedLinear&>(other).has_bias_;
  }
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const auto &x = in[0], &w = in[1];
    int64_t K = w.shape(1);
    GemmArgs g{nullptr, w.data<void>(), nullptr, {}, {w.shape(0)}, 1, static_cast<int64_t>(x.size() / K), K};
    g.type = panel_type(w);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    g.out[0] = out.data<float>();
    dispatch_gemm(stream(), g, x, has_bias_ ? &in[2] : nullptr, w.shape(0));
  }

 private:
  bool has_bias_;
};

// One packed GEMM whose panels fill several outputs: the q, k and v projections of a layer (one node
// and one pass of the GEMM threads where there were three).
class PackedLinearSplit : public CpuOnlyOutputs {
 public:
  PackedLinearSplit(mx::Stream s, std::vector<int> sizes, bool has_bias)
      : CpuOnlyOutputs(s), sizes_(std::move(sizes)), has_bias_(has_bias) {}
  const char* name() const override { return "MeshlmPackedLinearSplit"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PackedLinearSplit&>(other);
    return sizes_ == o.sizes_ && has_bias_ == o.has_bias_;
  }
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    const auto &x = in[0], &w = in[1];
    int64_t K = w.shape(1);
    GemmArgs g{nullptr, w.data<void>(), nullptr, {}, {}, static_cast<int>(outs.size()),
               static_cast<int64_t>(x.size() / K), K};
    g.type = panel_type(w);
    int64_t end = 0;
    for (size_t j = 0; j < outs.size(); ++j) {
      outs[j].set_data(mx::allocator::malloc(outs[j].nbytes()));
      g.out[j] = outs[j].data<float>();
      end += sizes_[j] / PANEL;
      g.ends[j] = end;
    }
    dispatch_gemm(stream(), g, x, has_bias_ ? &in[2] : nullptr, w.shape(0));
  }

 private:
  std::vector<int> sizes_;
  bool has_bias_;
};

// silu(x @ Wg) * (x @ Wu) with Wg's panels then Wu's in one packed weight: the MLP's gate, up and SwiGLU
// as one node and one pass of the GEMM threads.
class PackedSwiGLU : public CpuOnly {
 public:
  using CpuOnly::CpuOnly;
  const char* name() const override { return "MeshlmPackedSwiGLU"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const auto &x = in[0], &w = in[1];
    int64_t K = w.shape(1), half = w.shape(0) / 2, M = static_cast<int64_t>(x.size() / K);
    out.set_data(mx::allocator::malloc(out.nbytes()));
    GemmArgs g{nullptr, w.data<void>(), nullptr, {}, {half, 2 * half}, 2, M, K};
    g.type = panel_type(w);
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([g, xi = In<float>(x), o = out.data<float>(), n = static_cast<size_t>(M * half * PANEL),
                  panels = w.shape(0)]() mutable {
      std::vector<float> xs, scratch(2 * n);
      g.x = xi.get(xs);
      g.out[0] = scratch.data();
      g.out[1] = scratch.data() + n;
      gemm_pool().run(g, panels);
      swiglu_kernel(scratch.data(), scratch.data() + n, o, n);
    });
  }
};

// ---- A decoder layer of a decode step as one node ---------------------------
//
// A decode step of the demo model was ~780 graph nodes, 26 per layer: four GEMMs, nine small ops (norms,
// RoPE, KV writes, the paged attention, residual adds) and the views between them. At one row the small
// ops' arithmetic is nothing, but each node costs the thread that builds and launches the step, a task
// hand-off to the stream thread and a wake-up of the GEMM helper: ~3.5 ms of a ~10 ms step whose GEMMs
// take ~6.7 ms at the read bandwidth. Here a layer of llama / qwen2 / qwen3 shape (pre-norm attention and
// SwiGLU MLP with residuals) for rows of one new token each is one node calling the same kernels in the
// same order on the same values, so its outputs are the unfused layer's bit for bit:
//   norm1(h) @ Wqkv (+ bias), qwen3's q/k norms, RoPE of q and k;
//   the K and V rows written into the pools (the node's second and third outputs);
//   the paged attention over the written pools, o, the residual, norm2, gate/up, SwiGLU, down, the residual.
// It was four nodes (q/k/v, the two writes, the rest) until 2026-11-28: MLX's CPU stream lets a launching
// thread queue only ~100 dispatches (two a node) ahead, so the 120 nodes of 30 layers woke the launching
// thread ~15 times a step, each wake taking a core from the GEMM threads; one node a layer is launched at
// once (docs/BENCHMARKS.md).
struct DecodeLayerShape {
  int64_t E, H, Hk, D, I;  // hidden, query heads, KV heads, head dim, MLP width
  float eps1, eps2, qk_eps;  // qk_eps: qwen3's per-head q/k norms
  int rope_dims;
  bool rope_traditional;
  float rope_scale;
  int block_size;
  float q_scale;  // softmax scale * log2(e), for the paged attention
  bool qkv_bias, o_bias, qk_norm;
  int64_t Nq() const { return H * D; }
  int64_t Nk() const { return Hk * D; }
};

// out[i] = a[i] + b[i]: the residual add, elementwise as MLX's (exact, whatever the vector width).
void add_kernel(const float* a, const float* b, float* out, size_t n) {  // out may be a
#pragma omp simd
  for (size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

// One packed GEMM of R rows filling `parts` (pointer, columns) in order from one weight's panels.
void gemm_parts(const float* a, int64_t R, int64_t K, const void* w, PanelType t, const float* bias,
                std::initializer_list<std::pair<float*, int64_t>> parts) {
  GemmArgs g{a, w, bias, {}, {}, static_cast<int>(parts.size()), R, K};
  g.type = t;
  int64_t end = 0;
  int j = 0;
  for (auto [dst, n] : parts) {
    g.out[j] = dst;
    end += n / PANEL;
    g.ends[j++] = end;
  }
  gemm_pool().run(g, end);
}

// The attention after the writes: each row's q (planar, as decode_qkv_out left it) over its blocks of
// the written pools, then o: y (rows, E). att: (rows, H * D) scratch.
void decode_attention_out(const DecodeLayerShape& sh, int64_t rows, const float* q, const float* kp, const float* vp,
                          int64_t S, const int32_t* table, const int32_t* len, int64_t max_blocks, const void* o_w,
                          PanelType o_t, const float* o_bias, float* att, float* y) {
  PagedShape ps{rows, sh.Hk, sh.H / sh.Hk, sh.D, S, max_blocks, sh.block_size, {sh.D, sh.Nk()}, {sh.D, sh.Nk()},
                sh.q_scale, wide_kernels().load(), software_prefetch().load()};
  paged_decode(ps, q, kp, vp, table, len, att);
  gemm_parts(att, rows, sh.Nq(), o_w, o_t, o_bias, {{y, sh.E}});
}

// The MLP of h2 (rows, E): down(swiglu(norm2(h2) @ [gate | up])) into d (rows, E). scratch: rows * (E + 3 I).
void decode_mlp_out(const DecodeLayerShape& sh, int64_t rows, const float* h2, const float* ln2, const void* gu_w,
                    PanelType gu_t, const void* down_w, PanelType down_t, float* scratch, float* d) {
  const int64_t E = sh.E, I = sh.I;
  float *x = scratch, *gate = x + rows * E, *up = gate + rows * I, *g = up + rows * I;
  rms_norm_kernel(h2, ln2, x, rows, E, sh.eps2);
  gemm_parts(x, rows, E, gu_w, gu_t, nullptr, {{gate, I}, {up, I}});
  swiglu_kernel(gate, up, g, static_cast<size_t>(rows * I));
  gemm_parts(g, rows, I, down_w, down_t, nullptr, {{d, E}});
}

// norm1(h) @ Wqkv (+ bias), qwen3's q/k norms and RoPE into `planar`: q (R, H, D) then k (R, Hk, D) roped,
// then v (R, Hk, D). scratch: rows * (E + 2 Nq + 2 Nk).
void decode_qkv_out(const DecodeLayerShape& sh, int64_t rows, const float* h, const float* ln1, const void* w,
                    PanelType t, const float* bias, const float* q_norm, const float* k_norm, const float* inv_freq,
                    const int32_t* pos, float* scratch, float* planar) {
  const int64_t E = sh.E, D = sh.D, Nq = sh.Nq(), Nk = sh.Nk();
  float *x = scratch, *q = x + rows * E, *k = q + rows * Nq, *qn = k + rows * Nk, *kn = qn + rows * Nq;
  float *q_out = planar, *k_out = planar + rows * Nq, *v_out = k_out + rows * Nk;
  rms_norm_kernel(h, ln1, x, rows, E, sh.eps1);
  gemm_parts(x, rows, E, w, t, bias, {{q, Nq}, {k, Nk}, {v_out, Nk}});
  const float *qs = q, *ks = k;
  if (q_norm != nullptr) {
    rms_norm_kernel(q, q_norm, qn, rows * sh.H, D, sh.qk_eps);
    rms_norm_kernel(k, k_norm, kn, rows * sh.Hk, D, sh.qk_eps);
    qs = qn;
    ks = kn;
  }
  rope_kernel(qs, Nq, D, pos, inv_freq, q_out, rows, sh.H, D, sh.rope_dims, sh.rope_traditional, sh.rope_scale);
  rope_kernel(ks, Nk, D, pos, inv_freq, k_out, rows, sh.Hk, D, sh.rope_dims, sh.rope_traditional, sh.rope_scale);
}

// `rows` rows of n floats written into a pool of S slots at `slots`. Slots outside the pool (which the
// runner refuses first) are skipped, never a stray write.
void write_slots(float* pool, int64_t S, int64_t n, const int32_t* slots, const float* rows, int64_t R) {
  for (int64_t t = 0; t < R; ++t) {
    if (slots[t] < 0 || slots[t] >= S) continue;
    std::memcpy(pool + slots[t] * n, rows + t * n, static_cast<size_t>(n) * sizeof(float));
  }
}

// The node. Inputs: h, norm1, q/k/v panels, inv_freq, positions, K pool, V pool, slots, tables, lengths,
// o panels, then norm2, gate/up panels, down panels (not under `split`), then the optional q/k/v bias,
// q and k norms, o bias. Outputs: the layer's h (`split`: this rank's partial o, to be summed before
// DecodeMLP), the K pool and the V pool with this step's rows written, in place when MLX can donate them.
class DecodeLayerNode : public CpuOnlyOutputs {
 public:
  static constexpr int K_POOL = 5, V_POOL = 6, SLOTS = 7, TABLES = 8, LENGTHS = 9, O = 10, LN2 = 11, GU = 12,
                       DOWN = 13;
  DecodeLayerNode(mx::Stream s, DecodeLayerShape sh, bool split) : CpuOnlyOutputs(s), sh_(sh), split_(split) {}
  const char* name() const override { return "MeshlmDecodeLayer"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }  // each writes its own pools
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    release_sibling_inputs(in, outs);
    outs[0].set_data(mx::allocator::malloc(outs[0].nbytes()));
    auto k_src = pool_output(in[K_POOL], outs[1]);
    auto v_src = pool_output(in[V_POOL], outs[2]);
    int opt = split_ ? LN2 : DOWN + 1;  // the optional inputs follow the fixed ones
    const float* qkv_bias = sh_.qkv_bias ? in[opt++].data<float>() : nullptr;
    const float* q_norm = sh_.qk_norm ? in[opt++].data<float>() : nullptr;
    const float* k_norm = sh_.qk_norm ? in[opt++].data<float>() : nullptr;
    const float* o_bias = sh_.o_bias ? in[opt++].data<float>() : nullptr;
    const auto &qkv = in[2], &kpool = in[K_POOL], &tables = in[TABLES], &o = in[O];
    const void *gu_w = nullptr, *down_w = nullptr;
    PanelType gu_t = PanelType::f32, down_t = PanelType::f32;
    if (!split_) {
      gu_w = in[GU].data<void>();
      gu_t = panel_type(in[GU]);
      down_w = in[DOWN].data<void>();
      down_t = panel_type(in[DOWN]);
    }
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([sh = sh_, split = split_, hi = In<float>(in[0]), ln1 = in[1].data<float>(), qkv_w = qkv.data<void>(),
                  qkv_t = panel_type(qkv), inv_freq = in[3].data<float>(), pi = In<int32_t>(in[4]), qkv_bias, q_norm,
                  k_norm, k_src = std::move(k_src), v_src = std::move(v_src), kp = outs[1].data<float>(),
                  vp = outs[2].data<float>(), S = kpool.shape(0), si = In<int32_t>(in[SLOTS]),
                  tp = In<int32_t>(tables), lp = In<int32_t>(in[LENGTHS]), max_blocks = tables.shape(1),
                  o_w = o.data<void>(), o_t = panel_type(o), o_bias, ln2 = split_ ? nullptr : in[LN2].data<float>(),
                  gu_w, gu_t, down_w, down_t, y_out = outs[0].data<float>(), rows = tables.shape(0)]() {
      const int64_t E = sh.E, Nq = sh.Nq(), Nk = sh.Nk();
      std::vector<float> hs;
      std::vector<int32_t> ps, ss, ts, ls;
      const float* h = hi.get(hs);
      thread_local std::vector<float> buf;  // per thread: no allocation per layer
      const int64_t scratch_size = std::max(E + 2 * Nq + 2 * Nk, 2 * E + Nq + 3 * sh.I);  // q/k/v's, the rest's
      buf.resize(static_cast<size_t>(rows * (Nq + 2 * Nk + scratch_size)));
      float *planar = buf.data(), *scratch = planar + rows * (Nq + 2 * Nk);
      decode_qkv_out(sh, rows, h, ln1, qkv_w, qkv_t, qkv_bias, q_norm, k_norm, inv_freq, pi.get(ps), scratch, planar);
      copy_pool(k_src, kp, static_cast<size_t>(S * Nk));
      copy_pool(v_src, vp, static_cast<size_t>(S * Nk));
      const int32_t* slots = si.get(ss);
      write_slots(kp, S, Nk, slots, planar + rows * Nq, rows);
      write_slots(vp, S, Nk, slots, planar + rows * (Nq + Nk), rows);
      float *att = scratch, *y = att + rows * Nq, *mlp = y + rows * E;
      if (split) {  // the attention and this rank's partial o: summed over the ranks before DecodeMLP
        decode_attention_out(sh, rows, planar, kp, vp, S, tp.get(ts), lp.get(ls), max_blocks, o_w, o_t, nullptr,
                             att, y_out);
        return;
      }
      decode_attention_out(sh, rows, planar, kp, vp, S, tp.get(ts), lp.get(ls), max_blocks, o_w, o_t, o_bias, att, y);
      add_kernel(h, y, y_out, static_cast<size_t>(rows * E));  // h + attention, kept in the output
      decode_mlp_out(sh, rows, y_out, ln2, gu_w, gu_t, down_w, down_t, mlp, y);
      add_kernel(y_out, y, y_out, static_cast<size_t>(rows * E));
    });
  }

 private:
  // MLX gives each output of a node its own copy of the node's inputs, so a pool is held three times and
  // never donatable (array::is_donatable: held once). The outputs that are not being evaluated (`in` is
  // the evaluated one's list) drop their copies now, as MLX's detach does right after this call: a pool
  // is then held as a unary node's input is, and donated on the same terms (pool_output). Should MLX hand
  // over a copy of the list instead, nothing is dropped and the pools are copied, never lost.
  static void release_sibling_inputs(const std::vector<mx::array>& in, std::vector<mx::array>& outs) {
    bool found = false;
    for (auto& o : outs) found |= &o.inputs() == &in;
    if (!found) return;
    for (auto& o : outs) {
      if (&o.inputs() != &in) o.inputs().clear();
    }
  }

  DecodeLayerShape sh_;
  bool split_;
};

// inputs: h, the summed attention output (its bias added), norm2, gate/up panels, down panels.
// Outputs: h + attention, and this rank's partial MLP output (to be summed).
class DecodeMLP : public CpuOnlyOutputs {
 public:
  DecodeMLP(mx::Stream s, DecodeLayerShape sh) : CpuOnlyOutputs(s), sh_(sh) {}
  const char* name() const override { return "MeshlmDecodeMLP"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }
  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& outs) override {
    for (auto& o : outs) o.set_data(mx::allocator::malloc(o.nbytes()));
    const auto &gu = in[3], &down = in[4];
    auto& enc = mx::cpu::get_command_encoder(stream());
    enc.dispatch([sh = sh_, hi = In<float>(in[0]), ai = In<float>(in[1]), ln2 = in[2].data<float>(),
                  gu_w = gu.data<void>(), gu_t = panel_type(gu), down_w = down.data<void>(), down_t = panel_type(down),
                  h2 = outs[0].data<float>(), d = outs[1].data<float>(), rows = outs[0].size() / sh_.E]() {
      std::vector<float> hs, as;
      add_kernel(hi.get(hs), ai.get(as), h2, rows * sh.E);
      thread_local std::vector<float> buf;
      const int64_t R = static_cast<int64_t>(rows);
      buf.resize(static_cast<size_t>(R * (sh.E + 3 * sh.I)));
      decode_mlp_out(sh, R, h2, ln2, gu_w, gu_t, down_w, down_t, buf.data(), d);
    });
  }

 private:
  DecodeLayerShape sh_;
};
#endif

// q (T, H, D) and k, v (S or rows, Hk, D), T > 0, H a multiple of Hk: what every causal attention takes.
bool attention_shapes(const mx::array& q, const mx::array& k, const mx::array& v) {
  return q.ndim() == 3 && k.ndim() == 3 && v.shape() == k.shape() && k.shape(1) > 0 && q.shape(1) % k.shape(1) == 0 &&
         q.shape(2) == k.shape(2) && q.shape(0) > 0;
}

// q (T, H, D) against k, v (S, Hk, D), the queries the last T of the S positions (a prefill chunk); any
// strides. Returns (T, H, D).
mx::array causal_attention(const mx::array& q, const mx::array& k, const mx::array& v, float q_scale) {
  bool shapes = attention_shapes(q, k, v) && q.shape(0) <= k.shape(0);
  if (!shapes) {
    throw std::invalid_argument("causal_attention: q (T, H, D), k and v (S, Hk, D), 0 < T <= S, H a multiple of Hk");
  }
#if MESHLM_AVX2
  auto s = current_stream();
  std::vector<mx::array> inputs{require_float32(q), require_float32(k), require_float32(v)};
  return mx::array(q.shape(), mx::float32, std::make_shared<CausalAttention>(s, q_scale), inputs);
#else
  throw std::runtime_error("causal_attention: built without AVX2 (see the module's packed_gemm)");
#endif
}

// q (T, H, D) against rows slots[0..S) of the pools k, v (rows, Hk, D): causal_attention without gathering a
// long context's keys first (a 1,024-token chunk against 18,000 of them gathered ~40 ms a layer).
mx::array causal_attention_paged(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& slots,
                                 float q_scale) {
  bool shapes = attention_shapes(q, k, v) && slots.ndim() == 1 &&
                q.shape(0) <= slots.shape(0) && mx::issubdtype(slots.dtype(), mx::integer);
  if (!shapes) {
    throw std::invalid_argument("causal_attention_paged: q (T, H, D), pools k and v (rows, Hk, D), slots (S,) of "
                                "integers, 0 < T <= S, H a multiple of Hk");
  }
#if MESHLM_AVX2
  auto s = current_stream();
  std::vector<mx::array> inputs{require_float32(q), require_float32(k), require_float32(v),
                                mx::astype(slots, mx::int32, s)};
  return mx::array(q.shape(), mx::float32, std::make_shared<CausalAttention>(s, q_scale), inputs);
#else
  throw std::runtime_error("causal_attention_paged: built without AVX2 (see the module's packed_gemm)");
#endif
}

// q (T, H, D) against k, v (S, Hk, D), any strides, query t seeing the first counts[t] keys (T,). Returns
// the output (T, H, D) and each query's natural log-sum-exp (T, H): zeros and -inf for a query seeing none.
std::vector<mx::array> causal_partial(const mx::array& q, const mx::array& k, const mx::array& v,
                                      const mx::array& counts, float q_scale) {
  bool shapes = attention_shapes(q, k, v) && k.shape(0) > 0 &&
                counts.ndim() == 1 && counts.shape(0) == q.shape(0) && mx::issubdtype(counts.dtype(), mx::integer);
  if (!shapes) {
    throw std::invalid_argument("causal_partial: q (T, H, D), k and v (S, Hk, D), counts (T,) of integers, "
                                "T and S > 0, H a multiple of Hk");
  }
#if MESHLM_AVX2
  auto s = current_stream();
  std::vector<mx::array> inputs{require_float32(q), require_float32(k), require_float32(v),
                                mx::astype(counts, mx::int32, s)};
  return mx::array::make_arrays({q.shape(), {q.shape(0), q.shape(1)}}, {mx::float32, mx::float32},
                                std::make_shared<CausalPartial>(s, q_scale), inputs);
#else
  throw std::runtime_error("causal_partial: built without AVX2 (see the module's packed_gemm)");
#endif
}

// causal_partial against rows slots[0..S) of the pools k, v (rows, Hk, D), read in place (no gather).
std::vector<mx::array> causal_partial_paged(const mx::array& q, const mx::array& k, const mx::array& v,
                                            const mx::array& slots, const mx::array& counts, float q_scale) {
  bool shapes = attention_shapes(q, k, v) && slots.ndim() == 1 &&
                slots.shape(0) > 0 && mx::issubdtype(slots.dtype(), mx::integer) && counts.ndim() == 1 &&
                counts.shape(0) == q.shape(0) && mx::issubdtype(counts.dtype(), mx::integer);
  if (!shapes) {
    throw std::invalid_argument("causal_partial_paged: q (T, H, D), pools k and v (rows, Hk, D), slots (S,) and "
                                "counts (T,) of integers, T and S > 0, H a multiple of Hk");
  }
#if MESHLM_AVX2
  auto s = current_stream();
  std::vector<mx::array> inputs{require_float32(q), require_float32(k), require_float32(v),
                                mx::astype(counts, mx::int32, s), mx::astype(slots, mx::int32, s)};
  return mx::array::make_arrays({q.shape(), {q.shape(0), q.shape(1)}}, {mx::float32, mx::float32},
                                std::make_shared<CausalPartial>(s, q_scale), inputs);
#else
  throw std::runtime_error("causal_partial_paged: built without AVX2 (see the module's packed_gemm)");
#endif
}

mx::array packed_linear(const mx::array& x, const mx::array& w, std::optional<mx::array> bias) {
  if (w.ndim() != 3 || w.shape(2) != PANEL || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("packed_linear: x (..., K) and w (N/16, K, 16)");
  }
  int K = w.shape(1), N = w.shape(0) * PANEL;
  if (bias && (bias->ndim() != 1 || bias->shape(0) != N)) {
    throw std::invalid_argument("packed_linear: bias must be (N,), N = 16 x w.shape[0]");
  }
  auto s = current_stream();
#if MESHLM_AVX2
  if (x.dtype() == mx::float32) {
    auto shape = x.shape();
    shape.back() = N;
    std::vector<mx::array> inputs{float32_input(x, s), panel_weight(w, s)};
    if (bias) inputs.push_back(float32_input(*bias, s));
    return mx::array(shape, mx::float32, std::make_shared<PackedLinear>(s, bias.has_value()), inputs);
  }
#endif
  auto unpacked = mx::reshape(mx::transpose(w, {1, 0, 2}, s), {K, N}, s);  // a copy, for MLX's matmul
  return bias ? mx::addmm(*bias, x, unpacked, 1.0f, 1.0f, s) : mx::matmul(x, unpacked, s);
}

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps) {
  if (x.ndim() < 1 || weight.ndim() != 1 || weight.shape(0) != x.shape(-1)) {
    throw std::invalid_argument("rms_norm: x (..., D) and weight (D,)");
  }
  auto s = current_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<RmsNorm>(s, eps),
                   {float32_input(x, s), float32_input(weight, s)});
}

mx::array rope(const mx::array& x, const mx::array& positions, const mx::array& inv_freq, int dims, bool traditional,
               float scale) {
  if (x.ndim() != 4 || x.shape(0) != 1 || dims < 2 || dims % 2 != 0 || dims > x.shape(-1)) {
    throw std::invalid_argument("rope: x (1, H, T, D) and an even dims <= D");
  }
  if (inv_freq.ndim() != 1 || inv_freq.shape(0) != dims / 2) {
    throw std::invalid_argument("rope: inv_freq must be (dims / 2,)");
  }
  if (positions.ndim() != 1 || positions.shape(0) != x.shape(2) || !mx::issubdtype(positions.dtype(), mx::integer)) {
    throw std::invalid_argument("rope: positions must be integers, one per token of x (1, H, T, D)");
  }
  auto s = current_stream();
  return mx::array(x.shape(), mx::float32, std::make_shared<Rope>(s, dims, traditional, scale),
                   {float32_input(x, s), mx::astype(positions, mx::int32, s), float32_input(inv_freq, s)});
}

mx::array kv_write(const mx::array& pool, const mx::array& slots, const mx::array& rows) {
  if (pool.ndim() != 3 || rows.ndim() != 4 || rows.shape(0) != 1 || rows.shape(1) != pool.shape(1) ||
      rows.shape(3) != pool.shape(2)) {
    throw std::invalid_argument("kv_write: pool (S, Hk, D) and rows (1, Hk, T, D)");
  }
  if (slots.ndim() != 1 || slots.shape(0) != rows.shape(2) || !mx::issubdtype(slots.dtype(), mx::integer)) {
    throw std::invalid_argument("kv_write: slots must be integers, one per row");
  }
  auto s = current_stream();
  require_float32(rows);
  return mx::array(pool.shape(), mx::float32, std::make_shared<KVWrite>(s),
                   {require_float32(pool), mx::astype(slots, mx::int32, s), rows});
}

std::vector<mx::array> packed_linear_split(const mx::array& x, const mx::array& w, const std::vector<int>& sizes,
                                           std::optional<mx::array> bias) {
  if (w.ndim() != 3 || w.shape(2) != PANEL || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("packed_linear_split: x (..., K) and w (N/16, K, 16)");
  }
  int64_t total = 0;
  for (int n : sizes) {
    if (n <= 0 || n % PANEL != 0) throw std::invalid_argument("packed_linear_split: sizes must be multiples of 16");
    total += n;
  }
  if (sizes.empty() || sizes.size() > MAX_SPLITS || total != static_cast<int64_t>(w.shape(0)) * PANEL) {
    throw std::invalid_argument("packed_linear_split: 1-4 sizes adding up to N = 16 x w.shape[0]");
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != total)) {
    throw std::invalid_argument("packed_linear_split: bias must be (N,)");
  }
  auto s = current_stream();
#if MESHLM_AVX2
  if (x.dtype() == mx::float32) {
    std::vector<mx::Shape> shapes;
    for (int n : sizes) {
      auto shape = x.shape();
      shape.back() = n;
      shapes.push_back(shape);
    }
    std::vector<mx::array> inputs{float32_input(x, s), panel_weight(w, s)};
    if (bias) inputs.push_back(float32_input(*bias, s));
    return mx::array::make_arrays(shapes, std::vector<mx::Dtype>(sizes.size(), mx::float32),
                                  std::make_shared<PackedLinearSplit>(s, sizes, bias.has_value()), inputs);
  }
#endif
  auto y = packed_linear(x, w, bias);
  std::vector<mx::array> outs;
  int start = 0;
  for (int n : sizes) {
    auto lo = mx::Shape(y.ndim(), 0), hi = y.shape();
    lo.back() = start;
    hi.back() = start + n;
    outs.push_back(mx::slice(y, lo, hi, s));
    start += n;
  }
  return outs;
}

mx::array packed_swiglu(const mx::array& x, const mx::array& w) {
  if (w.ndim() != 3 || w.shape(2) != PANEL || w.shape(0) % 2 != 0 || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("packed_swiglu: x (..., K) and w (2 * I/16, K, 16), gate panels then up");
  }
  auto s = current_stream();
  int I = w.shape(0) / 2 * PANEL;
#if MESHLM_AVX2
  if (x.dtype() == mx::float32) {
    auto shape = x.shape();
    shape.back() = I;
    return mx::array(shape, mx::float32, std::make_shared<PackedSwiGLU>(s), {float32_input(x, s), panel_weight(w, s)});
  }
#endif
  auto parts = packed_linear_split(x, w, {I, I}, std::nullopt);
  return swiglu(parts[0], parts[1]);
}

// Weight shapes the decode layer takes: (n/16, k, 16) panels, and (n,) float32 vectors (norms, biases).
bool is_panels(const mx::array& w, int64_t n, int64_t k) {
  return w.ndim() == 3 && w.shape(2) == PANEL && w.shape(0) * PANEL == n && w.shape(1) == k;
}
bool is_vector(const mx::array& a, int64_t n) { return a.ndim() == 1 && a.shape(0) == n && a.dtype() == mx::float32; }

// The MLP width I of a decode layer's post-attention norm, gate/up panels (gate's then up's) and down panels
// for hidden size E, or 0 when they do not fit it (decode_layer and decode_mlp take the same weights).
constexpr const char* MLP_WEIGHTS =
    "norm (hidden,) float32, gate/up panels (hidden -> 2 I) and down panels (I -> hidden)";
int64_t decode_mlp_width(int64_t E, const mx::array& ln2, const mx::array& gu, const mx::array& down) {
  const int64_t I = gu.ndim() == 3 && gu.shape(0) % 2 == 0 ? gu.shape(0) / 2 * PANEL : 0;
  bool fits = E > 0 && I > 0 && is_vector(ln2, E) && is_panels(gu, 2 * I, E) && is_panels(down, E, I);
  return fits ? I : 0;
}

// weights: [input norm, q/k/v panels (q's then k's then v's), o panels, post-attention norm, gate/up panels
// (gate's then up's), down panels, RoPE inverse frequencies]; eps: [input norm's, post-attention norm's,
// the q/k norms'] (the last ignored without q_norm). Returns [h out, K pool, V pool]; with `split` (o and
// down are tensor-parallel row shards) [this rank's partial attention output, K pool, V pool], for the
// caller to sum over the ranks, add o's bias to, and hand to decode_mlp.
std::vector<mx::array> decode_layer(const mx::array& h, const std::vector<mx::array>& weights, const mx::array& k_pool,
                                    const mx::array& v_pool, const mx::array& slots, const mx::array& positions,
                                    const mx::array& tables, const mx::array& lengths, int heads,
                                    const std::vector<float>& eps, int rope_dims, bool rope_traditional,
                                    float rope_scale, int block_size, float q_scale,
                                    std::optional<mx::array> qkv_bias, std::optional<mx::array> o_bias,
                                    std::optional<mx::array> q_norm, std::optional<mx::array> k_norm, bool split) {
#if MESHLM_AVX2
  auto bad = [](const std::string& what) { return std::invalid_argument("decode_layer: " + what); };
  if (split && o_bias) throw bad("a split layer's o bias is added after the sum, by the caller");
  if (weights.size() != 7 || eps.size() != 3) throw bad("7 weights and 3 eps");
  const auto &ln1 = weights[0], &qkv = weights[1], &o = weights[2], &ln2 = weights[3], &gu = weights[4],
             &down = weights[5], &inv_freq = weights[6];
  if (h.ndim() < 1 || h.dtype() != mx::float32) throw bad("h (..., hidden) float32");
  const int64_t E = h.shape(-1), R = E > 0 ? static_cast<int64_t>(h.size()) / E : 0;
  if (k_pool.ndim() != 3 || v_pool.shape() != k_pool.shape() || k_pool.dtype() != mx::float32 ||
      v_pool.dtype() != mx::float32) {
    throw bad("pools (slots, kv_heads, head_dim) float32");
  }
  const int64_t Hk = k_pool.shape(1), D = k_pool.shape(2), S = k_pool.shape(0);
  if (R < 1 || Hk < 1 || heads < 1 || heads % Hk != 0 || D < 1) throw bad("rows, heads a multiple of kv_heads");
  if (block_size < 1 || S % block_size != 0) throw bad("the pools must hold whole blocks");
  const int64_t Nq = heads * D, Nqkv = Nq + 2 * Hk * D;
  if (!is_panels(qkv, Nqkv, E) || !is_panels(o, E, Nq)) {
    throw bad("panels (N/16, K, 16): q/k/v (hidden -> (heads + 2 kv_heads) head_dim), o");
  }
  const int64_t I = decode_mlp_width(E, ln2, gu, down);
  if (I < 1) throw bad(MLP_WEIGHTS);
  if (!is_vector(ln1, E)) throw bad("input norm (hidden,) float32");
  if (rope_dims < 2 || rope_dims % 2 != 0 || rope_dims > D || !is_vector(inv_freq, rope_dims / 2)) {
    throw bad("an even rope_dims <= head_dim and inv_freq (rope_dims / 2,) float32");
  }
  auto ids = [&](const mx::array& a) { return a.ndim() == 1 && a.shape(0) == R && mx::issubdtype(a.dtype(), mx::integer); };
  if (!ids(slots) || !ids(positions) || !ids(lengths) || tables.ndim() != 2 || tables.shape(0) != R ||
      !mx::issubdtype(tables.dtype(), mx::integer)) {
    throw bad("slots, positions, lengths (rows,) and tables (rows, max_blocks) of integers");
  }
  if ((qkv_bias && !is_vector(*qkv_bias, Nqkv)) || (o_bias && !is_vector(*o_bias, E)) ||
      q_norm.has_value() != k_norm.has_value() || (q_norm && (!is_vector(*q_norm, D) || !is_vector(*k_norm, D)))) {
    throw bad("biases (N,) and q/k norms (head_dim,) float32, both norms or neither");
  }
  auto s = current_stream();
  DecodeLayerShape sh{E, heads, Hk, D, I, eps[0], eps[1], eps[2], rope_dims, rope_traditional, rope_scale,
                      block_size, q_scale, qkv_bias.has_value(), o_bias.has_value(), q_norm.has_value()};
  auto i32 = [&](const mx::array& a) { return mx::astype(a, mx::int32, s); };
  std::vector<mx::array> in{float32_input(h, s), float32_input(ln1, s), panel_weight(qkv, s),
                            float32_input(inv_freq, s), i32(positions), k_pool, v_pool, i32(slots), i32(tables),
                            i32(lengths), panel_weight(o, s)};
  if (!split) {
    in.insert(in.end(), {float32_input(ln2, s), panel_weight(gu, s), panel_weight(down, s)});
  }
  for (const auto* opt : {&qkv_bias, &q_norm, &k_norm, &o_bias}) {
    if (*opt) in.push_back(float32_input(**opt, s));
  }
  return mx::array::make_arrays({h.shape(), k_pool.shape(), v_pool.shape()}, {mx::float32, mx::float32, mx::float32},
                                std::make_shared<DecodeLayerNode>(s, sh, split), std::move(in));
#else
  throw std::invalid_argument("decode_layer: built without AVX2");
#endif
}

// The rest of a split layer: [h + attention, this rank's partial MLP output]; weights and eps as decode_layer's.
std::vector<mx::array> decode_mlp(const mx::array& h, const mx::array& attention, const std::vector<mx::array>& weights,
                                  const std::vector<float>& eps) {
#if MESHLM_AVX2
  auto bad = [](const std::string& what) { return std::invalid_argument("decode_mlp: " + what); };
  if (weights.size() != 7 || eps.size() != 3) throw bad("7 weights and 3 eps");
  const auto &ln2 = weights[3], &gu = weights[4], &down = weights[5];
  if (h.ndim() < 1 || h.dtype() != mx::float32 || attention.shape() != h.shape() || attention.dtype() != mx::float32) {
    throw bad("h and the attention output (..., hidden) float32, of one shape");
  }
  const int64_t E = h.shape(-1), I = decode_mlp_width(E, ln2, gu, down);
  if (I < 1) throw bad(MLP_WEIGHTS);
  auto s = current_stream();
  DecodeLayerShape sh{};
  sh.E = E;
  sh.I = I;
  sh.eps2 = eps[1];
  return mx::array::make_arrays({h.shape(), h.shape()}, {mx::float32, mx::float32}, std::make_shared<DecodeMLP>(s, sh),
                                {float32_input(h, s), float32_input(attention, s), float32_input(ln2, s),
                                 panel_weight(gu, s), panel_weight(down, s)});
#else
  throw std::invalid_argument("decode_mlp: built without AVX2");
#endif
}

mx::array untouched_zeros(const std::vector<int>& shape, mx::Dtype dtype) {
  for (int d : shape) {
    if (d < 0) throw std::invalid_argument("untouched_zeros: negative dimension");
  }
  auto s = current_stream();
  return mx::array(mx::Shape(shape.begin(), shape.end()), dtype, std::make_shared<UntouchedZeros>(s), {});
}

void set_gemm_threads(int n) {
#if MESHLM_AVX2
  gemm_pool().set_threads(n);
#endif
}

// Moves the whole 2 MiB pages of the evaluated arrays' memory into transparent huge pages (MADV_COLLAPSE,
// Linux 6.1 and later; this machine's THP setting is "madvise", so nothing else would). A decode step
// streams every weight once: with 4 KiB pages it takes a TLB miss every 4 KiB, and the hardware prefetcher
// stops at each page's end. Huge pages took a stage's 8-row GEMMs over 144 MB of weights from ~12.4 to
// ~10.3 ms and a 16-row step's from ~16.7 to ~14.7 (one core), and the demo model's one-stream decode
// from ~68 % to ~75 % of the read bound (2026-11-28). Returns the bytes moved: 0 where the kernel cannot
// (older, or THP off), which changes nothing but speed.
#if defined(__linux__) && !defined(MADV_COLLAPSE)
#define MADV_COLLAPSE 25  // the kernel's value; C libraries before glibc 2.37 do not name it
#endif
size_t huge_pages(const std::vector<mx::array>& arrays) {
  size_t moved = 0;
#ifdef MADV_COLLAPSE
  constexpr uintptr_t HUGE = uintptr_t{2} << 20;
  // Arrays within 1 MiB of each other are one span: most of a small model's layers are under 4 MiB, and
  // alone hold no whole 2 MiB page. The gaps between weights are heap the load has used (the allocator's
  // headers, its temporaries' freed chunks): moving them too, the demo model's RSS did not grow (583 MB
  // against 585 without, 2026-11-28).
  constexpr uintptr_t GAP = uintptr_t{1} << 20;
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;
  for (const auto& a : arrays) {
    if (!a.is_available() || a.data<char>() == nullptr || a.nbytes() == 0) continue;  // memory once evaluated
    uintptr_t p = reinterpret_cast<uintptr_t>(a.data<char>());
    spans.emplace_back(p, p + a.nbytes());
  }
  std::sort(spans.begin(), spans.end());
  std::vector<std::pair<uintptr_t, uintptr_t>> merged;
  for (const auto& [b, e] : spans) {
    if (!merged.empty() && b <= merged.back().second + GAP) {
      merged.back().second = std::max(merged.back().second, e);
    } else {
      merged.emplace_back(b, e);
    }
  }
  for (const auto& [b, e] : merged) {
    uintptr_t lo = (b + HUGE - 1) & ~(HUGE - 1), hi = e & ~(HUGE - 1);
    if (hi > lo && madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_COLLAPSE) == 0) moved += hi - lo;
  }
#endif
  return moved;
}

bool set_software_prefetch(bool on) { return software_prefetch().exchange(on); }

bool set_wide_kernels(bool on) {
  wide_kernels().store(on && MESHLM_AVX512);
  return wide_kernels().load();
}
}  // namespace

NB_MODULE(_cpu_ops, m) {
  m.doc() = "meshlm's vectorised CPU kernels as MLX primitives";
  m.attr("mlx_version") = MESHLM_MLX_VERSION;
  m.def("swiglu", &swiglu, nb::arg("gate"), nb::arg("x"), "silu(gate) * x");
  m.def("softmax2", &softmax2, nb::arg("scores"), "softmax over the last axis of base-2 scores");
  m.def("softmax2_lse", &softmax2_lse, nb::arg("scores"),
        "softmax2 and each row's log2-sum-exp (max + log2 sum), as [weights, lse]");
  m.attr("packed_gemm") = static_cast<bool>(MESHLM_AVX2);
  m.attr("panel") = PANEL;
  m.def("packed_linear", &packed_linear, nb::arg("x"), nb::arg("w"), nb::arg("bias") = nb::none(),
        "x @ W (+ bias) with W packed as (N/16, K, 16) panels");
  m.def("packed_linear_split", &packed_linear_split, nb::arg("x"), nb::arg("w"), nb::arg("sizes"),
        nb::arg("bias") = nb::none(), "x @ W (+ bias) as one output per size (columns in order), one GEMM");
  m.def("packed_swiglu", &packed_swiglu, nb::arg("x"), nb::arg("w"),
        "silu(x @ Wg) * (x @ Wu), W holding Wg's panels then Wu's");
  m.def("set_gemm_threads", &set_gemm_threads, nb::arg("n"), "threads a packed GEMM may use (caller + helper)");
  m.attr("wide_kernels_built") = static_cast<bool>(MESHLM_AVX512);
  m.def("set_software_prefetch", &set_software_prefetch, nb::arg("on"),
        "the few-row packed GEMM and the paged decode prefetch in software (default: on Intel cores); "
        "returns the previous setting");
  m.def("set_wide_kernels", &set_wide_kernels, nb::arg("on"),
        "the packed GEMM and the paged decode scores use their 512-bit versions (where built; the default) "
        "or the 256-bit ones; returns which");
  m.def("decode_layer", &decode_layer, nb::arg("h"), nb::arg("weights"), nb::arg("k_pool"), nb::arg("v_pool"),
        nb::arg("slots"), nb::arg("positions"), nb::arg("tables"), nb::arg("lengths"), nb::arg("heads"),
        nb::arg("eps"), nb::arg("rope_dims"), nb::arg("rope_traditional"), nb::arg("rope_scale"),
        nb::arg("block_size"), nb::arg("q_scale"), nb::arg("qkv_bias") = nb::none(), nb::arg("o_bias") = nb::none(),
        nb::arg("q_norm") = nb::none(), nb::arg("k_norm") = nb::none(), nb::arg("split") = false,
        "one pre-norm decoder layer (attention, SwiGLU MLP, residuals) for rows of one new token each, in four "
        "nodes: [h out, K pool, V pool], the pools with the rows' K and V written at slots; with split, "
        "[partial attention output, K pool, V pool] (tensor-parallel o and down: decode_mlp follows the sum)");
  m.def("decode_mlp", &decode_mlp, nb::arg("h"), nb::arg("attention"), nb::arg("weights"), nb::arg("eps"),
        "a split decode layer after its attention sum: [h + attention, partial MLP output]");
  m.def("huge_pages", &huge_pages, nb::arg("arrays"),
        "moves the evaluated arrays' whole 2 MiB pages into transparent huge pages where Linux can "
        "(MADV_COLLAPSE); returns the bytes moved");
  m.def("untouched_zeros", &untouched_zeros, nb::arg("shape"), nb::arg("dtype"),
        "zeros whose memory pages are supplied on first write (resident only where written)");
  m.def("rms_norm", &rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
        "x * rsqrt(mean(x^2, -1) + eps) * weight, as mx.fast.rms_norm");
  m.def("rope", &rope, nb::arg("x"), nb::arg("positions"), nb::arg("inv_freq"), nb::arg("dims"),
        nb::arg("traditional"), nb::arg("scale"),
        "x (1, H, T, D) rotated by each token's position times scale times inv_freq, as mx.fast.rope; "
        "the result is stored token-major (a transposed (1, T, H, D) array)");
  m.def("kv_write", &kv_write, nb::arg("pool"), nb::arg("slots"), nb::arg("rows"),
        "the pool with rows (1, Hk, T, D) written at slots (T,), in place when MLX can donate its buffer");
  m.def("causal_partial", &causal_partial, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("counts"),
        nb::arg("q_scale") = 1.0f,
        "attention of q (T, H, D) to k, v (S, Hk, D), query t seeing the first counts[t] keys (q pre-scaled "
        "by q_scale: scale * log2(e)); returns the output and each query's natural log-sum-exp (T, H)");
  m.def("causal_attention", &causal_attention, nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("q_scale") = 1.0f,
        "q (T, H, D) attending causally to k, v (S, Hk, D) as the last T of the S positions; q times q_scale "
        "is in base 2 (scale * log2(e) for a softmax scale)");
  m.def("causal_partial_paged", &causal_partial_paged, nb::arg("q"), nb::arg("k_pool"), nb::arg("v_pool"),
        nb::arg("slots"), nb::arg("counts"), nb::arg("q_scale") = 1.0f,
        "causal_partial of q (T, H, D) to the pools' rows at slots (S,), read in place (no gather)");
  m.def("causal_attention_paged", &causal_attention_paged, nb::arg("q"), nb::arg("k_pool"), nb::arg("v_pool"),
        nb::arg("slots"), nb::arg("q_scale") = 1.0f,
        "causal_attention of q (T, H, D) to the pools' rows at slots (S,), read in place (no gather)");
  m.def("paged_decode_attention", &paged_decode_attention, nb::arg("q"), nb::arg("k_pool"), nb::arg("v_pool"),
        nb::arg("tables"), nb::arg("lengths"), nb::arg("block_size"), nb::arg("q_scale") = 1.0f,
        "one query position per row against its blocks of a KV pool; q times q_scale is in base 2 "
        "(scale * log2(e) for a softmax scale)");
  m.def("paged_decode_partial", &paged_decode_partial, nb::arg("q"), nb::arg("k_pool"), nb::arg("v_pool"),
        nb::arg("tables"), nb::arg("lengths"), nb::arg("block_size"), nb::arg("q_scale") = 1.0f,
        "paged_decode_attention of q (R, H, D) that also returns each query head's natural log-sum-exp (R, H); "
        "a row of no keys gets zeros and -inf");
}
