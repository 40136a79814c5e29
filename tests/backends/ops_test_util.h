// Small helpers for the ops / backend tests: random tensors, byte snapshots, error matchers.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/dtype.h"
#include "pagedattn/error.h"
#include "pagedattn/tensor.h"

namespace pagedattn::testing_ops {

// Fills every element of a host view (any strides, up to 5-D) with uniform values in [lo, hi),
// rounded to the view's dtype.
inline void fill_uniform(const TensorView& view, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  const Shape& shape = view.shape();
  std::vector<int64_t> index(static_cast<size_t>(shape.ndim()), 0);
  const int64_t n = shape.numel();
  for (int64_t linear = 0; linear < n; ++linear) {
    int64_t rest = linear;
    int64_t offset = 0;
    for (int d = shape.ndim() - 1; d >= 0; --d) {
      const int64_t i = rest % shape[d];
      rest /= shape[d];
      offset += i * view.stride(d);
    }
    store_f32(view.data(), view.dtype(), offset, dist(rng));
  }
}

inline Tensor random_tensor(Shape shape, DType dtype, std::mt19937& rng, float lo = -2.f,
                            float hi = 2.f) {
  Tensor t(shape, dtype);
  fill_uniform(t.view(), rng, lo, hi);
  return t;
}

inline std::vector<uint8_t> snapshot(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.data());
  return std::vector<uint8_t>(p, p + t.nbytes());
}

inline bool bytes_equal(const Tensor& t, const std::vector<uint8_t>& bytes) {
  return t.nbytes() == bytes.size() && std::memcmp(t.data(), bytes.data(), bytes.size()) == 0;
}

// Runs fn, expects a pagedattn::Error whose argument() is `argument` and whose message
// mentions it.
inline void expect_error(const std::function<void()>& fn, const std::string& argument,
                         const std::string& message_part = "") {
  try {
    fn();
    ADD_FAILURE() << "expected an Error naming '" << argument << "', nothing was thrown";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), argument) << e.what();
    EXPECT_NE(std::string(e.what()).find(argument), std::string::npos) << e.what();
    if (!message_part.empty()) {
      EXPECT_NE(std::string(e.what()).find(message_part), std::string::npos) << e.what();
    }
  }
}

}  // namespace pagedattn::testing_ops
