// `pagedattn run`: options -> RunOptions -> Simulation -> report.
#include <CLI/CLI.hpp>
#include <fstream>
#include <memory>
#include <ostream>

#include "cli_common.h"
#include "commands.h"
#include "option_limits.h"
#include "option_parsing.h"
#include "pagedattn/error.h"
#include "simulation.h"

namespace pagedattn::cli {

namespace {

struct RunFlags {
  std::string preset = "tiny";
  int layers = 0;
  int tensor_parallel_size = 1;
  std::string device = "cpu";
  std::string backend;
  std::string dtype = "bfloat16";
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  int threads = 0;
  uint64_t seed = 0;
  std::string json_path;
  int num_requests = 16;
  std::string prompt_len = "uniform:32:384";
  std::string output_len = "uniform:8:64";
  int system_prompt_len = 0;
  double arrival_rate = 0;
  int max_num_batched_tokens = 512;
  int max_num_seqs = 64;
  int max_model_len = 0;
  int num_blocks = 0;
  double kv_cache_gib = 4.0;
  bool no_chunked_prefill = false;
  int long_prefill_token_threshold = 0;
  int max_steps = 0;
  int num_speculative_tokens = 0;
  double spec_acceptance_rate = 0.7;
  int dcp = 1, dcp_interleave = 1;
  bool check = false, no_check = false;
  int check_interval = 4;
  bool batch_invariant = false, check_invariance = false;
  bool no_peaks = false;
  bool quiet = false;
};

}  // namespace

Command add_run_command(CLI::App& parent) {
  auto f = std::make_shared<RunFlags>();
  CLI::App* app = parent.add_subcommand(
      "run",
      "Serving simulation: continuous batching with chunked prefill over a paged KV cache, through "
      "every attention layer of a model preset, with random q/k/v (no weights). Each step builds the "
      "CommonAttentionMetadata, one plan per KV-cache group (layers with the same backend and "
      "KVCacheSpec), then runs every layer. Sliding-window and chunked-local layers keep every block "
      "of a request (full block tables) and the backend masks what a query cannot see; chunked-local "
      "layers (llama4) plan through the library's local-attention builder (virtual batches, as vLLM). "
      "Preemption frees "
      "a request's blocks and recomputes it. Prints steps, tokens, attention time, tokens/s, KV "
      "bandwidth and FLOP/s as fractions of the peaks `pagedattn calibrate` measured. --check (default "
      "for tiny) re-runs sampled steps on REFERENCE (REFERENCE_MLA for MLA layers), fails beyond the "
      "DESIGN.md tolerance, and prints both forwards' times on those steps. --batch-invariant plans every step "
      "so that a request's output bits do not depend on the batch; --check-invariance re-runs sampled requests "
      "alone and in shuffled batches and fails on any differing bit. MLA layers (deepseek-v3) run "
      "MLAAttention with one random kv_b_proj weight shared by every layer. A model no backend can run fails with the selector's reasons. Exit codes: 0 "
      "ok, 1 check (or check-invariance) failed, 2 bad arguments, 3 no backend can run the model.");
  app->add_option("--preset", f->preset, "model preset: " + join(preset_names(), ", "))->capture_default_str();
  app->add_option("--layers", f->layers, "number of layers (default: the preset's); the preset's layer pattern repeats")
      ->check(integer_option(1, kMaxLayers));
  app->add_option("--tensor-parallel-size,--tp", f->tensor_parallel_size,
                  "simulate one rank of tensor parallelism: each layer keeps num_heads / N query heads and "
                  "max(1, num_kv_heads / N) KV heads (the MLA latent cache is replicated, as in vLLM)")
      ->capture_default_str()
      ->check(integer_option(1, kMaxTensorParallel));
  app->add_option("--device", f->device, "cpu or cuda")->capture_default_str();
  app->add_option("--backend", f->backend, "force one backend for every layer (default: the selector's choice per layer)");
  app->add_option("--dtype", f->dtype, "activation dtype: float32, float16, bfloat16")->capture_default_str();
  app->add_option("--kv-cache-dtype", f->kv_cache_dtype,
                  "auto, fp8 (= fp8_e4m3), fp8_e4m3, fp8_e5m2, bfloat16, float16, float32")->capture_default_str();
  app->add_option("--block-size", f->block_size, "tokens per KV-cache block")
      ->capture_default_str()
      ->check(integer_option(1, kMaxBlockSize));
  app->add_option("--threads", f->threads, "CPU threads (sets OpenMP's thread count; 0 = OpenMP's default)")
      ->check(integer_option(0, kMaxThreads));
  app->add_option("--seed", f->seed, "seed of the workload, the activations and the sinks")
      ->capture_default_str()
      ->check(seed_option());
  app->add_option("--json", f->json_path, "also write the full report (with per-step records) as JSON to FILE");
  auto* wl = "Workload";
  app->add_option("--num-requests", f->num_requests, "requests in the workload")
      ->capture_default_str()
      ->check(integer_option(1, kMaxNumRequests))
      ->group(wl);
  app->add_option("--prompt-len", f->prompt_len,
                  "prompt length distribution (after the system prompt): N, fixed:N, uniform:MIN:MAX, "
                  "lognormal:MEAN:STDEV[:MAX] (MAX default 8 x MEAN); lengths 1 to " +
                      std::to_string(kMaxTokens))
      ->capture_default_str()
      ->group(wl);
  app->add_option("--output-len", f->output_len, "output length distribution (same forms)")->capture_default_str()->group(wl);
  app->add_option("--system-prompt-len", f->system_prompt_len,
                  "tokens of a system prompt every request shares: once one request has computed its full "
                  "blocks, requests admitted later share them through the block pool's reference counts")
      ->capture_default_str()
      ->check(integer_option(0, kMaxTokens))
      ->group(wl);
  app->add_option("--arrival-rate", f->arrival_rate,
                  "requests per scheduler step (Poisson); 0 = all at once")
      ->capture_default_str()
      ->check(number_option(0, kMaxArrivalRate))
      ->group(wl);
  auto* sched = "Scheduler and budgets";
  app->add_option("--max-num-batched-tokens", f->max_num_batched_tokens, "token budget per step")
      ->capture_default_str()
      ->check(integer_option(1, kMaxBatchedTokens))
      ->group(sched);
  app->add_option("--max-num-seqs", f->max_num_seqs, "running requests at most")
      ->capture_default_str()
      ->check(integer_option(1, kMaxNumSeqs))
      ->group(sched);
  app->add_option("--max-model-len", f->max_model_len, "longest prompt + output (0 = the preset's)")
      ->check(integer_option(0, kMaxTokens))
      ->group(sched);
  app->add_option("--num-blocks", f->num_blocks,
                  "KV-cache blocks (default: enough for every request at once, capped by --kv-cache-gib); "
                  "fewer blocks make the scheduler preempt; 0 = automatic; also limited by the host's (the "
                  "GPU's) memory")
      ->check(integer_option(0, kMaxNumBlocks))
      ->group(sched);
  app->add_option("--kv-cache-gib", f->kv_cache_gib, "cap of the automatic --num-blocks, all layers together")
      ->capture_default_str()
      ->check(number_option(0, kMaxKvCacheGib, true))
      ->group(sched);
  app->add_flag("--no-chunked-prefill", f->no_chunked_prefill, "a prefill must fit in one step's budget")->group(sched);
  app->add_option("--long-prefill-token-threshold", f->long_prefill_token_threshold,
                  "a prefill chunk takes at most this many tokens (0 = the budget)")
      ->check(integer_option(0, kMaxTokens))
      ->group(sched);
  app->add_option("--num-speculative-tokens", f->num_speculative_tokens,
                  "speculative decoding: every decode carries K draft tokens after its sampled one (a (1 + K)-token "
                  "decode; the builders take it as a decode: BuilderConfig::num_speculative_tokens); the drafts are "
                  "accepted at --spec-acceptance-rate (seeded by --seed), and the report gives the accepted tokens "
                  "per step")
      ->check(integer_option(0, kMaxTokens))
      ->group(sched);
  app->add_option("--dcp", f->dcp,
                  "decode context parallelism: every layer's KV cache striped over N ranks (threads of this process; "
                  "--device cpu: an in-memory group, --device cuda: GPU r and an NCCL communicator for rank r; "
                  "pagedattn/dcp.h), each row attended on every rank and merged by LSE; reports the KV memory and "
                  "the attention time per rank. Not for layers with sliding windows, chunked local attention, sinks "
                  "or ALiBi")
      ->capture_default_str()
      ->check(integer_option(1, kMaxDcpRanks))
      ->group(sched);
  app->add_option("--dcp-interleave", f->dcp_interleave,
                  "--dcp: tokens of one stripe (vLLM's cp_kv_cache_interleave_size; divides --block-size)")
      ->capture_default_str()
      ->check(integer_option(1, kMaxBlockSize))
      ->group(sched);
  app->add_option("--spec-acceptance-rate", f->spec_acceptance_rate,
                  "probability that one draft token is accepted (the first rejection ends a request's chain)")
      ->capture_default_str()
      ->check(number_option(0, 1, true))
      ->group(sched);
  app->add_option("--max-steps", f->max_steps, "stop after this many steps (0 = run every request to completion)")
      ->check(integer_option(0, kMaxInt))
      ->group(sched);
  auto* ver = "Verification and output";
  app->add_flag("--check", f->check, "re-run sampled steps on REFERENCE and compare (default for tiny)")->group(ver);
  app->add_flag("--no-check", f->no_check, "do not compare with REFERENCE")->group(ver)->excludes("--check");
  app->add_option("--check-interval", f->check_interval, "check every n-th step")
      ->capture_default_str()
      ->check(integer_option(1, kMaxInt))
      ->group(ver);
  app->add_flag("--batch-invariant", f->batch_invariant,
                "plan every step in the batch-invariant mode (BuilderConfig::batch_invariant; also "
                "PAGEDATTN_BATCH_INVARIANT=1): a request's output bits do not depend on the rest of the batch; "
                "no cascade, fixed split-KV sizes (docs/batch_invariance.md)")
      ->group(ver);
  app->add_flag("--check-invariance", f->check_invariance,
                "on every --check-interval-th step, re-run sampled requests through the first layer of each "
                "KV-cache group alone and in shuffled sub-batches of the step, and fail (exit 1) on any "
                "differing output bit; without --batch-invariant this shows what the default plans change")
      ->group(ver);
  app->add_flag("--no-peaks", f->no_peaks, "do not calibrate / report fractions of the machine's peaks")->group(ver);
  app->add_flag("--quiet", f->quiet, "no progress on stderr")->group(ver);

  CommandAction action = [f, app](Streams& io) -> int {
    RunOptions o;
    o.preset = f->preset;
    o.num_layers = f->layers;
    o.tensor_parallel_size = f->tensor_parallel_size;
    o.device = parse_device_flag(f->device, "--device");
    o.backend = f->backend;
    o.dtype = parse_activation_dtype_flag(f->dtype, "--dtype");
    check_kv_cache_dtype_flag(f->kv_cache_dtype, "--kv-cache-dtype");
    o.kv_cache_dtype = f->kv_cache_dtype;
    o.block_size = f->block_size;
    o.threads = f->threads;
    o.seed = f->seed;
    o.workload.num_requests = f->num_requests;
    o.workload.prompt_len = LengthDistribution::parse(f->prompt_len, "--prompt-len");
    o.workload.output_len = LengthDistribution::parse(f->output_len, "--output-len");
    o.workload.system_prompt_len = f->system_prompt_len;
    o.workload.arrival_rate = f->arrival_rate;
    o.workload.seed = o.seed;
    o.max_num_batched_tokens = f->max_num_batched_tokens;
    o.max_num_seqs = f->max_num_seqs;
    o.max_model_len = f->max_model_len;
    o.num_blocks = f->num_blocks;
    o.kv_cache_gib = f->kv_cache_gib;
    o.chunked_prefill = !f->no_chunked_prefill;
    o.long_prefill_token_threshold = f->long_prefill_token_threshold;
    o.max_steps = f->max_steps;
    o.num_speculative_tokens = f->num_speculative_tokens;
    o.dcp_world_size = f->dcp;
    o.dcp_interleave = f->dcp_interleave;
    o.spec_acceptance_rate = f->spec_acceptance_rate;
    if (f->check) o.check = true;
    if (f->no_check) o.check = false;
    o.check_interval = f->check_interval;
    o.batch_invariant = f->batch_invariant;
    o.check_invariance = f->check_invariance;
    o.measure_peaks = !f->no_peaks;
    o.progress = !f->quiet;

    std::ofstream json_file;
    if (app->count("--json") > 0) {  // fail before the run, not after it
      check_file_name("--json", f->json_path);
      json_file.open(f->json_path);
      if (!json_file) throw UsageError("--json: cannot write '" + f->json_path + "'");
    }
    Simulation sim(o);
    RunReport report = sim.run(o.progress ? &io.err : nullptr);
    print_run_report(report, io.out);
    if (json_file.is_open()) json_file << run_report_json(report) << "\n";
    return report.check_passed ? kExitOk : kExitFailure;
  };
  return Command{app, action};
}

}  // namespace pagedattn::cli
