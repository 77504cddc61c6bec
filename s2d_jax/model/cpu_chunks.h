// Column chunks of a few-row matmul shared by the calling thread and XLA's thread pool
// (small_matmul.cc, quant_matmul.cc): each chunk claimed once through its flag. Thread s
// walks its own contiguous segment of chunks forward, then takes what is left of the
// others' from their ends backward: the threads stream distant parts of each weight row at
// once (two threads on neighbouring tiles streamed one row 13% slower than on contiguous
// halves, a standalone probe on a 2-core AMD EPYC). A helper task that starts late finds
// everything claimed and touches no buffer; the caller claims every chunk it can and waits
// only for chunks already claimed.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace s2d_cpu {

constexpr int64_t kChunkUnit = 64;  // columns: whole register tiles of the kernels

struct Chunks {
  std::function<void(int64_t, int64_t)> fn;  // columns [c0, c1)
  int64_t N, chunk_cols, chunks, segments;
  std::unique_ptr<std::atomic<bool>[]> claimed;
  std::atomic<int64_t> done{0};

  void run(int64_t seg) {
    auto begin = [this](int64_t s) { return s * chunks / segments; };
    for (int64_t c = begin(seg); c < begin(seg + 1); ++c) claim(c);
    for (int64_t o = 1; o < segments; ++o) {
      int64_t s = (seg + o) % segments;
      for (int64_t c = begin(s + 1) - 1; c >= begin(s); --c) claim(c);
    }
  }

  void claim(int64_t c) {
    if (claimed[c].exchange(true, std::memory_order_relaxed)) return;
    int64_t c0 = c * chunk_cols;
    fn(c0, std::min(N, c0 + chunk_cols));
    done.fetch_add(1, std::memory_order_release);
  }
};

// Columns a chunk of an N-column matmul takes. `col_bytes`: weight bytes a column holds (K x
// the element width), which sizes the chunks: about four a thread (load balance), whole
// register tiles, >= 64 KiB of weights each so the hand-off stays small next to the work.
inline int64_t chunk_columns(xla::ffi::ThreadPool& pool, int64_t N, double col_bytes) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t min_cols = std::max<int64_t>(
      kChunkUnit, int64_t(65536 / std::max(col_bytes, 1.0)) / kChunkUnit * kChunkUnit);
  int64_t cols = (N + 4 * threads - 1) / (4 * threads);
  return std::max(min_cols, (cols + kChunkUnit - 1) / kChunkUnit * kChunkUnit);
}

// fn(c0, c1) over the N columns in chunks of `cols`, on the caller and the pool.
inline void run_column_chunks(xla::ffi::ThreadPool& pool, int64_t N, int64_t cols,
                              std::function<void(int64_t, int64_t)> fn) {
  auto work = std::make_shared<Chunks>();
  work->fn = std::move(fn);
  work->N = N;
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->chunk_cols = cols;
  work->chunks = (N + cols - 1) / cols;
  work->segments = std::min(threads, work->chunks);
  work->claimed.reset(new std::atomic<bool>[work->chunks]());
  for (int64_t t = 1; t < work->segments; ++t)
    pool.Schedule([work, t] { work->run(t); });
  work->run(0);
  while (work->done.load(std::memory_order_acquire) < work->chunks) cpu_relax();
}

// fn(c0, c1) over the N columns, on the caller and the pool, in chunks `chunk_columns` sizes.
inline void for_column_chunks(xla::ffi::ThreadPool& pool, int64_t N, double col_bytes,
                              std::function<void(int64_t, int64_t)> fn) {
  run_column_chunks(pool, N, chunk_columns(pool, N, col_bytes), std::move(fn));
}

}  // namespace s2d_cpu
