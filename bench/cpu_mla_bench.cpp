// CPU MLA decode benchmark (Google Benchmark): the CPU_MLA latent attention (absorbed decode =
// MQA over the latent cache) beside its floor, measured in the same run.
//
// Rows:
//   Peak/copy_bandwidth   memcpy of 1 GiB, all threads, (read + write bytes) / time, best of 5
//                         (the STREAM-copy convention, as cpu_bench)
//   Peak/dpbf16           vdpbf16ps rate, 12 independent chains per thread, all threads
//   MlaLatent/BxC[_fp8]   run_latent_decode of B decode requests with C cached tokens each:
//                         DeepSeek-V3 latent (kv_lora_rank 512 + rope 64 = 576), 16 query heads
//                         (the heads of one tensor-parallel rank of 128 / 8), bf16 activations,
//                         bf16 (or fp8_e4m3) cache, block 64, pages shuffled
//   MlaLatent/16x4k_qQ    the same with Q tokens a request (speculative decodes, causal among
//                         them; the plan's items share a request's key tiles across its tokens)
//   MlaLayer/BxC          MLAAttention::forward of the same decode batch through CPU_MLA: cache
//                         write, q·W_UK, the latent attention, o·W_UV (kv_b_proj of 16 heads)
//   MlaPrefill/BxN        the CPU MLA prefill backend, B prefills of N new tokens, causal, LSE on:
//                         16 heads, q/k 192, v 128, bf16 (GFLOP/s = 2·(192 + 128) per causal pair)
// Counters:
//   GB/s       latent bytes (Σ seq_len · 576 · cache bytes) + q_latent + o_latent, over time
//   GFLOP/s    2 · H · (576 + 512) per cached key and decode token (Q·Kᵀ and P·V)
//   bw_floor%  (latent bytes / copy bandwidth) / time: the memory floor the brief asks for
//   floor%     max(bytes / copy_bw, FLOPs / dpbf16 peak) / time: the roofline floor (with 16
//              heads the latent decode does ~16 FLOP per cache byte: compute-bound on CPUs)
// Run: OMP_WAIT_POLICY=passive build/<dir>/bench/cpu_mla_bench
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../src/backends/cpu/cpu_internal.h"
#include "../src/backends/cpu/cpu_mla_backend.h"
#include "pagedattn/pagedattn.h"
#include "cpu_peaks.h"

namespace pagedattn {
namespace {

// ---- measured peaks -------------------------------------------------------------------------
double g_copy_gbs = 0, g_dpbf16_gflops = 0;

void BM_Peak(benchmark::State& state, int which) {
  double value = 0;
  for (auto _ : state) {
    if (which == 0) {
      value = g_copy_gbs = bench::measure_bandwidth_gbs(/*read_only=*/false);
    } else if (__builtin_cpu_supports("avx512bf16")) {
      value = g_dpbf16_gflops = bench::measure_dpbf16_gflops();
    }
  }
  state.counters[which == 0 ? "GB/s" : "GFLOP/s"] = value;
  state.counters["threads"] = omp_get_max_threads();
}

// ---- the decode step ------------------------------------------------------------------------
constexpr int kHeads = 16, kRank = 512, kRope = 64, kLatent = kRank + kRope, kBlock = 64;
const MLADimensions kDims{kRank, 128, kRope, 128};

// Random values in [-1, 1) stored in `dtype` (16-bit floats or fp8 bytes of x / scale).
void fill_random(Tensor& t, uint64_t seed, float fp8_scale = 1.f) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) {
    const float x = dist(rng);
    switch (t.dtype()) {
      case DType::bf16: t.data_as<uint16_t>()[i] = f32_to_bf16_bits(x); break;
      case DType::f16: t.data_as<uint16_t>()[i] = f32_to_f16_bits(x); break;
      case DType::fp8_e4m3: t.data_as<uint8_t>()[i] = f32_to_fp8_e4m3_bits(x / fp8_scale); break;
      default: t.data_as<float>()[i] = x; break;
    }
  }
}

struct DecodeCounts {
  double bytes = 0, latent_bytes = 0, flops = 0;
};

// q_len tokens a request (speculative decodes): the latent rows read once, every token's FLOPs.
DecodeCounts counts(int batch, int context, DType cache_dtype, int q_len) {
  DecodeCounts c;
  const double seq = context + 1.0;
  c.latent_bytes = batch * seq * kLatent * static_cast<double>(dtype_size(cache_dtype));
  c.bytes = c.latent_bytes + batch * q_len * kHeads * (kLatent + kRank) * 2.0;
  const double token_keys = batch * (q_len * seq - q_len * (q_len - 1) / 2.0);  // causal among the q
  c.flops = token_keys * kHeads * 2.0 * (kLatent + kRank);
  return c;
}

void report(benchmark::State& state, const DecodeCounts& c) {
  const double it = static_cast<double>(state.iterations());
  state.counters["GB/s"] = benchmark::Counter(c.bytes * it / 1e9, benchmark::Counter::kIsRate);
  state.counters["GFLOP/s"] = benchmark::Counter(c.flops * it / 1e9, benchmark::Counter::kIsRate);
  if (g_copy_gbs > 0) {
    state.counters["bw_floor%"] = benchmark::Counter(
        100.0 * c.latent_bytes / (g_copy_gbs * 1e9) * it, benchmark::Counter::kIsRate);
    const double compute_s = g_dpbf16_gflops > 0 ? c.flops / (g_dpbf16_gflops * 1e9) : 0;
    state.counters["floor%"] = benchmark::Counter(
        100.0 * std::max(c.bytes / (g_copy_gbs * 1e9), compute_s) * it, benchmark::Counter::kIsRate);
  }
  state.SetLabel(cpu::active_kernels().name);
}

// The plan and buffers of B decodes over C cached tokens (block ids shuffled); q_len > 1:
// speculative decodes of q_len tokens a request (seq_len C + 1), as CPU_MLA plans them.
void BM_Latent(benchmark::State& state, int batch, int context, DType cache_dtype, int q_len) {
  const int seq = context + 1;
  const int64_t cols = (seq + kBlock - 1) / kBlock;
  const int tokens = batch * q_len;
  cpu::CpuMlaMetadata plan;
  plan.num_decodes = plan.decode.num_decodes = batch;
  plan.num_decode_tokens = plan.decode.num_decode_tokens = tokens;
  plan.decode.seq_lens.assign(batch, seq);
  plan.decode.max_seq_len = seq;
  plan.block_size = kBlock;
  plan.cpu_workspace = cpu::make_mla_decode_workspace(0, kHeads, kDims, true, q_len);
  plan.decode_block_table.resize(static_cast<size_t>(batch * cols));
  std::iota(plan.decode_block_table.begin(), plan.decode_block_table.end(), 0);
  std::shuffle(plan.decode_block_table.begin(), plan.decode_block_table.end(), std::mt19937(7));
  plan.decode_block_table_cols = cols;
  for (int r = 0; r <= batch; ++r) plan.decode.query_start_loc.push_back(r * q_len);
  plan.decode_first_pos.assign(batch, seq - q_len);
  cpu::plan_mla_decode(plan, *plan.cpu_workspace);

  const float k_scale = 0.02f;
  Tensor cache(Shape{batch * cols, kBlock, kLatent}, cache_dtype);
  fill_random(cache, 1, k_scale);
  Tensor q(Shape{tokens, kHeads, kLatent}, DType::bf16), out(Shape{tokens, kHeads, kRank}, DType::bf16);
  Tensor lse(Shape{kHeads, tokens}, DType::f32);
  fill_random(q, 2);
  const float scale = 1.f / std::sqrt(192.f);
  cpu::run_latent_decode(plan, q, cache, DType::bf16, scale, k_scale, out, lse);  // warm-up
  for (auto _ : state) {
    cpu::run_latent_decode(plan, q, cache, DType::bf16, scale, k_scale, out, lse);
    benchmark::ClobberMemory();
  }
  report(state, counts(batch, context, cache_dtype, q_len));
  state.counters["items"] = static_cast<double>(plan.items.size());
}

// The same decode batch through the layer (MLAAttention, backend forced to CPU_MLA).
void BM_Layer(benchmark::State& state, int batch, int context) {
  const int seq = context + 1;
  const int cols = (seq + kBlock - 1) / kBlock;
  MLAAttentionLayerParams p;
  p.num_heads = kHeads;
  p.kv_lora_rank = kRank;
  p.qk_nope_head_dim = kDims.qk_nope_head_dim;
  p.qk_rope_head_dim = kRope;
  p.qk_head_dim = kDims.qk_head_dim();
  p.v_head_dim = kDims.v_head_dim;
  p.block_size = kBlock;
  p.prefix = "layers.0.self_attn";
  p.dtype = DType::bf16;
  p.backend = "CPU_MLA";
  MLAAttention layer(p);
  Tensor weight(Shape{kHeads * (kDims.qk_nope_head_dim + kDims.v_head_dim), kRank}, DType::bf16);
  fill_random(weight, 3);
  layer.process_weights_after_loading(weight);
  Tensor cache = layer.allocate_kv_cache(static_cast<int64_t>(batch) * cols);
  fill_random(cache, 1);
  std::vector<int32_t> blocks(static_cast<size_t>(batch) * cols);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::shuffle(blocks.begin(), blocks.end(), std::mt19937(7));
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  args.max_num_blocks_per_req = cols;
  args.block_table = blocks;
  for (int r = 0; r < batch; ++r) {
    args.query_start_loc.push_back(r + 1);
    args.seq_lens.push_back(seq);
    const int32_t block = blocks[static_cast<size_t>(r) * cols + context / kBlock];
    args.slot_mapping.push_back(static_cast<int64_t>(block) * kBlock + context % kBlock);
  }
  auto common = make_common_attention_metadata(args, Device::cpu, static_cast<int64_t>(batch) * cols, kBlock);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(),
                                              layer.builder_config(std::max(batch, 16), 256, 32768),
                                              Device::cpu);
  auto metadata = builder->build(0, common.common);
  Tensor q(Shape{batch, kHeads, kDims.qk_head_dim()}, DType::bf16);
  Tensor kv_c(Shape{batch, kRank}, DType::bf16), k_pe(Shape{batch, kRope}, DType::bf16);
  Tensor out(Shape{batch, kHeads, kDims.v_head_dim}, DType::bf16);
  fill_random(q, 4);
  fill_random(kv_c, 5);
  fill_random(k_pe, 6);
  layer.forward(q, kv_c, k_pe, cache, *metadata, out);  // warm-up
  for (auto _ : state) {
    layer.forward(q, kv_c, k_pe, cache, *metadata, out);
    benchmark::ClobberMemory();
  }
  DecodeCounts c = counts(batch, context, DType::bf16, 1);
  // + q·W_UK and o·W_UV: 2 · H · 2 · (P or V) · L per token
  c.flops += batch * kHeads * 2.0 * (kDims.qk_nope_head_dim + kDims.v_head_dim) * kRank;
  report(state, c);
}

// The CPU MLA prefill backend on B prefills of N new tokens (no context): causal attention with
// H = 16 heads of q/k 192 (P 128 + R 64), v 128, bf16, LSE on (as with context chunks).
void BM_Prefill(benchmark::State& state, int batch, int tokens) {
  MLAPrefillParams params;
  params.num_heads = kHeads;
  params.scale = 1.f / std::sqrt(192.f);
  params.kv_lora_rank = kRank;
  params.qk_nope_head_dim = kDims.qk_nope_head_dim;
  params.qk_rope_head_dim = kRope;
  params.v_head_dim = kDims.v_head_dim;
  params.dtype = DType::bf16;
  auto prefill = find_mla_prefill_backend("CPU")->create(params);
  MLAPrefillMetadata md;
  md.num_prefills = batch;
  md.num_prefill_tokens = batch * tokens;
  md.max_query_len = md.max_seq_len = tokens;
  for (int i = 0; i <= batch; ++i) md.query_start_loc.push_back(i * tokens);
  md.seq_lens.assign(batch, tokens);
  md.context_lens.assign(batch, 0);
  prefill->prepare_metadata(md);
  const int64_t t = int64_t{batch} * tokens, qk = kDims.qk_head_dim(), v = kDims.v_head_dim;
  Tensor q(Shape{t, kHeads, qk}, DType::bf16), k(Shape{t, kHeads, qk}, DType::bf16);
  Tensor vv(Shape{t, kHeads, v}, DType::bf16), out(Shape{t, kHeads, v}, DType::bf16);
  Tensor lse(Shape{kHeads, t}, DType::f32);
  fill_random(q, 7);
  fill_random(k, 8);
  fill_random(vv, 9);
  prefill->run_prefill_new_tokens(q, k, vv, true, out, lse);  // warm-up
  for (auto _ : state) {
    prefill->run_prefill_new_tokens(q, k, vv, true, out, lse);
    benchmark::ClobberMemory();
  }
  // causal pairs: N (N + 1) / 2 per request and head, 2 (qk + v) FLOPs per pair and dim
  const double pairs = batch * 0.5 * tokens * (tokens + 1.0);
  const double flops = pairs * kHeads * 2.0 * (qk + v);
  const double it = static_cast<double>(state.iterations());
  state.counters["GFLOP/s"] = benchmark::Counter(flops * it / 1e9, benchmark::Counter::kIsRate);
  if (g_dpbf16_gflops > 0) {
    state.counters["floor%"] = benchmark::Counter(100.0 * flops / (g_dpbf16_gflops * 1e9) * it,
                                                  benchmark::Counter::kIsRate);
  }
  state.SetLabel(cpu::active_kernels().name);
}

void register_all() {
  benchmark::RegisterBenchmark("Peak/copy_bandwidth", BM_Peak, 0)->Iterations(1)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("Peak/dpbf16", BM_Peak, 1)->Iterations(1)->Unit(benchmark::kMillisecond);
  for (const auto& [batch, context] : {std::pair{1, 4096}, std::pair{16, 1024}, std::pair{16, 4096},
                                       std::pair{64, 4096}}) {
    const std::string shape = std::to_string(batch) + "x" + std::to_string(context / 1024) + "k";
    benchmark::RegisterBenchmark(("MlaLatent/" + shape).c_str(), BM_Latent, batch, context, DType::bf16, 1)
        ->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  benchmark::RegisterBenchmark("MlaLatent/16x4k_fp8", BM_Latent, 16, 4096, DType::fp8_e4m3, 1)
      ->Unit(benchmark::kMillisecond)->UseRealTime();
  for (const int q : {2, 4, 8}) {  // speculative decodes of q tokens (beside MlaLatent/16x4k)
    benchmark::RegisterBenchmark(("MlaLatent/16x4k_q" + std::to_string(q)).c_str(), BM_Latent, 16, 4096,
                                 DType::bf16, q)
        ->Unit(benchmark::kMillisecond)->UseRealTime();
  }
  benchmark::RegisterBenchmark("MlaLayer/16x4k", BM_Layer, 16, 4096)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("MlaPrefill/1x2048", BM_Prefill, 1, 2048)->Unit(benchmark::kMillisecond)->UseRealTime();
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
