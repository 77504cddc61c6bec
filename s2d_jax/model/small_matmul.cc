// y[M, N] = x[M, K] @ W for a few rows M (a verify window, a small batch), reading each
// weight once for all rows: XLA's CPU backend serves one row with a matrix-vector kernel
// at memory speed, but two or more with a general matmul that packs the weights on every
// call (a 2-token SmolLM2 step cost 1.33 one-token steps).
//
// W is one layer of a stacked weight [L, K, N] ("kn": x @ W[l]) or [L, N, K] ("nk":
// x @ W[l]^T, a tied embedding used as the head), float32, bfloat16 or int8 (a weight-only
// quantized matrix with per-output-channel scales, which the caller applies); `layer` picks
// l, so a scan over layers reads the stack in place instead of slicing a copy per layer.
//
// Every row is computed by the same instruction sequence whatever M is (rows never share
// accumulators; the k order is fixed), so a token's output does not depend on how many
// tokens share the call: bitwise, which keeps greedy speculative decoding equal to AR.
// No -ffast-math: the compiler may not reorder the sums; -ffp-contract=off: it may not fuse
// a multiply-add on its own either (every one is an explicit `fmadd`, cpu_vector.h).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_chunks.h"
#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using s2d_cpu::fmadd;
using s2d_cpu::lane_sum;
using s2d_cpu::load16;  // float32; the bfloat16 and int8 loads below join the overloads
using s2d_cpu::splat;
using s2d_cpu::store16;
using s2d_cpu::v16;
using s2d_cpu::v4;
using s2d_cpu::v8;

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

constexpr int kMaxRows = 8;    // rows one pass over the weights serves
constexpr int kPrefetch = 32;  // weight rows ahead to prefetch ("kn" walks rows with stride N)
constexpr int kNkPrefetch = 16;  // weight rows ahead to prefetch ("nk")

inline v16 load16(const uint16_t* p) {  // bfloat16 -> float32: the high half of the bits
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline v16 load16(const int8_t* p) {  // int8 (a per-channel-scaled weight; scaled after)
  return __builtin_convertvector(s2d_cpu::widen16(p), v16);
}

inline float load1(const float* p) { return *p; }
inline float load1(const int8_t* p) { return float(*p); }
inline float load1(const uint16_t* p) {
  uint32_t w = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}


// Columns a register tile holds per row: 64 up to 4 rows (16 accumulators), 32 beyond
// (8 rows x 2), so the accumulators stay in registers. Wider tiles read longer runs of
// each weight row: at 4 rows the MLP's projections cost 1.11-1.23 of one row's time, with
// 32-column tiles 1.22-1.29 (this machine, interleaved probes). A tile's lanes and the
// scalar tail sum each element over k in the same order, so the width changes no bit.
template <int R>
constexpr int Cols() { return R <= 4 ? 64 : 32; }

// Rows [0, R) of y, columns [c, c + Cols<R>()): y = x @ W, W [K, N] row-major.
template <int R, typename W>
void kn_tile(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t c) {
  constexpr int V = Cols<R>() / 16;
  v16 acc[R][V] = {};
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * N + c;
    if (k + kPrefetch < K) {
      for (int v = 0; v < V; ++v) __builtin_prefetch(row + kPrefetch * N + 16 * v, 0, 2);
    }
    v16 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load16(row + 16 * v);
    for (int r = 0; r < R; ++r) {
      v16 xv = splat(x[r * K + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = fmadd(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store16(y + r * N + c + 16 * v, acc[r][v]);
}

// The columns past the last full tile, one at a time (same k order as a tile's lanes).
template <typename W>
void kn_tail(const float* x, const W* w, float* y, int R, int64_t K, int64_t N, int64_t c) {
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc = fmadd(x[r * K + k], load1(w + k * N + c), acc);
    y[r * N + c] = acc;
  }
}

// Rows [0, R), output columns [n, n + NR): y[r, n] = dot(x[r], W[n]), W [N, K] row-major.
// Each dot runs two 16-lane accumulators over alternate 16-wide chunks of k, then adds them
// and sums the lanes as a fixed tree: the same operations for every (r, n) whatever R and
// NR are. One weight row at a time (NR = 1) for every R: with one row of x, four weight
// rows at a time (for more independent FMA chains) made SmolLM2's head 5.4-5.9 ms against
// 3.5-4.1 one at a time (AMD EPYC Zen 4, infer.matmul_bench): the head is read from memory,
// and one sequential stream is what its prefetchers serve best.
template <int R, int NR, typename W>
void nk_block(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t n) {
  v16 acc[NR][R][2] = {};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    for (int j = 0; j < NR; ++j) {
      const W* row = w + (n + j) * K + k;
      // the same chunk kNkPrefetch rows ahead, into L2: its two cache lines
      const char* ahead = reinterpret_cast<const char*>(row + kNkPrefetch * K);
      __builtin_prefetch(ahead, 0, 2);
      __builtin_prefetch(ahead + 64, 0, 2);
      v16 w0 = load16(row), w1 = load16(row + 16);
      for (int r = 0; r < R; ++r) {
        acc[j][r][0] = fmadd(load16(x + r * K + k), w0, acc[j][r][0]);
        acc[j][r][1] = fmadd(load16(x + r * K + k + 16), w1, acc[j][r][1]);
      }
    }
  }
  bool half = k + 16 <= K;  // one more 16-wide chunk goes to the first accumulator
  for (int j = 0; j < NR; ++j) {
    const W* row = w + (n + j) * K;
    for (int r = 0; r < R; ++r) {
      if (half) acc[j][r][0] = fmadd(load16(x + r * K + k), load16(row + k), acc[j][r][0]);
      float s = lane_sum(acc[j][r][0] + acc[j][r][1]);
      for (int64_t i = k + (half ? 16 : 0); i < K; ++i) s = fmadd(x[r * K + i], load1(row + i), s);
      y[r * N + n + j] = s;
    }
  }
}

template <int R, typename W>
void kn_range(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t c0,
              int64_t c1) {
  int64_t c = c0;
  for (; c + Cols<R>() <= c1; c += Cols<R>()) kn_tile<R>(x, w, y, K, N, c);
  for (; c < c1; ++c) kn_tail(x, w, y, R, K, N, c);
}

template <int R, typename W>
void nk_range(const float* x, const W* w, float* y, int64_t K, int64_t N, int64_t c0,
              int64_t c1) {
  for (int64_t n = c0; n < c1; ++n) nk_block<R, 1>(x, w, y, K, N, n);
}

// Rows [r0, r0 + R) for columns [c0, c1), dispatching R to a compile-time row count.
template <typename W>
void run_rows(bool nk, const float* x, const W* w, float* y, int R, int64_t K, int64_t N,
              int64_t c0, int64_t c1) {
#define S2D_CASE(n)                                                  \
  case n:                                                            \
    nk ? nk_range<n>(x, w, y, K, N, c0, c1) : kn_range<n>(x, w, y, K, N, c0, c1); \
    break;
  switch (R) {
    S2D_CASE(1) S2D_CASE(2) S2D_CASE(3) S2D_CASE(4)
    S2D_CASE(5) S2D_CASE(6) S2D_CASE(7) S2D_CASE(8)
  }
#undef S2D_CASE
}

enum class WeightType { kF32, kBF16, kS8 };

ffi::Error SmallMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                           bool nk) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3)
    return ffi::Error::InvalidArgument("small_matmul: x must be [M, K] and w [L, K, N] or [L, N, K]");
  int64_t M = xd[0], K = xd[1], L = wd[0];
  int64_t N = nk ? wd[1] : wd[2];
  if ((nk ? wd[2] : wd[1]) != K)
    return ffi::Error::InvalidArgument("small_matmul: contracted sizes differ");
  WeightType type;
  switch (w.element_type()) {
    case ffi::DataType::F32: type = WeightType::kF32; break;
    case ffi::DataType::BF16: type = WeightType::kBF16; break;
    case ffi::DataType::S8: type = WeightType::kS8; break;
    default:
      return ffi::Error::InvalidArgument("small_matmul: weights must be float32, bfloat16 or int8");
  }
  int64_t l = *layer.typed_data();
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("small_matmul: layer out of range");
  size_t width = type == WeightType::kF32 ? 4 : type == WeightType::kBF16 ? 2 : 1;
  const char* base = static_cast<const char*>(w.untyped_data()) + l * K * N * width;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  s2d_cpu::for_column_chunks(pool, N, double(K * width), [=](int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      int R = int(std::min<int64_t>(kMaxRows, M - r0));
      if (type == WeightType::kBF16)
        run_rows(nk, xp + r0 * K, reinterpret_cast<const uint16_t*>(base), yp + r0 * N, R, K, N, c0, c1);
      else if (type == WeightType::kS8)
        run_rows(nk, xp + r0 * K, reinterpret_cast<const int8_t*>(base), yp + r0 * N, R, K, N, c0, c1);
      else
        run_rows(nk, xp + r0 * K, reinterpret_cast<const float*>(base), yp + r0 * N, R, K, N, c0, c1);
    }
  });
  return ffi::Error::Success();
}

template <bool kNK>
ffi::Error Layout(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return SmallMatmulImpl(pool, x, w, layer, y, kNK);
}

// (thread pool, x [M, K] f32, w stack, layer index) -> y [M, N] f32
#define S2D_SMALL_MATMUL_BINDING                \
  ffi::Ffi::Bind()                              \
      .Ctx<ffi::ThreadPool>()                   \
      .Arg<ffi::Buffer<ffi::F32>>()             \
      .Arg<ffi::AnyBuffer>()                    \
      .Arg<ffi::Buffer<ffi::S32>>()             \
      .Ret<ffi::Buffer<ffi::F32>>()

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(S2dSmallMatmulKN, Layout<false>, S2D_SMALL_MATMUL_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2dSmallMatmulNK, Layout<true>, S2D_SMALL_MATMUL_BINDING);
