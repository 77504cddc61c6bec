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
using s2d_cpu::fmadd;
using s2d_cpu::lane_sum;
using s2d_cpu::load16;
using s2d_cpu::splat;
using s2d_cpu::store16;
using s2d_cpu::v16;

typedef int32_t i16x16 __attribute__((vector_size(64)));

// 16 vectors' lane sums, one per lane of the result (lane j: the sum of part[j]'s lanes):
// pairs are folded by halves, quarters, eighths and single lanes, so each vector's 16 lanes
// are added by the same tree whatever its place among the 16.
inline v16 reduce16(const v16* part) {
  v16 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(part[2 * i], part[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                   18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(part[2 * i], part[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                   24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// exp(x) for x <= 0 (scores minus their max), 16 lanes: 2^n * p(r), r = x - n ln2 in
// [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative error < 2e-7); below -87
// (e^-87 ~ 1.6e-38) a weight is 0.
inline v16 exp16(v16 x) {
  const v16 lo = splat(-87.0f);
  i16x16 dead = x < lo;
  x = x < lo ? lo : x;
  // round to nearest: adding and removing 1.5 * 2^23 leaves an integer (|n| < 2^22)
  v16 n = fmadd(x, splat(1.44269504088896341f), splat(12582912.0f)) - splat(12582912.0f);
  v16 r = fmadd(-n, splat(0.693359375f), x);  // ln2 in two parts, so r is exact
  r = fmadd(-n, splat(-2.12194440e-4f), r);
  v16 p = splat(1.0f / 720);
  p = fmadd(p, r, splat(1.0f / 120));
  p = fmadd(p, r, splat(1.0f / 24));
  p = fmadd(p, r, splat(1.0f / 6));
  p = fmadd(p, r, splat(0.5f));
  p = fmadd(p, r, splat(1.0f));
  p = fmadd(p, r, splat(1.0f));
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
// row may see. The scores of all the rows run 16 slots at a time (a block of keys read once
// into L1 for every row), their weighted values up to 4 rows at a time.
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

  // Scores of query row `qr` against slots [s0, min(s0 + 16, n)): each slot's 16 partial
  // sums reduced with the other slots' by one transposing tree (the same tree for every
  // slot) instead of a horizontal sum per slot.
  void scores16(const float* qr, const float* const* keys, int64_t s0, int64_t n, float* w) const {
    const int64_t H = sh->H, H16 = H / 16 * 16, m = std::min<int64_t>(16, n - s0);
    v16 part[16] = {};
    if (m == 16 && H16 == 64) {  // the common case (head_dim 64), unrolled in registers
      const v16 q0 = load16(qr), q1 = load16(qr + 16), q2 = load16(qr + 32), q3 = load16(qr + 48);
      for (int j = 0; j < 16; ++j) {
        const float* k = keys[s0 + j];
        v16 a = fmadd(q0, load16(k), v16{});
        a = fmadd(q1, load16(k + 16), a);
        a = fmadd(q2, load16(k + 32), a);
        part[j] = fmadd(q3, load16(k + 48), a);
      }
    } else {
      for (int64_t j = 0; j < m; ++j) {  // the same sums, any width
        v16 a = {};
        for (int64_t i = 0; i < H16; i += 16) a = fmadd(load16(qr + i), load16(keys[s0 + j] + i), a);
        part[j] = a;
      }
    }
    alignas(64) float d[16];
    store16(d, reduce16(part));
    for (int64_t j = 0; j < m; ++j) {
      float dot = d[j];
      for (int64_t i = H16; i < H; ++i) dot = fmadd(qr[i], keys[s0 + j][i], dot);
      w[s0 + j] = dot * scale;
    }
  }

  // Softmax weights of row r's scores in place (unnormalized) -> their sum.
  static float softmax(float* w, int64_t n) {
    float m = w[0];  // the max, 16 lanes at a time (a scalar max chain cost ~4 cycles a slot)
    int64_t s = 1;
    if (n >= 16) {
      v16 m16 = load16(w);
      for (s = 16; s + 16 <= n; s += 16) {
        v16 x = load16(w + s);
        m16 = x > m16 ? x : m16;
      }
      for (int j = 0; j < 16; ++j) m = std::max(m, m16[j]);
    }
    for (; s < n; ++s) m = std::max(m, w[s]);
    v16 sum16 = {};
    for (s = 0; s + 16 <= n; s += 16) {  // the weights, unnormalized
      v16 e = exp16(load16(w + s) - splat(m));
      store16(w + s, e);
      sum16 += e;
    }
    float norm = lane_sum(sum16);
    for (; s < n; ++s) {  // the tail through a padded vector, the same exp
      alignas(64) float t16[16] = {};
      t16[0] = w[s] - m;
      w[s] = exp16(load16(t16))[0];
      norm += w[s];
    }
    return norm;
  }

  // Weighted values of R rows at once (their slot counts n[0..R)), 64 columns at a time in
  // registers: each value vector is loaded once for the R rows, and R x 4 independent sums
  // keep both FMA ports busy; each row still adds its slots in order, as it would alone.
  template <int R>
  void values(const float* const* vals, float* const* w, const int64_t* n, const float* norm,
              float* const* o) const {
    const int64_t H = sh->H, H16 = H / 16 * 16;
    int64_t n_min = n[0], n_max = n[0];
    for (int r = 1; r < R; ++r) n_min = std::min(n_min, n[r]), n_max = std::max(n_max, n[r]);
    for (int64_t h = 0; h < H16; h += 64) {
      const int64_t width = std::min<int64_t>(64, H16 - h) / 16;
      v16 acc[R][4] = {};
      int64_t s = 0;
      for (; s < n_min; ++s) {
        v16 v[4];
        for (int64_t j = 0; j < width; ++j) v[j] = load16(vals[s] + h + 16 * j);
        for (int r = 0; r < R; ++r) {
          v16 p = splat(w[r][s]);
          for (int64_t j = 0; j < width; ++j) acc[r][j] = fmadd(p, v[j], acc[r][j]);
        }
      }
      for (; s < n_max; ++s)
        for (int r = 0; r < R; ++r) {
          if (s >= n[r]) continue;
          v16 p = splat(w[r][s]);
          for (int64_t j = 0; j < width; ++j) acc[r][j] = fmadd(p, load16(vals[s] + h + 16 * j), acc[r][j]);
        }
      for (int r = 0; r < R; ++r)
        for (int64_t j = 0; j < width; ++j) store16(o[r] + h + 16 * j, acc[r][j] / splat(norm[r]));
    }
    for (int r = 0; r < R; ++r)
      for (int64_t i = H16; i < H; ++i) {
        float acc = 0.f;
        for (int64_t s = 0; s < n[r]; ++s) acc = fmadd(w[r][s], vals[s][i], acc);
        o[r][i] = acc / norm[r];
      }
  }

  void run(int64_t b, int64_t kv, int64_t r0, int64_t r1) const {
    const Shapes& d = *sh;
    const int64_t rows = r1 - r0;
    if (rows <= 0) return;  // the last of the groups can be empty (rows split ceil-wise)
    int64_t n_max = 0;
    for (int64_t r = r0; r < r1; ++r) n_max = std::max(n_max, seen(b, r / d.G));
    std::vector<const float*> keys(n_max), vals(n_max);
    std::vector<float> kbuf, vbuf, wbuf(rows * n_max), norms(rows);
    std::vector<int64_t> n(rows), at(rows);
    slots(kc, k_new, b, kv, n_max, keys, kbuf);
    slots(vc, v_new, b, kv, n_max, vals, vbuf);
    for (int64_t r = r0; r < r1; ++r) {
      n[r - r0] = seen(b, r / d.G);
      at[r - r0] = (((b * d.T + r / d.G) * d.K + kv) * d.G + r % d.G) * d.H;
    }
    // every row's scores, 16 slots at a time: a block's keys stay in L1 for all the rows
    for (int64_t s0 = 0; s0 < n_max; s0 += 16)
      for (int64_t i = 0; i < rows; ++i)
        if (s0 < n[i]) scores16(q + at[i], keys.data(), s0, n[i], wbuf.data() + i * n_max);
    for (int64_t i = 0; i < rows; ++i) norms[i] = softmax(wbuf.data() + i * n_max, n[i]);
    constexpr int kRows = 4;  // rows whose weighted values share one pass over the values
    for (int64_t g = 0; g < rows; g += kRows) {
      const int R = int(std::min<int64_t>(kRows, rows - g));
      float* w[kRows];
      float* o[kRows];
      for (int i = 0; i < R; ++i) w[i] = wbuf.data() + (g + i) * n_max, o[i] = out + at[g + i];
      const int64_t* ng = n.data() + g;
      const float* nm = norms.data() + g;
      switch (R) {
        case 1: values<1>(vals.data(), w, ng, nm, o); break;
        case 2: values<2>(vals.data(), w, ng, nm, o); break;
        case 3: values<3>(vals.data(), w, ng, nm, o); break;
        default: values<4>(vals.data(), w, ng, nm, o); break;
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
  // One token a row (a decode step) is bound by reading the cache: one task per (batch
  // row, kv head) where there are at least as many as threads, since splitting a head's
  // rows over two tasks reads its keys and values twice (SmolLM2, 3 kv heads on 2 threads:
  // 1.9-2.1 ms for a step's attention against 2.5 with two tasks a head, despite the 2:1
  // split). A window's rows add arithmetic, and there about two tasks a thread balance it
  // better. Fewer pairs than threads: rows are split so that every thread has work.
  int64_t pairs = shapes->B * shapes->K, per_thread = shapes->T == 1 ? 1 : 2;
  work->groups = std::min<int64_t>(shapes->T * shapes->G,
                                   (per_thread * threads + pairs - 1) / pairs);
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
