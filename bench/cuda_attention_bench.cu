// Benchmark of the CUDA backend on the paged-attention grids of issue 5 (decode, prefill,
// mixed), with the two ceilings measured in the same run: device copy bandwidth (bytes read +
// written) and the cuBLAS bf16 GEMM rate. Writes one JSON document (stdout or --out).
//
// Method (docs/perf/cuda.md): each configuration's forward (attention kernel + split combine)
// is captured in a CUDA graph and replayed; time = median over 5 repeats of (events around
// `iters` replays) / iters. Small working sets rotate over several plans whose KV blocks are
// disjoint (>= 256 MB touched per rotation) so the 50 MB L2 does not serve the KV. Block tables
// are random permutations of the cache's blocks. Inputs are random, never zeros.
//   KV bytes   = sum_r seq_len_r * Hkv * (D + Dv) * sizeof(kv)   (each byte once per group)
//   FLOPs      = 4 * D * Hq * sum over query rows of visible keys (causal counted exactly)
//   floor      = max(bytes / copy bandwidth, FLOPs / GEMM rate)
// Kernel variants (src/backends/cuda/common/kernel_override.h): --kernels auto,mma,wgmma,ws,unified,...
// times each selected case once per listed variant, in alternation, --passes times (same-run
// comparisons of old and new paths); the JSON rows then carry "kernel" and "pass". Each name is a
// PAGEDATTN_CUDA_KERNEL value set through the same parser (set_kernel_override) before the case's
// builder is made; without --kernels the environment's PAGEDATTN_CUDA_KERNEL applies.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../src/backends/cuda/common/kernel_override.h"
#include "../src/backends/cuda/attention/cuda_backend.h"
#include "pagedattn/pagedattn.h"
#include "cuda_bench_common.cuh"

namespace {

using namespace pagedattn;

struct Request {
  int context = 0;
  int query = 0;
};

struct BenchCase {
  std::string grid;   // decode / prefill / mixed / spec (speculative decodes)
  std::string name;
  int head_size = 128;
  std::string kv_cache_dtype = "auto";  // auto (bf16), fp8_e4m3 or fp8_e5m2
  std::vector<Request> batch;
  int num_heads = 32, num_kv_heads = 8, block_size = 16;
  KVCacheLayout layout = KVCacheLayout::NHD;
  int num_speculative_tokens = 0;  // BuilderConfig::num_speculative_tokens of the builder
  // fp8 e4m3 output (grid fp8out): fused (the kernels write it, output_scale) or separate (bf16
  // output, then a quantize pass over it, as an engine without the fusion runs it).
  enum class Fp8Out { none, fused, separate } fp8_out = Fp8Out::none;
  // grid fp8q: the query given pre-quantized (e4m3 with q_scale, supports_quant_query_input)
  // instead of bf16 (which the fp8 kernel quantizes per row itself).
  bool quant_query = false;
};

// The separate quantization the fused fp8 output replaces: bf16 -> e4m3 = x / scale[0], saturated
// (one read of the bf16 output, one write of the bytes; 8 elements per thread).
__global__ void quantize_e4m3(const __nv_bfloat16* in, __nv_fp8_e4m3* out, const float* scale, int64_t n) {
  const int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * 8;
  if (i >= n) return;
  const float inv = 1.f / *scale;
  const uint4 raw = *reinterpret_cast<const uint4*>(in + i);
  const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&raw);
  uint2 packed;
  uint8_t* b = reinterpret_cast<uint8_t*>(&packed);
  for (int k = 0; k < 8; ++k) b[k] = __nv_cvt_float_to_fp8(__bfloat162float(x[k]) * inv, __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<uint2*>(out + i) = packed;
}

struct BenchResult {
  double ms = 0, kv_bytes = 0, flops = 0, tbps = 0, tflops = 0, floor_ms = 0, fraction_of_floor = 0;
  int rotations = 0;
};

BenchResult run_case(const BenchCase& bc, const Ceilings& ceil) {
  const AttentionBackend& backend = cuda_backend();
  const bool fp8 = bc.kv_cache_dtype != "auto";
  const DType kv_dtype = !fp8 ? DType::bf16 : bc.kv_cache_dtype == "fp8_e5m2" ? DType::fp8_e5m2 : DType::fp8_e4m3;
  const int d = bc.head_size, hq = bc.num_heads, hkv = bc.num_kv_heads, bs = bc.block_size;
  int num_tokens = 0, max_seq = 0;
  int64_t blocks_per_plan = 0;
  double kv_bytes = 0, flops = 0;
  for (const Request& r : bc.batch) {
    const int seq = r.context + r.query;
    num_tokens += r.query;
    max_seq = std::max(max_seq, seq);
    blocks_per_plan += (seq + bs - 1) / bs;
    kv_bytes += double(seq) * hkv * 2 * d * dtype_size(kv_dtype);
    for (int i = 0; i < r.query; ++i) flops += 4.0 * d * hq * (r.context + i + 1);
  }
  const double io_bytes = kv_bytes + (bc.quant_query ? 3.0 : 4.0) * num_tokens * hq * d;  // + Q read, O written
  const int rotations = static_cast<int>(std::clamp(std::ceil(256e6 / kv_bytes), 1.0, 8.0));
  const int64_t num_blocks = blocks_per_plan * rotations + 1;

  AttentionImplParams params;
  params.num_heads = hq;
  params.num_kv_heads = hkv;
  params.head_size = d;
  params.scale = 1.f / std::sqrt(float(d));
  params.kv_cache_dtype = bc.kv_cache_dtype;
  params.dtype = DType::bf16;
  params.device = Device::cuda;
  params.block_size = bs;
  auto impl = backend.make_impl(params);
  LayerScales scales;
  scales.k_scale = 0.5f;
  scales.v_scale = 0.25f;

  set_kv_cache_layout(bc.layout);
  Tensor cache = backend.allocate_kv_cache(num_blocks, bs, hkv, d, kv_dtype, Device::cuda);
  set_kv_cache_layout(std::nullopt);
  fill(cache.data(), cache.numel(), kv_dtype, 11);
  const DType q_dtype = bc.quant_query ? DType::fp8_e4m3 : DType::bf16;
  Tensor query(Shape{num_tokens, hq, d}, q_dtype, Device::cuda);
  Tensor output(Shape{num_tokens, hq, d}, DType::bf16, Device::cuda);
  fill(query.data(), query.numel(), q_dtype, 12);
  if (bc.quant_query) scales.q_scale = 1.f / 32.f;
  using Fp8Out = BenchCase::Fp8Out;
  Tensor output8, output_scale;  // fp8out rows
  if (bc.fp8_out != Fp8Out::none) {
    output8 = Tensor(Shape{num_tokens, hq, d}, DType::fp8_e4m3, Device::cuda);
    Tensor host_scale(Shape{1}, DType::f32, Device::cpu);
    host_scale.data_as<float>()[0] = 1.f / 64.f;
    output_scale = host_scale.to(Device::cuda);
  }
  // One forward as the row runs it (captured in the graphs below).
  const auto forward = [&](const AttentionMetadata& plan) {
    if (bc.fp8_out == Fp8Out::fused) {
      impl->forward(scales, query, {}, {}, cache, plan, output8, output_scale);
      return;
    }
    impl->forward(scales, query, {}, {}, cache, plan, output);
    if (bc.fp8_out == Fp8Out::separate) {
      const int64_t n = output.numel();
      quantize_e4m3<<<static_cast<unsigned>((n / 8 + 255) / 256), 256, 0, static_cast<cudaStream_t>(current_cuda_stream())>>>(
          static_cast<const __nv_bfloat16*>(output.data()), static_cast<__nv_fp8_e4m3*>(output8.data()),
          output_scale.data_as<const float>(), n);
    }
  };

  const KVCacheSpec spec = KVCacheSpec::full_attention(bs, hkv, d, kv_dtype);
  BuilderConfig config;
  config.num_heads = hq;
  config.num_kv_heads = hkv;
  config.head_size = d;
  config.max_num_seqs = std::max<int>(256, static_cast<int>(bc.batch.size()));
  config.max_num_batched_tokens = std::max(8192, num_tokens);
  config.max_model_len = std::max(max_seq, 1);
  config.num_speculative_tokens = bc.num_speculative_tokens;

  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  set_current_cuda_stream(stream);
  std::mt19937_64 rng(42);
  std::vector<int32_t> perm(num_blocks - 1);
  std::iota(perm.begin(), perm.end(), 1);
  std::shuffle(perm.begin(), perm.end(), rng);

  std::vector<std::unique_ptr<AttentionMetadataBuilder>> builders;
  std::vector<OwnedCommonAttentionMetadata> commons;
  std::vector<std::shared_ptr<const AttentionMetadata>> plans;
  std::vector<cudaGraphExec_t> graphs;
  BenchResult res;
  for (int rot = 0; rot < rotations; ++rot) {
    CommonAttentionMetadataArgs args;
    args.query_start_loc = {0};
    int cols = (max_seq + bs - 1) / bs;
    args.max_num_blocks_per_req = std::max(cols, 1);
    int64_t next = rot * blocks_per_plan;
    for (const Request& r : bc.batch) {
      const int seq = r.context + r.query;
      args.query_start_loc.push_back(args.query_start_loc.back() + r.query);
      args.seq_lens.push_back(seq);
      const int used = (seq + bs - 1) / bs;
      for (int c = 0; c < args.max_num_blocks_per_req; ++c) {
        args.block_table.push_back(c < used ? perm[next + c] : 0);
      }
      next += used;
      for (int i = 0; i < r.query; ++i) args.slot_mapping.push_back(-1);  // attention only
    }
    commons.push_back(make_common_attention_metadata(args, Device::cuda));
    builders.push_back(backend.make_builder(spec, config, Device::cuda));
    plans.push_back(builders.back()->build(0, commons.back().common));
    // Warm-up outside the graph (also configures the kernel).
    forward(*plans.back());
    BENCH_CUDA(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    forward(*plans.back());
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    cudaGraphDestroy(graph);
    graphs.push_back(exec);
  }
  // Output sanity: every row finite (random inputs, no poison left).
  {
    Tensor& out = bc.fp8_out == Fp8Out::none ? output : output8;
    out.fill_bytes(0xFF);
    BENCH_CUDA(cudaGraphLaunch(graphs[0], stream));
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const Tensor host = out.to(Device::cpu);
    for (int64_t i = 0; i < host.numel(); ++i) {
      if (!std::isfinite(load_f32(host.data(), out.dtype(), i))) {
        std::fprintf(stderr, "bench %s: output element %lld not finite\n", bc.name.c_str(), (long long)i);
        std::exit(1);
      }
    }
  }
  const double floor_guess_ms = std::max(io_bytes / (ceil.copy_tbps * 1e12), flops / (ceil.gemm_tflops * 1e12)) * 1e3;
  const int iters = static_cast<int>(std::clamp(20.0 / std::max(floor_guess_ms, 1e-3), 10.0, 2000.0));
  int k = 0;
  for (int i = 0; i < 3 * rotations; ++i) cudaGraphLaunch(graphs[i % rotations], stream);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> samples;
  for (int rep = 0; rep < 5; ++rep) {
    cudaEventRecord(a, stream);
    for (int i = 0; i < iters; ++i) cudaGraphLaunch(graphs[k++ % rotations], stream);
    cudaEventRecord(b, stream);
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    samples.push_back(ms / iters);
  }
  std::sort(samples.begin(), samples.end());
  res.ms = samples[2];
  res.kv_bytes = kv_bytes;
  res.flops = flops;
  res.tbps = kv_bytes / (res.ms * 1e-3) / 1e12;  // KV read rate (the decode metric)
  res.tflops = flops / (res.ms * 1e-3) / 1e12;
  res.floor_ms = floor_guess_ms;
  res.fraction_of_floor = floor_guess_ms / res.ms;
  res.rotations = rotations;
  for (auto g : graphs) cudaGraphExecDestroy(g);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  set_current_cuda_stream(nullptr);
  cudaStreamDestroy(stream);
  return res;
}

// e5m2: every row with an fp8 cache also with an fp8 e5m2 cache (only under --kv fp8_e5m2, so that
// the default grid, which the peers read, keeps one fp8 format).
std::vector<BenchCase> make_grid(bool quick, bool e5m2) {
  std::vector<BenchCase> cases;
  const int batches[] = {1, 8, 32, 64, 128, 256};
  const int contexts[] = {1024, 2048, 4096, 8192, 16384};
  std::vector<const char*> kvs = {"auto", "fp8_e4m3"};
  if (e5m2) kvs.push_back("fp8_e5m2");
  for (int d : {128, 64, 256}) {
    for (const char* kv : kvs) {
      for (int b : batches) {
        for (int ctx : contexts) {
          const bool full = d == 128;
          if (!full && !((b == 1 || b == 32 || b == 128) && (ctx == 2048 || ctx == 8192))) continue;
          if (quick && !(d == 128 && std::string(kv) == "auto" && (b == 1 || b == 64 || b == 128) &&
                         (ctx == 2048 || ctx == 4096 || ctx == 8192))) {
            continue;
          }
          if (double(b) * ctx * 8 * d * 4 > 30e9) continue;  // keep under ~30 GB of cache
          BenchCase c;
          c.grid = "decode";
          c.head_size = d;
          c.kv_cache_dtype = kv;
          c.name = "decode b" + std::to_string(b) + "x" + std::to_string(ctx / 1024) + "k";
          c.batch.assign(b, Request{ctx - 1, 1});
          cases.push_back(c);
        }
      }
    }
  }
  // The same targets with the HND layout (pages of [Hkv][block_size][D]).
  for (auto [b, ctx] : {std::pair{128, 4096}, std::pair{64, 2048}, std::pair{1, 8192}, std::pair{32, 16384}}) {
    BenchCase c;
    c.grid = "decode";
    c.layout = KVCacheLayout::HND;
    c.name = "decode b" + std::to_string(b) + "x" + std::to_string(ctx / 1024) + "k HND";
    c.batch.assign(b, Request{ctx - 1, 1});
    cases.push_back(c);
  }
  // Speculative decodes (issue 19): b64 x 4k (keys per request, the new tokens included) with q =
  // 1 + k query tokens each, the builder told k; q = 1 is the plain decode they compare with.
  for (const char* kv : kvs) {
    if (quick && std::string(kv) != "auto") continue;
    for (int q : {1, 2, 4, 8}) {
      BenchCase c;
      c.grid = "spec";
      c.kv_cache_dtype = kv;
      c.name = "spec decode b64x4k q" + std::to_string(q);
      c.num_speculative_tokens = q - 1;
      c.batch.assign(64, Request{4096 - q, q});
      cases.push_back(c);
    }
  }
  // Fused fp8 e4m3 output against bf16 output + a separate quantize pass (issue 19), d 128 bf16.
  if (!quick) {
    const std::pair<const char*, std::vector<Request>> shapes[] = {
        {"decode b128x4k", std::vector<Request>(128, Request{4095, 1})},
        {"prefill 4x4k causal", std::vector<Request>(4, Request{0, 4096})},
        {"mixed 64 decodes@2k + 2 chunks of 512 (context 1536)", [] {
           std::vector<Request> m(64, Request{2047, 1});
           m.push_back(Request{1536, 512});
           m.push_back(Request{1536, 512});
           return m;
         }()}};
    for (const auto& [shape, batch] : shapes) {
      for (auto [mode, suffix] : {std::pair{BenchCase::Fp8Out::fused, " fp8 out fused"},
                                  std::pair{BenchCase::Fp8Out::separate, " fp8 out separate"}}) {
        BenchCase c;
        c.grid = "fp8out";
        c.name = std::string(shape) + suffix;
        c.fp8_out = mode;
        c.batch = batch;
        cases.push_back(c);
      }
    }
  }
  // A pre-quantized e4m3 query (q_scale) against a bf16 one over an e4m3 cache (issue 19), d 128.
  if (!quick) {
    const std::pair<const char*, std::vector<Request>> shapes[] = {
        {"decode b128x4k", std::vector<Request>(128, Request{4095, 1})},
        {"prefill 4x4k causal", std::vector<Request>(4, Request{0, 4096})},
        {"prefill 1x16k causal", std::vector<Request>(1, Request{0, 16384})}};
    for (const auto& [shape, batch] : shapes) {
      for (const bool quant : {false, true}) {
        BenchCase c;
        c.grid = "fp8q";
        c.kv_cache_dtype = "fp8_e4m3";
        c.name = std::string(shape) + (quant ? " e4m3 query" : " bf16 query");
        c.quant_query = quant;
        c.batch = batch;
        cases.push_back(c);
      }
    }
  }
  for (int d : {128, 64, 256}) {
    for (const char* kv : kvs) {
      if (quick && (d != 128 || std::string(kv) != "auto")) continue;
      for (auto [n, len] : {std::pair{1, 16384}, std::pair{4, 4096}, std::pair{16, 1024}}) {
        BenchCase c;
        c.grid = "prefill";
        c.head_size = d;
        c.kv_cache_dtype = kv;
        c.name = "prefill " + std::to_string(n) + "x" + std::to_string(len / 1024) + "k causal";
        c.batch.assign(n, Request{0, len});
        cases.push_back(c);
      }
      BenchCase m;
      m.grid = "mixed";
      m.head_size = d;
      m.kv_cache_dtype = kv;
      m.name = "mixed 64 decodes@2k + 2 chunks of 512 (context 1536)";
      m.batch.assign(64, Request{2047, 1});
      m.batch.push_back(Request{1536, 512});
      m.batch.push_back(Request{1536, 512});
      cases.push_back(m);
    }
  }
  return cases;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, only, only_kv, kernels_arg;
  int only_head_size = 0, block_size = 0, passes = 1;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else if (a == "--kv" && i + 1 < argc) {
      only_kv = argv[++i];
    } else if (a == "--head-size" && i + 1 < argc) {
      only_head_size = std::atoi(argv[++i]);
    } else if (a == "--block-size" && i + 1 < argc) {
      block_size = std::atoi(argv[++i]);
    } else if (a == "--kernels" && i + 1 < argc) {
      kernels_arg = argv[++i];
    } else if (a == "--passes" && i + 1 < argc) {
      passes = std::max(1, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr,
                   "usage: %s [--quick] [--out FILE.json] [--only [=]NAME_SUBSTRING[|[=]NAME_SUBSTRING...]] "
                   "[--kv auto|fp8_e4m3|fp8_e5m2] [--head-size D] [--block-size N] [--kernels auto,mma,wgmma,ws,ws-unified,unified,decode] "
                   "[--passes N]\n",
                   argv[0]);
      return 2;
    }
  }
  // Kernel variants to alternate (empty: the environment's choice, one row per case), each a
  // PAGEDATTN_CUDA_KERNEL value: auto (every default), mma (the mma.sync prefill path), ws (the
  // warp-specialized kernel; ws-unified: also for decode batches), wgmma (the one-warpgroup wgmma
  // path), unified (no decode-only kernel), decode (the decode-only kernel for every decode batch).
  struct KernelVariant {
    std::string name;
    cuda::KernelOverride choice;
  };
  std::vector<KernelVariant> kernels;
  for (size_t pos = 0; !kernels_arg.empty() && pos <= kernels_arg.size();) {
    const size_t end = std::min(kernels_arg.find(',', pos), kernels_arg.size());
    const std::string k = kernels_arg.substr(pos, end - pos);
    pos = end + 1;
    const std::pair<const char*, const char*> known[] = {
        {"auto", ""},           {"mma", "prefill=mma"},         {"ws", "prefill=ws"},
        {"wgmma", "prefill=wgmma"}, {"ws-unified", "prefill=ws,decode=unified"},
        {"unified", "decode=unified"}, {"decode", "decode=decode"}};
    bool found = false;
    for (const auto& [name, spec] : known) {
      if (k == name) {
        kernels.push_back({name, cuda::parse_kernel_override(spec)});
        found = true;
      }
    }
    if (!found) {
      std::fprintf(stderr, "cuda_attention_bench: --kernels: unknown variant '%s'\n", k.c_str());
      return 2;
    }
  }
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "cuda_attention_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const Ceilings ceil = measure_ceilings();
  std::fprintf(stderr, "device %s: copy %.2f TB/s, bf16 GEMM %.0f TFLOP/s\n", prop.name, ceil.copy_tbps,
               ceil.gemm_tflops);
  std::ostringstream js;
  js << "{\n  \"device\": \"" << prop.name << "\", \"sms\": " << prop.multiProcessorCount
     << ",\n  \"copy_tbps\": " << ceil.copy_tbps << ", \"gemm_bf16_tflops\": " << ceil.gemm_tflops
     << ",\n  \"rows\": [\n";
  bool first = true;
  for (BenchCase c : make_grid(quick, only_kv == "fp8_e5m2")) {
    if (!only.empty()) {  // '|'-separated name substrings ("=NAME": that name exactly)
      bool match = false;
      for (size_t pos = 0; pos <= only.size() && !match;) {
        const size_t end = std::min(only.find('|', pos), only.size());
        const std::string want = only.substr(pos, end - pos);
        match = want.starts_with('=') ? c.name == want.substr(1) : c.name.find(want) != std::string::npos;
        pos = end + 1;
      }
      if (!match) continue;
    }
    if (!only_kv.empty() && c.kv_cache_dtype != only_kv) continue;
    if (only_head_size != 0 && c.head_size != only_head_size) continue;
    if (block_size != 0) c.block_size = block_size;
    // One row per (pass, variant); without --kernels one row, under the environment's choice.
    const int num_kernels = std::max<int>(1, static_cast<int>(kernels.size()));
    const int num_passes = kernels.empty() ? 1 : passes;
    for (int run = 0; run < num_passes * num_kernels; ++run) {
      const int pass = run / num_kernels;
      std::string kernel_name = "env";
      if (!kernels.empty()) {
        kernel_name = kernels[run % num_kernels].name;
        cuda::set_kernel_override(kernels[run % num_kernels].choice);
      }
      const BenchResult r = run_case(c, ceil);
      std::fprintf(stderr, "%-8s d%-3d %-9s %-52s %-18s %9.4f ms %6.3f TB/s %7.1f TFLOP/s  %5.1f%% of floor\n",
                   c.grid.c_str(), c.head_size, c.kv_cache_dtype.c_str(), c.name.c_str(), kernel_name.c_str(),
                   r.ms, r.tbps, r.tflops, 100 * r.fraction_of_floor);
      js << (first ? "" : ",\n") << "    {\"grid\": \"" << c.grid << "\", \"name\": \"" << c.name
         << "\", \"kernel\": \"" << kernel_name << "\", \"pass\": " << pass << ", \"head_size\": " << c.head_size
         << ", \"kv_cache_dtype\": \"" << c.kv_cache_dtype << "\", \"num_heads\": " << c.num_heads
         << ", \"num_kv_heads\": " << c.num_kv_heads << ", \"block_size\": " << c.block_size
         << ", \"batch\": " << c.batch.size() << ", \"ms\": " << r.ms << ", \"kv_bytes\": " << r.kv_bytes
         << ", \"flops\": " << r.flops << ", \"tbps\": " << r.tbps << ", \"tflops\": " << r.tflops
         << ", \"floor_ms\": " << r.floor_ms << ", \"fraction_of_floor\": " << r.fraction_of_floor
         << ", \"rotations\": " << r.rotations << "}";
      first = false;
    }
  }
  cuda::set_kernel_override(std::nullopt);
  js << "\n  ]\n}\n";
  if (out_path.empty()) {
    std::cout << js.str();
  } else {
    std::ofstream(out_path) << js.str();
  }
  return 0;
}
