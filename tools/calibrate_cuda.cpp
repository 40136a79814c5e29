// GPU calibration (built only with CUDA): device-to-device copy bandwidth and the bf16 GEMM rate
// of cuBLAS, the two ceilings an attention kernel on this GPU is measured against.
//   copy: cudaMemcpyAsync of 1 GiB, best of 10, bytes = 2 * size (read + write)
//   GEMM: 8192^3 bf16 x bf16 -> bf16 with fp32 accumulation (CUBLAS_COMPUTE_32F), best of 20,
//         FLOPs = 2 * M * N * K
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <string>

#include "calibrate.h"

namespace pagedattn::cli {

namespace {

std::string cuda_message(cudaError_t e) { return cudaGetErrorString(e); }

// Frees what it holds on every path out of measure_gpu.
struct GpuScratch {
  void* a = nullptr;
  void* b = nullptr;
  void* c = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  cublasHandle_t blas = nullptr;
  ~GpuScratch() {
    if (blas) cublasDestroy(blas);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    cudaFree(a);
    cudaFree(b);
    cudaFree(c);
  }
};

}  // namespace

int gpu_sm_count(int device_index) {
  int count = 0;
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device_index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

int64_t gpu_memory_bytes(int device_index) {
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device_index) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return static_cast<int64_t>(prop.totalGlobalMem);
}

std::optional<GpuCalibration> measure_gpu(int device_index, std::string* why) {
  auto fail = [&](const std::string& what) -> std::optional<GpuCalibration> {
    if (why) *why = what;
    return std::nullopt;
  };
  auto t0 = std::chrono::steady_clock::now();
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device_index < 0 || device_index >= count) {
    cudaGetLastError();
    return fail("CUDA device " + std::to_string(device_index) + " is not present");
  }
  cudaDeviceProp prop{};
  cudaError_t e = cudaGetDeviceProperties(&prop, device_index);
  if (e != cudaSuccess) return fail("cudaGetDeviceProperties: " + cuda_message(e));
  if ((e = cudaSetDevice(device_index)) != cudaSuccess) return fail("cudaSetDevice: " + cuda_message(e));

  GpuScratch s;
  const size_t copy_bytes = size_t{1} << 30;
  const int n = 8192;
  const size_t gemm_bytes = size_t{n} * n * 2;
  if ((e = cudaMalloc(&s.a, std::max(copy_bytes, gemm_bytes))) != cudaSuccess ||
      (e = cudaMalloc(&s.b, std::max(copy_bytes, gemm_bytes))) != cudaSuccess ||
      (e = cudaMalloc(&s.c, gemm_bytes)) != cudaSuccess) {
    return fail("cudaMalloc: " + cuda_message(e));
  }
  if ((e = cudaStreamCreate(&s.stream)) != cudaSuccess || (e = cudaEventCreate(&s.start)) != cudaSuccess ||
      (e = cudaEventCreate(&s.stop)) != cudaSuccess) {
    return fail("CUDA stream/event: " + cuda_message(e));
  }
  // 0x3F3F is bf16 ~0.75: finite, non-zero operands.
  cudaMemsetAsync(s.a, 0x3F, std::max(copy_bytes, gemm_bytes), s.stream);
  cudaMemsetAsync(s.b, 0x3F, std::max(copy_bytes, gemm_bytes), s.stream);

  auto time_ms = [&](auto&& body) -> float {
    cudaEventRecord(s.start, s.stream);
    body();
    cudaEventRecord(s.stop, s.stream);
    cudaEventSynchronize(s.stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, s.start, s.stop);
    return ms;
  };

  float best_copy = 1e30f;
  for (int rep = 0; rep < 11; ++rep) {
    float ms = time_ms([&] { cudaMemcpyAsync(s.b, s.a, copy_bytes, cudaMemcpyDeviceToDevice, s.stream); });
    if (rep > 0) best_copy = std::min(best_copy, ms);
  }
  if ((e = cudaGetLastError()) != cudaSuccess) return fail("device-to-device copy: " + cuda_message(e));

  if (cublasCreate(&s.blas) != CUBLAS_STATUS_SUCCESS) return fail("cublasCreate failed");
  cublasSetStream(s.blas, s.stream);
  const float alpha = 1.f, beta = 0.f;
  auto gemm = [&] {
    return cublasGemmEx(s.blas, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, s.a, CUDA_R_16BF, n, s.b,
                        CUDA_R_16BF, n, &beta, s.c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  for (int rep = 0; rep < 3; ++rep) {
    if (gemm() != CUBLAS_STATUS_SUCCESS) return fail("cublasGemmEx (bf16) failed");
  }
  float best_gemm = 1e30f;
  for (int rep = 0; rep < 20; ++rep) best_gemm = std::min(best_gemm, time_ms([&] { gemm(); }));
  if ((e = cudaStreamSynchronize(s.stream)) != cudaSuccess) return fail("bf16 GEMM: " + cuda_message(e));

  GpuCalibration g;
  g.device_index = device_index;
  g.name = prop.name;
  g.d2d_bandwidth = 2.0 * static_cast<double>(copy_bytes) / (best_copy * 1e-3);
  g.bf16_gemm_flops = 2.0 * n * double(n) * n / (best_gemm * 1e-3);
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  g.measured_at = buf;
  g.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return g;
}

}  // namespace pagedattn::cli
