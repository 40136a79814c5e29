// `pagedattn run`: the serving simulation. Drives the real library the way a serving engine
// does, without model weights:
//
//   scheduler step (scheduler.h)
//     -> host arrays: query_start_loc, seq_lens, block_table, slot_mapping
//     -> CommonAttentionMetadata (make_common_attention_metadata)
//     -> one builder per KV-cache group (layers with the same backend and KVCacheSpec), build once;
//        a chunked-local group's builder (the library's, from make_builder) plans its virtual
//        batches itself, as the layer's own path does for any caller
//     -> every layer: ForwardContext::forward with random q/k/v of the layer's shape (views at
//        random offsets into a pool of N(0, 1) values, fresh per layer and step)
//
// --check-invariance re-runs sampled requests of every check_interval-th step through the first
// layer of each group, alone and in shuffled sub-batches (invariance_check.h).
//
// --dcp N: every layer runs on N ranks (threads; on the host an in-memory group, on CUDA GPU r and
// an NCCL communicator per rank: dcp_ranks.h) with its cache striped over them (pagedattn/dcp.h):
// N layers and caches per layer, N builders per group, the scheduler's blocks are virtual blocks of
// N x block_size tokens, and each layer's step is dcp_forward on every rank (planning included in
// its forward time; each rank's own time is reported). --check compares rank 0's
// output with REFERENCE layers whose block size is the virtual one (the unsharded layout).
//
// --check keeps a second set of layers forced to REFERENCE (on the CPU) with caches of their
// own, written with the same k/v every step (reshape_and_cache; the layer writes them itself on
// checked steps), and on every check_interval-th step runs them and compares the outputs:
// max ||out - ref|| / ||ref|| per layer against the DESIGN.md tolerance of the dtypes.
//
// Sliding-window and chunked-local layers keep every block of a request (full block tables) and
// the backend masks what a query does not see: simple and correct for a simulator.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "calibrate.h"
#include "cli_common.h"
#include "invariance_check.h"
#include "pagedattn/device.h"
#include "pagedattn/dtype.h"
#include "pagedattn/tensor.h"
#include "presets.h"
#include "scheduler.h"
#include "workload.h"

namespace pagedattn::cli {

struct RunOptions {
  std::string preset = "tiny";
  int num_layers = 0;                 // 0 = the preset's
  int tensor_parallel_size = 1;       // heads of one rank: num_heads / N, max(1, num_kv_heads / N)
  Device device = Device::cpu;
  std::string backend;                // "" = the selector's choice per layer
  DType dtype = DType::bf16;
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  int threads = 0;                    // 0 = OpenMP default
  uint64_t seed = 0;
  WorkloadConfig workload;
  int num_blocks = 0;                 // 0 = enough for every request at once, within kv_cache_gib
  double kv_cache_gib = 4.0;          // cap of the automatic num_blocks (all layers together)
  int max_num_batched_tokens = 512;
  int max_num_seqs = 64;
  int max_model_len = 0;              // 0 = the preset's
  bool chunked_prefill = true;
  int long_prefill_token_threshold = 0;
  int max_steps = 0;                  // 0 = until every request finished
  int dcp_world_size = 1;             // decode context parallelism: ranks (threads; one GPU each on CUDA) per layer
  int dcp_interleave = 1;             // tokens per rank stripe (divides block_size)
  int num_speculative_tokens = 0;     // K draft tokens per decode (scheduler.h); 0 = none
  double spec_acceptance_rate = 0.7;  // probability that one draft is accepted
  std::optional<bool> check;          // unset = on for the tiny preset only
  int check_interval = 4;             // check every n-th step (the first included)
  bool batch_invariant = false;       // BuilderConfig::batch_invariant of every group
  bool check_invariance = false;      // re-run sampled requests alone / in shuffled sub-batches
                                      // on every check_interval-th step (invariance_check.h)
  bool measure_peaks = true;          // calibrate (cached) for the fractions of peak
  bool progress = true;
};

struct LayerReport {
  std::string name;
  std::string kind;                   // LayerShape::describe()
  std::string backend;
  int group = 0;
  // --check
  int checked_steps = 0;
  double max_rel_error = 0;
  double tolerance = 0;
  double checked_seconds = 0;         // the layer's forward on the checked steps
  double reference_seconds = 0;       // REFERENCE's forward of the same steps (same inputs)
  bool passed() const { return max_rel_error <= tolerance; }
};

struct GroupReport {
  std::string backend;
  std::string spec;                   // kind, window/chunk, heads x size, dtype, page size
  int num_layers = 0;
  bool local_virtual_batches = false;  // chunked local attention: the builder plans virtual batches
};

struct StepRecord {
  int step = 0;
  int num_reqs = 0;
  int num_tokens = 0;
  int num_decode_tokens = 0;
  int num_prefill_tokens = 0;
  int num_draft_tokens = 0;           // speculative drafts among the step's tokens
  int num_preempted = 0;
  double plan_seconds = 0;
  double forward_seconds = 0;
  int cascade_plans = 0;              // group plans that took the cascade (shared-prefix) path
  bool checked = false;
};

struct RunReport {
  RunOptions options;
  std::string preset_summary;
  std::string preset_source;
  int threads = 0;
  int num_blocks = 0;
  int64_t kv_cache_bytes = 0;         // all layer caches of the run (check caches excluded; --dcp: every rank's)
  int64_t kv_cache_bytes_per_rank = 0;  // --dcp: one rank's caches (kv_cache_bytes / N)
  std::vector<double> dcp_rank_forward_seconds;  // --dcp: each rank's own dcp_forward time (synchronized)
  std::vector<LayerReport> layers;
  std::vector<GroupReport> groups;
  SchedulerStats stats;
  int num_requests = 0;
  int64_t requested_tokens = 0;
  bool completed = false;             // every request finished (not stopped by --max-steps)
  int free_blocks_at_end = 0;
  double plan_seconds = 0;            // builders' build()
  double forward_seconds = 0;         // layers' forward (cache write + attention)
  double wall_seconds = 0;            // the whole simulation, checks included
  int64_t plans = 0;                  // builder.build() calls (steps x groups)
  int64_t cascade_plans = 0;          // of which took the cascade path
  double kv_bytes = 0;                // bytes that must move: KV read once per request + q + o
  double flops = 0;                   // 2 (D + Dv) per visible (query, key) pair per head
  std::optional<MachinePeaks> peaks;
  std::string peaks_unavailable;      // why not, when peaks is empty
  bool check_enabled = false;
  int checked_steps = 0;
  bool check_passed = true;           // --check and --check-invariance
  bool batch_invariant_plans = false;  // the plans were built in the batch-invariant mode
  bool invariance_enabled = false;    // --check-invariance
  InvarianceStats invariance;
  std::vector<StepRecord> steps;

  double attention_seconds() const { return plan_seconds + forward_seconds; }
};

class Simulation {
 public:
  // Builds the layers (selector), caches, builders and the scheduler. Throws UsageError for bad
  // options and UnsupportedConfiguration when no backend fits a layer.
  explicit Simulation(RunOptions options);
  ~Simulation();
  Simulation(const Simulation&) = delete;
  Simulation& operator=(const Simulation&) = delete;

  // Runs to completion (or max_steps). Progress lines go to `progress` when not null.
  RunReport run(std::ostream* progress);

  const Scheduler& scheduler() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// --check's measure: ||out - ref|| / ||ref|| over every element (fp64), infinity when out has a
// non-finite element (e.g. poison left unwritten); the absolute norm when ref is all zeros.
double output_relative_error(const TensorView& out, const TensorView& ref);
// DESIGN.md §5 tolerance for activations of `dtype` and a cache of `kv_cache_dtype`:
// f32 1e-5, f16 2e-3, bf16 8e-3, fp8 KV 6e-2 (the loosest dtype involved wins).
double check_tolerance(DType dtype, const std::string& kv_cache_dtype);

// The final table (stdout) and the JSON document (--json).
void print_run_report(const RunReport& report, std::ostream& os);
std::string run_report_json(const RunReport& report);

}  // namespace pagedattn::cli
