// y[M, N] = x[M, K] @ W for a few rows M, W one layer of a block-quantized weight
// (quantize.QuantizedWeight, the layout quant_matmul.cc reads), with the activations
// quantized to int8 per block of 32 inputs, as llama.cpp computes a GGUF's Q4_0 / Q4_1 /
// Q8_0 matmuls (its Q8_0 / Q8_1 activation blocks): each block's products are summed in
// integers by AVX-512 VNNI (vpdpbusd: 64 byte products an instruction), and only the
// group's sum is scaled in float. quant_matmul.cc dequantizes every weight to float32 and
// multiply-adds it per row, which made a SmolLM2 Q4_1 step compute-bound (8.4 ms at one
// row, 22 at eight), where this one streams the bytes.
//
// Per row r, group g (32 inputs k) and column c, with xq = round(x / dx), dx = max|x| / 127
// over the row's block, sx = sum of xq over it, u the weight's stored unsigned value:
//   Q8 (int8 q):        u = q + 128,  sum w x = s dx (sum u xq - 128 sx)
//   Q4 (signed nibble): u = q + 8 (the nibble with its top bit flipped), sum w x = s dx (sum u xq - 8 sx)
//   Q4 + offset:        w = s u + o,  sum w x = s dx (sum u xq) + o (dx sx)
// and y += each group's term in group order: (s * dx) * float(isum) fused-added, then the
// offset term. The integer sums are exact, so a row's result is bitwise the same whatever
// the row count and whichever code path (vector tile or scalar tail) computed its column:
// greedy speculative decoding stays equal to AR.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_chunks.h"
#include "cpu_vector.h"
#include "quant_layer.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using s2d_cpu::fmadd;

using s2d_cpu::kQ8;
using s2d_cpu::kQ4;
using s2d_cpu::kQ4Offset;
using Layer = s2d_cpu::QuantLayer;
constexpr int kBlock = 32;      // inputs per activation block (one scale)
constexpr int kRowChunk = 4;    // rows one pass of a register tile serves
constexpr int kPrefetch = 16;   // weight rows ahead to prefetch (a tile walks rows with stride N)

// The rows' activations as int8 blocks: xq [M, K] in the byte order the tiles read (for
// the 4-bit formats each quad of inputs stored as k, k+2, k+1, k+3: the order the packed
// nibbles unpack into), dx and sx [M, K/32].
struct Acts {
  std::vector<int8_t> xq;
  std::vector<float> dx;
  std::vector<int32_t> sx;
  int64_t K;
};

// One block of 32 activations -> its int8 values (in `out`, in the tiles' byte order), its
// scale and its sum. The vector and scalar spellings compute the same values: the same
// float product x * (127 / amax), rounded half to even (vcvtps2dq under the default
// rounding mode, nearbyint), in [-127, 127] by construction.
inline void quantize_block(const float* xb, bool nibble_order, int8_t* out, float* d, int32_t* sum) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
  float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  float id = amax > 0.f ? 127.f / amax : 0.f;
  __m512 idv = _mm512_set1_ps(id);
  __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, idv));
  __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, idv));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  __m128i b0 = _mm512_cvtsepi32_epi8(q0), b1 = _mm512_cvtsepi32_epi8(q1);
  if (nibble_order) {  // each quad k, k+1, k+2, k+3 -> k, k+2, k+1, k+3
    const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    b0 = _mm_shuffle_epi8(b0, order);
    b1 = _mm_shuffle_epi8(b1, order);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), b0);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), b1);
  *d = amax / 127.f;
#else
  float amax = 0.f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
  float id = amax > 0.f ? 127.f / amax : 0.f;
  int8_t q[kBlock];
  int32_t total = 0;
  for (int i = 0; i < kBlock; ++i) {
    int iv = int(std::min(127.f, std::max(-127.f, std::nearbyint(xb[i] * id))));
    q[i] = int8_t(iv);
    total += iv;
  }
  for (int i = 0; i < kBlock; i += 4) {
    out[i] = q[i];
    out[i + 1] = nibble_order ? q[i + 2] : q[i + 1];
    out[i + 2] = nibble_order ? q[i + 1] : q[i + 2];
    out[i + 3] = q[i + 3];
  }
  *d = amax / 127.f;
  *sum = total;
#endif
}

void quantize_rows(const float* x, int64_t M, int64_t K, bool nibble_order, Acts& a) {
  const int64_t blocks = K / kBlock;
  a.K = K;
  a.xq.resize(M * K);
  a.dx.resize(M * blocks);
  a.sx.resize(M * blocks);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      quantize_block(x + r * K + b * kBlock, nibble_order, a.xq.data() + r * K + b * kBlock,
                     &a.dx[r * blocks + b], &a.sx[r * blocks + b]);
}

// The stored value u of weight (k, c) as the unsigned byte the dot multiplies.
template <int F>
inline int u1(const Layer& w, int64_t k, int64_t c) {
  if (F == kQ8) return int(int8_t(w.q[k * w.N + c])) + 128;
  int b = w.q[(k / 2) * w.N + c];
  int nib = (k & 1) ? b >> 4 : b & 15;
  return F == kQ4 ? nib ^ 8 : nib;  // a signed nibble (two's complement) + 8
}

// Bias of u against the signed value (u = q + bias), times the block's sum sx.
template <int F>
constexpr int32_t Bias() { return F == kQ8 ? 128 : F == kQ4 ? 8 : 0; }

// One group's contribution to a column: the same operations, in the same order, as the
// vector tiles' epilogue.
template <int F>
inline float group_term(float acc, int32_t isum, float s, float o, float d, int32_t sx) {
  acc = fmadd(s * d, float(isum - Bias<F>() * sx), acc);
  if (F == kQ4Offset) acc = fmadd(o, d * float(sx), acc);
  return acc;
}

// Columns [c0, c1) one at a time: the scalar path (tails, and CPUs without VNNI).
template <int F>
void columns_scalar(const Acts& a, const Layer& w, float* y, int64_t M, int64_t c0, int64_t c1) {
  const int64_t K = w.K, N = w.N, G = w.G, blocks = K / kBlock;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t isum = 0;
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
          // xq is stored in the tiles' byte order; undo it to pair with natural k
          int64_t i = k - b * kBlock, lane = i & 3;
          int64_t pos = (F != kQ8 && (lane == 1 || lane == 2)) ? k + (lane == 1 ? 1 : -1) : k;
          isum += u1<F>(w, k, c) * int32_t(a.xq[r * K + pos]);
        }
        int64_t gi = b * kBlock / G;
        float o = F == kQ4Offset ? w.o.at(gi * N + c) : 0.f;
        acc = group_term<F>(acc, isum, w.s.at(gi * N + c), o, a.dx[r * blocks + b],
                            a.sx[r * blocks + b]);
      }
      y[r * N + c] = acc;
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// The 4x4 transpose of 128-bit blocks across four vectors: a tile's dot lanes hold column
// 16 L + 4 j + i in vector j, lane 4 L + i (what the in-lane unpacks give); natural order
// holds it in vector L, lane 4 j + i. The transpose maps either order to the other.
inline void transpose_blocks(__m512 v[4]) {
  __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  v[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

// Four inputs k..k+3 of 64 columns as the unsigned bytes of four dword vectors (lane 4 L + i
// of vector j: column 16 L + 4 j + i).
template <int F>
inline void quad(const Layer& w, int64_t k, int64_t c, __m512i u[4]) {
  const int64_t N = w.N;
  if (F == kQ8) {
    const uint8_t* p = w.q + k * N + c;
    if (k + kPrefetch < w.K) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch * N), _MM_HINT_T0);
    const __m512i flip = _mm512_set1_epi8(char(0x80));  // q + 128 as an unsigned byte
    __m512i r0 = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
    __m512i r1 = _mm512_xor_si512(_mm512_loadu_si512(p + N), flip);
    __m512i r2 = _mm512_xor_si512(_mm512_loadu_si512(p + 2 * N), flip);
    __m512i r3 = _mm512_xor_si512(_mm512_loadu_si512(p + 3 * N), flip);
    __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
    __m512i e = _mm512_unpacklo_epi8(r2, r3), f = _mm512_unpackhi_epi8(r2, r3);
    u[0] = _mm512_unpacklo_epi16(a, e);
    u[1] = _mm512_unpackhi_epi16(a, e);
    u[2] = _mm512_unpacklo_epi16(b, f);
    u[3] = _mm512_unpackhi_epi16(b, f);
  } else {
    // byte rows k/2 and k/2 + 1 hold (k, k+1) and (k+2, k+3) in their (low, high) nibbles
    const uint8_t* p = w.q + (k / 2) * N + c;
    if (k + 2 * kPrefetch < w.K) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch * N), _MM_HINT_T0);
    __m512i r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + N);
    if (F == kQ4) {  // signed nibbles (two's complement) + 8: flip each nibble's top bit
      const __m512i flip = _mm512_set1_epi8(char(0x88));
      r0 = _mm512_xor_si512(r0, flip);
      r1 = _mm512_xor_si512(r1, flip);
    }
    const __m512i m = _mm512_set1_epi8(0x0F);
    __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
    __m512i al = _mm512_and_si512(a, m), ah = _mm512_and_si512(_mm512_srli_epi16(a, 4), m);
    __m512i bl = _mm512_and_si512(b, m), bh = _mm512_and_si512(_mm512_srli_epi16(b, 4), m);
    // dword bytes: k, k+2, k+1, k+3 (the activations are stored in that order)
    u[0] = _mm512_unpacklo_epi16(al, ah);
    u[1] = _mm512_unpackhi_epi16(al, ah);
    u[2] = _mm512_unpacklo_epi16(bl, bh);
    u[3] = _mm512_unpackhi_epi16(bl, bh);
  }
}

// Rows [r0, r0 + R) (R <= kRowChunk) of y, columns [c, c + 64).
// Rows [r0, r0 + R) (R <= kRowChunk) of y, columns [c, c + 64 T): T tiles of 64 columns
// side by side, each weight row read as T adjacent cache lines (one or two rows: T = 2).
template <int R, int F, int T>
void tile(const Acts& a, int64_t r0, const Layer& w, float* y, int64_t c) {
  constexpr int V = 4 * T;  // vectors of 16 columns
  const int64_t K = w.K, N = w.N, G = w.G, blocks = K / kBlock;
  const int8_t* xq = a.xq.data() + r0 * K;
  const float* dx = a.dx.data() + r0 * blocks;
  const int32_t* sxs = a.sx.data() + r0 * blocks;
  y += r0 * N;
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[R][V];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < V; ++j) dot[r][j] = _mm512_setzero_si512();
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += 4) {
      __m512i u[V];
      for (int t = 0; t < T; ++t) quad<F>(w, k, c + 64 * t, u + 4 * t);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + k, 4);
        __m512i xv = _mm512_set1_epi32(x4);
        for (int j = 0; j < V; ++j) dot[r][j] = _mm512_dpbusd_epi32(dot[r][j], u[j], xv);
      }
    }
    int64_t gi = b * kBlock / G;
    __m512 s[V], o[V];
    for (int j = 0; j < V; ++j) {
      s[j] = (__m512)w.s.load16(gi * N + c + 16 * j);
      o[j] = F == kQ4Offset ? (__m512)w.o.load16(gi * N + c + 16 * j) : _mm512_setzero_ps();
    }
    for (int t = 0; t < T; ++t) {
      transpose_blocks(s + 4 * t);  // into the dot lanes' column order
      if (F == kQ4Offset) transpose_blocks(o + 4 * t);
    }
    for (int r = 0; r < R; ++r) {
      float d = dx[r * blocks + b];
      int32_t sx = sxs[r * blocks + b];
      __m512 dv = _mm512_set1_ps(d), dsx = _mm512_set1_ps(d * float(sx));
      __m512i bias = _mm512_set1_epi32(Bias<F>() * sx);
      for (int j = 0; j < V; ++j) {
        __m512 t = _mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r][j], bias));
        acc[r][j] = _mm512_fmadd_ps(_mm512_mul_ps(s[j], dv), t, acc[r][j]);
        if (F == kQ4Offset) acc[r][j] = _mm512_fmadd_ps(o[j], dsx, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      transpose_blocks(acc[r] + 4 * t);  // back to natural column order
      for (int j = 0; j < 4; ++j)
        _mm512_storeu_ps(y + r * N + c + 64 * t + 16 * j, acc[r][4 * t + j]);
    }
}

template <int F, int T>
void rows_tile(const Acts& a, int64_t r0, const Layer& w, float* y, int R, int64_t c) {
  switch (R) {
    case 1: tile<1, F, T>(a, r0, w, y, c); break;
    case 2: tile<2, F, T>(a, r0, w, y, c); break;
    case 3: tile<3, F, 1>(a, r0, w, y, c); break;
    case 4: tile<4, F, 1>(a, r0, w, y, c); break;
  }
}

// Columns [c0, c1): 128-column tiles for one or two rows (their registers allow it), then
// 64-column ones, then the scalar tail.
template <int F>
void columns(const Acts& a, const Layer& w, float* y, int64_t M, int64_t c0, int64_t c1) {
  int64_t c = c0;
  if (M <= 2)
    for (; c + 128 <= c1; c += 128) rows_tile<F, 2>(a, 0, w, y, int(M), c);
  for (; c + 64 <= c1; c += 64)
    for (int64_t r0 = 0; r0 < M; r0 += kRowChunk)
      rows_tile<F, 1>(a, r0, w, y, int(std::min<int64_t>(kRowChunk, M - r0)), c);
  columns_scalar<F>(a, w, y, M, c, c1);
}
#else
template <int F>
void columns(const Acts& a, const Layer& w, float* y, int64_t M, int64_t c0, int64_t c1) {
  columns_scalar<F>(a, w, y, M, c0, c1);
}
#endif

void run_columns(int F, const Acts& a, const Layer& w, float* y, int64_t M, int64_t c0, int64_t c1) {
  if (F == kQ8) columns<kQ8>(a, w, y, M, c0, c1);
  else if (F == kQ4) columns<kQ4>(a, w, y, M, c0, c1);
  else columns<kQ4Offset>(a, w, y, M, c0, c1);
}

ffi::Error QuantDot8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                         ffi::AnyBuffer scale, ffi::AnyBuffer offset,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_dot8: x must be [M, K]");
  int64_t M = xd[0], K = xd[1];
  Layer w;
  ffi::Error err = s2d_cpu::parse_quant_layer("quant_dot8", K, *layer.typed_data(), q, scale,
                                              offset, kBlock, w);
  if (err.failure()) return err;
  const int F = w.format;
  const double col_bytes = w.col_bytes;
  Acts a;
  quantize_rows(x.typed_data(), M, K, F != kQ8, a);
  float* yp = y->typed_data();
  const Acts* ap = &a;
  s2d_cpu::for_column_chunks(pool, w.N, col_bytes, [=](int64_t c0, int64_t c1) {
    run_columns(F, *ap, w, yp, M, c0, c1);
  });
  return ffi::Error::Success();
}

// Several weights that read the same x (a block's q, k and v; its gate and up): x quantized
// once, and every weight's column chunks in one hand-off to the thread pool (a layer's
// small wk / wv alone make one chunk each, which one thread computes while the other
// waits). Arguments after x and the layer: (q, scale, offset) per weight; a result each.
ffi::Error QuantDot8SharedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                               ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs args,
                               ffi::RemainingRets rets) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("quant_dot8: x must be [M, K]");
  int64_t M = xd[0], K = xd[1];
  size_t n = rets.size();
  if (n < 1 || n > 4 || args.size() != 3 * n)
    return ffi::Error::InvalidArgument("quant_dot8: 1-4 weights, (q, scale, offset) and a result each");
  Layer w[4];
  int F[4];
  float* out[4];
  double col_bytes = 0;
  bool orders[2] = {false, false};  // Q8's natural order, the 4-bit formats' nibble order
  for (size_t i = 0; i < n; ++i) {
    auto q = args.get<ffi::AnyBuffer>(3 * i), s = args.get<ffi::AnyBuffer>(3 * i + 1),
         o = args.get<ffi::AnyBuffer>(3 * i + 2);
    auto r = rets.get<ffi::Buffer<ffi::F32>>(i);
    if (q.has_error() || s.has_error() || o.has_error() || r.has_error())
      return ffi::Error::InvalidArgument("quant_dot8: a weight's buffers are missing");
    ffi::Error err = s2d_cpu::parse_quant_layer("quant_dot8", K, *layer.typed_data(), *q, *s, *o,
                                                kBlock, w[i]);
    if (err.failure()) return err;
    F[i] = w[i].format;
    col_bytes = std::max(col_bytes, w[i].col_bytes);
    orders[F[i] != kQ8] = true;
    out[i] = (*r)->typed_data();
  }
  Acts a[2];
  for (int k = 0; k < 2; ++k)
    if (orders[k]) quantize_rows(x.typed_data(), M, K, k == 1, a[k]);
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) total += w[i].N;
  const int64_t cols = s2d_cpu::chunk_columns(pool, total, col_bytes);
  // each weight's columns from its own multiple of `cols` on: a chunk lies in one weight
  int64_t base[5] = {0};
  for (size_t i = 0; i < n; ++i) base[i + 1] = base[i] + (w[i].N + cols - 1) / cols * cols;
  const Acts* ap = a;
  s2d_cpu::run_column_chunks(pool, base[n], cols, [=, &w, &F, &out](int64_t v0, int64_t v1) {
    size_t i = 0;
    while (v0 >= base[i + 1]) ++i;
    int64_t c0 = v0 - base[i], c1 = std::min(w[i].N, c0 + (v1 - v0));
    run_columns(F[i], ap[F[i] != kQ8], w[i], out[i], M, c0, c1);
  });
  return ffi::Error::Success();
}

}  // namespace

// (thread pool, x [M, K] f32, q stack, scale [L, K/G, N] f32 or f16, offset (the same, or
// no elements), layer index) -> y [M, N] f32
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2dQuantDot8, QuantDot8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// (thread pool, x [M, K] f32, layer index, then (q, scale, offset) per weight) -> y [M, N_i]
// f32 per weight
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2dQuantDot8Shared, QuantDot8SharedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
