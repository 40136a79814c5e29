// The output stores of the attention kernels and of the split combine: final rows in the activation
// dtype T, or -- fused fp8 output, vLLM's static per-tensor quantization -- in fp8 e4m3 as
// output / output_scale[0], rounded to nearest and saturated to +-448 (one rounding, from the f32
// accumulator, except where a kernel stages its rows in T first: those round twice). The scale is
// read on the device (graph-safe: it may change between replays); one that is not a positive finite
// number makes every element NaN (e4m3 0x7F) instead of a silently wrong value. Offsets and strides
// are in elements of the output (1 byte for e4m3).
#pragma once

#include <cstdint>

#include "backends/cuda/common/device_primitives.cuh"

namespace pagedattn::cuda {

// The factor the kernels multiply the final rows by before rounding to e4m3: 1 / output_scale[0]
// (NaN for an invalid scale); unused for T output (output_scale == nullptr).
__device__ __forceinline__ float output_quant_factor(const float* output_scale) {
  if (output_scale == nullptr) return 1.f;
  const float s = __ldg(output_scale);
  return s > 0.f && s <= 3.402823466e38f ? 1.f / s : __int_as_float(0x7fc00000);
}

// Two floats -> two e4m3 bytes (a in the low byte), round to nearest, saturating; NaN stays NaN.
__device__ __forceinline__ uint16_t pack_e4m3x2(float a, float b) {
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3));
}

// Elements [offset, offset + 2) of the output (4-byte aligned for T, 2-byte for e4m3).
template <typename T>
__device__ __forceinline__ void store_output2(void* output, int64_t offset, float a, float b, bool fp8, float q) {
  if (fp8) {
    *reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(output) + offset) = pack_e4m3x2(a * q, b * q);
  } else {
    *reinterpret_cast<uint32_t*>(static_cast<T*>(output) + offset) = Mma<T>::pack(a, b);
  }
}

// Elements [offset, offset + 4) (8-byte aligned for T, 4-byte for e4m3).
template <typename T>
__device__ __forceinline__ void store_output4(void* output, int64_t offset, float4 v, bool fp8, float q) {
  if (fp8) {
    *reinterpret_cast<uint32_t*>(static_cast<uint8_t*>(output) + offset) =
        pack_e4m3x2(v.x * q, v.y * q) | (static_cast<uint32_t>(pack_e4m3x2(v.z * q, v.w * q)) << 16);
  } else {
    *reinterpret_cast<uint2*>(static_cast<T*>(output) + offset) = make_uint2(Mma<T>::pack(v.x, v.y), Mma<T>::pack(v.z, v.w));
  }
}

// Elements [offset, offset + 8) (16-byte aligned for T, 8-byte for e4m3).
template <typename T>
__device__ __forceinline__ void store_output8(void* output, int64_t offset, const float (&v)[8], bool fp8, float q) {
  if (fp8) {
    uint2 packed;
    packed.x = pack_e4m3x2(v[0] * q, v[1] * q) | (static_cast<uint32_t>(pack_e4m3x2(v[2] * q, v[3] * q)) << 16);
    packed.y = pack_e4m3x2(v[4] * q, v[5] * q) | (static_cast<uint32_t>(pack_e4m3x2(v[6] * q, v[7] * q)) << 16);
    *reinterpret_cast<uint2*>(static_cast<uint8_t*>(output) + offset) = packed;
  } else {
    uint4 packed;
    packed.x = Mma<T>::pack(v[0], v[1]);
    packed.y = Mma<T>::pack(v[2], v[3]);
    packed.z = Mma<T>::pack(v[4], v[5]);
    packed.w = Mma<T>::pack(v[6], v[7]);
    *reinterpret_cast<uint4*>(static_cast<T*>(output) + offset) = packed;
  }
}

// Eight T values staged in shared memory (16 bytes) -> elements [offset, offset + 8): a plain copy
// for T output, a conversion for e4m3.
template <typename T>
__device__ __forceinline__ void store_output8_staged(void* output, int64_t offset, const T* staged, bool fp8, float q) {
  const uint4 raw = *reinterpret_cast<const uint4*>(staged);
  if (!fp8) {
    *reinterpret_cast<uint4*>(static_cast<T*>(output) + offset) = raw;
    return;
  }
  const T* e = reinterpret_cast<const T*>(&raw);
  float v[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = to_f32<T>(e[i]);
  store_output8<T>(output, offset, v, true, q);
}

}  // namespace pagedattn::cuda
