// Helpers shared by the GPU tests: skip without a device, the CUDA backend object, host random
// tensors.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "../../src/backends/cuda/attention/cuda_backend.h"
#include "../../src/backends/cuda/common/kernel_override.h"
#include "pagedattn/pagedattn.h"

#define PAGEDATTN_REQUIRE_GPU()                                                     \
  do {                                                                             \
    if (::pagedattn::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";   \
  } while (0)

namespace pagedattn::gpu_test {

// Forces a PAGEDATTN_CUDA_KERNEL value (kernel_override.h) for the builders made in its scope and
// restores the environment's when the scope ends.
class KernelOverrideScope {
 public:
  explicit KernelOverrideScope(const char* spec) { cuda::set_kernel_override(cuda::parse_kernel_override(spec)); }
  ~KernelOverrideScope() { cuda::set_kernel_override(std::nullopt); }
  KernelOverrideScope(const KernelOverrideScope&) = delete;
  KernelOverrideScope& operator=(const KernelOverrideScope&) = delete;
};

// Host tensor of `dtype` filled with uniform(lo, hi) values (rounded into dtype).
inline Tensor random_host(Shape shape, DType dtype, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  Tensor t(shape, dtype, Device::cpu);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, dist(rng));
  return t;
}

// `value` as a tensor of `dtype` stores it (rounded; fp8: saturated or NaN as store_f32 writes it).
inline float as_stored(float value, DType dtype) {
  unsigned char bytes[8] = {};
  store_f32(bytes, dtype, 0, value);
  return load_f32(bytes, dtype, 0);
}

// Sets every element of t (host or device memory, contiguous) to `value`.
inline void fill_value(Tensor& t, float value) {
  Tensor host(t.shape(), t.dtype(), Device::cpu);
  for (int64_t i = 0; i < host.numel(); ++i) store_f32(host.data(), host.dtype(), i, value);
  t.copy_from(host);
}

// Every element of t (host or device memory) as a float, in order.
inline std::vector<float> host_floats(const Tensor& t) {
  const Tensor host = t.to(Device::cpu);
  std::vector<float> v(static_cast<size_t>(host.numel()));
  for (int64_t i = 0; i < host.numel(); ++i) v[static_cast<size_t>(i)] = load_f32(host.data(), host.dtype(), i);
  return v;
}

// ||a - b|| / ||b|| over every element (a NaN in `a` counts as a failure: returns +inf).
inline double rel_error(const TensorView& a, const TensorView& b) {
  double diff2 = 0, ref2 = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = load_f64(a.data(), a.dtype(), i), y = load_f64(b.data(), b.dtype(), i);
    if (!std::isfinite(x)) return INFINITY;
    diff2 += (x - y) * (x - y);
    ref2 += y * y;
  }
  return ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
}

// An MLA layer at DeepSeek-V3's dims (kv_lora_rank 512, nope 128, rope 64, v 128), bf16, named
// layer.0: the CUDA_MLA tests' layer, on `backend` / `device`.
inline MLAAttentionLayerParams deepseek_mla_params(int heads, const char* kv_cache_dtype, int block_size,
                                                   const char* backend, Device device) {
  MLAAttentionLayerParams p;
  p.num_heads = heads;
  p.kv_lora_rank = 512;
  p.qk_nope_head_dim = 128;
  p.qk_rope_head_dim = 64;
  p.qk_head_dim = 128 + 64;
  p.v_head_dim = 128;
  p.kv_cache_dtype = kv_cache_dtype;
  p.block_size = block_size;
  p.prefix = "layer.0";
  p.dtype = DType::bf16;
  p.device = device;
  p.backend = backend;
  return p;
}

}  // namespace pagedattn::gpu_test
