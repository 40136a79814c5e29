// Benchmarks of the CPU backend (Google Benchmark). Every row reports, besides the time:
//   GFLOP/s   4 * (visible keys) * D * Hq per token (Q·Kᵀ and P·V, causal keys only)
//   GB/s      K/V bytes read (each visible page once per (request, kv head)) + Q + O, over time
//   floor%    the roofline floor max(bytes / copy_bw, flops / peak) over the measured time,
//             with copy_bw and peak measured by this program (Peak/* rows, same run):
//               Peak/copy_bandwidth  STREAM-copy convention: (read + write bytes) / time
//               Peak/read_bandwidth  read-only streaming (the access pattern of decode)
//               Peak/paged_read      loads-only read of the Decode/16x4k cache in its page
//                                    order (whole pages, K then V; the best of passes with the
//                                    pages two ahead prefetched and passes without): the floor
//                                    of a scattered decode read (paged_read% below)
//               Peak/paged_read_fp8  the same probe on the Decode/16x4k_fp8 cache (1-byte
//                                    elements: pages half the size; paged_read% of fp8 rows)
//               Peak/fma_f32         f32 FMA rate at the width of the path that runs (8 lanes on
//                                    avx2 / scalar, 16 on avx512f / avx512 / amx), all threads
//               Peak/dpbf16          vdpbf16ps rate (AVX-512 BF16, all threads; only where the
//                                    CPU has it)
//               Peak/amx_bf16        tdpbf16ps rate (AMX-BF16 tiles, all threads; only where the
//                                    amx path can run; the floor of amx rows uses it)
//   paged_read%  GB/s over Peak/paged_read (decode rows: how close to the paged-read floor)
//   The compute peak of a row is the path's: AMX tiles on amx, vdpbf16ps for bf16 activations on
//   avx512, else the f32 FMA rate.
//   path      the kernel path (PAGEDATTN_CPU_ISA or the best)
// Shapes: Llama-3-8B attention (Hq 32, Hkv 8, D 128, bf16 unless _f16, block 16, NHD, shuffled
// pages; _fp8: bf16 activations over an fp8 e4m3 cache, kv_cache_dtype "fp8_e4m3", scales 1,
// random finite codes of magnitude < 1).
//   Prefill/…    1x2048 and 4x1024 new tokens, causal, no context
//   Decode/B/C   batch B (1, 16, 64) x context C (1k, 4k, 16k), one new token each
//   Mixed        one 512-token chunk over 1536 cached + 32 decodes over 2k
//   Decode/128x4k, Prefill/4x4096   the batch-invariance cost shapes (issue 21; A/B with
//                PAGEDATTN_BATCH_INVARIANT=1, docs/perf/cpu.md)
//   DecodeKernels/B x C   the direct decode kernel and the tile kernel alternating on one batch
//                (medians of the rounds: direct_GB/s, tile_GB/s, direct/tile)
//   Reference/…  the REFERENCE backend (fp64, naive) on reduced sizes (it is ~1000x slower)
//   DecodeShape/BxC[:fp8|:f16]   extra decode rows named in PAGEDATTN_BENCH_DECODE (e.g.
//                "1x63,4x4095:fp8"; C = cached keys, one new token each): cache-resident shapes
//                beside the DRAM rows, to separate a kernel's compute from its memory
// Run: build/…/bench/cpu_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../src/backends/cpu/cpu_backend.h"
#include "../src/backends/cpu/cpu_kernels.h"
#include "pagedattn/pagedattn.h"
#include "cpu_peaks.h"

namespace pagedattn {
namespace {
using namespace pagedattn::bench;  // cpu_peaks.h

// ---- measured peaks -------------------------------------------------------------------------
struct Peaks {
  double copy_gbs = 0, read_gbs = 0, paged_read_gbs = 0, paged_read_fp8_gbs = 0, fma_gflops = 0,
         dpbf16_gflops = 0, amx_gflops = 0;
};
Peaks g_peaks;

enum class PeakKind { copy, read, paged_read, paged_read_fp8, fma, dpbf16, amx };

double measure_paged_read(DType kv_dtype);  // below (needs the decode step)

void BM_Peak(benchmark::State& state, PeakKind which) {
  double value = 0;
  const cpu::Isa isa = cpu::active_kernels().isa;
  const bool wide = isa == cpu::Isa::avx512 || isa == cpu::Isa::amx || isa == cpu::Isa::avx512f;
  for (auto _ : state) {
    switch (which) {
      case PeakKind::copy: value = g_peaks.copy_gbs = measure_bandwidth_gbs(false); break;
      case PeakKind::read: value = g_peaks.read_gbs = measure_bandwidth_gbs(true); break;
      case PeakKind::paged_read:
        value = g_peaks.paged_read_gbs = measure_paged_read(DType::bf16);
        break;
      case PeakKind::paged_read_fp8:
        value = g_peaks.paged_read_fp8_gbs = measure_paged_read(DType::fp8_e4m3);
        break;
      case PeakKind::fma: value = g_peaks.fma_gflops = measure_fma_gflops(wide ? 16 : 8); break;
      case PeakKind::dpbf16: value = g_peaks.dpbf16_gflops = measure_dpbf16_gflops(); break;
      case PeakKind::amx: value = g_peaks.amx_gflops = measure_amx_gflops(); break;
    }
  }
  const bool bandwidth =
      which == PeakKind::copy || which == PeakKind::read || which == PeakKind::paged_read ||
      which == PeakKind::paged_read_fp8;
  state.counters[bandwidth ? "GB/s" : "GFLOP/s"] = value;
  state.counters["threads"] = omp_get_max_threads();
  if (which == PeakKind::fma) state.SetLabel(wide ? "16 lanes" : "8 lanes");
}

// ---- one attention step -----------------------------------------------------------------------
struct RequestShape {
  int context = 0;
  int query = 0;
};

struct AttentionStep {
  std::unique_ptr<AttentionImpl> impl;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  Tensor cache, query, output;
  OwnedCommonAttentionMetadata common;
  std::shared_ptr<const AttentionMetadata> metadata;
  LayerScales scales;
  DType dtype = DType::bf16;     // activations
  DType kv_dtype = DType::bf16;  // cache storage
  double flops = 0, bytes = 0;

  void run() {
    impl->forward(scales, query, TensorView{}, TensorView{}, cache, *metadata, output);
  }
};

constexpr int kHq = 32, kHkv = 8, kD = 128, kBlock = 16;

// Fills an fp8 e4m3 tensor with random finite codes of magnitude < 1 (exponent field < 7).
void fill_random_e4m3(Tensor& t, uint64_t seed) {
  std::vector<uint8_t> pattern(size_t{1} << 20);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (auto& v : pattern) {
    const uint32_t x = rng();
    v = static_cast<uint8_t>((x & 0x80) | ((x >> 8) % 0x38));
  }
  auto* data = static_cast<uint8_t*>(t.data());
  const size_t n = t.nbytes();
  for (size_t begin = 0; begin < n; begin += pattern.size()) {
    std::memcpy(data + begin, pattern.data(), std::min(pattern.size(), n - begin));
  }
}

// Fills a 16-bit float tensor with a repeated 1 MiB block of random values in [-1, 1).
void fill_random(Tensor& t, uint64_t seed) {
  if (t.dtype() == DType::fp8_e4m3) {
    fill_random_e4m3(t, seed);
    return;
  }
  const size_t pattern_elems = size_t{1} << 19;
  std::vector<uint16_t> pattern(pattern_elems);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (auto& v : pattern) {
    v = t.dtype() == DType::f16 ? f32_to_f16_bits(dist(rng)) : f32_to_bf16_bits(dist(rng));
  }
  auto* data = static_cast<uint16_t*>(t.data());
  const size_t n = t.nbytes() / 2;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < static_cast<int64_t>((n + pattern_elems - 1) / pattern_elems); ++i) {
    const size_t begin = static_cast<size_t>(i) * pattern_elems;
    std::memcpy(data + begin, pattern.data(), std::min(pattern_elems, n - begin) * 2);
  }
}

std::unique_ptr<AttentionStep> make_step(const AttentionBackend& backend,
                                         const std::vector<RequestShape>& batch,
                                         DType dtype = DType::bf16, DType kv_dtype = DType::bf16) {
  auto step = std::make_unique<AttentionStep>();
  if (kv_dtype == DType::bf16) kv_dtype = dtype;  // "auto": the activation dtype
  step->dtype = dtype;
  step->kv_dtype = kv_dtype;
  AttentionImplParams params;
  params.num_heads = kHq;
  params.num_kv_heads = kHkv;
  params.head_size = kD;
  params.scale = 1.f / std::sqrt(static_cast<float>(kD));
  params.dtype = dtype;
  if (kv_dtype == DType::fp8_e4m3) params.kv_cache_dtype = "fp8_e4m3";
  params.block_size = kBlock;
  step->impl = backend.make_impl(params);

  int num_tokens = 0, max_seq = 1, total_blocks = 0, cols = 1;
  for (const RequestShape& r : batch) {
    num_tokens += r.query;
    const int seq = r.context + r.query;
    max_seq = std::max(max_seq, seq);
    total_blocks += (seq + kBlock - 1) / kBlock;
    cols = std::max(cols, (seq + kBlock - 1) / kBlock);
  }
  BuilderConfig config;
  config.num_heads = kHq;
  config.num_kv_heads = kHkv;
  config.head_size = kD;
  config.head_size_v = kD;
  config.max_num_seqs = std::max<int>(256, static_cast<int>(batch.size()));
  config.max_num_batched_tokens = std::max(8192, num_tokens);
  config.max_model_len = std::max(max_seq, 8192);
  step->builder = backend.make_builder(
      KVCacheSpec::full_attention(kBlock, kHkv, kD, kv_dtype), config, Device::cpu);

  step->cache = backend.allocate_kv_cache(total_blocks, kBlock, kHkv, kD, kv_dtype, Device::cpu);
  // The cache (>= 32 MiB) is on transparent huge pages: the host allocator advises them.
  fill_random(step->cache, 1);
  std::vector<int32_t> block_ids(total_blocks);
  std::iota(block_ids.begin(), block_ids.end(), 0);
  std::shuffle(block_ids.begin(), block_ids.end(), std::mt19937(7));

  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  args.max_num_blocks_per_req = cols;
  size_t next = 0;
  for (const RequestShape& r : batch) {
    const int seq = r.context + r.query;
    args.query_start_loc.push_back(args.query_start_loc.back() + r.query);
    args.seq_lens.push_back(seq);
    const int used = (seq + kBlock - 1) / kBlock;
    for (int c = 0; c < cols; ++c) args.block_table.push_back(c < used ? block_ids[next + c] : 0);
    next += used;
    for (int i = 0; i < r.query; ++i) args.slot_mapping.push_back(-1);
    // visible keys: causal, no window
    for (int i = 0; i < r.query; ++i) {
      const double keys = r.context + i + 1;
      step->flops += 4.0 * keys * kD * kHq;
    }
    // K and V, read once per (request, kv head)
    step->bytes += 2.0 * seq * kHkv * kD * static_cast<double>(dtype_size(kv_dtype));
  }
  step->bytes += 2.0 * num_tokens * kHq * kD * static_cast<double>(dtype_size(dtype));  // Q, O
  step->common = make_common_attention_metadata(args, Device::cpu, total_blocks, kBlock);
  step->metadata = step->builder->build(0, step->common.common);
  step->query = Tensor(Shape{num_tokens, kHq, kD}, dtype);
  fill_random(step->query, 2);
  step->output = Tensor(Shape{num_tokens, kHq, kD}, dtype);
  return step;
}

void report(benchmark::State& state, const AttentionStep& step, const char* path) {
  const double iterations = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] =
      benchmark::Counter(step.flops * iterations / 1e9, benchmark::Counter::kIsRate);
  state.counters["GB/s"] = benchmark::Counter(step.bytes * iterations / 1e9, benchmark::Counter::kIsRate);
  state.SetLabel(path);
  // The compute peak of the path that ran: AMX tiles on amx, vdpbf16ps for bf16 activations on
  // avx512 (Precision::bf16_dot), else the f32 FMA rate at the path's width.
  const cpu::KernelTable& kernels = cpu::active_kernels();
  double peak_gflops = g_peaks.fma_gflops;
  if (kernels.isa == cpu::Isa::amx && g_peaks.amx_gflops > 0) {
    peak_gflops = g_peaks.amx_gflops;
  } else if (kernels.has_bf16_dot && step.dtype == DType::bf16 && g_peaks.dpbf16_gflops > 0) {
    peak_gflops = g_peaks.dpbf16_gflops;
  }
  if (g_peaks.copy_gbs > 0 && peak_gflops > 0) {
    // floor seconds per iteration; the counter divides by measured seconds per iteration.
    const double floor_s = std::max(step.bytes / (g_peaks.copy_gbs * 1e9),
                                    step.flops / (peak_gflops * 1e9));
    state.counters["floor%"] = benchmark::Counter(100.0 * floor_s * iterations, benchmark::Counter::kIsRate);
    state.counters["copy_bw%"] = benchmark::Counter(
        100.0 * step.bytes * iterations / (g_peaks.copy_gbs * 1e9), benchmark::Counter::kIsRate);
  }
  const double paged_read_gbs =
      dtype_size(step.kv_dtype) == 1 ? g_peaks.paged_read_fp8_gbs : g_peaks.paged_read_gbs;
  if (paged_read_gbs > 0) {
    state.counters["paged_read%"] = benchmark::Counter(
        100.0 * step.bytes * iterations / (paged_read_gbs * 1e9),
        benchmark::Counter::kIsRate);
  }
}

void BM_Cpu(benchmark::State& state, std::vector<RequestShape> batch, DType dtype,
            DType kv_dtype) {
  auto step = make_step(cpu_backend(), batch, dtype, kv_dtype);
  step->run();  // warm-up (first touch of scratch)
  for (auto _ : state) {
    step->run();
    benchmark::ClobberMemory();
  }
  report(state, *step, cpu::active_kernels().name);
}

// The decode kernels of the CPU backend side by side on one batch: each round runs the direct
// decode kernel (PAGEDATTN_CPU_DECODE_KERNEL=auto) and the tile kernel (=tile) once each, in
// alternating order, so both see the same machine state; counters are the medians of the rounds
// (direct_GB/s, tile_GB/s, direct/tile = speedup). The reported time is the sum of both calls.
void BM_DecodeKernels(benchmark::State& state, std::vector<RequestShape> batch) {
  auto step = make_step(cpu_backend(), batch);
  std::vector<double> direct_s, tile_s;
  const auto timed = [&](cpu::DecodeKernel kernel) {
    cpu::set_decode_kernel_override(kernel);
    const auto start = std::chrono::steady_clock::now();
    step->run();
    const auto stop = std::chrono::steady_clock::now();
    return std::chrono::duration<double>(stop - start).count();
  };
  step->run();  // warm-up (first touch of scratch)
  int round = 0;
  for (auto _ : state) {
    if (round++ % 2 == 0) {
      direct_s.push_back(timed(cpu::DecodeKernel::automatic));
      tile_s.push_back(timed(cpu::DecodeKernel::tile));
    } else {
      tile_s.push_back(timed(cpu::DecodeKernel::tile));
      direct_s.push_back(timed(cpu::DecodeKernel::automatic));
    }
    benchmark::ClobberMemory();
  }
  cpu::clear_decode_kernel_override();
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double direct = median(direct_s), tile = median(tile_s);
  state.counters["direct_GB/s"] = step->bytes / direct / 1e9;
  state.counters["tile_GB/s"] = step->bytes / tile / 1e9;
  state.counters["direct/tile"] = tile / direct;
  if (g_peaks.copy_gbs > 0) {
    state.counters["direct_copy_bw%"] = 100.0 * step->bytes / direct / (g_peaks.copy_gbs * 1e9);
  }
  state.SetLabel(cpu::active_kernels().name);
}

void BM_Reference(benchmark::State& state, std::vector<RequestShape> batch) {
  const AttentionBackend* reference = find_backend("REFERENCE");
  if (reference == nullptr) {
    state.SkipWithError("REFERENCE is not registered");
    return;
  }
  auto step = make_step(*reference, batch);
  for (auto _ : state) step->run();
  report(state, *step, "reference-fp64");
}

std::vector<RequestShape> decode_batch(int batch, int context) {
  return std::vector<RequestShape>(static_cast<size_t>(batch), RequestShape{context, 1});
}

// Peak/paged_read(_fp8): the loads-only rate of the Decode/16x4k(_fp8) cache in its page order.
double measure_paged_read(DType kv_dtype) {
  auto step = make_step(cpu_backend(), decode_batch(16, 4096), DType::bf16, kv_dtype);
  const TensorView cache = step->cache.view();  // (2, blocks, block_size, Hkv, D), dense
  const int64_t elem = static_cast<int64_t>(dtype_size(step->cache.dtype()));
  const char* base = static_cast<const char*>(step->cache.data());
  const int64_t block_bytes = static_cast<int64_t>(kBlock) * kHkv * kD * elem;
  const TensorView table = step->common.block_table.view();  // (reqs, cols) i32
  return measure_paged_read_gbs(base, base + cache.stride(0) * elem, cache.stride(1) * elem,
                                block_bytes, static_cast<const int32_t*>(table.data()),
                                table.stride(0), static_cast<int>(table.size(0)),
                                (4096 + 1 + kBlock - 1) / kBlock);
}

void register_all() {
  const auto peak = [](const char* name, PeakKind which) {
    benchmark::RegisterBenchmark(name, BM_Peak, which)->Iterations(1)->Unit(benchmark::kMillisecond);
  };
  peak("Peak/copy_bandwidth", PeakKind::copy);
  peak("Peak/read_bandwidth", PeakKind::read);
  peak("Peak/paged_read", PeakKind::paged_read);
  peak("Peak/paged_read_fp8", PeakKind::paged_read_fp8);
  peak("Peak/fma_f32", PeakKind::fma);
  if (has_avx512bf16()) peak("Peak/dpbf16", PeakKind::dpbf16);
  if (cpu::isa_supported(cpu::Isa::amx)) peak("Peak/amx_bf16", PeakKind::amx);
  const auto cpu = [](const std::string& name, std::vector<RequestShape> batch,
                      DType dtype = DType::bf16, DType kv_dtype = DType::bf16) {
    benchmark::RegisterBenchmark(("CPU/" + name).c_str(), BM_Cpu, std::move(batch), dtype,
                                 kv_dtype)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(0.5);
  };
  cpu("Prefill/1x2048", {{0, 2048}});
  cpu("Prefill/4x1024", std::vector<RequestShape>(4, RequestShape{0, 1024}));
  // f16 activations run the f32 FMA path (no bf16 dot product): the AVX-512 fp32 kernels.
  cpu("Prefill/1x2048_f16", {{0, 2048}}, DType::f16);
  cpu("Decode/16x4k_f16", decode_batch(16, 4096), DType::f16);
  // bf16 activations over an fp8 e4m3 cache (the widening of e4m3 is the kernels' cost here).
  cpu("Decode/16x4k_fp8", decode_batch(16, 4096), DType::bf16, DType::fp8_e4m3);
  cpu("Decode/64x4k_fp8", decode_batch(64, 4096), DType::bf16, DType::fp8_e4m3);
  cpu("Decode/8x2k_fp8", decode_batch(8, 2048), DType::bf16, DType::fp8_e4m3);
  cpu("Decode/8x2k", decode_batch(8, 2048));
  for (int batch : {1, 16, 64}) {
    for (int context : {1024, 4096, 16384}) {
      cpu("Decode/" + std::to_string(batch) + "x" + std::to_string(context / 1024) + "k",
          decode_batch(batch, context));
    }
  }
  // Direct decode kernel vs the tile kernel, alternating in one run (see BM_DecodeKernels).
  for (const auto& [name, batch] : {std::pair{"16x4k", decode_batch(16, 4096)},
                                    std::pair{"64x4k", decode_batch(64, 4096)}}) {
    benchmark::RegisterBenchmark((std::string("CPU/DecodeKernels/") + name).c_str(),
                                 BM_DecodeKernels, batch)
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->MinTime(1.0);
  }
  std::vector<RequestShape> mixed = decode_batch(32, 2048);
  mixed.push_back({1536, 512});
  cpu("Mixed/512chunk+32x2k", mixed);
  // The shapes of issue 21's batch-invariance cost (docs/perf/cpu.md): run with and without
  // PAGEDATTN_BATCH_INVARIANT=1 (the env var reaches the builder here).
  cpu("Decode/128x4k", decode_batch(128, 4096));
  cpu("Prefill/4x4096", std::vector<RequestShape>(4, RequestShape{0, 4096}));
  const auto ref = [](const std::string& name, std::vector<RequestShape> batch) {
    benchmark::RegisterBenchmark(("REFERENCE/" + name).c_str(), BM_Reference, std::move(batch))
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(1);
  };
  ref("Prefill/1x256", {{0, 256}});
  ref("Decode/16x1k", decode_batch(16, 1024));
  cpu("Prefill/1x256", {{0, 256}});  // the same sizes on the CPU backend, for the ratio
  cpu("Decode/16x1k_again", decode_batch(16, 1024));
  // Extra decode shapes from PAGEDATTN_BENCH_DECODE="BxC[:fp8|:f16],..." (contexts in keys), e.g.
  // cache-resident ones (2x64, 8x256) beside the DRAM rows to separate compute from memory.
  if (const char* extra = std::getenv("PAGEDATTN_BENCH_DECODE")) {
    std::string list = extra;
    for (size_t at = 0; at < list.size();) {
      const size_t comma = std::min(list.find(',', at), list.size());
      const std::string item = list.substr(at, comma - at);
      at = comma + 1;
      const size_t colon = std::min(item.find(':'), item.size());
      const std::string shape = item.substr(0, colon);
      const std::string k = colon < item.size() ? item.substr(colon + 1) : "";
      int batch = 0, context = 0, used = 0;
      const bool parsed = std::sscanf(shape.c_str(), "%dx%d%n", &batch, &context, &used) == 2 &&
                          used == static_cast<int>(shape.size());
      if (!parsed || batch <= 0 || context <= 0 || !(k.empty() || k == "fp8" || k == "f16")) {
        std::fprintf(stderr, "PAGEDATTN_BENCH_DECODE: '%s' is not BxC[:fp8|:f16] (B, C > 0)\n", item.c_str());
        std::exit(2);
      }
      cpu("DecodeShape/" + item, decode_batch(batch, context), k == "f16" ? DType::f16 : DType::bf16,
          k == "fp8" ? DType::fp8_e4m3 : DType::bf16);
    }
  }
}

}  // namespace
}  // namespace pagedattn

int main(int argc, char** argv) {
  pagedattn::register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
