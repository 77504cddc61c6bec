// y[M, N] = x[M, K] @ W for a few rows M (decode steps, verify windows, draft steps), W one
// layer of a block-quantized weight (quantize.QuantizedWeight) read as stored: the bytes a
// step streams are the quantized ones (Q4_1: 0.625 bytes a weight with the GGUF's float16
// scales and offsets, against 4 for float32), instead of a float32 copy dequantized before
// the matmul. The layout: quant_layer.h.
//
// Each weight vector is dequantized in registers exactly as QuantizedWeight.astype computes
// it (float32 scale * q, then + offset: two roundings, -ffp-contract=off), once for all rows
// of the pass, and then multiply-added like a float32 weight by small_matmul.cc's tiles: a
// row's result is bitwise the float32 kernel's on the dequantized weight, and bitwise the
// same whatever the row count (same instruction sequence per row, fixed k order), which
// keeps greedy speculative decoding equal to AR.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_chunks.h"
#include "cpu_vector.h"
#include "quant_layer.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using s2d_cpu::fmadd;
using s2d_cpu::load16;
using s2d_cpu::splat;
using s2d_cpu::store16;
using s2d_cpu::v16;

using s2d_cpu::i32x16;
using s2d_cpu::widen16;

using s2d_cpu::kQ8;
using s2d_cpu::kQ4;
using s2d_cpu::kQ4Offset;
using Layer = s2d_cpu::QuantLayer;

constexpr int kMaxRows = 8;    // rows one pass over the weights serves
// q rows ahead to prefetch (a tile walks rows with stride N). 8 to 128 rows, and prefetching
// the scales a group or more ahead as well, timed alike within the noise (SmolLM2's gate
// projection, 30 layers, one thread on a 2-core AMD EPYC Zen 4 under load).
constexpr int kPrefetch = 32;

// Columns of the widest register tile per row. Wider tiles read longer runs of each q row
// (a row of SmolLM2's untied head [576 | 49152] is 48 KiB from the next): one thread, q in
// memory, 128 columns against small_matmul.cc's 64 took the head from 6.2 to 3.8 ms (Q8_0,
// 1 row), 3.0 to 2.3 (Q4_1), 3.9 to 3.2 (Q4_1, 2 rows), a layer stack's w_gate 4.4 to 3.1
// (Q8_0). 128 at 4 rows, 32 accumulators, paid for Q8_0 (head 5.9 -> 4.3 ms) but doubled
// Q4_1's time (its dequantization needs the registers); past 4 rows 32, as small_matmul.cc.
template <int R, int F>
constexpr int Cols() { return R <= (F == kQ8 ? 4 : 2) ? 128 : R <= 4 ? 64 : 32; }

// 16 int8 weights as float32 values (cpu_vector.h's widen16: vpmovsxbd, then vcvtdq2ps).
inline v16 q8(const int8_t* p) { return __builtin_convertvector(widen16(p), v16); }

// 16 packed bytes -> the low nibbles (k = 2i) and the high ones (k = 2i + 1) as float32,
// sign-extended for Q4, as they are for Q4 + offset.
template <int F>
inline void q4(const uint8_t* p, v16& lo, v16& hi) {
  i32x16 v = widen16(p);
  if (F == kQ4) {
    lo = __builtin_convertvector((v << 28) >> 28, v16);
    hi = __builtin_convertvector((v << 24) >> 28, v16);
  } else {
    lo = __builtin_convertvector(v & 15, v16);
    hi = __builtin_convertvector(v >> 4, v16);
  }
}

// The same scalar: element (k, c) of the layer.
template <int F>
inline float q1(const void* q, int64_t N, int64_t k, int64_t c) {
  if (F == kQ8) return float(static_cast<const int8_t*>(q)[k * N + c]);
  int b = static_cast<const uint8_t*>(q)[(k / 2) * N + c];
  int nib = (k & 1) ? b >> 4 : b & 15;
  return float(F == kQ4 ? (nib ^ 8) - 8 : nib);
}

template <int F>
inline v16 dequant(v16 q, v16 s, v16 o) {
  v16 w = q * s;
  return F == kQ4Offset ? w + o : w;
}

template <int F>
inline float dequant(float q, float s, float o) {
  float w = q * s;
  return F == kQ4Offset ? w + o : w;
}

// Rows [0, R) of y, columns [c, c + C).
template <int R, int F, int C>
void tile(const float* x, const Layer& w, float* y, int64_t c) {
  constexpr int V = C / 16;
  const int64_t K = w.K, N = w.N, G = w.G;
  v16 acc[R][V] = {};
  for (int64_t g0 = 0, gi = 0; g0 < K; g0 += G, ++gi) {
    v16 s[V], o[V] = {};
    for (int v = 0; v < V; ++v) {
      s[v] = w.s.load16(gi * N + c + 16 * v);
      if (F == kQ4Offset) o[v] = w.o.load16(gi * N + c + 16 * v);
    }
    if (F == kQ8) {
      for (int64_t k = g0; k < g0 + G; ++k) {
        const int8_t* row = reinterpret_cast<const int8_t*>(w.q) + k * N + c;
        if (k + kPrefetch < K) __builtin_prefetch(row + kPrefetch * N, 0, 2);
        v16 wv[V];
        for (int v = 0; v < V; ++v) wv[v] = dequant<F>(q8(row + 16 * v), s[v], o[v]);
        for (int r = 0; r < R; ++r) {
          v16 xv = splat(x[r * K + k]);
          for (int v = 0; v < V; ++v) acc[r][v] = fmadd(xv, wv[v], acc[r][v]);
        }
      }
    } else {
      for (int64_t k = g0; k < g0 + G; k += 2) {
        const uint8_t* row = w.q + (k / 2) * N + c;
        if (k + 2 * kPrefetch < K) __builtin_prefetch(row + kPrefetch * N, 0, 2);
        v16 lo[V], hi[V];
        for (int v = 0; v < V; ++v) {
          q4<F>(row + 16 * v, lo[v], hi[v]);
          lo[v] = dequant<F>(lo[v], s[v], o[v]);
          hi[v] = dequant<F>(hi[v], s[v], o[v]);
        }
        for (int r = 0; r < R; ++r) {
          v16 xv = splat(x[r * K + k]);
          for (int v = 0; v < V; ++v) acc[r][v] = fmadd(xv, lo[v], acc[r][v]);
          xv = splat(x[r * K + k + 1]);
          for (int v = 0; v < V; ++v) acc[r][v] = fmadd(xv, hi[v], acc[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store16(y + r * N + c + 16 * v, acc[r][v]);
}

// The columns past the last full tile, one at a time (the same operations per element).
template <int F>
void tail(const float* x, const Layer& w, float* y, int R, int64_t c) {
  const int64_t K = w.K, N = w.N, G = w.G;
  for (int r = 0; r < R; ++r) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      int64_t gi = k / G;
      float o = F == kQ4Offset ? w.o.at(gi * N + c) : 0.f;
      acc = fmadd(x[r * K + k], dequant<F>(q1<F>(w.q, N, k, c), w.s.at(gi * N + c), o), acc);
    }
    y[r * N + c] = acc;
  }
}

// Columns [c0, c1): the widest tiles, then narrower ones (a 192-column wk), then the tail.
template <int R, int F>
void range(const float* x, const Layer& w, float* y, int64_t c0, int64_t c1) {
  constexpr int C = Cols<R, F>();
  int64_t c = c0;
  for (; c + C <= c1; c += C) tile<R, F, C>(x, w, y, c);
  if (C > 64)
    for (; c + 64 <= c1; c += 64) tile<R, F, (C > 64 ? 64 : C)>(x, w, y, c);
  if (C > 32)
    for (; c + 32 <= c1; c += 32) tile<R, F, (C > 32 ? 32 : C)>(x, w, y, c);
  for (; c + 16 <= c1; c += 16) tile<R, F, 16>(x, w, y, c);
  for (; c < c1; ++c) tail<F>(x, w, y, R, c);
}

template <int F>
void run_rows(const float* x, const Layer& w, float* y, int R, int64_t c0, int64_t c1) {
  switch (R) {
    case 1: range<1, F>(x, w, y, c0, c1); break;
    case 2: range<2, F>(x, w, y, c0, c1); break;
    case 3: range<3, F>(x, w, y, c0, c1); break;
    case 4: range<4, F>(x, w, y, c0, c1); break;
    case 5: range<5, F>(x, w, y, c0, c1); break;
    case 6: range<6, F>(x, w, y, c0, c1); break;
    case 7: range<7, F>(x, w, y, c0, c1); break;
    case 8: range<8, F>(x, w, y, c0, c1); break;
  }
}

ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                           ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_matmul: x must be [M, K]");
  int64_t M = xd[0], K = xd[1];
  Layer w;
  ffi::Error err = s2d_cpu::parse_quant_layer("quant_matmul", K, *layer.typed_data(), q, scale,
                                              offset, 1, w);
  if (err.failure()) return err;
  int F = w.format;
  double col_bytes = w.col_bytes;
  const int64_t N = w.N;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  s2d_cpu::for_column_chunks(pool, N, col_bytes, [=](int64_t c0, int64_t c1) {
    for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
      int R = int(std::min<int64_t>(kMaxRows, M - r0));
      const float* xr = xp + r0 * K;
      float* yr = yp + r0 * N;
      if (F == kQ8) run_rows<kQ8>(xr, w, yr, R, c0, c1);
      else if (F == kQ4) run_rows<kQ4>(xr, w, yr, R, c0, c1);
      else run_rows<kQ4Offset>(xr, w, yr, R, c0, c1);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

// (thread pool, x [M, K] f32, q stack, scale [L, K/G, N] f32 or f16, offset (the same, or
// no elements), layer index) -> y [M, N] f32
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2dQuantMatmul, QuantMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
