// CPU microbenchmarks and the calibration cache (see calibrate.h).
//
// Copy bandwidth: two 128 MiB buffers (4x a large L3), each thread copies its contiguous share
// with memcpy; best of 5 repetitions after a first-touch pass; bytes = 2 * size (read + write).
// FMA (at the width of the CPU kernel path that runs): each thread keeps kFmaChains independent accumulators in vector registers and updates
// them acc = acc * a + b for a fixed number of iterations; kFmaChains >= latency x FMA ports
// (4 x 2 on current x86) keeps both pipes busy. FLOPs = 2 * lanes * chains * iterations.
// AMX: four independent 16x16 fp32 accumulator tiles fed by two A and two B bf16 tiles
// (16 x 32 each), 16*16*32*2 FLOPs per TDPBF16PS.
#include "calibrate.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#endif

#include "../src/backends/cpu/cpu_kernels.h"
#include "cli_common.h"
#include "pagedattn/device.h"
#include "pagedattn/error.h"

namespace pagedattn::cli {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// ---- copy bandwidth --------------------------------------------------------------------------
double measure_copy_bandwidth(int threads) {
  const size_t bytes = size_t{128} << 20;
  struct FreeDeleter {
    void operator()(void* p) const { std::free(p); }
  };
  std::unique_ptr<char, FreeDeleter> src(static_cast<char*>(std::aligned_alloc(4096, bytes)));
  std::unique_ptr<char, FreeDeleter> dst(static_cast<char*>(std::aligned_alloc(4096, bytes)));
  if (!src || !dst) throw Error("calibrate: cannot allocate 2 x 128 MiB for the copy benchmark");
  auto run = [&](bool first_touch) {
#pragma omp parallel num_threads(threads)
    {
      int t = omp_get_thread_num(), n = omp_get_num_threads();
      size_t begin = bytes * static_cast<size_t>(t) / static_cast<size_t>(n);
      size_t end = bytes * static_cast<size_t>(t + 1) / static_cast<size_t>(n);
      if (first_touch) {
        std::memset(src.get() + begin, t + 1, end - begin);
        std::memset(dst.get() + begin, 0, end - begin);
      } else {
        std::memcpy(dst.get() + begin, src.get() + begin, end - begin);
      }
    }
  };
  run(true);
  run(false);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = Clock::now();
    run(false);
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * static_cast<double>(bytes) / best;
}

// ---- FMA throughput --------------------------------------------------------------------------
constexpr int kFmaChains = 12;

#if defined(__x86_64__)
__attribute__((target("avx512f"))) float fma_loop_avx512(int64_t iterations) {
  __m512 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_set1_ps(0.001f * static_cast<float>(c + 1));
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i) {
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  __m512 sum = acc[0];
  for (int c = 1; c < kFmaChains; ++c) sum = _mm512_add_ps(sum, acc[c]);
  float lanes[16];
  _mm512_storeu_ps(lanes, sum);
  float total = 0;
  for (float v : lanes) total += v;
  return total;
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2(int64_t iterations) {
  __m256 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_set1_ps(0.001f * static_cast<float>(c + 1));
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (int64_t i = 0; i < iterations; ++i) {
    for (int c = 0; c < kFmaChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  __m256 sum = acc[0];
  for (int c = 1; c < kFmaChains; ++c) sum = _mm256_add_ps(sum, acc[c]);
  float lanes[8];
  _mm256_storeu_ps(lanes, sum);
  float total = 0;
  for (float v : lanes) total += v;
  return total;
}
#endif

// Portable fallback: GCC vectors of 4 floats (multiply + add where the ISA has no FMA).
float fma_loop_generic(int64_t iterations) {
  typedef float v4 __attribute__((vector_size(16)));
  v4 acc[kFmaChains];
  for (int c = 0; c < kFmaChains; ++c) {
    float s = 0.001f * static_cast<float>(c + 1);
    acc[c] = v4{s, s, s, s};
  }
  const v4 a = {0.999999f, 0.999999f, 0.999999f, 0.999999f};
  const v4 b = {1e-7f, 1e-7f, 1e-7f, 1e-7f};
  for (int64_t i = 0; i < iterations; ++i) {
    for (int c = 0; c < kFmaChains; ++c) acc[c] = acc[c] * a + b;
  }
  float total = 0;
  for (int c = 0; c < kFmaChains; ++c) total += acc[c][0] + acc[c][1] + acc[c][2] + acc[c][3];
  return total;
}

struct FmaKernel {
  const char* isa;
  int lanes;
  float (*loop)(int64_t);
};

// The FMA width of the CPU kernel path that runs (PAGEDATTN_CPU_ISA or the best the CPU has): the
// avx512f / avx512 / amx kernels compute in 16 lanes, the avx2 ones in 8, the scalar ones in the
// compiler's portable vectors.
FmaKernel pick_fma_kernel() {
#if defined(__x86_64__)
  const cpu::Isa isa = cpu::active_kernels().isa;
  if (isa == cpu::Isa::avx512 || isa == cpu::Isa::amx || isa == cpu::Isa::avx512f) {
    return {"avx512", 16, fma_loop_avx512};
  }
  if (isa == cpu::Isa::avx2) return {"avx2", 8, fma_loop_avx2};
#endif
  return {"generic", 4, fma_loop_generic};
}

// Keeps the benchmark loops' results observable, so the compiler cannot drop them.
volatile float g_benchmark_sink = 0;

// Runs `loop(iterations)` on every thread at once; returns the wall time of the slowest.
double time_parallel(int threads, float (*loop)(int64_t), int64_t iterations) {
  float total = 0;
  auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : total)
  total += loop(iterations);
  double t = seconds_since(t0);
  g_benchmark_sink = total;
  return t;
}

double measure_fma(int threads, const FmaKernel& k) {
  int64_t iterations = 1 << 16;
  // Grow until one run takes >= 60 ms, then keep the best of 3.
  double t = time_parallel(threads, k.loop, iterations);
  while (t < 0.06 && iterations < (int64_t{1} << 34)) {
    iterations *= 2;
    t = time_parallel(threads, k.loop, iterations);
  }
  for (int rep = 0; rep < 2; ++rep) t = std::min(t, time_parallel(threads, k.loop, iterations));
  double flops = 2.0 * k.lanes * kFmaChains * static_cast<double>(iterations) * threads;
  return flops / t;
}

// ---- AMX -------------------------------------------------------------------------------------
#if defined(__x86_64__)
constexpr int kXFeatureXTileData = 18;
constexpr int kArchReqXCompPerm = 0x1023;

bool cpuid_has_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return false;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  bool amx_bf16 = (edx >> 22) & 1u, amx_tile = (edx >> 24) & 1u;
  return amx_bf16 && amx_tile;
}

bool os_grants_amx() {
  // Linux >= 5.16: the tile data state must be requested per process.
  return syscall(SYS_arch_prctl, kArchReqXCompPerm, kXFeatureXTileData) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) float amx_loop(int64_t iterations) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;  // 16 fp32 (C) or 32 bf16 (A, B) per row
    config.rows[t] = 16;
  }
  alignas(64) uint16_t ab[2][16 * 32];  // bf16 values near 1e-2
  for (int m = 0; m < 2; ++m) {
    for (int i = 0; i < 16 * 32; ++i) ab[m][i] = static_cast<uint16_t>(0x3C23 + (i % 7));
  }
  alignas(64) float c[16 * 16];
  _tile_loadconfig(&config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ab[0], 64);
  _tile_loadd(5, ab[1], 64);
  _tile_loadd(6, ab[0], 64);
  _tile_loadd(7, ab[1], 64);
  for (int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0];
}

double measure_amx(int threads) {
  int64_t iterations = 1 << 12;
  double t = time_parallel(threads, amx_loop, iterations);
  while (t < 0.06 && iterations < (int64_t{1} << 34)) {
    iterations *= 2;
    t = time_parallel(threads, amx_loop, iterations);
  }
  for (int rep = 0; rep < 2; ++rep) t = std::min(t, time_parallel(threads, amx_loop, iterations));
  double flops = 4.0 * 16 * 16 * 32 * 2 * static_cast<double>(iterations) * threads;
  return flops / t;
}
#endif

}  // namespace

std::string cpu_model_name() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      size_t colon = line.find(':');
      if (colon != std::string::npos) {
        std::string name = line.substr(colon + 1);
        size_t b = name.find_first_not_of(" \t");
        return b == std::string::npos ? "unknown CPU" : name.substr(b);
      }
    }
  }
  return "unknown CPU";
}

bool cpu_has_amx() {
#if defined(__x86_64__)
  static const bool has = cpuid_has_amx() && os_grants_amx();
  return has;
#else
  return false;
#endif
}

CpuCalibration measure_cpu(int threads) {
  if (threads < 1) threads = omp_get_max_threads();
  auto t0 = Clock::now();
  CpuCalibration c;
  c.cpu_model = cpu_model_name();
  c.threads = threads;
  c.copy_bandwidth = measure_copy_bandwidth(threads);
  FmaKernel k = pick_fma_kernel();
  c.fma_isa = k.isa;
  c.fma_flops = measure_fma(threads, k);
  c.amx_present = cpu_has_amx();
#if defined(__x86_64__)
  if (c.amx_present) c.amx_bf16_flops = measure_amx(threads);
#endif
  c.measured_at = utc_now();
  c.seconds = seconds_since(t0);
  return c;
}

std::string calibration_path() {
  if (const char* env = std::getenv("PAGEDATTN_CALIBRATION"); env && *env) return env;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    return std::string(xdg) + "/pagedattn/calibration.json";
  }
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/pagedattn/calibration.json";
}

namespace {

using nlohmann::json;

json load_cache() {
  std::ifstream in(calibration_path());
  if (!in) return json::object();
  try {
    json j = json::parse(in);
    if (j.is_object() && j.value("version", 0) == 1) return j;
  } catch (const json::exception&) {
    // An unreadable cache is measured again and overwritten.
  }
  return json::object();
}

void save_cache(json j) {
  j["version"] = 1;
  std::filesystem::path path(calibration_path());
  std::error_code ec;
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path(), ec);
  // Write then rename, so that a concurrent reader never sees half a file.
  std::filesystem::path tmp = path;
  tmp += ".tmp" + std::to_string(getpid());
  {
    std::ofstream out(tmp);
    if (!out) throw Error("PAGEDATTN_CALIBRATION", "calibrate: cannot write the calibration cache " + tmp.string());
    out << j.dump(2) << '\n';
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) throw Error("PAGEDATTN_CALIBRATION", "calibrate: cannot write the calibration cache " + path.string() + ": " + ec.message());
}

// The kernel path is part of the key: its FMA width is what the entry measured.
std::string cpu_key(const std::string& model, int threads) {
  return "cpu|" + model + "|threads=" + std::to_string(threads) + "|path=" +
         cpu::active_kernels().name;
}
std::string gpu_key(int index, const std::string& name) { return "cuda|" + std::to_string(index) + "|" + name; }

json to_json(const CpuCalibration& c) {
  return json{{"device", "cpu"},
              {"cpu_model", c.cpu_model},
              {"threads", c.threads},
              {"copy_bandwidth_bytes_per_s", c.copy_bandwidth},
              {"fma_fp32_flop_per_s", c.fma_flops},
              {"fma_isa", c.fma_isa},
              {"amx", c.amx_present ? "present" : "absent"},
              {"amx_bf16_flop_per_s", c.amx_bf16_flops},
              {"measured_at", c.measured_at},
              {"seconds", c.seconds}};
}

std::optional<CpuCalibration> cpu_from_json(const json& j) {
  try {
    CpuCalibration c;
    c.cpu_model = j.at("cpu_model").get<std::string>();
    c.threads = j.at("threads").get<int>();
    c.copy_bandwidth = j.at("copy_bandwidth_bytes_per_s").get<double>();
    c.fma_flops = j.at("fma_fp32_flop_per_s").get<double>();
    c.fma_isa = j.at("fma_isa").get<std::string>();
    c.amx_present = j.at("amx").get<std::string>() == "present";
    c.amx_bf16_flops = j.at("amx_bf16_flop_per_s").get<double>();
    c.measured_at = j.at("measured_at").get<std::string>();
    c.seconds = j.value("seconds", 0.0);
    if (c.copy_bandwidth <= 0 || c.fma_flops <= 0) return std::nullopt;
    return c;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

json to_json(const GpuCalibration& g) {
  return json{{"device", "cuda"},
              {"device_index", g.device_index},
              {"name", g.name},
              {"d2d_bandwidth_bytes_per_s", g.d2d_bandwidth},
              {"bf16_gemm_flop_per_s", g.bf16_gemm_flops},
              {"measured_at", g.measured_at},
              {"seconds", g.seconds}};
}

std::optional<GpuCalibration> gpu_from_json(const json& j) {
  try {
    GpuCalibration g;
    g.device_index = j.at("device_index").get<int>();
    g.name = j.at("name").get<std::string>();
    g.d2d_bandwidth = j.at("d2d_bandwidth_bytes_per_s").get<double>();
    g.bf16_gemm_flops = j.at("bf16_gemm_flop_per_s").get<double>();
    g.measured_at = j.at("measured_at").get<std::string>();
    g.seconds = j.value("seconds", 0.0);
    if (g.d2d_bandwidth <= 0 || g.bf16_gemm_flops <= 0) return std::nullopt;
    return g;
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

}  // namespace

CpuCalibration cpu_calibration(int threads, bool force, std::ostream* log) {
  if (threads < 1) threads = omp_get_max_threads();
  std::string key = cpu_key(cpu_model_name(), threads);
  json cache = load_cache();
  if (!force && cache.contains("entries") && cache["entries"].contains(key)) {
    if (auto c = cpu_from_json(cache["entries"][key])) return *c;
  }
  if (log) *log << "pagedattn: calibrating the CPU (" << threads << " threads; cached in " << calibration_path() << ")\n";
  CpuCalibration c = measure_cpu(threads);
  cache = load_cache();  // re-read: another process may have added entries meanwhile
  cache["entries"][key] = to_json(c);
  save_cache(cache);
  return c;
}

std::optional<GpuCalibration> gpu_calibration(int device_index, bool force, std::ostream* log, std::string* why) {
  std::string probe_why;
  if (!built_with_cuda()) {
    if (why) *why = "this pagedattn was built without CUDA";
    return std::nullopt;
  }
  if (device_index < 0 || device_index >= cuda_device_count()) {
    if (why) *why = "CUDA device " + std::to_string(device_index) + " is not present (" +
                    std::to_string(cuda_device_count()) + " visible)";
    return std::nullopt;
  }
  json cache = load_cache();
  if (!force && cache.contains("entries")) {
    for (auto& [key, entry] : cache["entries"].items()) {
      if (key.rfind("cuda|" + std::to_string(device_index) + "|", 0) != 0) continue;
      if (auto g = gpu_from_json(entry)) return g;
    }
  }
  if (log) *log << "pagedattn: calibrating CUDA device " << device_index << " (cached in " << calibration_path() << ")\n";
  std::optional<GpuCalibration> g = measure_gpu(device_index, why);
  if (!g) return g;
  cache = load_cache();
  if (cache.contains("entries")) {  // one entry per device index
    std::vector<std::string> stale;
    for (auto& [key, entry] : cache["entries"].items()) {
      if (key.rfind("cuda|" + std::to_string(device_index) + "|", 0) == 0) stale.push_back(key);
    }
    for (const auto& k : stale) cache["entries"].erase(k);
  }
  cache["entries"][gpu_key(device_index, g->name)] = to_json(*g);
  save_cache(cache);
  return g;
}

MachinePeaks machine_peaks(Device device, DType dtype, int threads, std::ostream* log) {
  MachinePeaks p;
  if (device == Device::cuda) {
    std::string why;
    std::optional<GpuCalibration> g = gpu_calibration(0, false, log, &why);
    if (!g) throw Error("device", "cannot measure the CUDA peaks: " + why);
    p.bandwidth = g->d2d_bandwidth;
    p.flops = g->bf16_gemm_flops;
    p.bandwidth_source = g->name + " device-to-device copy";
    p.flops_source = g->name + " cuBLAS bf16 GEMM";
    return p;
  }
  CpuCalibration c = cpu_calibration(threads, false, log);
  p.bandwidth = c.copy_bandwidth;
  p.bandwidth_source = "CPU copy, " + std::to_string(c.threads) + " threads";
  if (dtype == DType::bf16 && c.amx_present && c.amx_bf16_flops > c.fma_flops) {
    p.flops = c.amx_bf16_flops;
    p.flops_source = "CPU AMX bf16, " + std::to_string(c.threads) + " threads";
  } else {
    p.flops = c.fma_flops;
    p.flops_source = "CPU fp32 FMA " + c.fma_isa + ", " + std::to_string(c.threads) + " threads";
  }
  return p;
}

}  // namespace pagedattn::cli
