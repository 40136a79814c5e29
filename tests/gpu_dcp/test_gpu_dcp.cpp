// Decode context parallelism on GPUs (pagedattn/dcp.h over the NCCL communicator of
// pagedattn/dcp_nccl.h), one process per GPU (nccl_ranks.h). Each rank holds its stripe of the
// cache (filled through dcp_forward: the context as one prefill step), then runs a decode or mixed
// step. Checked on every rank: no output element left unwritten, the result within DESIGN.md's
// bf16 tolerance (8e-3) of the unsharded layer run on the same GPU, the LSE within 1e-3 of its;
// and every rank's output has the same bits. Standard layers (CUDA) at interleave 1 and 16, MLA
// layers (CUDA_MLA, DeepSeek-V3 dims), and planned decode steps of both captured in a CUDA graph
// (attention, NCCL all-gather, merge) that replay to the eager step's bits. Skipped without two GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "dcp/dcp_steps.h"
#include "gpu/gpu_test_util.h"
#include "gpu_dcp/nccl_ranks.h"
#include "pagedattn/dcp_nccl.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

using dcp_test::global_step;
using dcp_test::Req;
using nccl_ranks::SharedBytes;

#define REQUIRE_GPUS(n)                                                                              \
  do {                                                                                               \
    if (nccl_ranks::gpu_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs (one per DCP rank)"; \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// The group's ranks as processes; a rank with a GoogleTest failure exits 1.
std::vector<int> run_ranks(int n, const std::function<void(int, DcpCommunicator&)>& body) {
  return nccl_ranks::run_nccl_ranks(n, body, [] { return ::testing::Test::HasFailure(); });
}

Tensor random_device(Shape shape, uint64_t seed, float lo = -1.f, float hi = 1.f) {
  return gpu_test::random_host(shape, DType::bf16, seed, lo, hi).to(Device::cuda);
}

using gpu_test::rel_error;

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data_as<float>()[i], y = b.data_as<float>()[i];
    if (std::isinf(x) && std::isinf(y) && (x > 0) == (y > 0)) continue;
    m = std::max(m, std::isfinite(x) ? std::abs(x - y) : INFINITY);
  }
  return m;
}

const std::vector<Req>& decodes() {
  static const std::vector<Req> r = {{1200, 1}, {477, 1}, {1, 1}, {2100, 1}, {900, 1}, {64, 1}};
  return r;
}
const std::vector<Req>& mixed() {
  static const std::vector<Req> r = {{1200, 1}, {0, 40}, {1000, 25}, {2100, 1}, {20, 3}, {640, 16}};
  return r;
}

// The global rows of the main step (the fill is the contexts).
int64_t step_tokens(const std::vector<Req>& reqs, bool fill) {
  int64_t t = 0;
  for (const Req& r : reqs) t += fill ? r.context : r.query;
  return t;
}

// ---- standard layers ------------------------------------------------------------------------------

constexpr int kBlock = 16, kHeads = 16, kKvHeads = 4, kHead = 128;

AttentionLayerParams standard_params() {
  AttentionLayerParams p;
  p.num_heads = kHeads;
  p.num_kv_heads = kKvHeads;
  p.head_size = kHead;
  p.block_size = kBlock;
  p.dtype = DType::bf16;
  p.device = Device::cuda;
  p.backend = "CUDA";
  p.prefix = "layer.0";
  return p;
}

struct StdInputs {
  Tensor q, k, v;
};

StdInputs standard_inputs(int64_t tokens, uint64_t seed) {
  return {random_device(Shape{tokens, kHeads, kHead}, seed), random_device(Shape{tokens, kKvHeads, kHead}, seed + 1),
          random_device(Shape{tokens, kKvHeads, kHead}, seed + 2)};
}

// The unsharded run on this GPU: the layer's own forward over one cache.
void unsharded_standard(const std::vector<Req>& reqs, const StdInputs (&in)[2], Tensor& out, Tensor& lse) {
  Attention layer(standard_params());
  int blocks = 0;
  (void)global_step(reqs, 1, false, kBlock, &blocks);
  Tensor cache = layer.allocate_kv_cache(blocks);
  cache.fill_bytes(0xFF);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(64, 8192, 8192), Device::cuda);
  for (int step = 0; step < 2; ++step) {
    const DcpLocalStep s = make_dcp_local_step(global_step(reqs, 1, step == 0, kBlock, &blocks), DcpConfig{}, kBlock);
    const OwnedCommonAttentionMetadata md = make_common_attention_metadata(s.args, Device::cuda);
    const auto plan = builder->build(0, md.common);
    Tensor o(Shape{in[step].q.shape()[0], kHeads, kHead}, DType::bf16, Device::cuda);
    layer.forward(in[step].q, in[step].k, in[step].v, cache, *plan, step == 0 ? o.view() : out.view(),
                  step == 0 ? TensorView{} : lse.view());
  }
}

// One rank of the group: the sharded fill and step; the output is checked against the unsharded
// run and left, as bytes, in `bits` at this rank's slot.
void standard_rank(int rank, DcpCommunicator& comm, int interleave, const std::vector<Req>& reqs, uint64_t seed,
                   SharedBytes& bits) {
  const int n = comm.world_size();
  const StdInputs in[2] = {standard_inputs(step_tokens(reqs, true), seed), standard_inputs(step_tokens(reqs, false), seed + 10)};
  const int64_t tokens = step_tokens(reqs, false);
  Tensor ref_out(Shape{tokens, kHeads, kHead}, DType::bf16, Device::cuda), ref_lse(Shape{kHeads, tokens}, DType::f32, Device::cuda);
  unsharded_standard(reqs, in, ref_out, ref_lse);

  AttentionLayerParams p = standard_params();
  const DcpConfig config{n, rank, interleave};
  p.dcp = config;
  Attention layer(p);
  ASSERT_TRUE(layer.impl().need_to_return_lse_for_decode());
  int blocks = 0;
  (void)global_step(reqs, n, false, kBlock, &blocks);
  Tensor cache = layer.allocate_kv_cache(blocks);
  cache.fill_bytes(0xFF);  // NaN: a key read from a slot this rank never wrote would show
  // A fill step's runs of rows held elsewhere are one local request each: max_num_seqs holds them.
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8192, 8192, 8192), Device::cuda);
  Tensor out(Shape{tokens, kHeads, kHead}, DType::bf16, Device::cuda), lse(Shape{kHeads, tokens}, DType::f32, Device::cuda);
  out.fill_bytes(0xFF);
  for (int step = 0; step < 2; ++step) {
    Tensor fill_out(Shape{in[step].q.shape()[0], kHeads, kHead}, DType::bf16, Device::cuda);
    dcp_forward(layer, *builder, comm, config, global_step(reqs, n, step == 0, kBlock, &blocks), in[step].q, in[step].k,
                in[step].v, cache, step == 0 ? fill_out.view() : out.view(), step == 0 ? TensorView{} : lse.view());
  }
  const Tensor got = out.to(Device::cpu);
  EXPECT_LE(rel_error(got, ref_out.to(Device::cpu)), 8e-3) << "rank " << rank;
  EXPECT_LE(max_abs_diff(lse.to(Device::cpu), ref_lse.to(Device::cpu)), 1e-3) << "rank " << rank;
  ASSERT_LE(static_cast<size_t>(rank + 1) * got.nbytes(), bits.size());
  std::memcpy(bits.as<uint8_t>() + static_cast<size_t>(rank) * got.nbytes(), got.data(), got.nbytes());
}

void expect_same_bits(const SharedBytes& bits, int n, size_t bytes) {
  for (int r = 1; r < n; ++r) {
    EXPECT_EQ(std::memcmp(bits.as<uint8_t>(), bits.as<uint8_t>() + static_cast<size_t>(r) * bytes, bytes), 0)
        << "rank " << r << " combined other bits than rank 0";
  }
}

void expect_ranks_passed(const std::vector<int>& codes) {
  for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r << " failed (its output is above)";
}

TEST(DcpNccl, StandardLayerMatchesOneGpu) {
  REQUIRE_GPUS(2);
  std::vector<int> groups = {2};
  if (const int gpus = nccl_ranks::gpu_count(); gpus > 2) groups.push_back(gpus);
  for (int n : groups) {
    for (int interleave : {1, 16}) {
      for (const std::vector<Req>* reqs : {&decodes(), &mixed()}) {
        SCOPED_TRACE(detail::concat("N ", n, " I ", interleave, reqs == &decodes() ? " decodes" : " mixed"));
        const size_t bytes = static_cast<size_t>(step_tokens(*reqs, false)) * kHeads * kHead * 2;
        SharedBytes bits(bytes * static_cast<size_t>(n));
        expect_ranks_passed(run_ranks(
            n, [&](int rank, DcpCommunicator& comm) { standard_rank(rank, comm, interleave, *reqs, 40, bits); }));
        expect_same_bits(bits, n, bytes);
      }
    }
  }
}

// The planned step `forward` (it reads q, writes out) captured once on a new stream, then twice:
// new queries into q, the graph replayed, the same step run eagerly. The replay must give the eager
// bits, and new queries must change them; the last output is left in bits at this rank's slot.
void check_graph_replay(int rank, Tensor& q, Tensor& out, const std::function<void()>& forward,
                        SharedBytes& bits) {
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  set_current_cuda_stream(stream);
  forward();  // eager first: lazy library state (cuBLAS workspaces, kernel attributes) before capture
  synchronize_cuda();
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  forward();
  CUDA_OK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  Tensor first;
  for (uint64_t seed : {90, 100}) {
    q.copy_from(random_device(q.shape(), seed));
    out.fill_bytes(0xFF);
    CUDA_OK(cudaGraphLaunch(exec, stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    const Tensor replayed = out.to(Device::cpu);
    forward();
    synchronize_cuda();
    const Tensor eager = out.to(Device::cpu);
    EXPECT_EQ(std::memcmp(replayed.data(), eager.data(), eager.nbytes()), 0) << "rank " << rank << " seed " << seed;
    if (seed == 90) {
      first = eager.to(Device::cpu);
    } else {
      EXPECT_NE(std::memcmp(first.data(), eager.data(), eager.nbytes()), 0) << "new queries, same output";
      ASSERT_LE(static_cast<size_t>(rank + 1) * eager.nbytes(), bits.size());
      std::memcpy(bits.as<uint8_t>() + static_cast<size_t>(rank) * eager.nbytes(), eager.data(), eager.nbytes());
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  set_current_cuda_stream(nullptr);
  cudaStreamDestroy(stream);
}

// A planned decode step captured once (local attention, NCCL all-gather, merge) and replayed with
// new queries gives the bits of the same step run eagerly.
TEST(DcpNccl, PlannedDecodeStepReplaysInACudaGraph) {
  REQUIRE_GPUS(2);
  // A 1-token request with no context: rank 1 holds no key of it, so its plan gathers and packs.
  std::vector<Req> reqs = decodes();
  reqs.push_back({0, 1});
  const int64_t tokens = step_tokens(reqs, false);
  const size_t bytes = static_cast<size_t>(tokens) * kHeads * kHead * 2;
  SharedBytes bits(2 * bytes);
  expect_ranks_passed(run_ranks(2, [&](int rank, DcpCommunicator& comm) {
    AttentionLayerParams p = standard_params();
    const DcpConfig config{2, rank, 1};
    p.dcp = config;
    Attention layer(p);
    int blocks = 0;
    (void)global_step(reqs, 2, false, kBlock, &blocks);
    Tensor cache = layer.allocate_kv_cache(blocks);
    cache.fill_bytes(0xFF);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8192, 8192, 8192), Device::cuda);
    const StdInputs fill = standard_inputs(step_tokens(reqs, true), 70);
    Tensor fill_out(Shape{fill.q.shape()[0], kHeads, kHead}, DType::bf16, Device::cuda);
    dcp_forward(layer, *builder, comm, config, global_step(reqs, 2, true, kBlock, &blocks), fill.q, fill.k, fill.v, cache,
                fill_out);
    const std::unique_ptr<DcpPlan> plan = dcp_plan(layer, *builder, config, global_step(reqs, 2, false, kBlock, &blocks));
    EXPECT_EQ(plan->identity, rank == 0) << "rank 1 holds no key of the 1-token request";
    StdInputs in = standard_inputs(tokens, 80);
    Tensor out(Shape{tokens, kHeads, kHead}, DType::bf16, Device::cuda), lse(Shape{kHeads, tokens}, DType::f32, Device::cuda);
    check_graph_replay(rank, in.q, out, [&] { dcp_forward(layer, *plan, comm, in.q, in.k, in.v, cache, out, lse); }, bits);
  }));
  expect_same_bits(bits, 2, bytes);
}

// ---- MLA layers ------------------------------------------------------------------------------------

constexpr int kMlaBlock = 64, kMlaHeads = 16, kL = 512, kNope = 128, kRope = 64, kV = 128;

MLAAttentionLayerParams mla_params() {
  return gpu_test::deepseek_mla_params(kMlaHeads, "auto", kMlaBlock, "CUDA_MLA", Device::cuda);
}

struct MlaInputs {
  Tensor q, c, k;
};

MlaInputs mla_inputs(int64_t tokens, uint64_t seed) {
  return {random_device(Shape{tokens, kMlaHeads, kNope + kRope}, seed), random_device(Shape{tokens, kL}, seed + 1),
          random_device(Shape{tokens, kRope}, seed + 2)};
}

TEST(DcpNccl, MlaLayerMatchesOneGpu) {
  REQUIRE_GPUS(2);
  // MLA builders take decodes first: the batches list them first, and no context is a single token
  // (its fill would be a decode after prefills), so the unsharded run's rows are the global rows.
  const std::vector<std::vector<Req>> batches = {
      {{1200, 1}, {477, 1}, {3, 1}, {2100, 1}, {900, 1}},
      {{1200, 1}, {2100, 1}, {0, 40}, {1000, 25}, {20, 3}, {640, 16}},
  };
  for (const std::vector<Req>& reqs : batches) {
    for (int interleave : {1, 16}) {
      SCOPED_TRACE(detail::concat("I ", interleave, " batch of ", reqs.size()));
      const int64_t tokens = step_tokens(reqs, false);
      const size_t bytes = static_cast<size_t>(tokens) * kMlaHeads * kV * 2;
      SharedBytes bits(2 * bytes);
      expect_ranks_passed(run_ranks(2, [&](int rank, DcpCommunicator& comm) {
        const MlaInputs in[2] = {mla_inputs(step_tokens(reqs, true), 500), mla_inputs(tokens, 600)};
        const Tensor weight = random_device(Shape{int64_t{kMlaHeads} * (kNope + kV), kL}, 700, -0.08f, 0.08f);
        Tensor ref_out(Shape{tokens, kMlaHeads, kV}, DType::bf16, Device::cuda), ref_lse(Shape{kMlaHeads, tokens}, DType::f32, Device::cuda);
        MLAAttentionLayerParams p = mla_params();
        {
          // Unsharded: the plain layer forward on this GPU.
          MLAAttention layer(p);
          layer.process_weights_after_loading(weight);
          int blocks = 0;
          (void)global_step(reqs, 1, false, kMlaBlock, &blocks);
          Tensor cache = layer.allocate_kv_cache(blocks);
          cache.fill_bytes(0xFF);
          auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(64, 8192, 8192), Device::cuda);
          for (int step = 0; step < 2; ++step) {
            const DcpLocalStep s = make_dcp_local_step(global_step(reqs, 1, step == 0, kMlaBlock, &blocks), DcpConfig{}, kMlaBlock);
            const OwnedCommonAttentionMetadata md = make_common_attention_metadata(s.args, Device::cuda);
            const auto plan = builder->build(0, md.common);
            Tensor o(Shape{in[step].q.shape()[0], kMlaHeads, kV}, DType::bf16, Device::cuda);
            layer.forward(in[step].q, in[step].c, in[step].k, cache, *plan, step == 0 ? o.view() : ref_out.view(),
                          step == 0 ? TensorView{} : ref_lse.view());
          }
        }
        Tensor out(Shape{tokens, kMlaHeads, kV}, DType::bf16, Device::cuda), lse(Shape{kMlaHeads, tokens}, DType::f32, Device::cuda);
        out.fill_bytes(0xFF);
        const DcpConfig config{2, rank, interleave};
        p.dcp = config;
        MLAAttention layer(p);
        layer.process_weights_after_loading(weight);
        int blocks = 0;
        (void)global_step(reqs, 2, false, kMlaBlock, &blocks);
        Tensor cache = layer.allocate_kv_cache(blocks);
        cache.fill_bytes(0xFF);
        auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8192, 8192, 8192), Device::cuda);
        for (int step = 0; step < 2; ++step) {
          Tensor fill_out(Shape{in[step].q.shape()[0], kMlaHeads, kV}, DType::bf16, Device::cuda);
          dcp_forward(layer, *builder, comm, config, global_step(reqs, 2, step == 0, kMlaBlock, &blocks), in[step].q,
                      in[step].c, in[step].k, cache, step == 0 ? fill_out.view() : out.view(),
                      step == 0 ? TensorView{} : lse.view());
        }
        const Tensor got = out.to(Device::cpu);
        EXPECT_LE(rel_error(got, ref_out.to(Device::cpu)), 8e-3) << "rank " << rank;
        // (MLA's prefill rows merge context chunks: their LSEs move by ~1e-3 with the chunking)
        EXPECT_LE(max_abs_diff(lse.to(Device::cpu), ref_lse.to(Device::cpu)), 5e-3) << "rank " << rank;
        std::memcpy(bits.as<uint8_t>() + static_cast<size_t>(rank) * bytes, got.data(), bytes);
      }));
      expect_same_bits(bits, 2, bytes);
    }
  }
}

// The same for an MLA layer's absorbed decode (W_UK and W_UV through cuBLAS, the latent decode
// kernel, the all-gather and merge): the planned step replays in a CUDA graph to the eager bits.
TEST(DcpNccl, PlannedMlaDecodeStepReplaysInACudaGraph) {
  REQUIRE_GPUS(2);
  const std::vector<Req> reqs = {{1200, 1}, {477, 1}, {3, 1}, {2100, 1}, {900, 1}, {0, 1}};
  const int64_t tokens = step_tokens(reqs, false);
  const size_t bytes = static_cast<size_t>(tokens) * kMlaHeads * kV * 2;
  SharedBytes bits(2 * bytes);
  expect_ranks_passed(run_ranks(2, [&](int rank, DcpCommunicator& comm) {
    MLAAttentionLayerParams p = mla_params();
    const DcpConfig config{2, rank, 1};
    p.dcp = config;
    MLAAttention layer(p);
    layer.process_weights_after_loading(random_device(Shape{int64_t{kMlaHeads} * (kNope + kV), kL}, 700, -0.08f, 0.08f));
    int blocks = 0;
    (void)global_step(reqs, 2, false, kMlaBlock, &blocks);
    Tensor cache = layer.allocate_kv_cache(blocks);
    cache.fill_bytes(0xFF);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8192, 8192, 8192), Device::cuda);
    const MlaInputs fill = mla_inputs(step_tokens(reqs, true), 500);
    Tensor fill_out(Shape{fill.q.shape()[0], kMlaHeads, kV}, DType::bf16, Device::cuda);
    dcp_forward(layer, *builder, comm, config, global_step(reqs, 2, true, kMlaBlock, &blocks), fill.q, fill.c, fill.k,
                cache, fill_out);
    const std::unique_ptr<DcpPlan> plan = dcp_plan(layer, *builder, config, global_step(reqs, 2, false, kMlaBlock, &blocks));
    MlaInputs in = mla_inputs(tokens, 600);
    Tensor out(Shape{tokens, kMlaHeads, kV}, DType::bf16, Device::cuda), lse(Shape{kMlaHeads, tokens}, DType::f32, Device::cuda);
    check_graph_replay(rank, in.q, out, [&] { dcp_forward(layer, *plan, comm, in.q, in.c, in.k, cache, out, lse); }, bits);
  }));
  expect_same_bits(bits, 2, bytes);
}

// Wrong-device use is an Error naming the argument, before any collective: a host communicator
// with a plan on the GPU.
TEST(DcpNccl, HostCommunicatorWithADevicePlanIsAnError) {
  REQUIRE_GPUS(2);
  expect_ranks_passed(run_ranks(2, [&](int rank, DcpCommunicator& comm) {
    EXPECT_EQ(comm.device(), Device::cuda);
    EXPECT_FALSE(nccl_version().empty());
    AttentionLayerParams p = standard_params();
    p.dcp = DcpConfig{2, rank, 1};
    Attention layer(p);
    auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(64, 512, 8192), Device::cuda);
    int blocks = 0;
    const auto plan = dcp_plan(layer, *builder, p.dcp, global_step(decodes(), 2, false, kBlock, &blocks));
    const auto host = make_in_memory_dcp_group(2);
    Tensor out(Shape{plan->num_tokens, kHeads, kHead}, DType::bf16, Device::cuda);
    try {
      dcp_combine(*plan, *host[static_cast<size_t>(rank)], out);
      ADD_FAILURE() << "a host communicator combined a device plan";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "comm") << e.what();
    }
  }));
}

}  // namespace
}  // namespace pagedattn
