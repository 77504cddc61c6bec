// Vector helpers shared by the CPU decode kernels (small_matmul.cc, cpu_attention.cc):
// 16-lane float32 vectors through GCC/Clang vector extensions (AVX-512 registers with
// -march=native where the CPU has them, pairs of narrower ones elsewhere).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

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
