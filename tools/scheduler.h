// The serving simulator's scheduler: continuous batching with chunked prefill over a paged KV
// cache, as vLLM's V1 scheduler does it (FCFS).
//
// Every step:
//   1. requests whose arrival step has come join the waiting queue;
//   2. RUNNING requests are scheduled first, in admission order: each gets
//      min(tokens it still has to compute, tokens left in the budget) tokens (a decode is 1;
//      a prefill longer than the budget is chunked). A request that needs more blocks than are
//      free preempts the most recently admitted running request (its blocks are freed, it goes
//      back to the front of the waiting queue with num_computed_tokens = 0 and recomputes its
//      prompt plus the tokens it already generated) until the blocks fit;
//   3. if nothing was preempted, WAITING requests are admitted in order while the budget,
//      max_num_seqs and the free blocks allow;
//   4. the scheduled requests form the persistent batch (finished/unscheduled ones leave by
//      moving the last entry into the hole, new ones are appended, as vLLM's InputBatch), which
//      is then reordered decodes-first with reorder_batch_to_split_decodes_and_prefills.
// After the step runs, complete_step() advances every scheduled request; a request whose known
// tokens are all computed samples one token, and finishes (freeing its blocks) after
// output_len tokens. The last sampled token is never fed back, so a request computes
// prompt_len + output_len - 1 tokens (plus what preemption makes it recompute).
//
// Speculative decoding (num_speculative_tokens = K > 0, as vLLM with a draft model): a running
// request whose prompt is done schedules its last sampled token plus d = min(K, outputs it still
// needs - 1, budget - 1) draft tokens. After the step the drafts are verified: each is accepted
// with probability spec_acceptance_rate (seeded; the first rejection ends the chain), so the
// request gains a + 1 tokens (a accepted drafts and the token sampled after them) and
// num_computed_tokens advances by 1 + a; the cache slots of the d - a rejected drafts are written
// again by later steps. Then scheduled_tokens == requested - prefix hits + discarded + rejected.
//
// Prefix sharing (a shared system prompt): once a request has computed the full blocks of the
// system prompt, the scheduler keeps a reference to them (a one-entry prefix cache); requests
// admitted later incref those blocks and start with num_computed_tokens = the shared tokens, so
// they neither recompute nor rewrite them. The cache lets go of the blocks when an allocation
// could not otherwise succeed and at release_prefix_cache().
//
// All blocks of a request are kept for its whole life (also for sliding-window and chunked-local
// layers, whose backends mask what they do not see): simple and correct for a simulator, where
// vLLM would free blocks that fell out of the window.
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <vector>

#include "pagedattn/kv_cache.h"
#include "pagedattn/metadata.h"
#include "workload.h"

namespace pagedattn::cli {

struct SchedulerConfig {
  int block_size = 16;
  int num_blocks = 0;                   // blocks in the pool (each layer's cache has this many)
  int max_num_batched_tokens = 512;     // token budget per step
  int max_num_seqs = 64;                // running requests at most
  int max_model_len = 4096;             // prompt + output of one request at most
  bool chunked_prefill = true;
  int long_prefill_token_threshold = 0; // > 0: a prefill chunk takes at most this many tokens
  int decode_threshold = 1;             // query_len <= this counts as a decode (reorder)
  bool prefix_caching = true;           // share the system prompt's full blocks
  int num_speculative_tokens = 0;       // K drafts per decode (see above); 0 = none
  double spec_acceptance_rate = 0.7;    // probability that one draft is accepted
  uint64_t spec_seed = 0;               // seed of the acceptance draws
};

enum class RequestStatus { pending, waiting, running, finished };

struct SimRequest {
  RequestSpec spec;
  RequestStatus status = RequestStatus::pending;
  int num_computed_tokens = 0;
  int num_output_tokens = 0;            // sampled so far
  std::vector<int32_t> blocks;          // block table row (ids in the pool)
  int num_preemptions = 0;
  int admitted_step = -1;
  int finished_step = -1;

  // Tokens known so far: the prompt and every sampled token.
  int num_tokens() const { return spec.prompt_len + num_output_tokens; }
};

struct ScheduledRequest {
  int request_id = 0;
  int num_scheduled_tokens = 0;         // query_len this step
  int num_computed_tokens = 0;          // before this step (context)
  int num_draft_tokens = 0;             // of num_scheduled_tokens: drafts to verify (speculative)
  std::vector<int32_t> blocks;          // the request's block table row after allocation
  int seq_len() const { return num_computed_tokens + num_scheduled_tokens; }
};

struct StepSchedule {
  int step = 0;
  std::vector<ScheduledRequest> requests;  // batch order: decodes first
  BatchReorder reorder;                    // what reorder_batch_to_split_decodes_and_prefills did
  int num_scheduled_tokens = 0;
  int num_decode_tokens = 0;               // of requests with query_len <= decode_threshold
  int num_prefill_tokens = 0;
  std::vector<int> preempted;              // request ids preempted while scheduling this step
  std::vector<int> admitted;               // request ids admitted from the waiting queue
  bool empty() const { return requests.empty(); }
};

struct SchedulerStats {
  int64_t steps = 0;                // steps that ran something
  int64_t idle_steps = 0;           // steps skipped waiting for an arrival
  int64_t scheduled_tokens = 0;
  int64_t decode_tokens = 0;
  int64_t prefill_tokens = 0;
  int64_t preemptions = 0;
  int64_t discarded_tokens = 0;     // num_computed_tokens thrown away by preemptions
  int64_t prefix_hit_tokens = 0;    // tokens skipped by admissions that took the shared prefix
  // Speculative decoding: decodes that carried drafts, their drafts, how many were accepted.
  int64_t spec_decodes = 0;
  int64_t draft_tokens = 0;
  int64_t accepted_tokens = 0;
  int64_t rejected_tokens() const { return draft_tokens - accepted_tokens; }
  // Once done(): scheduled_tokens == requested_tokens() - prefix_hit_tokens + discarded_tokens
  // + rejected_tokens().
  int64_t prefix_evictions = 0;
  int finished_requests = 0;
  int max_running = 0;
};

class Scheduler {
 public:
  // Checks the configuration and that every request fits (throws UsageError naming the flag).
  Scheduler(SchedulerConfig config, std::vector<RequestSpec> requests);

  bool done() const { return stats_.finished_requests == static_cast<int>(requests_.size()); }
  // Schedules the next step (skipping idle steps until an arrival). Empty only when done().
  StepSchedule schedule();
  // Advances the requests of a step returned by the last schedule().
  void complete_step(const StepSchedule& step);
  // The backends' reorder_batch_threshold (vLLM takes it from the metadata builder): requests
  // with at most this many tokens count as decodes and go first. Must be >= 1.
  void set_decode_threshold(int threshold);
  // Drops the prefix cache's references (the pool is full again once every request finished).
  void release_prefix_cache();

  const SchedulerConfig& config() const { return config_; }
  const SchedulerStats& stats() const { return stats_; }
  const std::vector<SimRequest>& requests() const { return requests_; }
  const BlockPool& pool() const { return pool_; }
  const std::vector<int32_t>& prefix_cache_blocks() const { return prefix_blocks_; }
  int clock() const { return clock_; }
  // Columns of the block table: blocks of the longest request.
  int max_blocks_per_request() const { return max_blocks_per_request_; }
  int max_request_len() const { return max_request_len_; }
  // Tokens every request asks to compute: sum of prompt_len + output_len - 1.
  int64_t requested_tokens() const { return requested_tokens_; }

 private:
  int blocks_needed(const SimRequest& r, int num_new_tokens) const;
  bool try_evict_prefix_cache();
  void preempt(int request_id);
  void take_prefix(SimRequest& r);
  void maybe_register_prefix(const SimRequest& r);
  int shared_prefix_tokens(const SimRequest& r) const;
  int accepted_drafts(int num_drafts);

  SchedulerConfig config_;
  std::vector<SimRequest> requests_;
  BlockPool pool_;
  SchedulerStats stats_;
  std::deque<int> waiting_;
  std::vector<int> running_;        // admission order
  std::vector<int> batch_;          // persistent batch order (request ids)
  size_t next_arrival_ = 0;         // requests_ are sorted by arrival
  int clock_ = 0;
  std::vector<int32_t> prefix_blocks_;
  int max_blocks_per_request_ = 0;
  int max_request_len_ = 0;
  int64_t requested_tokens_ = 0;
  std::mt19937_64 spec_rng_;
};

}  // namespace pagedattn::cli
