// Vector helpers shared by the CPU decode kernels (small_matmul.cc, cpu_attention.cc):
// 16-lane float32 vectors through GCC/Clang vector extensions (AVX-512 registers with
// -march=native where the CPU has them, pairs of narrower ones elsewhere).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#if defined(__FMA__)
#define S2D_FUSED_MULTIPLY_ADD 1
#endif
#endif

namespace s2d_cpu {

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// 16 bytes widened to 16 int32 lanes, sign- (int8) or zero-extended (uint8): quantized
// weights. Spelled with intrinsics because GCC 12 scalarized __builtin_convertvector from
// 16 bytes (a shift and an insert per element, which made int8 weights 1.7x slower than
// float32 ones); int32 -> float32 (__builtin_convertvector) stays one vcvtdq2ps.
template <bool kSigned, typename T>
inline i32x16 widen16(const T* p) {
#if defined(__AVX512F__)
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (i32x16)(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#elif defined(__AVX2__)
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m128i h = _mm_unpackhi_epi64(b, b);
  i32x8 lo = (i32x8)(kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  i32x8 hi = (i32x8)(kSigned ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  i32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = p[i];
  return v;
#endif
}

inline i32x16 widen16(const int8_t* p) { return widen16<true>(p); }
inline i32x16 widen16(const uint8_t* p) { return widen16<false>(p); }

inline v16 splat(float x) { return v16{} + x; }

// IEEE binary16 -> binary32, exact (GGUF's block scales and offsets, kept as the file has
// them: half the bytes of float32 ones).
inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0) {  // zero or subnormal: man * 2^-24, exact in float32
    float f = float(man) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

inline v16 load16_half(const uint16_t* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = half_to_float(p[i]);
  return v;
#endif
}

// A layer's block scales (or offsets) [K/G, N], float32 or float16 as stored.
struct Scales {
  const void* p = nullptr;
  bool half = false;
  float at(int64_t i) const {
    return half ? half_to_float(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
  }
  v16 load16(int64_t i) const {
    return half ? load16_half(static_cast<const uint16_t*>(p) + i)
                : s2d_cpu::load16(static_cast<const float*>(p) + i);
  }
  Scales layer(int64_t offset) const {  // the same array from element `offset` on
    Scales s = *this;
    s.p = static_cast<const char*>(p) + offset * (half ? 2 : 4);
    return s;
  }
};

// a * b + c. The kernels build with -ffp-contract=off and write every multiply-add through
// these two: fused (one rounding) where the CPU has FMA, unfused elsewhere, the same for
// vector lanes and scalar tails. Left to the compiler, GCC 12 on an AMD Zen 4 fused the
// vector tiles' multiply-adds but not every scalar loop's, so a column summed in a vector
// tile at one row count and in the scalar tail at another differed in the last bit, and a
// token's output depended on how many tokens shared the call.
inline v16 fmadd(v16 a, v16 b, v16 c) {
#if defined(S2D_FUSED_MULTIPLY_ADD) && defined(__AVX512F__)
  return (v16)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(S2D_FUSED_MULTIPLY_ADD)
  v8 lo = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7),
                              (__m256)__builtin_shufflevector(b, b, 0, 1, 2, 3, 4, 5, 6, 7),
                              (__m256)__builtin_shufflevector(c, c, 0, 1, 2, 3, 4, 5, 6, 7));
  v8 hi = (v8)_mm256_fmadd_ps((__m256)__builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15),
                              (__m256)__builtin_shufflevector(b, b, 8, 9, 10, 11, 12, 13, 14, 15),
                              (__m256)__builtin_shufflevector(c, c, 8, 9, 10, 11, 12, 13, 14, 15));
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return a * b + c;
#endif
}

inline float fmadd(float a, float b, float c) {
#if defined(S2D_FUSED_MULTIPLY_ADD)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

// The 16 lanes summed as a fixed tree (halves added): the same order on every call, so a
// row's result does not depend on which other rows share the call.
inline float lane_sum(v16 a) {
  v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// While a thread waits for the chunks another thread claimed.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

}  // namespace s2d_cpu
