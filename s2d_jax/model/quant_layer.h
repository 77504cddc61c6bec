// One layer of a block-quantized weight stack (quantize.QuantizedWeight) as the CPU kernels
// read it in place (quant_matmul.cc: float32 activations; quant_dot8.cc: int8 ones), and
// the checks of its buffers against x's input dim. W [L, K, N] as q and scales per group
// of G consecutive input rows (k) and output column:
//   Q8 (int8 q [L, K, N]):                     w = scale * q
//   Q4 (uint8 q [L, K/2, N], signed nibbles):  w = scale * q,           q in [-8, 7]
//   Q4 + offset (unsigned nibbles):            w = scale * q + offset,  q in [0, 15]
// (packed byte row i holds k = 2i in its low nibble, k = 2i + 1 in its high one); scale and
// offset [L, K/G, N], float32 or float16 (a GGUF's own).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "cpu_vector.h"
#include "xla/ffi/api/ffi.h"

namespace s2d_cpu {

enum QuantFormat { kQ8 = 0, kQ4 = 1, kQ4Offset = 2 };

struct QuantLayer {
  const uint8_t* q = nullptr;  // this layer's q rows ([K, N] int8 or [K/2, N] packed)
  Scales s;                    // [K/G, N]
  Scales o;                    // [K/G, N], or no pointer
  int64_t K = 0, N = 0, G = 0;
  int format = kQ8;
  double col_bytes = 0;        // bytes a column holds: its q plus its scales (and offsets)
};

// Layer `l` of (q, scale, offset) for x's input dim K; `group_multiple`: what G must be a
// multiple of (2 for the nibbles of 4 bits, 32 for quant_dot8's activation blocks).
inline xla::ffi::Error parse_quant_layer(const char* who, int64_t K, int64_t l,
                                         xla::ffi::AnyBuffer q, xla::ffi::AnyBuffer scale,
                                         xla::ffi::AnyBuffer offset, int64_t group_multiple,
                                         QuantLayer& w) {
  namespace ffi = xla::ffi;
  auto fail = [who](const char* what) {
    return ffi::Error::InvalidArgument(std::string(who) + ": " + what);
  };
  auto qd = q.dimensions(), sd = scale.dimensions();
  if (qd.size() != 3 || sd.size() != 3) return fail("q must be [L, K or K/2, N] and scale [L, K/G, N]");
  int64_t L = qd[0], N = qd[2], groups = sd[1];
  bool packed = q.element_type() == ffi::DataType::U8;
  if (!packed && q.element_type() != ffi::DataType::S8) return fail("q must be int8 or packed uint8");
  bool has_offset = offset.element_count() != 0;
  bool half = scale.element_type() == ffi::DataType::F16;
  if (!half && scale.element_type() != ffi::DataType::F32)
    return fail("scales must be float32 or float16");
  if (has_offset && offset.element_type() != scale.element_type())
    return fail("offsets must have the scales' dtype");
  if (has_offset && !packed) return fail("offsets go with 4-bit q only");
  if (has_offset && !std::equal(sd.begin(), sd.end(), offset.dimensions().begin(),
                                offset.dimensions().end()))
    return fail("offset and scale shapes differ");
  if (qd[1] * (packed ? 2 : 1) != K || sd[0] != L || sd[2] != N || groups < 1 || K % groups)
    return fail("x, q and scale shapes do not agree");
  int64_t G = K / groups;
  if (G % std::max<int64_t>(group_multiple, packed ? 2 : 1))
    return fail("the weight's groups do not divide into the kernel's blocks");
  if (l < 0 || l >= L) return fail("layer out of range");
  w.q = static_cast<const uint8_t*>(q.untyped_data()) + l * qd[1] * N;
  w.s = Scales{scale.untyped_data(), half}.layer(l * groups * N);
  w.o = has_offset ? Scales{offset.untyped_data(), half}.layer(l * groups * N) : Scales{};
  w.K = K;
  w.N = N;
  w.G = G;
  w.format = packed ? (has_offset ? kQ4Offset : kQ4) : kQ8;
  w.col_bytes = K * (packed ? 0.5 : 1.0) + groups * (half ? 2.0 : 4.0) * (has_offset ? 2 : 1);
  return ffi::Error::Success();
}

}  // namespace s2d_cpu
