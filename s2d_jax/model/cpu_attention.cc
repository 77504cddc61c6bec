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

#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using s2d_cpu::cpu_relax;
using s2d_cpu::lane_sum;
using s2d_cpu::load16;
using s2d_cpu::store16;
using s2d_cpu::v16;

typedef int32_t i16x16 __attribute__((vector_size(64)));

inline v16 splat(float x) { return v16{} + x; }

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

// One (batch row, kv head) and a range of its T * G query rows, against the slots each
// row may see. Rows run one after another, each with its query and sums in registers; the
// keys/values of the (b, kv) pair are read from L2 again for every row (once from memory).
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

  // float32 rows of slots [0, n) of (b, kv): the cache's, or the call's own where patched;
  // bfloat16 caches converted into `buf`.
  void slots(const void* cache, const float* fresh, int64_t b, int64_t kv, int64_t n,
             std::vector<const float*>& ptr, std::vector<float>& buf) const {
    const Shapes& d = *sh;
    int64_t at = (b * d.K + kv) * d.S * d.H;
    if (bf16) {
      buf.resize(n * d.H);
      const uint16_t* p = static_cast<const uint16_t*>(cache) + at;
      for (int64_t i = 0; i < n * d.H; ++i) buf[i] = bf16_to_f32(p[i]);
    }
    for (int64_t s = 0; s < n; ++s)
      ptr[s] = bf16 ? buf.data() + s * d.H : static_cast<const float*>(cache) + at + s * d.H;
    if (fresh) {
      for (int64_t t = 0; t < d.T; ++t) {
        int64_t p = pos[b * d.T + t];
        if (p >= 0 && p < n) ptr[p] = fresh + ((b * d.T + t) * d.K + kv) * d.H;
      }
    }
  }

  void run(int64_t b, int64_t kv, int64_t r0, int64_t r1) const {
    const Shapes& d = *sh;
    const int64_t H = d.H, H16 = H / 16 * 16;
    int64_t n_max = 0;
    for (int64_t r = r0; r < r1; ++r) n_max = std::max(n_max, seen(b, r / d.G));
    std::vector<const float*> keys(n_max), vals(n_max);
    std::vector<float> kbuf, vbuf, w(n_max);
    slots(kc, k_new, b, kv, n_max, keys, kbuf);
    slots(vc, v_new, b, kv, n_max, vals, vbuf);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = seen(b, r / d.G), at = (((b * d.T + r / d.G) * d.K + kv) * d.G + r % d.G) * H;
      const float* qr = q + at;
      for (int64_t s = 0; s < n; ++s) {  // scores
        const float* key = keys[s];
        v16 a = {};
        for (int64_t i = 0; i < H16; i += 16) a += load16(qr + i) * load16(key + i);
        float dot = lane_sum(a);
        for (int64_t i = H16; i < H; ++i) dot += qr[i] * key[i];
        w[s] = dot * scale;
      }
      float m = w[0];
      for (int64_t s = 1; s < n; ++s) m = std::max(m, w[s]);
      v16 sum16 = {};
      int64_t s = 0;
      for (; s + 16 <= n; s += 16) {  // softmax weights, unnormalized
        v16 e = exp16(load16(w.data() + s) - splat(m));
        store16(w.data() + s, e);
        sum16 += e;
      }
      float norm = lane_sum(sum16);
      for (; s < n; ++s) {  // the tail through a padded vector, the same exp
        alignas(64) float t16[16] = {};
        t16[0] = w[s] - m;
        w[s] = exp16(load16(t16))[0];
        norm += w[s];
      }
      float* o = out + at;  // weighted values, 64 columns at a time in registers
      for (int64_t h = 0; h < H16; h += 64) {
        const int64_t width = std::min<int64_t>(64, H16 - h);
        v16 acc[4] = {};
        for (int64_t s = 0; s < n; ++s) {
          v16 p = splat(w[s]);
          for (int64_t j = 0; j < width / 16; ++j) acc[j] += p * load16(vals[s] + h + 16 * j);
        }
        for (int64_t j = 0; j < width / 16; ++j) store16(o + h + 16 * j, acc[j] / splat(norm));
      }
      for (int64_t i = H16; i < H; ++i) {
        float acc = 0.f;
        for (int64_t s = 0; s < n; ++s) acc += w[s] * vals[s][i];
        o[i] = acc / norm;
      }
    }
  }

  int64_t seen(int64_t b, int64_t t) const {  // slots [0, n) query t of row b may see
    int64_t p = pos[b * sh->T + t];
    return std::min<int64_t>(std::max<int64_t>(p, 0), sh->S - 1) + 1;
  }
};

// Tasks: (batch row, kv head, one of `groups` ranges of its query rows), so that two
// threads have work even for one kv head; a range's rows are computed as they would be
// alone.
struct Work {
  Task task;
  int64_t groups, tasks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    const Shapes& d = *task.sh;
    const int64_t rows = d.T * d.G, per = (rows + groups - 1) / groups;
    for (int64_t i; (i = next.fetch_add(1)) < tasks; done.fetch_add(1)) {
      int64_t g = i % groups, bk = i / groups;
      task.run(bk / d.K, bk % d.K, g * per, std::min(rows, (g + 1) * per));
    }
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
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // about two tasks a thread (an odd count of kv heads split 2:1 over 2 threads otherwise)
  int64_t pairs = shapes->B * shapes->K;
  work->groups = std::min<int64_t>(shapes->T * shapes->G, (2 * threads + pairs - 1) / pairs);
  work->tasks = shapes->B * shapes->K * work->groups;
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
