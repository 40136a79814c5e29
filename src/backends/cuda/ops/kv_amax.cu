// amax of the rows a cache write stores, on the GPU (detail::cuda_written_rows_amax,
// ops/cuda_ops.h): the Attention layer's calculate_kv_scales measures its first batch with it.
//
//   result[0] = max over rows t < N' with slot_mapping[t] >= 0 of bits(|key[t, h, i]|)
//   result[1] = the same over value
// where bits() is the f32 bit pattern as an unsigned integer: for non-negative floats the integer
// order is the numeric order and every NaN pattern sorts above +inf, so one integer atomicMax
// both finds the max and lets a NaN through (fmaxf would drop it). Exact: no rounding anywhere
// (f16 / bf16 widen to f32 exactly).
//
// Tiling: a grid-stride loop over tokens (at most 1024 CTAs), 256 threads over (head, element) of
// one token's key then value row; each thread keeps its max, a warp reduces with shuffles and
// its lane 0 issues one atomicMax per tensor. Memory traffic: every written row read once; the
// kernel runs once per layer (the first batch), so it is not tuned further.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "core/device_memory.h"
#include "ops/cuda_ops.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

struct RowsView {
  const void* data;     // (N, H, dim):(strides)
  int64_t strides[3];
  int heads;
  int dim;
};

struct AmaxParams {
  RowsView key, value;
  const int64_t* slot_mapping;  // (N',):(slot_stride)
  int64_t slot_stride;
  int64_t num_tokens;           // N'
  unsigned int* result;         // (2,): key, value
};

template <typename In>
__device__ __forceinline__ unsigned int row_amax_bits(const RowsView& r, int64_t token,
                                                      unsigned int amax) {
  const In* base = static_cast<const In*>(r.data) + token * r.strides[0];
  const int total = r.heads * r.dim;
  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int h = idx / r.dim;
    const int i = idx - h * r.dim;
    const float x = to_f32(base[h * r.strides[1] + static_cast<int64_t>(i) * r.strides[2]]);
    amax = max(amax, __float_as_uint(x) & 0x7fffffffu);
  }
  return amax;
}

__device__ __forceinline__ unsigned int warp_max(unsigned int x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x = max(x, __shfl_xor_sync(0xffffffffu, x, offset));
  return x;
}

template <typename In>
__global__ void __launch_bounds__(256) written_rows_amax_kernel(const AmaxParams p) {
  unsigned int k_amax = 0, v_amax = 0;
  for (int64_t token = blockIdx.x; token < p.num_tokens; token += gridDim.x) {
    if (p.slot_mapping[token * p.slot_stride] < 0) continue;  // -1: padding, not written
    k_amax = row_amax_bits<In>(p.key, token, k_amax);
    v_amax = row_amax_bits<In>(p.value, token, v_amax);
  }
  k_amax = warp_max(k_amax);
  v_amax = warp_max(v_amax);
  if ((threadIdx.x & 31) == 0) {
    if (k_amax != 0) atomicMax(&p.result[0], k_amax);
    if (v_amax != 0) atomicMax(&p.result[1], v_amax);
  }
}

RowsView rows_view(const TensorView& t) {
  return RowsView{t.data(), {t.stride(0), t.stride(1), t.stride(2)}, static_cast<int>(t.size(1)),
                  static_cast<int>(t.size(2))};
}

}  // namespace
}  // namespace pagedattn::cuda

namespace pagedattn::detail {

void cuda_written_rows_amax(const TensorView& key, const TensorView& value,
                            const TensorView& slot_mapping, const TensorView& result) {
  device_memset(result.data(), 0, 2 * sizeof(unsigned int));  // on the current stream
  const int64_t num_tokens = slot_mapping.size(0);
  if (num_tokens == 0) return;
  cuda::AmaxParams p{};
  p.key = cuda::rows_view(key);
  p.value = cuda::rows_view(value);
  p.slot_mapping = slot_mapping.data_as<const int64_t>();
  p.slot_stride = slot_mapping.stride(0);
  p.num_tokens = num_tokens;
  p.result = static_cast<unsigned int*>(result.data());
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(num_tokens, 1024));
  const auto stream = static_cast<cudaStream_t>(current_cuda_stream());
  switch (key.dtype()) {
    case DType::f32:
      cuda::written_rows_amax_kernel<float><<<grid, 256, 0, stream>>>(p);
      break;
    case DType::f16:
      cuda::written_rows_amax_kernel<__half><<<grid, 256, 0, stream>>>(p);
      break;
    case DType::bf16:
      cuda::written_rows_amax_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(p);
      break;
    default:
      throw Error("key", detail::concat("written_rows_amax: key dtype ", dtype_name(key.dtype()),
                                        " is not supported on CUDA: expected float32, float16 or "
                                        "bfloat16"));
  }
  cuda::check_launch("written_rows_amax_kernel");
}

}  // namespace pagedattn::detail
