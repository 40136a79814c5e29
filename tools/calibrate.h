// `pagedattn calibrate`: measures this machine's peaks once and caches them, so reports can
// say what fraction of the machine a run achieved. Never a hard-coded peak.
//
// CPU (OpenMP over the threads in use):
//   copy bandwidth   parallel memcpy of two 128 MiB buffers, bytes read + bytes written / time
//   FMA throughput   independent chains of fused multiply-adds in registers, fp32 FLOP/s
//                    (AVX-512 when the CPU has it, else AVX2+FMA, else portable vectors)
//   AMX throughput   bf16 tile dot products (TDPBF16PS) when the CPU and the OS support AMX;
//                    "absent" otherwise
// GPU (built with CUDA and a device present): a device-to-device copy and a cuBLAS bf16 GEMM.
//
// Cache: JSON at $PAGEDATTN_CALIBRATION, else ~/.cache/pagedattn/calibration.json, one entry per
// (CPU model, thread count) and per GPU (index, name).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>

#include "pagedattn/dtype.h"

namespace pagedattn::cli {

struct CpuCalibration {
  std::string cpu_model;
  int threads = 0;
  double copy_bandwidth = 0;     // bytes/s (read + write)
  double fma_flops = 0;          // fp32 FLOP/s over all threads
  std::string fma_isa;           // "avx512", "avx2", "generic": the CPU kernel path's width
  bool amx_present = false;
  double amx_bf16_flops = 0;     // bf16 FLOP/s (0 when absent)
  std::string measured_at;       // ISO-8601 UTC
  double seconds = 0;            // time the measurement took
};

struct GpuCalibration {
  int device_index = 0;
  std::string name;
  double d2d_bandwidth = 0;      // bytes/s (read + write)
  double bf16_gemm_flops = 0;    // FLOP/s of a large cuBLAS bf16 GEMM
  std::string measured_at;
  double seconds = 0;
};

// The roofline a report divides by.
struct MachinePeaks {
  double bandwidth = 0;          // bytes/s
  double flops = 0;              // FLOP/s
  std::string bandwidth_source;  // "CPU copy, 2 threads"
  std::string flops_source;      // "CPU fp32 FMA avx512, 2 threads"
};

std::string cpu_model_name();
bool cpu_has_amx();              // CPUID AMX-TILE + AMX-BF16 and the OS grants the tile state

CpuCalibration measure_cpu(int threads);
// Without CUDA (or without a device) returns nullopt; `why` says why.
std::optional<GpuCalibration> measure_gpu(int device_index, std::string* why = nullptr);

// Streaming multiprocessors of a CUDA device (0 without CUDA or without that device).
int gpu_sm_count(int device_index);
// Bytes of memory of a CUDA device (0 without CUDA or without that device).
int64_t gpu_memory_bytes(int device_index);

std::string calibration_path();

// Cached measurement, measured (and cached) when missing or when `force`. `log` (may be null)
// gets one line when a measurement runs.
CpuCalibration cpu_calibration(int threads, bool force, std::ostream* log);
std::optional<GpuCalibration> gpu_calibration(int device_index, bool force, std::ostream* log,
                                              std::string* why = nullptr);

// Peaks for work of `dtype` on `device` with `threads` CPU threads (CPU: AMX for bf16 when
// present, else fp32 FMA; GPU: bf16 GEMM). Throws Error when a CUDA peak cannot be measured.
MachinePeaks machine_peaks(Device device, DType dtype, int threads, std::ostream* log);

}  // namespace pagedattn::cli
