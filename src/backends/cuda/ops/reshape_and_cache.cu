// reshape_and_cache on the GPU (detail::cuda_reshape_and_cache_flash, ops/cuda_ops.h): writes
// key (N, Hkv, D) and value (N, Hkv, Dv) rows into the paged caches key_cache / value_cache
// (num_blocks, block_size, Hkv, D[v]) at slot_mapping[t] = block * block_size + offset.
//
//   stored = x                          (16-bit / f32 cache: one rounding from f32, RNE)
//   stored = saturate_fp8(x / scale)    (fp8 cache: IEEE division, then one RNE rounding with
//                                        saturation to the finite max; NaN stays NaN)
// Slot -1 and any slot outside [0, num_blocks * block_size) are skipped (the slots are never
// read on the host: that would need a sync; this is the bounds guarantee).
//
// Tiling: one CTA per token, threads over (k|v, head, vector); a vector is 16 bytes of the cache
// (8 elements of a 16-bit cache, 16 of fp8, 4 of f32) read from 16-, 32- or 64-byte aligned
// input chunks. The vector path needs unit stride on the last dim and 16-byte aligned rows in
// both the input and the cache (true for the caches the backends allocate); anything else takes
// the element-wise path. Memory traffic: each input row read once, each cache row written once.
#include <cuda_runtime.h>

#include <cstdint>

#include "backends/cuda/common/device_primitives.cuh"
#include "backends/cuda/common/device_runtime.h"
#include "ops/cuda_ops.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn::cuda {
namespace {

struct RowWriteParams {
  const void* src;            // (N, Hkv, dim):(src_strides)
  void* cache;                // (num_blocks, block_size, Hkv, dim):(cache_strides)
  int64_t src_strides[3];
  int64_t cache_strides[4];
  int dim;
  float scale;                // fp8 only
  const float* scale_per_head;  // (Hkv,):(scale_stride) or nullptr
  int64_t scale_stride;
};

struct CacheWriteParams {
  RowWriteParams k, v;
  const int64_t* slot_mapping;
  int64_t slot_stride;
  int64_t num_slots;          // num_blocks * block_size
  int block_size;
  int num_kv_heads;
};

template <typename Out>
struct CacheStore;

template <>
struct CacheStore<float> {
  static __device__ __forceinline__ float convert(float x, float) { return x; }
};
template <>
struct CacheStore<__half> {
  static __device__ __forceinline__ __half convert(float x, float) { return __float2half_rn(x); }
};
template <>
struct CacheStore<__nv_bfloat16> {
  static __device__ __forceinline__ __nv_bfloat16 convert(float x, float) { return __float2bfloat16_rn(x); }
};
template <>
struct CacheStore<__nv_fp8_e4m3> {
  static __device__ __forceinline__ __nv_fp8_e4m3 convert(float x, float scale) {
    __nv_fp8_e4m3 r;
    r.__x = __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E4M3);
    return r;
  }
};
template <>
struct CacheStore<__nv_fp8_e5m2> {
  static __device__ __forceinline__ __nv_fp8_e5m2 convert(float x, float scale) {
    __nv_fp8_e5m2 r;
    r.__x = __nv_cvt_float_to_fp8(__fdiv_rn(x, scale), __NV_SATFINITE, __NV_E5M2);
    return r;
  }
};

template <typename In>
__device__ __forceinline__ float load_as_float(const In* p) {
  if constexpr (std::is_same_v<In, float>) {
    return *p;
  } else if constexpr (std::is_same_v<In, __half>) {
    return __half2float(*p);
  } else {
    return __bfloat162float(*p);
  }
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Writes the rows of one token (all heads of k or v).
template <typename In, typename Out, bool kVector>
__device__ __forceinline__ void write_rows(const RowWriteParams& w, int64_t token, int64_t block,
                                           int64_t offset, int num_kv_heads, int first, int step) {
  constexpr int E = kVector ? static_cast<int>(16 / sizeof(Out)) : 1;  // elements per vector
  const int vectors = w.dim / E;
  const int total = num_kv_heads * vectors;
  for (int idx = first; idx < total; idx += step) {
    const int h = idx / vectors;
    const int i = (idx - h * vectors) * E;
    const float scale = w.scale_per_head != nullptr ? w.scale_per_head[h * w.scale_stride] : w.scale;
    const In* src = static_cast<const In*>(w.src) + token * w.src_strides[0] + h * w.src_strides[1] +
                    static_cast<int64_t>(i) * w.src_strides[2];
    Out* dst = static_cast<Out*>(w.cache) + block * w.cache_strides[0] + offset * w.cache_strides[1] +
               h * w.cache_strides[2] + static_cast<int64_t>(i) * w.cache_strides[3];
    if constexpr (kVector) {
      Vec<In, E> in = *reinterpret_cast<const Vec<In, E>*>(src);
      Vec<Out, E> out;
      if constexpr (std::is_same_v<In, Out>) {
        out = *reinterpret_cast<Vec<Out, E>*>(&in);
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) out.v[e] = CacheStore<Out>::convert(load_as_float(&in.v[e]), scale);
      }
      *reinterpret_cast<Vec<Out, E>*>(dst) = out;
    } else {
      if constexpr (std::is_same_v<In, Out>) {
        *dst = *src;
      } else {
        *dst = CacheStore<Out>::convert(load_as_float(src), scale);
      }
    }
  }
}

template <typename In, typename Out, bool kVector>
__global__ void __launch_bounds__(128) reshape_and_cache_kernel(const CacheWriteParams p) {
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token * p.slot_stride];
  if (slot < 0 || slot >= p.num_slots) return;  // -1 (or out of range): nothing to write
  const int64_t block = slot / p.block_size;
  const int64_t offset = slot - block * p.block_size;
  write_rows<In, Out, kVector>(p.k, token, block, offset, p.num_kv_heads, threadIdx.x, blockDim.x);
  write_rows<In, Out, kVector>(p.v, token, block, offset, p.num_kv_heads, threadIdx.x, blockDim.x);
}

bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

// The vector path needs unit stride on the last dim, dim % E == 0, and every row start aligned
// (base pointer and the token / head / block strides).
bool vector_ok(const TensorView& src, const TensorView& cache, int64_t dim, int elems) {
  const int64_t out_bytes = 16;
  const int64_t in_bytes = std::min<int64_t>(16, elems * static_cast<int64_t>(src.element_size()));
  if (dim % elems != 0 || src.stride(2) != 1 || cache.stride(3) != 1) return false;
  if (!aligned(src.data(), in_bytes) || !aligned(cache.data(), out_bytes)) return false;
  for (int i = 0; i < 2; ++i) {
    if ((src.stride(i) * static_cast<int64_t>(src.element_size())) % in_bytes != 0) return false;
  }
  for (int i = 0; i < 3; ++i) {
    if ((cache.stride(i) * static_cast<int64_t>(cache.element_size())) % out_bytes != 0) return false;
  }
  return true;
}

RowWriteParams row_params(const TensorView& src, const TensorView& cache, const TensorView& per_head,
                          float scale) {
  RowWriteParams w{};
  w.src = src.data();
  w.cache = cache.data();
  for (int i = 0; i < 3; ++i) w.src_strides[i] = src.stride(i);
  for (int i = 0; i < 4; ++i) w.cache_strides[i] = cache.stride(i);
  w.dim = static_cast<int>(src.size(2));
  w.scale = scale;
  w.scale_per_head = per_head.defined() ? per_head.data_as<const float>() : nullptr;
  w.scale_stride = per_head.defined() ? per_head.stride(0) : 0;
  return w;
}

template <typename In, typename Out>
void launch_typed(const CacheWriteParams& p, int64_t num_tokens, bool vector, cudaStream_t stream) {
  const unsigned grid = static_cast<unsigned>(num_tokens);
  if (vector) {
    reshape_and_cache_kernel<In, Out, true><<<grid, 128, 0, stream>>>(p);
  } else {
    reshape_and_cache_kernel<In, Out, false><<<grid, 128, 0, stream>>>(p);
  }
  check_launch("reshape_and_cache_kernel");
}

template <typename In>
void launch_for_input(const CacheWriteParams& p, int64_t num_tokens, DType cache_dtype, bool vector,
                      cudaStream_t stream) {
  switch (cache_dtype) {
    case DType::f32: return launch_typed<In, float>(p, num_tokens, vector, stream);
    case DType::f16: return launch_typed<In, __half>(p, num_tokens, vector, stream);
    case DType::bf16: return launch_typed<In, __nv_bfloat16>(p, num_tokens, vector, stream);
    case DType::fp8_e4m3: return launch_typed<In, __nv_fp8_e4m3>(p, num_tokens, vector, stream);
    case DType::fp8_e5m2: return launch_typed<In, __nv_fp8_e5m2>(p, num_tokens, vector, stream);
    default:
      throw Error("key_cache", detail::concat("reshape_and_cache: cache dtype ", dtype_name(cache_dtype),
                                              " is not supported on CUDA: expected float32, float16, "
                                              "bfloat16, fp8_e4m3 or fp8_e5m2"));
  }
}

}  // namespace
}  // namespace pagedattn::cuda

namespace pagedattn::detail {

void cuda_reshape_and_cache_flash(const TensorView& key, const TensorView& value,
                                  const TensorView& key_cache, const TensorView& value_cache,
                                  const TensorView& slot_mapping, DType cache_dtype,
                                  const LayerScales& scales) {
  const int64_t num_tokens = slot_mapping.size(0);
  if (num_tokens == 0 || key_cache.size(0) == 0) return;
  cuda::CacheWriteParams p{};
  const bool fp8 = is_fp8(cache_dtype);
  p.k = cuda::row_params(key, key_cache, scales.k_scale_per_head, fp8 ? scales.k_scale : 1.f);
  p.v = cuda::row_params(value, value_cache, scales.v_scale_per_head, fp8 ? scales.v_scale : 1.f);
  if (!fp8) {
    p.k.scale_per_head = nullptr;
    p.v.scale_per_head = nullptr;
  }
  p.slot_mapping = slot_mapping.data_as<const int64_t>();
  p.slot_stride = slot_mapping.stride(0);
  p.block_size = static_cast<int>(key_cache.size(1));
  p.num_slots = key_cache.size(0) * key_cache.size(1);
  p.num_kv_heads = static_cast<int>(key_cache.size(2));
  const int elems = static_cast<int>(16 / dtype_size(cache_dtype));
  const bool vector = cuda::vector_ok(key, key_cache, key.size(2), elems) &&
                      cuda::vector_ok(value, value_cache, value.size(2), elems);
  const auto stream = static_cast<cudaStream_t>(current_cuda_stream());
  switch (key.dtype()) {
    case DType::f32: return cuda::launch_for_input<float>(p, num_tokens, cache_dtype, vector, stream);
    case DType::f16: return cuda::launch_for_input<__half>(p, num_tokens, cache_dtype, vector, stream);
    case DType::bf16:
      return cuda::launch_for_input<__nv_bfloat16>(p, num_tokens, cache_dtype, vector, stream);
    default:
      throw Error("key", detail::concat("reshape_and_cache: key dtype ", dtype_name(key.dtype()),
                                        " is not supported on CUDA: expected float32, float16 or bfloat16"));
  }
}

}  // namespace pagedattn::detail
