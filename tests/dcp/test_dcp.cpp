// Decode context parallelism (pagedattn/dcp.h) on the CPU: the layout (owner, local positions,
// local lengths against a brute-force count), a rank's local step (rows, causal geometry, slots),
// the N-way LSE merge, and the emulation the issue asks for: N ranks (threads, in-memory
// communicator), each with its own cache and layer, run a context fill then a decode or mixed step
// through dcp_forward; every rank ends with the same bits, and they equal the unsharded run of the
// same layer up to merge rounding (f32), for N = 2, 3, 4 and interleave 1, 16 (every pair in
// Release, three under ASan: emulated_groups), on standard (CPU) and MLA (CPU_MLA) layers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backends/ops_test_util.h"
#include "dcp/dcp_steps.h"
#include "pagedattn/pagedattn.h"
#include "sanitized_build.h"

namespace pagedattn {
namespace {

constexpr int kBlock = 16;

using testing_ops::expect_error;

TEST(DcpLayout, OwnersLocalPositionsAndLengthsMatchACount) {
  for (int n : {1, 2, 3, 4}) {
    for (int interleave : {1, 2, 16}) {
      std::vector<int64_t> next(static_cast<size_t>(n), 0);  // next local position per rank
      for (int64_t t = 0; t < 400; ++t) {
        const DcpConfig any{n, 0, interleave};
        const int owner = dcp_owner(t, any);
        ASSERT_EQ(dcp_local_position(t, any), next[static_cast<size_t>(owner)]) << "n " << n << " I " << interleave << " t " << t;
        ++next[static_cast<size_t>(owner)];
        for (int r = 0; r < n; ++r) {
          ASSERT_EQ(dcp_local_seq_len(t + 1, DcpConfig{n, r, interleave}), next[static_cast<size_t>(r)])
              << "n " << n << " I " << interleave << " rank " << r << " seq_len " << t + 1;
        }
      }
      const std::vector<int32_t> lens = {0, 1, 17, 399};
      int64_t sum = 0;
      for (int r = 0; r < n; ++r) {
        const auto local = get_dcp_local_seq_lens(lens, DcpConfig{n, r, interleave});
        ASSERT_EQ(local.size(), lens.size());
        sum += local[3];
      }
      EXPECT_EQ(sum, 399) << "every token on exactly one rank";
    }
  }
  expect_error([] { DcpConfig{0, 0, 1}.validate(16); }, "dcp.world_size");
  expect_error([] { DcpConfig{2, 2, 1}.validate(16); }, "dcp.rank");
  expect_error([] { DcpConfig{2, 0, 3}.validate(16); }, "dcp.interleave");
}

using dcp_test::Req;

CommonAttentionMetadataArgs global_step(const std::vector<Req>& reqs, int n, bool fill, int* num_blocks) {
  return dcp_test::global_step(reqs, n, fill, kBlock, num_blocks);
}

TEST(DcpLayout, LocalStepRowsGeometryAndSlots) {
  const std::vector<Req> reqs = {{300, 1}, {47, 1}, {0, 40}, {100, 25}, {513, 1}, {20, 3}, {5, 0}};
  for (int n : {1, 2, 3, 4}) {
    for (int interleave : {1, 4, 16}) {
      int num_blocks = 0;
      const CommonAttentionMetadataArgs g = global_step(reqs, n, false, &num_blocks);
      std::vector<int> seen(static_cast<size_t>(g.query_start_loc.back()), 0);
      for (int r = 0; r < n; ++r) {
        const DcpConfig c{n, r, interleave};
        const DcpLocalStep s = make_dcp_local_step(g, c, kBlock);
        ASSERT_EQ(s.rows.size(), static_cast<size_t>(s.args.query_start_loc.back()));
        ASSERT_EQ(s.args.slot_mapping.size(), s.rows.size());
        (void)make_common_attention_metadata(s.args, Device::cpu);  // a valid step
        for (size_t lr = 0; lr + 1 < s.args.query_start_loc.size(); ++lr) {
          const int q = s.args.query_start_loc[lr + 1] - s.args.query_start_loc[lr];
          for (int i = 0; i < q; ++i) {
            const int row = s.rows[static_cast<size_t>(s.args.query_start_loc[lr] + i)];
            const int gr = static_cast<int>(std::upper_bound(g.query_start_loc.begin(), g.query_start_loc.end(), row) -
                                            g.query_start_loc.begin()) - 1;
            const int64_t pos = g.seq_lens[static_cast<size_t>(gr)] - (g.query_start_loc[gr + 1] - g.query_start_loc[gr]) +
                                (row - g.query_start_loc[gr]);
            // Row i of the local request sits at local position seq_len - q + i and must see
            // exactly the keys of [0, pos] that the rank holds.
            EXPECT_EQ(s.args.seq_lens[lr] - q + i + 1, dcp_local_seq_len(pos + 1, c)) << "n " << n << " rank " << r;
            const int64_t slot = s.args.slot_mapping[static_cast<size_t>(s.args.query_start_loc[lr] + i)];
            if (dcp_owner(pos, c) != r) {
              EXPECT_EQ(slot, -1);
            } else {
              const int64_t local = dcp_local_position(pos, c);
              const int32_t block = g.block_table[static_cast<size_t>(gr * g.max_num_blocks_per_req) +
                                                  static_cast<size_t>(local / kBlock)];
              EXPECT_EQ(slot, int64_t{block} * kBlock + local % kBlock);
              ++seen[static_cast<size_t>(row)];
            }
          }
        }
      }
      for (size_t t = 0; t < seen.size(); ++t) EXPECT_EQ(seen[t], 1) << "token row " << t << " written by one rank";
    }
  }
}

TEST(DcpMerge, NWayMergeEqualsTheSoftmaxOfTheUnion) {
  // Three partial results of one row / head: (out_r, lse_r); the merge is their weighted sum.
  const int n = 3;
  std::vector<Tensor> outs, lses;
  const float l[n] = {0.5f, -std::numeric_limits<float>::infinity(), 2.0f};
  for (int r = 0; r < n; ++r) {
    outs.emplace_back(Shape{1, 1, 2}, DType::f32, Device::cpu);
    outs.back().data_as<float>()[0] = static_cast<float>(r + 1);
    outs.back().data_as<float>()[1] = -static_cast<float>(r);
    lses.emplace_back(Shape{1, 1}, DType::f32, Device::cpu);
    lses.back().data_as<float>()[0] = l[r];
  }
  std::vector<TensorView> ov(outs.begin(), outs.end()), lv(lses.begin(), lses.end());
  Tensor out(Shape{1, 1, 2}, DType::f32, Device::cpu), lse(Shape{1, 1}, DType::f32, Device::cpu);
  merge_attn_states_n(ov, lv, out, lse);
  const double w0 = std::exp(0.5), w2 = std::exp(2.0);
  EXPECT_NEAR(out.data_as<float>()[0], (w0 * 1 + w2 * 3) / (w0 + w2), 1e-6);
  EXPECT_NEAR(out.data_as<float>()[1], (w0 * 0 + w2 * -2) / (w0 + w2), 1e-6);
  EXPECT_NEAR(lse.data_as<float>()[0], std::log(w0 + w2), 1e-6);
  expect_error([&] { merge_attn_states_n(std::span<const TensorView>(ov).first(2), lv, out, lse); }, "outs");
}

// A NaN LSE (a rank's row saw a NaN logit) makes the merged row NaN, output and LSE, in whatever
// order it comes with empty (-inf, or +inf as FA2 writes) and finite ranks; rows without NaN keep
// the merge's math. Fails when the max drops the NaN (the rows then read as empty or as the finite
// ranks' merge).
TEST(DcpMerge, ANanLseMakesTheMergedRowNan) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  // Per row, the three ranks' LSEs; expect_nan: the merged row is NaN.
  struct Row {
    float l[3];
    bool expect_nan;
  };
  const std::vector<Row> rows = {
      {{nan, -inf, -inf}, true}, {{-inf, nan, -inf}, true}, {{-inf, -inf, nan}, true}, {{nan, 1.f, -inf}, true},
      {{1.f, -inf, nan}, true},  {{inf, nan, 2.f}, true},   {{-nan, 0.5f, 0.5f}, true}, {{nan, nan, nan}, true},
      {{1.f, -inf, 2.f}, false}, {{-inf, -inf, -inf}, false}, {{inf, -inf, 0.5f}, false}, {{inf, inf, inf}, false},
  };
  const int64_t T = static_cast<int64_t>(rows.size()), H = 1, D = 5;
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    std::vector<Tensor> outs, lses;
    for (int r = 0; r < 3; ++r) {
      outs.emplace_back(Shape{T, H, D}, dtype, Device::cpu);
      lses.emplace_back(Shape{H, T}, DType::f32, Device::cpu);
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t k = 0; k < D; ++k) store_f32(outs[r].data(), dtype, t * D + k, 0.25f * (r + 1) - 0.125f * k);
        lses[r].data_as<float>()[t] = rows[t].l[r];
      }
    }
    std::vector<TensorView> ov(outs.begin(), outs.end()), lv(lses.begin(), lses.end());
    Tensor out(Shape{T, H, D}, dtype, Device::cpu), lse(Shape{H, T}, DType::f32, Device::cpu);
    for (int64_t i = 0; i < out.numel(); ++i) store_f32(out.data(), dtype, i, -77.f);
    for (int64_t i = 0; i < T; ++i) lse.data_as<float>()[i] = -77.f;
    merge_attn_states_n(ov, lv, out, lse);
    for (int64_t t = 0; t < T; ++t) {
      const Row& row = rows[t];
      SCOPED_TRACE(testing::Message() << "row " << t << " lses " << row.l[0] << " " << row.l[1] << " " << row.l[2]);
      const float got_lse = lse.data_as<float>()[t];
      if (row.expect_nan) {
        EXPECT_TRUE(std::isnan(got_lse)) << got_lse;
        for (int64_t k = 0; k < D; ++k) EXPECT_TRUE(std::isnan(load_f32(out.data(), dtype, t * D + k))) << k;
        continue;
      }
      // Expected: weights e^{l_r} over the finite ranks (+inf counts as -inf).
      double sum = 0, acc[D] = {};
      for (int r = 0; r < 3; ++r) {
        const float l = row.l[r];
        if (!std::isfinite(l)) continue;
        sum += std::exp(double(l));
        for (int64_t k = 0; k < D; ++k) acc[k] += std::exp(double(l)) * load_f32(outs[r].data(), dtype, t * D + k);
      }
      if (sum == 0) {
        EXPECT_EQ(got_lse, -inf);
      } else {
        EXPECT_NEAR(got_lse, std::log(sum), 1e-5);
      }
      for (int64_t k = 0; k < D; ++k) {
        EXPECT_NEAR(load_f32(out.data(), dtype, t * D + k), sum == 0 ? 0.0 : acc[k] / sum, dtype == DType::f32 ? 1e-6 : 8e-3)
            << k;
      }
    }
  }
}

// ---- the N-rank emulation -------------------------------------------------------------------------

Tensor random_tensor(Shape shape, std::mt19937_64& rng) {
  Tensor t(shape, DType::f32, Device::cpu);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = dist(rng);
  return t;
}

double rel_error(const Tensor& a, const Tensor& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double d = double(a.data_as<float>()[i]) - b.data_as<float>()[i];
    num += d * d;
    den += double(b.data_as<float>()[i]) * b.data_as<float>()[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

// The (N, interleave) pairs of the emulation: all six in Release; under ASan (which looks for memory
// errors, the same on every pair) the three that still cover N = 2, 3, 4 and both interleaves.
std::vector<std::pair<int, int>> emulated_groups() {
  if (test_env::kSanitizedBuild) return {{2, 1}, {3, 16}, {4, 1}};
  return {{2, 1}, {2, 16}, {3, 1}, {3, 16}, {4, 1}, {4, 16}};
}

const std::vector<std::vector<Req>>& emulated_batches() {
  static const std::vector<std::vector<Req>> batches = {
      {{200, 1}, {47, 1}, {1, 1}, {333, 1}, {90, 1}},                 // decodes
      {{200, 1}, {0, 40}, {100, 25}, {333, 1}, {20, 3}, {64, 16}},    // mixed: prefill chunks, a speculative decode
  };
  return batches;
}

// One step's activations (the same on every rank and in the unsharded run).
struct StepInputs {
  Tensor q, k, v;
};

TEST(DcpEmulation, StandardLayerMatchesTheUnshardedRun) {
  AttentionLayerParams p;
  p.num_heads = 8;
  p.num_kv_heads = 2;
  p.head_size = 64;
  p.block_size = kBlock;
  p.dtype = DType::f32;
  p.backend = "CPU";
  p.logits_soft_cap = 20.f;
  for (size_t b = 0; b < emulated_batches().size(); ++b) {
    const std::vector<Req>& reqs = emulated_batches()[b];
    std::mt19937_64 rng(900 + b);
    // Inputs of the two steps (fill, main), shared by every run.
    std::vector<StepInputs> inputs;
    for (bool fill : {true, false}) {
      int64_t t = 0;
      for (const Req& r : reqs) t += fill ? r.context : r.query;
      inputs.push_back({random_tensor(Shape{t, 8, 64}, rng), random_tensor(Shape{t, 2, 64}, rng),
                        random_tensor(Shape{t, 2, 64}, rng)});
    }
    const int64_t tokens = inputs[1].q.shape()[0];
    // Unsharded: one cache, the layer's own forward.
    Tensor ref_out(Shape{tokens, 8, 64}, DType::f32, Device::cpu), ref_lse(Shape{8, tokens}, DType::f32, Device::cpu);
    {
      Attention layer(p);
      int num_blocks = 0;
      (void)global_step(reqs, 1, false, &num_blocks);
      Tensor cache = layer.allocate_kv_cache(num_blocks);
      cache.fill_bytes(0xFF);
      auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(64, 1024, 2048), Device::cpu);
      for (int step = 0; step < 2; ++step) {
        const DcpLocalStep s = make_dcp_local_step(global_step(reqs, 1, step == 0, &num_blocks), DcpConfig{}, kBlock);
        const auto md = make_common_attention_metadata(s.args, Device::cpu);
        const auto plan = builder->build(0, md.common);
        Tensor out(Shape{inputs[static_cast<size_t>(step)].q.shape()[0], 8, 64}, DType::f32, Device::cpu);
        layer.forward(inputs[static_cast<size_t>(step)].q, inputs[static_cast<size_t>(step)].k,
                      inputs[static_cast<size_t>(step)].v, cache, *plan, step == 0 ? out.view() : ref_out.view(),
                      step == 0 ? TensorView{} : ref_lse.view());
      }
    }
    for (const std::pair<int, int>& group_shape : emulated_groups()) {
      {
        const int n = group_shape.first, interleave = group_shape.second;  // (lambdas below capture them)
        SCOPED_TRACE("batch " + std::to_string(b) + " N " + std::to_string(n) + " I " + std::to_string(interleave));
        const auto group = make_in_memory_dcp_group(n);
        std::vector<Tensor> outs, lses;
        for (int r = 0; r < n; ++r) {
          outs.emplace_back(Shape{tokens, 8, 64}, DType::f32, Device::cpu);
          lses.emplace_back(Shape{8, tokens}, DType::f32, Device::cpu);
        }
        run_dcp_ranks(n, [&](int r) {
          const DcpConfig c{n, r, interleave};
          AttentionLayerParams rank_params = p;
          rank_params.dcp = c;
          Attention layer(rank_params);
          EXPECT_TRUE(layer.impl().need_to_return_lse_for_decode());
          int num_blocks = 0;
          (void)global_step(reqs, n, false, &num_blocks);
          Tensor cache = layer.allocate_kv_cache(num_blocks);
          cache.fill_bytes(0xFF);  // NaN: a key read from a slot this rank never wrote would show
          auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(2048, 2048, 2048),
                                                      Device::cpu);
          for (int step = 0; step < 2; ++step) {
            const StepInputs& in = inputs[static_cast<size_t>(step)];
            Tensor fill_out(Shape{in.q.shape()[0], 8, 64}, DType::f32, Device::cpu);
            dcp_forward(layer, *builder, *group[static_cast<size_t>(r)], c, global_step(reqs, n, step == 0, &num_blocks),
                        in.q, in.k, in.v, cache, step == 0 ? fill_out.view() : outs[static_cast<size_t>(r)].view(),
                        step == 0 ? TensorView{} : lses[static_cast<size_t>(r)].view());
          }
        });
        for (int r = 1; r < n; ++r) {
          EXPECT_EQ(std::memcmp(outs[0].data(), outs[static_cast<size_t>(r)].data(), outs[0].nbytes()), 0)
              << "rank " << r << " combined other bits";
        }
        EXPECT_LE(rel_error(outs[0], ref_out), 1e-5);
        EXPECT_LE(rel_error(lses[0], ref_lse), 1e-6);
      }
    }
  }
}

// The same for an MLA layer (CPU_MLA, DeepSeek's layout scaled down: latent 64 + rope 16, 4 heads):
// decodes take the absorbed path on every rank, a rank's runs of prefill rows the prefill path.
// The unsharded run is the same driver with a group of one (its merge of one state is exact).
TEST(DcpEmulation, MlaLayerMatchesTheUnshardedRun) {
  MLAAttentionLayerParams p;
  p.num_heads = 4;
  p.kv_lora_rank = 64;
  p.qk_nope_head_dim = 32;
  p.qk_rope_head_dim = 16;
  p.qk_head_dim = 48;
  p.v_head_dim = 32;
  p.block_size = kBlock;
  p.dtype = DType::f32;
  p.backend = "CPU_MLA";
  for (size_t b = 0; b < emulated_batches().size(); ++b) {
    const std::vector<Req>& reqs = emulated_batches()[b];
    std::mt19937_64 rng(700 + b);
    const Tensor weight = random_tensor(Shape{4 * (32 + 32), 64}, rng);
    struct MlaInputs {
      Tensor q, c, k;
    };
    std::vector<MlaInputs> inputs;
    for (bool fill : {true, false}) {
      int64_t t = 0;
      for (const Req& r : reqs) t += fill ? r.context : r.query;
      inputs.push_back({random_tensor(Shape{t, 4, 48}, rng), random_tensor(Shape{t, 64}, rng),
                        random_tensor(Shape{t, 16}, rng)});
    }
    const int64_t tokens = inputs[1].q.shape()[0];
    const auto run = [&](int n, int interleave, std::vector<Tensor>& outs, std::vector<Tensor>& lses) {
      const auto group = make_in_memory_dcp_group(n);
      for (int r = 0; r < n; ++r) {
        outs.emplace_back(Shape{tokens, 4, 32}, DType::f32, Device::cpu);
        lses.emplace_back(Shape{4, tokens}, DType::f32, Device::cpu);
      }
      run_dcp_ranks(n, [&](int r) {
        MLAAttentionLayerParams rank_params = p;
        rank_params.dcp = DcpConfig{n, r, interleave};
        MLAAttention layer(rank_params);
        EXPECT_EQ(layer.impl().need_to_return_lse_for_decode(), n > 1);
        layer.process_weights_after_loading(weight);
        int num_blocks = 0;
        (void)global_step(reqs, n, false, &num_blocks);
        Tensor cache = layer.allocate_kv_cache(num_blocks);
        cache.fill_bytes(0xFF);
        auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(2048, 2048, 2048),
                                                    Device::cpu);
        for (int step = 0; step < 2; ++step) {
          const MlaInputs& in = inputs[static_cast<size_t>(step)];
          Tensor fill_out(Shape{in.q.shape()[0], 4, 32}, DType::f32, Device::cpu);
          dcp_forward(layer, *builder, *group[static_cast<size_t>(r)], DcpConfig{n, r, interleave},
                      global_step(reqs, n, step == 0, &num_blocks), in.q, in.c, in.k, cache,
                      step == 0 ? fill_out.view() : outs[static_cast<size_t>(r)].view(),
                      step == 0 ? TensorView{} : lses[static_cast<size_t>(r)].view());
        }
      });
    };
    std::vector<Tensor> ref_out, ref_lse;
    run(1, 1, ref_out, ref_lse);
    for (const std::pair<int, int>& group_shape : emulated_groups()) {
      {
        const int n = group_shape.first, interleave = group_shape.second;  // (lambdas below capture them)
        SCOPED_TRACE("batch " + std::to_string(b) + " N " + std::to_string(n) + " I " + std::to_string(interleave));
        std::vector<Tensor> outs, lses;
        run(n, interleave, outs, lses);
        for (int r = 1; r < n; ++r) {
          EXPECT_EQ(std::memcmp(outs[0].data(), outs[static_cast<size_t>(r)].data(), outs[0].nbytes()), 0) << "rank " << r;
        }
        EXPECT_LE(rel_error(outs[0], ref_out[0]), 1e-5);
        EXPECT_LE(rel_error(lses[0], ref_lse[0]), 1e-6);
      }
    }
  }
}

// A rank that fails before its collective aborts the group: the others leave their all-gather with
// an Error instead of waiting for it, and run_dcp_ranks rethrows the first failure (not the aborts
// it caused). A group that was not given waits as before (not run: it would hang).
TEST(DcpEmulation, AFailingRankAbortsTheGroupInsteadOfHangingIt) {
  for (int failing : {0, 2}) {
    const auto group = make_in_memory_dcp_group(3);
    std::vector<int> aborted(3, 0);
    try {
      run_dcp_ranks(
          3,
          [&](int r) {
            if (r == failing) throw Error("query", "rank " + std::to_string(r) + " was given a bad query");
            Tensor send(Shape{2}, DType::f32, Device::cpu), recv(Shape{3, 2}, DType::f32, Device::cpu);
            send.fill_bytes(0);
            try {
              group[static_cast<size_t>(r)]->all_gather(send, recv);
            } catch (const Error& e) {
              EXPECT_EQ(e.argument(), "comm") << e.what();
              aborted[static_cast<size_t>(r)] = 1;
              throw;
            }
          },
          group);
      ADD_FAILURE() << "a failing rank's error was not rethrown";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "query") << e.what();
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(failing)), std::string::npos) << e.what();
    }
    for (int r = 0; r < 3; ++r) EXPECT_EQ(aborted[static_cast<size_t>(r)], r == failing ? 0 : 1) << "rank " << r;
  }
}

// A planned step rejected for what the combine reads (out, the communicator) is rejected before the
// local attention writes the step's keys and values: the cache stays byte-identical.
TEST(DcpEmulation, ARejectedPlannedStepLeavesTheCacheUntouched) {
  AttentionLayerParams p;
  p.num_heads = 4;
  p.num_kv_heads = 2;
  p.head_size = 16;
  p.block_size = kBlock;
  p.dtype = DType::f32;
  p.backend = "CPU";
  p.dcp = DcpConfig{2, 0, 1};
  Attention layer(p);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8, 64, 256), Device::cpu);
  int num_blocks = 0;
  const CommonAttentionMetadataArgs g = global_step({{20, 3}, {7, 1}}, 2, false, &num_blocks);
  Tensor cache = layer.allocate_kv_cache(num_blocks);
  std::mt19937_64 rng(3);
  const Tensor filled = random_tensor(cache.shape(), rng);
  cache.copy_from(filled);
  const auto plan = dcp_plan(layer, *builder, p.dcp, g);
  const Tensor q = random_tensor(Shape{4, 4, 16}, rng), k = random_tensor(Shape{4, 2, 16}, rng),
               v = random_tensor(Shape{4, 2, 16}, rng);
  Tensor out(Shape{4, 4, 16}, DType::f32, Device::cpu), short_out(Shape{3, 4, 16}, DType::f32, Device::cpu);
  const auto pair = make_in_memory_dcp_group(2), solo = make_in_memory_dcp_group(1);
  expect_error([&] { dcp_forward(layer, *plan, *pair[0], q, k, v, cache, short_out); }, "out");
  expect_error([&] { dcp_forward(layer, *plan, *solo[0], q, k, v, cache, out); }, "comm");
  expect_error([&] { dcp_forward(layer, *plan, *pair[1], q, k, v, cache, out); }, "comm");
  EXPECT_EQ(std::memcmp(cache.data(), filled.data(), cache.nbytes()), 0) << "a rejected step wrote the cache";
}

// What DCP cannot compute is an Error naming the argument: a layer with ALiBi (positions), a config
// that does not match the communicator.
TEST(DcpEmulation, UnsupportedLayersAndMismatchedConfigsAreErrors) {
  AttentionLayerParams p;
  p.num_heads = 2;
  p.num_kv_heads = 2;
  p.head_size = 16;
  p.block_size = kBlock;
  p.dtype = DType::f32;
  p.backend = "CPU";
  p.alibi_slopes = {0.5f, 0.25f};
  Attention layer(p);
  auto builder = layer.backend().make_builder(layer.kv_cache_spec(), layer.builder_config(8, 64, 256), Device::cpu);
  Tensor cache = layer.allocate_kv_cache(4);
  std::mt19937_64 rng(1);
  const Tensor q = random_tensor(Shape{1, 2, 16}, rng), kv = random_tensor(Shape{1, 2, 16}, rng);
  Tensor out(Shape{1, 2, 16}, DType::f32, Device::cpu);
  int num_blocks = 0;
  const CommonAttentionMetadataArgs g = global_step({{5, 1}}, 1, false, &num_blocks);
  auto group = make_in_memory_dcp_group(1);
  expect_error([&] { dcp_forward(layer, *builder, *group[0], DcpConfig{}, g, q, kv, kv, cache, out); }, "layer");
  expect_error([&] { dcp_forward(layer, *builder, *group[0], DcpConfig{2, 1, 1}, g, q, kv, kv, cache, out); }, "dcp");
  // The layer's own group must be the one dcp_forward is given; a bad one is rejected at construction.
  p.alibi_slopes.clear();
  Attention plain(p);
  EXPECT_FALSE(plain.impl().need_to_return_lse_for_decode());
  auto pair = make_in_memory_dcp_group(2);
  expect_error([&] { dcp_forward(plain, *builder, *pair[1], DcpConfig{2, 1, 1}, g, q, kv, kv, cache, out); }, "dcp");
  p.dcp = DcpConfig{2, 2, 1};
  expect_error([&] { Attention bad(p); }, "dcp.rank");
  p.dcp = DcpConfig{2, 0, 5};
  expect_error([&] { Attention bad(p); }, "dcp.interleave");
}

}  // namespace
}  // namespace pagedattn
