// Benchmark of CUDA_MLA (issue 7): the latent decode kernel at 16 and 128 heads x batch
// 1 / 32 / 128 x context 1k / 4k / 16k, and MLA prefill (4 requests x 4k new tokens, with and
// without 8k of cached context each), with the ceilings measured in the same run (device copy
// bandwidth, bytes read + written; cuBLAS bf16 8192^3 GEMM rate) and a peer measured in the
// same run: cuBLAS GEMM-based attention on the equivalent dense problem (S = Q.K^T strided-
// batched GEMM in f32, a softmax kernel writing bf16 P, O = P.V GEMM; the same FLOPs as ours,
// plus the S/P round trips through memory). Writes JSON (--out) and a markdown table (stdout).
//
// Decode (bf16 latent cache, block_size 64, random block permutation): time = median of 5 x
// (events around `iters` launches of decode kernel + split combine) / iters, the cache rotated
// over disjoint block sets (>= 512 MB per rotation) so L2 never holds the working set.
//   latent bytes = sum_b seq_b * 576 * 2 (+ Q and O);  FLOPs = 2 * H * seq * (576 + 512)
//   floor = max(bytes / copy bandwidth, FLOPs / GEMM rate)
// Speculative decodes ("spec" rows, issue 18): 16, 32 and 128 heads, B64 x 4k with q = 1, 2, 4, 8 tokens a request, run
// as the builder plans them (a request's tokens are its rows: one pass over its keys per row
// tile) and, as a same-run baseline ("spec-token" rows), with every token its own request; their
// floor reads each request's latent rows once and does every token's FLOPs.
// fp8 rows ("decode-fp8"): the same decode over an fp8 e4m3 latent cache (k_scale 1), floor =
// its bytes (half of bf16's) / copy bandwidth.
// Prefill (H heads, DeepSeek dims, bf16): the "CUDA" prefill backend's attention alone (new
// tokens causal + one context chunk) and the whole MLAAttention forward on CUDA_MLA (cache
// write, up-projection GEMMs, gather, attention, LSE merge).
//   attention FLOPs = 2 * H * (192 + 128) * (causal pairs + q * context)
//   layer FLOPs     = attention + 2 * H * 256 * 512 * (new + context tokens) (up-projections)
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "../src/backends/cuda/mla/mla_cuda_backend.h"
#include "../src/backends/cuda/mla/mla_decode.h"
#include "pagedattn/pagedattn.h"
#include "cuda_bench_common.cuh"

namespace {

using namespace pagedattn;
namespace md = pagedattn::cuda::mla_decode;

#define BENCH_CUBLAS(expr)                                                               \
  do {                                                                                   \
    const cublasStatus_t _s = (expr);                                                    \
    if (_s != CUBLAS_STATUS_SUCCESS) {                                                   \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #expr, (int)_s); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// bf16 uniform in [-1, 1) (random, never zeros).
__global__ void softmax_rows(const float* s, __nv_bfloat16* p, int n, float scale, int q_len, int offset) {
  const int64_t row = blockIdx.x;
  const int limit = q_len > 0 ? min(n, static_cast<int>(row % q_len) + offset + 1) : n;
  const float* x = s + row * n;
  __shared__ float red[32];
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < limit; i += blockDim.x) mx = fmaxf(mx, x[i]);
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
  __syncthreads();
  mx = red[0];
  for (int w = 1; w < blockDim.x / 32; ++w) mx = fmaxf(mx, red[w]);
  __syncthreads();
  float sum = 0.f;
  for (int i = threadIdx.x; i < limit; i += blockDim.x) sum += __expf((x[i] - mx) * scale);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = sum;
  __syncthreads();
  sum = 0.f;
  for (int w = 0; w < blockDim.x / 32; ++w) sum += red[w];
  const float inv = 1.f / sum;
  for (int i = threadIdx.x; i < n; i += blockDim.x)
    p[row * n + i] = __float2bfloat16(i < limit ? __expf((x[i] - mx) * scale) * inv : 0.f);
}

struct Row {
  std::string grid, name;
  double ms = 0, floor_ms = 0, bytes = 0, flops = 0, peer_ms = -1;
  std::string peer;
};

// ---- decode -------------------------------------------------------------------------------

// q_len > 1: speculative decodes of q_len tokens a request (seq_len `context`; token j sees
// context - q_len + 1 + j keys), as the builder plans them (the request's tokens are its rows) or,
// token_requests, with each token a request of its own through its request's block-table row.
// cache: bf16, or fp8_e4m3 (the pool then holds fp8 codes; k_scale 1).
Row bench_decode(int heads, int batch, int context, const Ceilings& ceil, cublasHandle_t h, void* pool,
                 size_t pool_bytes, bool quick, int q_len = 1, bool token_requests = false,
                 DType cache = DType::bf16) {
  const int elem = static_cast<int>(dtype_size(cache));
  constexpr int kBs = 64;
  const int tokens = batch * q_len;
  const int cols = context / kBs;
  const int64_t blocks_needed = static_cast<int64_t>(batch) * cols;
  const size_t block_bytes = size_t{kBs} * md::kLatent * elem;
  const int64_t pool_blocks = static_cast<int64_t>(pool_bytes / block_bytes);
  const size_t case_bytes = blocks_needed * block_bytes;
  const int rotations = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(pool_blocks / blocks_needed, (size_t{512} << 20) / case_bytes + 1)));
  // Requests of q_len tokens (token t sees context - q_len + 1 + t keys): the kernel's rows.
  std::vector<int32_t> seqs, qsl = {0};
  for (int b = 0; b < batch; ++b) {
    if (token_requests) {
      for (int j = 0; j < q_len; ++j) seqs.push_back(context - q_len + 1 + j);
    } else {
      seqs.push_back(context);
      qsl.push_back(qsl.back() + q_len);
    }
  }
  const int rows_per_request = (token_requests ? 1 : q_len) * heads;
  const md::DecodeKernel kernel = md::resolve_decode_kernel(rows_per_request, cache);  // as the builder's plans
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const md::Plan plan = md::make_plan(seqs, token_requests ? std::vector<int32_t>{} : qsl,
                                      std::max(1, sms / md::row_tiles(kernel, rows_per_request)), kernel);

  // Device plan + block tables (one per rotation, disjoint blocks, random permutations; a row per
  // kernel request: token_requests gives each token its request's row).
  const int kernel_requests = static_cast<int>(plan.requests.size());
  const int64_t table_entries = static_cast<int64_t>(kernel_requests) * cols;
  std::vector<int32_t> bt(static_cast<size_t>(rotations) * table_entries);
  std::mt19937 rng(7);
  for (int r = 0; r < rotations; ++r) {
    std::vector<int32_t> perm(blocks_needed);
    std::iota(perm.begin(), perm.end(), static_cast<int32_t>(r * blocks_needed));
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < kernel_requests; ++i) {
      const int64_t request = token_requests ? i / q_len : i;
      std::copy_n(perm.begin() + request * cols, cols, bt.begin() + r * table_entries + int64_t{i} * cols);
    }
  }
  int32_t *bt_d = nullptr, *part_d = nullptr;
  md::Segment* seg_d = nullptr;
  md::DecodeRequest* req_d = nullptr;
  float *po = nullptr, *pl = nullptr;
  void *q = nullptr, *out = nullptr;
  float* lse = nullptr;
  BENCH_CUDA(cudaMalloc(&bt_d, bt.size() * 4));
  BENCH_CUDA(cudaMemcpy(bt_d, bt.data(), bt.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&part_d, plan.part_begin.size() * 4));
  BENCH_CUDA(cudaMemcpy(part_d, plan.part_begin.data(), plan.part_begin.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&seg_d, plan.segments.size() * sizeof(md::Segment)));
  BENCH_CUDA(cudaMemcpy(seg_d, plan.segments.data(), plan.segments.size() * sizeof(md::Segment), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMalloc(&req_d, plan.requests.size() * sizeof(md::DecodeRequest)));
  BENCH_CUDA(cudaMemcpy(req_d, plan.requests.data(), plan.requests.size() * sizeof(md::DecodeRequest), cudaMemcpyHostToDevice));
  const int64_t slots = std::max(1, plan.num_partial_slots);
  BENCH_CUDA(cudaMalloc(&po, slots * rows_per_request * md::kValue * 4));
  BENCH_CUDA(cudaMalloc(&pl, slots * rows_per_request * 4));
  BENCH_CUDA(cudaMalloc(&q, size_t{2} * tokens * heads * md::kLatent));
  BENCH_CUDA(cudaMalloc(&out, size_t{2} * tokens * heads * md::kValue));
  BENCH_CUDA(cudaMalloc(&lse, size_t{4} * tokens * heads));
  fill(q, static_cast<size_t>(tokens) * heads * md::kLatent, DType::bf16, 11);

  md::DecodeParams p{};
  p.q = q;
  p.q_token_stride = static_cast<int64_t>(heads) * md::kLatent;
  p.q_head_stride = md::kLatent;
  p.cache = pool;
  p.block_stride = static_cast<int64_t>(kBs) * md::kLatent;
  p.token_stride = md::kLatent;
  p.num_blocks = pool_blocks;
  p.bt_stride = cols;
  p.block_size = kBs;
  p.num_heads = heads;
  p.out = out;
  p.o_token_stride = static_cast<int64_t>(heads) * md::kValue;
  p.o_head_stride = md::kValue;
  p.lse = lse;
  p.lse_head_stride = tokens;
  p.lse_token_stride = 1;
  p.segments = seg_d;
  p.part_begin = part_d;
  p.requests = req_d;
  p.partial_out = po;
  p.partial_lse = pl;
  p.num_requests = kernel_requests;
  p.tokens_per_request = plan.tokens_per_request;
  p.scale_log2 = 0.0722f * 1.4426950408889634f;
  p.out_scale = 1.f;
  int rot = 0;
  auto run = [&] {
    p.block_table = bt_d + static_cast<int64_t>(rot) * table_entries;
    rot = (rot + 1) % rotations;
    md::launch_decode(p, DType::bf16, cache, kernel, plan.num_parts, md::plan_combine(plan), current_cuda_stream());
  };
  for (int i = 0; i < 3; ++i) run();
  const double work = double(batch) * context;
  const int base_iters = std::max(3, std::min(200, static_cast<int>(2e8 / (work * heads + 1e6)) + 3));
  const int iters = std::max(base_iters, rotations);  // every rotation at least once per repeat
  Row row;
  row.grid = "decode";  // (the caller names its speculative rows)
  row.name = "H" + std::to_string(heads) + " B" + std::to_string(batch) + " ctx" + std::to_string(context / 1024) + "k";
  row.ms = time_events(run, quick ? rotations : iters);
  // The floor reads each request's latent rows once (its tokens share them) and does every
  // token's FLOPs.
  double token_keys = 0;
  for (int t = 0; t < q_len; ++t) token_keys += double(batch) * (context - q_len + 1 + t);
  row.bytes = work * md::kLatent * elem + double(tokens) * heads * (md::kLatent + md::kValue) * 2;
  row.flops = 2.0 * heads * token_keys * (md::kLatent + md::kValue);
  row.floor_ms = std::max(row.bytes / (ceil.copy_tbps * 1e12), row.flops / (ceil.gemm_tflops * 1e12)) * 1e3;

  // Peer: cuBLAS GEMM attention over a dense copy of the latent rows (B, S, 576).
  const size_t dense = static_cast<size_t>(batch) * context * md::kLatent * 2;
  const size_t s_bytes = static_cast<size_t>(batch) * heads * context * 4;
  void *k_dense = nullptr, *sc = nullptr, *pp = nullptr;
  if (q_len == 1 && cache == DType::bf16 && dense + s_bytes * 3 / 2 < (size_t{24} << 30) && cudaMalloc(&k_dense, dense) == cudaSuccess &&
      cudaMalloc(&sc, s_bytes) == cudaSuccess && cudaMalloc(&pp, s_bytes / 2) == cudaSuccess) {
    fill(k_dense, dense / 2, DType::bf16, 13);
    const float one = 1.f, zero = 0.f;
    auto peer = [&] {
      BENCH_CUBLAS(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, context, heads, md::kLatent, &one, k_dense,
                                              CUDA_R_16BF, md::kLatent, int64_t{context} * md::kLatent, q, CUDA_R_16BF,
                                              md::kLatent, int64_t{heads} * md::kLatent, &zero, sc, CUDA_R_32F, context,
                                              int64_t{heads} * context, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      softmax_rows<<<batch * heads, 256, 0, static_cast<cudaStream_t>(current_cuda_stream())>>>(
          static_cast<float*>(sc), static_cast<__nv_bfloat16*>(pp), context, 0.0722f, 0, 0);
      BENCH_CUBLAS(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, md::kValue, heads, context, &one, k_dense,
                                              CUDA_R_16BF, md::kLatent, int64_t{context} * md::kLatent, pp, CUDA_R_16BF,
                                              context, int64_t{heads} * context, &zero, out, CUDA_R_16BF, md::kValue,
                                              int64_t{heads} * md::kValue, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    peer();
    row.peer_ms = time_events(peer, quick ? 1 : base_iters);
    row.peer = "cuBLAS GEMM attention (dense latent)";
  } else if (q_len == 1 && cache == DType::bf16) {
    cudaGetLastError();
    row.peer = "cuBLAS peer skipped (memory)";
  }
  cudaFree(k_dense);
  cudaFree(sc);
  cudaFree(pp);
  for (void* x : {static_cast<void*>(bt_d), static_cast<void*>(part_d), static_cast<void*>(seg_d),
                  static_cast<void*>(req_d), static_cast<void*>(po), static_cast<void*>(pl), q, out,
                  static_cast<void*>(lse)})
    cudaFree(x);
  return row;
}

// ---- prefill ------------------------------------------------------------------------------

std::vector<Row> bench_prefill(int heads, int context, const Ceilings& ceil, cublasHandle_t h, bool quick) {
  constexpr int kReqs = 4, kNew = 4096, kBs = 64;
  constexpr int kP = 128, kR = 64, kV = 128, kL = 512;
  const int total = kReqs * kNew, seq = kNew + context;
  const int cols = (seq + kBs - 1) / kBs;
  const int blocks = kReqs * cols;
  MLAAttentionLayerParams lp;
  lp.num_heads = heads;
  lp.kv_lora_rank = kL;
  lp.qk_nope_head_dim = kP;
  lp.qk_rope_head_dim = kR;
  lp.qk_head_dim = kP + kR;
  lp.v_head_dim = kV;
  lp.block_size = kBs;
  lp.dtype = DType::bf16;
  lp.device = Device::cuda;
  lp.backend = "CUDA_MLA";
  lp.prefix = "bench";
  MLAAttention layer(lp);
  Tensor w(Shape{int64_t{heads} * (kP + kV), kL}, DType::bf16, Device::cuda);
  fill(w.data(), w.numel(), DType::bf16, 21);
  layer.process_weights_after_loading(w);
  Tensor cache = layer.allocate_kv_cache(blocks);
  fill(cache.data(), cache.numel(), DType::bf16, 22);
  Tensor q(Shape{total, heads, kP + kR}, DType::bf16, Device::cuda), kv_c(Shape{total, kL}, DType::bf16, Device::cuda),
      k_pe(Shape{total, kR}, DType::bf16, Device::cuda), out(Shape{total, heads, kV}, DType::bf16, Device::cuda);
  fill(q.data(), q.numel(), DType::bf16, 23);
  fill(kv_c.data(), kv_c.numel(), DType::bf16, 24);
  fill(k_pe.data(), k_pe.numel(), DType::bf16, 25);
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  args.max_num_blocks_per_req = cols;
  std::vector<int32_t> perm(blocks);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(9));
  for (int r = 0; r < kReqs; ++r) {
    args.query_start_loc.push_back(args.query_start_loc.back() + kNew);
    args.seq_lens.push_back(seq);
    for (int j = 0; j < cols; ++j) args.block_table.push_back(perm[r * cols + j]);
    for (int pos = context; pos < seq; ++pos) args.slot_mapping.push_back(int64_t{perm[r * cols + pos / kBs]} * kBs + pos % kBs);
  }
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(kReqs, total, seq), Device::cuda);
  const OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, Device::cuda, blocks, kBs);
  const auto md = builder->build(0, common.common);
  auto layer_run = [&] { layer.forward(q, kv_c, k_pe, cache, *md, out); };
  layer_run();
  const double pairs_new = double(kReqs) * kNew * (kNew + 1) / 2, pairs_ctx = double(kReqs) * kNew * context;
  const double attn_flops = 2.0 * heads * (kP + kR + kV) * (pairs_new + pairs_ctx);
  const double up_flops = 2.0 * heads * (kP + kV) * kL * (double(total) + double(kReqs) * context);
  std::vector<Row> rows;
  Row lr;
  lr.grid = "prefill";
  lr.name = "H" + std::to_string(heads) + " 4x4k" + (context ? " +8k ctx" : "") + " layer";
  lr.ms = time_events(layer_run, quick ? 1 : 5);
  lr.flops = attn_flops + up_flops;
  lr.floor_ms = lr.flops / (ceil.gemm_tflops * 1e12) * 1e3;
  lr.peer = "-";
  rows.push_back(lr);

  // The prefill attention alone (new tokens causal + the context as one non-causal chunk) vs the
  // cuBLAS peer on the same dense q / k / v.
  MLAPrefillParams pp;
  pp.num_heads = heads;
  pp.scale = 0.0722f;
  pp.kv_lora_rank = kL;
  pp.qk_nope_head_dim = kP;
  pp.qk_rope_head_dim = kR;
  pp.v_head_dim = kV;
  pp.dtype = DType::bf16;
  pp.device = Device::cuda;
  auto prefill = cuda_mla_prefill_backend().create(pp);
  MLAPrefillMetadata pm;
  pm.num_prefills = kReqs;
  pm.num_prefill_tokens = total;
  pm.max_query_len = kNew;
  std::vector<int32_t> qsl = {0}, cu = {0};
  for (int r = 0; r < kReqs; ++r) {
    qsl.push_back(qsl.back() + kNew);
    cu.push_back(cu.back() + context);
  }
  pm.query_start_loc = qsl;
  Tensor qsl_d(Shape{kReqs + 1}, DType::i32, Device::cuda), cu_d(Shape{1, kReqs + 1}, DType::i32, Device::cuda);
  BENCH_CUDA(cudaMemcpy(qsl_d.data(), qsl.data(), qsl.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(cu_d.data(), cu.data(), cu.size() * 4, cudaMemcpyHostToDevice));
  pm.query_start_loc_device = qsl_d;
  MLAChunkedContextMetadata cc;
  cc.num_chunks = 1;
  cc.cu_seq_lens = cu;
  cc.chunk_total_tokens = {cu.back()};
  cc.cu_seq_lens_device = cu_d;
  if (context > 0) pm.chunked_context = cc;
  prefill->prepare_metadata(pm);
  const int64_t kv_rows = std::max(total, kReqs * context);
  Tensor k(Shape{kv_rows, heads, kP + kR}, DType::bf16, Device::cuda), v(Shape{kv_rows, heads, kV}, DType::bf16, Device::cuda),
      lse(Shape{heads, total}, DType::f32, Device::cuda), out2(Shape{total, heads, kV}, DType::bf16, Device::cuda);
  fill(k.data(), k.numel(), DType::bf16, 26);
  fill(v.data(), v.numel(), DType::bf16, 27);
  auto attn = [&] {
    prefill->run_prefill_new_tokens(q, k.view().narrow(0, 0, total), v.view().narrow(0, 0, total), true, out, lse);
    if (context > 0) prefill->run_prefill_context_chunk(0, q, k.view().narrow(0, 0, kReqs * context),
                                                        v.view().narrow(0, 0, kReqs * context), out2, lse);
  };
  attn();
  Row ar;
  ar.grid = "prefill";
  ar.name = "H" + std::to_string(heads) + " 4x4k" + (context ? " +8k ctx" : "") + " attention";
  ar.ms = time_events(attn, quick ? 1 : 5);
  ar.flops = attn_flops;
  ar.floor_ms = attn_flops / (ceil.gemm_tflops * 1e12) * 1e3;
  // Peer: per request, S = Q.K^T (H batched, f32), masked softmax -> bf16 P, O = P.V.
  const int kv_len = kNew + context;
  void *kd = nullptr, *vd = nullptr, *sc = nullptr, *pb = nullptr;
  const size_t s_bytes = static_cast<size_t>(heads) * kNew * kv_len * 4;
  if (s_bytes < (size_t{20} << 30) && cudaMalloc(&kd, size_t{2} * kv_len * heads * (kP + kR)) == cudaSuccess &&
      cudaMalloc(&vd, size_t{2} * kv_len * heads * kV) == cudaSuccess && cudaMalloc(&sc, s_bytes) == cudaSuccess &&
      cudaMalloc(&pb, s_bytes / 2) == cudaSuccess) {
    fill(kd, static_cast<size_t>(kv_len) * heads * (kP + kR), DType::bf16, 28);
    fill(vd, static_cast<size_t>(kv_len) * heads * kV, DType::bf16, 29);
    const float one = 1.f, zero = 0.f;
    const int dq = kP + kR;
    auto peer = [&] {
      for (int r = 0; r < kReqs; ++r) {
        const auto* qr = static_cast<const __nv_bfloat16*>(q.data()) + int64_t{r} * kNew * heads * dq;
        // S_h (kNew x kv_len) row-major = col-major (kv_len x kNew): K_h (kv_len x dq, ld H*dq) op T ...
        BENCH_CUBLAS(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, kv_len, kNew, dq, &one, kd, CUDA_R_16BF,
                                                heads * dq, dq, qr, CUDA_R_16BF, heads * dq, dq, &zero, sc, CUDA_R_32F,
                                                kv_len, int64_t{kNew} * kv_len, heads, CUBLAS_COMPUTE_32F,
                                                CUBLAS_GEMM_DEFAULT));
        softmax_rows<<<heads * kNew, 256, 0, static_cast<cudaStream_t>(current_cuda_stream())>>>(
            static_cast<float*>(sc), static_cast<__nv_bfloat16*>(pb), kv_len, 0.0722f, kNew, context);
        auto* orow = static_cast<__nv_bfloat16*>(out.data()) + int64_t{r} * kNew * heads * kV;
        BENCH_CUBLAS(cublasGemmStridedBatchedEx(h, CUBLAS_OP_N, CUBLAS_OP_N, kV, kNew, kv_len, &one, vd, CUDA_R_16BF,
                                                heads * kV, kV, pb, CUDA_R_16BF, kv_len, int64_t{kNew} * kv_len, &zero,
                                                orow, CUDA_R_16BF, heads * kV, kV, heads, CUBLAS_COMPUTE_32F,
                                                CUBLAS_GEMM_DEFAULT));
      }
    };
    peer();
    ar.peer_ms = time_events(peer, quick ? 1 : 3);
    ar.peer = "cuBLAS GEMM attention (full S, masked softmax)";
  } else {
    cudaGetLastError();
    ar.peer = "cuBLAS peer skipped (memory)";
  }
  cudaFree(kd);
  cudaFree(vd);
  cudaFree(sc);
  cudaFree(pb);
  rows.push_back(ar);
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path, only;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc) {
      out_path = argv[++i];
    } else if (a == "--quick") {
      quick = true;
    } else if (a == "--only" && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--out FILE.json] [--only CASE_SUBSTRING]\n", argv[0]);
      return 2;
    }
  }
  try {
    cudaDeviceProp prop{};
    BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
    cublasHandle_t h;
    BENCH_CUBLAS(cublasCreate(&h));
    cublasSetStream(h, static_cast<cudaStream_t>(current_cuda_stream()));
    const Ceilings ceil = measure_ceilings();
    std::printf("device %s, %d SMs; copy %.2f TB/s (read + write), cuBLAS bf16 %.0f TFLOP/s\n", prop.name,
                prop.multiProcessorCount, ceil.copy_tbps, ceil.gemm_tflops);
    // One cache pool for every decode case (largest: 128 x 16k x 1152 B = 2.4 GB; 3 GB pool).
    const size_t pool_bytes = size_t{3} << 30;
    void* pool = nullptr;
    BENCH_CUDA(cudaMalloc(&pool, pool_bytes));
    fill(pool, pool_bytes / 2, DType::bf16, 5);
    std::vector<Row> rows;
    for (const int heads : {16, 128}) {
      for (const int batch : {1, 32, 128}) {
        for (const int ctx : {1024, 4096, 16384}) {
          if (quick && !(batch == 128 && ctx == 4096) && !(batch == 1 && ctx == 1024)) continue;
          const std::string name = "H" + std::to_string(heads) + " B" + std::to_string(batch) + " ctx" +
                                   std::to_string(ctx / 1024) + "k";
          if (!only.empty() && name.find(only) == std::string::npos) continue;
          rows.push_back(bench_decode(heads, batch, ctx, ceil, h, pool, pool_bytes, quick));
          const Row& r = rows.back();
          std::printf("%-24s %8.3f ms  floor %.3f  peer %.3f\n", r.name.c_str(), r.ms, r.floor_ms, r.peer_ms);
          std::fflush(stdout);
        }
      }
    }
    // Speculative decodes (q tokens a request, the builder's plan), and each token a request of
    // its own as the same-run baseline: B64 x 4k, q 1..8.
    for (const int heads : {16, 32, 128}) {
      for (const int q : {1, 2, 4, 8}) {
        if (quick && (q != 4 || heads == 32)) continue;
        for (const bool per_token : {false, true}) {
          if (per_token && q == 1) continue;
          const std::string name =
              "H" + std::to_string(heads) + " B64 ctx4k q" + std::to_string(q) + (per_token ? " per-token" : "");
          if (!only.empty() && name.find(only) == std::string::npos) continue;
          rows.push_back(bench_decode(heads, 64, 4096, ceil, h, pool, pool_bytes, quick, q, per_token));
          rows.back().grid = per_token ? "spec-token" : "spec";
          rows.back().name = name;
          const Row& r = rows.back();
          std::printf("%-32s %8.3f ms  floor %.3f\n", r.name.c_str(), r.ms, r.floor_ms);
          std::fflush(stdout);
        }
      }
    }
    // An fp8 e4m3 latent cache (issue 18: 90% of its floor): the pool refilled with fp8 codes.
    fill(pool, pool_bytes, DType::fp8_e4m3, 6);
    for (const int heads : {16, 128}) {
      for (const auto& [batch, ctx] : {std::pair{1, 4096}, {32, 4096}, {128, 4096}, {32, 16384}, {128, 16384}}) {
        if (quick && batch != 128) continue;
        const std::string name = "H" + std::to_string(heads) + " B" + std::to_string(batch) + " ctx" +
                                 std::to_string(ctx / 1024) + "k fp8";
        if (!only.empty() && name.find(only) == std::string::npos) continue;
        rows.push_back(bench_decode(heads, batch, ctx, ceil, h, pool, pool_bytes, quick, 1, false, DType::fp8_e4m3));
        rows.back().grid = "decode-fp8";
        rows.back().name = name;
        const Row& r = rows.back();
        std::printf("%-24s %8.3f ms  floor %.3f\n", r.name.c_str(), r.ms, r.floor_ms);
        std::fflush(stdout);
      }
    }
    cudaFree(pool);
    for (const int heads : {16, 128}) {
      for (const int ctx : {0, 8192}) {
        if (quick && heads == 128 && ctx > 0) continue;
        if (!only.empty() && only != "prefill") continue;
        for (const Row& r : bench_prefill(heads, ctx, ceil, h, quick)) {
          rows.push_back(r);
          std::printf("%-30s %8.3f ms  floor %.3f  peer %.3f\n", r.name.c_str(), r.ms, r.floor_ms, r.peer_ms);
          std::fflush(stdout);
        }
      }
    }
    cublasDestroy(h);

    std::ostringstream md_out, json;
    md_out << "| grid | case | time ms | floor ms | of floor | TB/s (latent) | TFLOP/s | peer ms | peer |\n"
           << "|---|---|---:|---:|---:|---:|---:|---:|---|\n";
    json << "{\"device\": \"" << prop.name << "\", \"copy_tbps\": " << ceil.copy_tbps
         << ", \"gemm_tflops\": " << ceil.gemm_tflops << ", \"rows\": [";
    char buf[512];
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      std::snprintf(buf, sizeof(buf), "| %s | %s | %.3f | %.3f | %.0f%% | %s | %.0f | %s | %s |\n", r.grid.c_str(),
                    r.name.c_str(), r.ms, r.floor_ms, 100.0 * r.floor_ms / r.ms,
                    r.grid != "prefill" ? std::to_string(r.bytes / (r.ms * 1e-3) / 1e12).substr(0, 4).c_str() : "-",
                    r.flops / (r.ms * 1e-3) / 1e12, r.peer_ms > 0 ? std::to_string(r.peer_ms).substr(0, 6).c_str() : "-",
                    r.peer.c_str());
      md_out << buf;
      std::snprintf(buf, sizeof(buf),
                    "%s{\"grid\": \"%s\", \"name\": \"%s\", \"ms\": %.5f, \"floor_ms\": %.5f, \"bytes\": %.0f, "
                    "\"flops\": %.0f, \"peer_ms\": %.5f, \"peer\": \"%s\"}",
                    i ? ", " : "", r.grid.c_str(), r.name.c_str(), r.ms, r.floor_ms, r.bytes, r.flops, r.peer_ms,
                    r.peer.c_str());
      json << buf;
    }
    json << "]}\n";
    std::printf("\n%s", md_out.str().c_str());
    if (!out_path.empty()) std::ofstream(out_path) << json.str();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_mla_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
