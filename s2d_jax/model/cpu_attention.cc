// Attention of a decode step or verify window to a K/V cache, on CPU: each query row
// attends to the cache slots <= its position, reading each key and value once for all the
// rows that share a kv head, straight from the cache buffers (one layer of the stacked
// [L, B, K, S, H] cache, picked by `layer`), float32 or bfloat16.
//
// XLA's CPU backend ran this as blocks: every block of keys sliced (a copy) out of the
// cache, then small dots with few rows (general matmuls), then the softmax's elementwise
// ops, one thunk each; on SmolLM2-135M that grew with the window's rows about as much as
// the projections did.
//
// Each row is computed by the same operations whatever the number of rows (rows never
// share sums; slots are visited in order), so a token's output does not depend on how many
// tokens share the call: bitwise, as for the small-matmul kernel.
//
// `patch`: the call's own keys/values (k_new, v_new [B, T, K, H], float32) stand in for
// the cache slots at their positions (the caller writes them to the cache after a
// `lax.cond`); without it the cache already holds them.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16x16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

inline v16 splat(float x) { return v16{} + x; }

inline float lane_sum(v16 a) {  // a fixed tree (halves added)
  v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// exp(x) for x <= 0 (scores minus their max), 16 lanes: 2^n * p(r), r = x - n ln2 in
// [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative error < 2e-7); below -87
// (e^-87 ~ 1.6e-38) a weight is 0.
inline v16 exp16(v16 x) {
  const v16 lo = splat(-87.0f);
  i16x16 dead = x < lo;
  x = x < lo ? lo : x;
  // round to nearest: adding and removing 1.5 * 2^23 leaves an integer (|n| < 2^22)
  v16 n = (x * splat(1.44269504088896341f) + splat(12582912.0f)) - splat(12582912.0f);
  v16 r = x - n * splat(0.693359375f);  // ln2 in two parts, so r is exact
  r = r - n * splat(-2.12194440e-4f);
  v16 p = splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  i16x16 bits = (__builtin_convertvector(n, i16x16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  v16 out = p * scale;
  i16x16 out_bits;
  std::memcpy(&out_bits, &out, sizeof out);
  out_bits &= ~dead;
  std::memcpy(&out, &out_bits, sizeof out);
  return out;
}

inline float bf16_to_f32(uint16_t h) {
  uint32_t w = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

struct Shapes {
  int64_t B, T, K, G, H, S;
};

// One (batch row, kv head): all T * G query rows against the slots each may see.
struct Task {
  const Shapes* sh;
  const float* q;        // [B, T, K, G, H]
  const void* kc;        // layer's [B, K, S, H]
  const void* vc;
  bool bf16;
  const int32_t* pos;    // [B, T]
  const float* k_new;    // [B, T, K, H] or null
  const float* v_new;
  float scale;
  float* out;            // [B, T, K, G, H]

  // slot s of (b, kv) as float32 into buf (the call's own value where patched)
  const float* slot(const void* cache, const float* fresh, int64_t b, int64_t kv, int64_t s,
                    float* buf) const {
    const Shapes& d = *sh;
    if (fresh) {
      for (int64_t t = 0; t < d.T; ++t)
        if (pos[b * d.T + t] == s) return fresh + ((b * d.T + t) * d.K + kv) * d.H;
    }
    int64_t at = ((b * d.K + kv) * d.S + s) * d.H;
    if (!bf16) return static_cast<const float*>(cache) + at;
    const uint16_t* p = static_cast<const uint16_t*>(cache) + at;
    for (int64_t i = 0; i < d.H; ++i) buf[i] = bf16_to_f32(p[i]);
    return buf;
  }

  void run(int64_t b, int64_t kv) const {
    const Shapes& d = *sh;
    const int64_t rows = d.T * d.G, H = d.H, H16 = H / 16 * 16;
    std::vector<int64_t> n(rows);  // slots row r sees: [0, n[r])
    int64_t n_max = 0;
    for (int64_t t = 0; t < d.T; ++t) {
      int64_t p = pos[b * d.T + t];
      int64_t seen = std::min<int64_t>(std::max<int64_t>(p, 0), d.S - 1) + 1;
      for (int64_t g = 0; g < d.G; ++g) n[t * d.G + g] = seen;
      n_max = std::max(n_max, seen);
    }
    auto qrow = [&](int64_t r) { return q + (((b * d.T + r / d.G) * d.K + kv) * d.G + r % d.G) * H; };
    std::vector<float> w(rows * n_max), buf(H), acc(rows * H, 0.f);
    for (int64_t s = 0; s < n_max; ++s) {  // scores: each key read once
      const float* key = slot(kc, k_new, b, kv, s, buf.data());
      for (int64_t r = 0; r < rows; ++r) {
        if (s >= n[r]) continue;
        const float* qr = qrow(r);
        v16 a = {};
        for (int64_t i = 0; i < H16; i += 16) a += load16(qr + i) * load16(key + i);
        float dot = lane_sum(a);
        for (int64_t i = H16; i < H; ++i) dot += qr[i] * key[i];
        w[r * n_max + s] = dot * scale;
      }
    }
    std::vector<float> norm(rows);
    for (int64_t r = 0; r < rows; ++r) {  // softmax weights, unnormalized
      float* wr = w.data() + r * n_max;
      float m = wr[0];
      for (int64_t s = 1; s < n[r]; ++s) m = std::max(m, wr[s]);
      v16 sum16 = {};
      int64_t s = 0;
      for (; s + 16 <= n[r]; s += 16) {
        v16 e = exp16(load16(wr + s) - splat(m));
        store16(wr + s, e);
        sum16 += e;
      }
      float sum = lane_sum(sum16);
      for (; s < n[r]; ++s) {  // the tail through a padded vector, same exp
        alignas(64) float t16[16] = {};
        t16[0] = wr[s] - m;
        wr[s] = exp16(load16(t16))[0];
        sum += wr[s];
      }
      norm[r] = sum;  // >= 1: the max's own weight
    }
    for (int64_t s = 0; s < n_max; ++s) {  // weighted values: each value read once
      const float* val = slot(vc, v_new, b, kv, s, buf.data());
      for (int64_t r = 0; r < rows; ++r) {
        if (s >= n[r]) continue;
        float p = w[r * n_max + s];
        float* ar = acc.data() + r * H;
        for (int64_t i = 0; i < H16; i += 16) store16(ar + i, load16(ar + i) + splat(p) * load16(val + i));
        for (int64_t i = H16; i < H; ++i) ar[i] += p * val[i];
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + (((b * d.T + r / d.G) * d.K + kv) * d.G + r % d.G) * H;
      for (int64_t i = 0; i < H; ++i) o[i] = acc[r * H + i] / norm[r];
    }
  }
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  std::atomic_signal_fence(std::memory_order_seq_cst);
#endif
}

struct Work {
  Task task;
  int64_t tasks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t i; (i = next.fetch_add(1)) < tasks; done.fetch_add(1))
      task.run(i / task.sh->K, i % task.sh->K);
  }
};

ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer kc,
                               ffi::AnyBuffer vc, ffi::Buffer<ffi::S32> layer,
                               ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> k_new,
                               ffi::Buffer<ffi::F32> v_new, ffi::ResultBuffer<ffi::F32> out,
                               bool patch) {
  auto qd = q.dimensions(), cd = kc.dimensions();
  if (qd.size() != 5 || cd.size() != 5)
    return ffi::Error::InvalidArgument("cpu_attention: q must be [B,T,K,G,H], caches [L,B,K,S,H]");
  auto shapes = std::make_shared<Shapes>(Shapes{qd[0], qd[1], qd[2], qd[3], qd[4], cd[3]});
  if (cd[1] != qd[0] || cd[2] != qd[2] || cd[4] != qd[4] || kc.element_type() != vc.element_type())
    return ffi::Error::InvalidArgument("cpu_attention: q and cache shapes differ");
  bool bf16 = kc.element_type() == ffi::DataType::BF16;
  if (!bf16 && kc.element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("cpu_attention: caches must be float32 or bfloat16");
  int64_t l = *layer.typed_data();
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("cpu_attention: layer out of range");
  size_t width = bf16 ? 2 : 4;
  int64_t layer_bytes = cd[1] * cd[2] * cd[3] * cd[4] * width;
  auto work = std::make_shared<Work>();
  Task& t = work->task;
  t.sh = shapes.get();
  t.q = q.typed_data();
  t.kc = static_cast<const char*>(kc.untyped_data()) + l * layer_bytes;
  t.vc = static_cast<const char*>(vc.untyped_data()) + l * layer_bytes;
  t.bf16 = bf16;
  t.pos = positions.typed_data();
  t.k_new = patch ? k_new.typed_data() : nullptr;
  t.v_new = patch ? v_new.typed_data() : nullptr;
  t.scale = 1.0f / std::sqrt(float(shapes->H));
  t.out = out->typed_data();
  work->tasks = shapes->B * shapes->K;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  for (int64_t i = 1; i < std::min(threads, work->tasks); ++i)
    pool.Schedule([work, shapes] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->tasks) cpu_relax();
  return ffi::Error::Success();
}

}  // namespace

// (pool, q, kc, vc, layer, positions, k_new, v_new; attr patch) -> out [B, T, K, G, H]
XLA_FFI_DEFINE_HANDLER_SYMBOL(S2dDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("patch"));
