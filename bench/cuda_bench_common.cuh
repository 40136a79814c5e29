// Shared by the CUDA benchmark programs (cuda_attention_bench, cuda_mla_bench): error check,
// random device fill, event timing (median of 5) and the measured ceilings every row is reported
// against. Each program is one translation unit that includes this once.
#pragma once

#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "pagedattn/device.h"
#include "pagedattn/dtype.h"

namespace {

using namespace pagedattn;

#define BENCH_CUDA(expr)                                                                       \
  do {                                                                                         \
    const cudaError_t _s = (expr);                                                             \
    if (_s != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(_s)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// A 4-d tensor map over 16-bit elements for the probes that copy with TMA (sm_stream_probe,
// mla_wgmma_probe): dims innermost first, byte strides of dims 1-3, boxes of `box` elements, the
// 128-byte swizzle of their shared tiles. cuTensorMapEncodeTiled is looked up through the runtime
// (no link against the driver library); a failure ends the program.
[[maybe_unused]] CUtensorMap tensor_map_4d_u16(const void* base, const cuuint64_t (&dims)[4],
                                               const cuuint64_t (&strides)[3], const cuuint32_t (&box)[4]) {
  using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
  BENCH_CUDA(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
#else
  BENCH_CUDA(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q));
#endif
  CUtensorMap m;
  const cuuint32_t es[4] = {1, 1, 1, 1};
  const CUresult r = reinterpret_cast<EncodeTiled>(fn)(
      &m, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(base), dims, strides, box, es,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r));
    std::exit(1);
  }
  return m;
}

// Fills `bytes` with random values of `dtype` (bf16 in [-1, 1); fp8: finite random bytes).
__global__ void fill_random(uint8_t* data, size_t count, int dtype_code, uint64_t seed) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    if (dtype_code == 0) {  // bf16
      const float v = static_cast<float>(x & 0xffffff) / 8388608.f - 1.f;
      reinterpret_cast<__nv_bfloat16*>(data)[i] = __float2bfloat16(v);
    } else {  // fp8 e4m3: exponent <= 8 (|v| < 2), never NaN
      data[i] = static_cast<uint8_t>((x & 0x80) | ((x >> 8) % 0x48));
    }
  }
}

void fill(void* data, size_t count, DType dtype, uint64_t seed) {
  fill_random<<<1024, 256>>>(static_cast<uint8_t*>(data), count, dtype == DType::bf16 ? 0 : 1, seed);
  BENCH_CUDA(cudaGetLastError());
}

struct Ceilings {
  double copy_tbps = 0;     // bytes read + written per second / 1e12
  double gemm_tflops = 0;   // cuBLAS bf16 8192^3
};

float time_events(const std::function<void()>& body, int iters) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> samples;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(a, static_cast<cudaStream_t>(current_cuda_stream()));
    for (int i = 0; i < iters; ++i) body();
    cudaEventRecord(b, static_cast<cudaStream_t>(current_cuda_stream()));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    samples.push_back(ms / iters);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// Device copy (read + written bytes, 2 GiB) and cuBLAS bf16 GEMM (8192^3) rates.
Ceilings measure_ceilings() {
  Ceilings c;
  const size_t bytes = size_t{2} << 30;
  void *src = nullptr, *dst = nullptr;
  BENCH_CUDA(cudaMalloc(&src, bytes));
  BENCH_CUDA(cudaMalloc(&dst, bytes));
  fill(src, bytes / 2, DType::bf16, 1);
  for (int i = 0; i < 3; ++i) cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice);
  const float ms = time_events([&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice); }, 10);
  c.copy_tbps = 2.0 * bytes / (ms * 1e-3) / 1e12;
  cudaFree(src);
  cudaFree(dst);

  const int n = 8192;
  void *a = nullptr, *b = nullptr, *out = nullptr;
  BENCH_CUDA(cudaMalloc(&a, size_t{2} * n * n));
  BENCH_CUDA(cudaMalloc(&b, size_t{2} * n * n));
  BENCH_CUDA(cudaMalloc(&out, size_t{2} * n * n));
  fill(a, size_t{n} * n, DType::bf16, 2);
  fill(b, size_t{n} * n, DType::bf16, 3);
  cublasHandle_t handle;
  cublasCreate(&handle);
  const float alpha = 1.f, beta = 0.f;
  auto gemm = [&] {
    cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &beta,
                 out, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  for (int i = 0; i < 3; ++i) gemm();
  const float gms = time_events(gemm, 10);
  c.gemm_tflops = 2.0 * n * double(n) * n / (gms * 1e-3) / 1e12;
  cublasDestroy(handle);
  cudaFree(a);
  cudaFree(b);
  cudaFree(out);
  return c;
}

}  // namespace
