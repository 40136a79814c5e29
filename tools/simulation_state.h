// The serving simulation's state (simulation.cpp; the --dcp step in simulation_dcp.cpp): its
// layers, KV-cache groups, scheduler, activations and the --dcp rank group. Internal to `run`.
#pragma once

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "dcp_ranks.h"
#include "invariance_check.h"
#include "pagedattn/pagedattn.h"
#include "presets.h"
#include "scheduler.h"
#include "simulation.h"

namespace pagedattn::cli {

// One model layer: a standard Attention layer, or an MLAAttention layer (shape.kind == mla).
struct LayerState {
  LayerShape shape;
  std::unique_ptr<Attention> layer;
  std::unique_ptr<MLAAttention> mla;
  Tensor cache;
  int group = -1;
  std::unique_ptr<Attention> ref_layer;  // --check: the same layer on REFERENCE (cpu)
  std::unique_ptr<MLAAttention> ref_mla;  // --check, MLA: the same layer on REFERENCE_MLA (cpu)
  Tensor ref_cache;
  int ref_group = -1;
  // --dcp N: ranks 1 .. N - 1 of the layer and their caches (rank 0 is layer / mla and cache).
  std::vector<std::unique_ptr<Attention>> rank_layers;
  std::vector<std::unique_ptr<MLAAttention>> rank_mla;
  std::vector<Tensor> rank_caches;
  double max_rel_error = 0;
  int checked_steps = 0;
  double checked_seconds = 0;    // the layer's forward on the checked steps
  double reference_seconds = 0;  // REFERENCE's forward of the same steps

  const std::string& name() const { return mla ? mla->name() : layer->name(); }
  const AttentionBackend& backend() const { return mla ? mla->backend() : layer->backend(); }
  KVCacheSpec kv_cache_spec() const { return mla ? mla->kv_cache_spec() : layer->kv_cache_spec(); }
  Tensor allocate_kv_cache(int64_t num_blocks) const {
    return mla ? mla->allocate_kv_cache(num_blocks) : layer->allocate_kv_cache(num_blocks);
  }
};


// One KV-cache group: the layers that share a backend, a KVCacheSpec and a builder config.
struct GroupState {
  const AttentionBackend* backend = nullptr;
  KVCacheSpec spec;
  BuilderConfig config;
  std::unique_ptr<AttentionMetadataBuilder> builder;
  std::vector<std::unique_ptr<AttentionMetadataBuilder>> rank_builders;  // --dcp: ranks 1 .. N - 1
  std::vector<int> layers;
  LayerShape shape;
};

// The step's arrays on the host (for the metadata and the accounting).
struct HostBatch {
  std::vector<int32_t> query_start_loc, seq_lens, query_lens, block_table;
  std::vector<int64_t> slot_mapping;
  int cols = 0;
};

struct Simulation::State {
  RunOptions options;
  const ModelPreset* preset = nullptr;
  std::vector<LayerState> layers;
  std::vector<GroupState> groups, ref_groups;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<InvarianceChecker> invariance;  // --check-invariance
  bool check = false;
  int threads = 0;
  int num_sms = 0;
  double tolerance = 0;
  // Random activations: N(0, 1) values; q/k/v are views at random offsets (fresh per layer and
  // step). pool_device is the copy on the run's device (empty on the cpu).
  Tensor pool_host, pool_device;
  int64_t pool_slack = 0;
  Tensor output, ref_output;  // flat; viewed as (T, Hq, Dv)
  // --dcp on CUDA: ranks 1 .. N - 1's copies of the pool and their outputs, on their GPUs (a step
  // copies nothing across GPUs: a peer copy on the legacy stream would wait for the other GPU's
  // queue, where the all-gather waits for this rank).
  std::vector<Tensor> rank_pools, rank_outputs;
  std::mt19937_64 rng;
  int64_t kv_cache_bytes = 0;
  int64_t kv_cache_bytes_per_rank = 0;

  // MLA layers: one kv_b_proj weight (H*(P+V), L), N(0, 1/L) values, shared by every layer (the
  // simulator has no model weights; each layer still splits it into its own W_UK / W_UV).
  Tensor kv_b_proj_host, kv_b_proj_device;
  // --dcp N: the group of N ranks (threads; on CUDA one GPU and one NCCL communicator each).
  std::unique_ptr<DcpRanks> dcp_ranks;
  std::vector<double> dcp_rank_seconds;  // each rank's own forward time (its dcp_forward, synchronized)
  DcpConfig dcp_config(int rank) const { return DcpConfig{options.dcp_world_size, rank, options.dcp_interleave}; }
  bool dcp() const { return options.dcp_world_size > 1; }

  int add_group(std::vector<GroupState>& list, const LayerState& layer, bool reference, Device device);
  // --dcp: one layer's step on every rank (one thread each; simulation_dcp.cpp): rank 0 writes
  // `out`, the others their own outputs; each rank's forward time is added to dcp_rank_seconds.
  void dcp_layer_step(LayerState& l, const CommonAttentionMetadataArgs& args, const TensorView (&in)[3],
                      const TensorView& out);
  HostBatch host_batch(const StepSchedule& step) const;
  StepRecord run_step(const StepSchedule& step, bool check_step, bool invariance_step, RunReport& report);
};

}  // namespace pagedattn::cli
