// The row and merge kernels of a DCP step (src/dcp/dcp_device.h). Each moves a few rows of a
// decode step (T x H x D elements, a few hundred KB at most): they are latency-bound, one
// launch each, and far from any floor that matters next to the attention they surround.
//   gather_rows_kernel  one thread per element: dst[i] = src[rows[i]].
//   pack_rows_kernel    one warp per (row, head): the rank's local result, or zeros / -inf.
//   merge_states_kernel one warp per (row, head): weights w_r = e^{lse_r - max} over the N ranks
//                       (lanes recompute them: N is the group size), out = sum w_r o_r / sum w_r,
//                       lse = max + log sum w_r; +inf counts as -inf; no key anywhere: 0, -inf;
//                       a NaN LSE (a rank's row saw a NaN logit): NaN out and LSE
//                       (merge_attn_states_n's math; every rank runs it on the same gathered
//                       bits, so every rank ends with the same output).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "dcp/dcp_device.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn::dcp_detail {
namespace {

struct Strides3 {
  int64_t s0, s1, s2;
};

Strides3 strides3(const TensorView& t) {
  return {t.stride(0), t.stride(1), t.ndim() == 3 ? t.stride(2) : 0};
}

template <typename E>
__global__ void gather_rows_kernel(const E* __restrict__ src, Strides3 ss, const int32_t* __restrict__ rows,
                                   E* __restrict__ dst, int64_t n, int64_t a, int64_t b) {
  const int64_t total = n * a * b;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t k = e % b, j = e / b % a, i = e / (a * b);
    dst[e] = src[int64_t{rows[i]} * ss.s0 + j * ss.s1 + k * ss.s2];
  }
}

template <typename T>
__device__ __forceinline__ T from_f32(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return cuda::Mma<T>::from_float(x);
  }
}

template <typename T>
__global__ void __launch_bounds__(128) pack_rows_kernel(const T* __restrict__ local_out, Strides3 os,
                                                         const float* __restrict__ local_lse, int64_t lse_s0,
                                                         int64_t lse_s1, const int32_t* __restrict__ inverse,
                                                         T* __restrict__ out, float* __restrict__ lse, int64_t tokens,
                                                         int heads, int dim) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = tokens * heads;
  for (int64_t r = blockIdx.x * 4 + (threadIdx.x >> 5); r < rows; r += int64_t{gridDim.x} * 4) {
    const int64_t t = r / heads;
    const int h = static_cast<int>(r % heads);
    const int32_t src = inverse[t];
    T* dst = out + r * dim;
    if (src < 0) {
      for (int d = lane; d < dim; d += 32) dst[d] = from_f32<T>(0.f);
      if (lane == 0) lse[int64_t{h} * tokens + t] = cuda::neg_inf();
      continue;
    }
    const T* s = local_out + int64_t{src} * os.s0 + int64_t{h} * os.s1;
    for (int d = lane; d < dim; d += 32) dst[d] = s[d * os.s2];
    if (lane == 0) lse[int64_t{h} * tokens + t] = local_lse[int64_t{h} * lse_s0 + int64_t{src} * lse_s1];
  }
}

struct MergeArgs {
  const void* outs;
  int64_t os[4];  // (N, T, H, D) strides in elements
  const float* lses;
  int64_t ls[3];  // (N, H, T)
  void* out;
  int64_t out_s[3];
  float* out_lse;
  int64_t out_lse_s[2];
  int ranks;
  int64_t tokens;
  int heads, dim;
};

template <typename T>
__global__ void __launch_bounds__(128) merge_states_kernel(const MergeArgs p) {
  const int lane = threadIdx.x & 31;
  const T* outs = static_cast<const T*>(p.outs);
  T* out = static_cast<T*>(p.out);
  const int64_t rows = p.tokens * p.heads;
  for (int64_t r = blockIdx.x * 4 + (threadIdx.x >> 5); r < rows; r += int64_t{gridDim.x} * 4) {
    const int64_t t = r / p.heads;
    const int h = static_cast<int>(r % p.heads);
    const auto lse_of = [&](int n) {
      const float l = p.lses[n * p.ls[0] + h * p.ls[1] + t * p.ls[2]];
      return l == -cuda::neg_inf() ? cuda::neg_inf() : l;  // +inf (an empty row elsewhere) counts as -inf
    };
    float m = cuda::neg_inf();
    bool nan = false;  // a rank's row saw a NaN logit: the merged row is NaN (out and LSE)
    for (int n = 0; n < p.ranks; ++n) {
      const float l = lse_of(n);
      nan = nan || l != l;
      m = fmaxf(m, l);
    }
    if (nan) {
      const float q = __int_as_float(0x7fffffff);
      for (int d = lane; d < p.dim; d += 32) out[t * p.out_s[0] + h * p.out_s[1] + d * p.out_s[2]] = from_f32<T>(q);
      if (lane == 0 && p.out_lse != nullptr) p.out_lse[h * p.out_lse_s[0] + t * p.out_lse_s[1]] = q;
      continue;
    }
    float sum = 0.f;
    for (int n = 0; n < p.ranks; ++n) {
      const float l = lse_of(n);
      sum += m == cuda::neg_inf() || !(l > cuda::neg_inf()) ? 0.f : expf(l - m);
    }
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int d = lane; d < p.dim; d += 32) {
      float acc = 0.f;
      for (int n = 0; n < p.ranks; ++n) {
        const float l = lse_of(n);
        const float w = m == cuda::neg_inf() || !(l > cuda::neg_inf()) ? 0.f : expf(l - m);
        if (w != 0.f) acc += w * cuda::to_f32(outs[n * p.os[0] + t * p.os[1] + h * p.os[2] + d * p.os[3]]);
      }
      out[t * p.out_s[0] + h * p.out_s[1] + d * p.out_s[2]] = from_f32<T>(acc * inv);
    }
    if (lane == 0 && p.out_lse != nullptr) {
      p.out_lse[h * p.out_lse_s[0] + t * p.out_lse_s[1]] = sum > 0.f ? m + logf(sum) : cuda::neg_inf();
    }
  }
}

int grid_for(int64_t warps) { return static_cast<int>(std::clamp<int64_t>((warps + 3) / 4, 1, 65535)); }

cudaStream_t stream() { return static_cast<cudaStream_t>(current_cuda_stream()); }

template <class F>
void by_dtype(DType dtype, const char* what, F&& f) {
  switch (dtype) {
    case DType::f32: f(float{}); break;
    case DType::f16: f(__half{}); break;
    case DType::bf16: f(__nv_bfloat16{}); break;
    default:
      throw Error("out", detail::concat(what, ": dtype ", dtype_name(dtype),
                                        " is not supported: expected float32, float16 or bfloat16"));
  }
}

}  // namespace

void cuda_gather_rows(const TensorView& src, const TensorView& rows, const TensorView& dst) {
  const int64_t n = dst.size(0), a = dst.size(1), b = dst.ndim() == 3 ? dst.size(2) : 1;
  if (n * a * b == 0) return;
  const int grid = static_cast<int>(std::clamp<int64_t>((n * a * b + 255) / 256, 1, 65535));
  const Strides3 ss = strides3(src);
  const auto* idx = rows.data_as<const int32_t>();
  switch (src.element_size()) {
    case 1:
      gather_rows_kernel<<<grid, 256, 0, stream()>>>(src.data_as<const uint8_t>(), ss, idx, dst.data_as<uint8_t>(), n, a, b);
      break;
    case 2:
      gather_rows_kernel<<<grid, 256, 0, stream()>>>(src.data_as<const uint16_t>(), ss, idx, dst.data_as<uint16_t>(), n, a, b);
      break;
    default:
      gather_rows_kernel<<<grid, 256, 0, stream()>>>(src.data_as<const uint32_t>(), ss, idx, dst.data_as<uint32_t>(), n, a, b);
      break;
  }
  cuda::check_launch("dcp gather_rows_kernel");
}

void cuda_pack_rows(const TensorView& local_out, const TensorView& local_lse, const TensorView& inverse,
                    const TensorView& out, const TensorView& lse) {
  const int64_t tokens = out.size(0);
  const int heads = static_cast<int>(out.size(1)), dim = static_cast<int>(out.size(2));
  if (tokens * heads == 0) return;
  const Strides3 os = strides3(local_out);
  by_dtype(out.dtype(), "dcp pack_rows", [&](auto tag) {
    using T = decltype(tag);
    pack_rows_kernel<T><<<grid_for(tokens * heads), 128, 0, stream()>>>(
        local_out.data_as<const T>(), os, local_lse.data_as<const float>(), local_lse.stride(0), local_lse.stride(1),
        inverse.data_as<const int32_t>(), out.data_as<T>(), lse.data_as<float>(), tokens, heads, dim);
  });
  cuda::check_launch("dcp pack_rows_kernel");
}

void cuda_merge_states(const TensorView& outs, const TensorView& lses, const TensorView& out,
                       const TensorView& out_lse) {
  MergeArgs p{};
  p.outs = outs.data();
  for (int i = 0; i < 4; ++i) p.os[i] = outs.stride(i);
  p.lses = lses.data_as<const float>();
  for (int i = 0; i < 3; ++i) p.ls[i] = lses.stride(i);
  p.out = out.data();
  for (int i = 0; i < 3; ++i) p.out_s[i] = out.stride(i);
  p.out_lse = out_lse.defined() ? out_lse.data_as<float>() : nullptr;
  if (out_lse.defined()) {
    p.out_lse_s[0] = out_lse.stride(0);
    p.out_lse_s[1] = out_lse.stride(1);
  }
  p.ranks = static_cast<int>(outs.size(0));
  p.tokens = out.size(0);
  p.heads = static_cast<int>(out.size(1));
  p.dim = static_cast<int>(out.size(2));
  if (p.tokens * p.heads == 0) return;
  by_dtype(out.dtype(), "dcp merge_states", [&](auto tag) {
    using T = decltype(tag);
    merge_states_kernel<T><<<grid_for(p.tokens * p.heads), 128, 0, stream()>>>(p);
  });
  cuda::check_launch("dcp merge_states_kernel");
}

}  // namespace pagedattn::dcp_detail
