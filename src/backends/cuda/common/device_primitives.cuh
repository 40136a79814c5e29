// Device primitives of the CUDA backends' kernels: tensor-core MMA (mma.sync m16n8k16, f32
// accumulate), ldmatrix, fast exp2, and exact conversions of 16-bit and fp8 values. sm_80+ (fp8
// hardware conversions on sm_89+, exact software otherwise). The asynchronous units (cp.async,
// TMA, mbarriers, wgmma, named barriers) are wrapped in async_primitives.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace pagedattn::cuda {

// ---- element types --------------------------------------------------------------------------
template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  // D (16x8 f32) += A (16x16 f16, row) * B (16x8 f16, col)
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Two floats -> packed pair, round to nearest even (low half = first).
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

// ---- shared memory (the asynchronous copies: async_primitives.cuh) ------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}

// ---- math -----------------------------------------------------------------------------------
// 2^x (ex2.approx: relative error ~2^-22; -inf -> 0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe, for exponentials beside fast_exp2's (the multi-function unit runs 16 a clock
// an SM, a quarter of the FMA pipe's rate): x = n + f with n = floor(x), f in [0, 1); 2^f by a cubic
// (minimax relative error 8.6e-5 on [0, 1), p(0) = 1, below the 16-bit P's rounding), times 2^n
// built in the exponent field. x is clamped at -127 (2^n then 0); NaN stays NaN (max.NaN, and
// NaN times the scale). For softmax arguments: x <= 0 (up to rounding).
__device__ __forceinline__ float fma_exp2(float x) {
  constexpr float kShift = 12582912.f + 127.f;  // 1.5 * 2^23 + the exponent bias
  float xc, r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(xc) : "f"(x), "f"(-127.f));
  asm("add.rm.f32 %0, %1, %2;\n" : "=f"(r) : "f"(xc), "f"(kShift));  // low bits: n + 127
  const float f = xc - (r - kShift);
  const float poly = fmaf(fmaf(fmaf(0.077067042f, f, 0.227644991f), f, 0.695116786f), f, 1.f);
  return poly * __int_as_float(__float_as_int(r) << 23);
}

// Programmatic dependent launch (sm_90+; no-ops below it and for a grid launched without the
// attribute): a kernel lets the grid launched after it with programmatic stream serialization be
// scheduled (launch_dependents: one thread of each CTA suffices), and that grid waits for the
// whole kernel before it reads what the kernel wrote (wait_for_prerequisites: every write of the
// prerequisite grid is visible after it).
namespace pdl {
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
}  // namespace pdl

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
__device__ __forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// The natural-log LSE of a softmax row, -inf when it has no mass (sum 0: no visible key) and NaN
// when its sum is NaN (a NaN logit: the row is NaN, as REFERENCE; `sum > 0` would read it as
// empty). Base 2: the state (m, l) with l = sum 2^(s - m) (kFast: __log2f); natural: base + log
// of a sum of e^(lse_i - base).
template <bool kFast = false>
__device__ __forceinline__ float lse_base2(float m, float l) {
  return !(l <= 0.f) ? (m + (kFast ? __log2f(l) : log2f(l))) * kLn2 : neg_inf();
}
__device__ __forceinline__ float lse_natural(float base, float sum) {
  return !(sum <= 0.f) ? base + logf(sum) : neg_inf();
}

// One element of T (float, __half, __nv_bfloat16, __nv_fp8_e4m3, __nv_fp8_e5m2) -> float, exact.
template <typename T>
__device__ __forceinline__ float to_f32(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.__x, __NV_E4M3)));
  } else {
    static_assert(std::is_same_v<T, __nv_fp8_e5m2>);
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.__x, __NV_E5M2)));
  }
}

// ---- fp8 -> 16-bit (exact: every e4m3 / e5m2 value is representable in f16 and bf16) -------
// Two fp8 bytes (low byte = first element) -> two floats.
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t bits, int format) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h2;
  if (format == 1) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(bits));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(h2) : "h"(bits));
  }
  __half2 h = *reinterpret_cast<__half2*>(&h2);
  return __half22float2(h);
#else
  float out[2];
  for (int i = 0; i < 2; ++i) {
    const uint32_t b = (bits >> (8 * i)) & 0xffu;
    const uint32_t sign = (b & 0x80u) << 24;
    float v;
    if (format == 1) {  // e4m3: bias 7, no inf, 0x7f / 0xff = NaN
      if ((b & 0x7fu) == 0x7fu) {
        v = __int_as_float(0x7fc00000);
      } else {
        // Place exponent and mantissa in a float's low exponent bits, then rescale by 2^120:
        // exact for normals and subnormals alike.
        v = __int_as_float(static_cast<int>(((b & 0x7fu) << 20))) * 1.329227995784916e36f;
      }
    } else {  // e5m2: f16's top byte
      v = __half2float(__ushort_as_half(static_cast<unsigned short>((b & 0x7fu) << 8)));
    }
    out[i] = __int_as_float(__float_as_int(v) | static_cast<int>(sign));
  }
  return make_float2(out[0], out[1]);
#endif
}

// 4 fp8 values (one word, first value in the lowest byte) -> 4 values of T as two 16-bit pairs
// (x: values 0, 1; y: values 2, 3; the first of a pair in the low half).
template <typename T>
__device__ __forceinline__ uint2 fp8x4_to_16bit(uint32_t word, int format) {
  const uint16_t lo = static_cast<uint16_t>(word & 0xffffu);
  const uint16_t hi = static_cast<uint16_t>(word >> 16);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (std::is_same_v<T, __half>) {
    uint2 out;
    if (format == 1) {
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out.x) : "h"(lo));
      asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(out.y) : "h"(hi));
    } else {
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(out.x) : "h"(lo));
      asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(out.y) : "h"(hi));
    }
    return out;
  }
#endif
  const float2 a = fp8x2_to_float2(lo, format);
  const float2 b = fp8x2_to_float2(hi, format);
  return make_uint2(Mma<T>::pack(a.x, a.y), Mma<T>::pack(b.x, b.y));  // exact: fp8 values fit T
}

// 4 fp8 values of a format known at compile time (1: e4m3, 2: e5m2) -> 4 f16 values as two pairs
// (x: values 0, 1; y: values 2, 3). sm_89+: two cvt.rn.f16x2.{e4m3,e5m2}x2, the second on the
// word's high half (F2FP ... R.H1 in SASS: no shift); exact.
template <int kFormat>
__device__ __forceinline__ uint2 fp8x4_to_f16x4(uint32_t word) {
  static_assert(kFormat == 1 || kFormat == 2);
  uint2 out;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if constexpr (kFormat == 1) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(out.x), "=r"(out.y)
        : "r"(word));
  } else {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e5m2x2 %0, lo;\n cvt.rn.f16x2.e5m2x2 %1, hi;\n}\n"
        : "=r"(out.x), "=r"(out.y)
        : "r"(word));
  }
#else
  out = fp8x4_to_16bit<__half>(word, kFormat);
#endif
  return out;
}

// 8 fp8 values (one uint2, first value in the lowest byte) -> 8 values of T (one uint4).
template <typename T>
__device__ __forceinline__ uint4 fp8x8_to_16bit(const uint2& in, int format) {
  const uint2 a = fp8x4_to_16bit<T>(in.x, format);
  const uint2 b = fp8x4_to_16bit<T>(in.y, format);
  return make_uint4(a.x, a.y, b.x, b.y);
}

}  // namespace pagedattn::cuda
