#include "scheduler.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cli_common.h"

namespace pagedattn::cli {

namespace {
int cdiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

Scheduler::Scheduler(SchedulerConfig config, std::vector<RequestSpec> requests)
    : config_(config), pool_(std::max(config.num_blocks, 0)), spec_rng_(config.spec_seed) {
  const SchedulerConfig& c = config_;
  if (c.block_size < 1) throw UsageError("--block-size: " + str(c.block_size) + " must be >= 1");
  if (c.num_blocks < 1) throw UsageError("--num-blocks: " + str(c.num_blocks) + " must be >= 1");
  if (c.max_num_seqs < 1) throw UsageError("--max-num-seqs: " + str(c.max_num_seqs) + " must be >= 1");
  if (c.max_num_batched_tokens < c.block_size) {
    throw UsageError("--max-num-batched-tokens: " + str(c.max_num_batched_tokens) +
                     " is smaller than one block (--block-size " + str(c.block_size) + ")");
  }
  if (c.long_prefill_token_threshold < 0) {
    throw UsageError("--long-prefill-token-threshold: " + str(c.long_prefill_token_threshold) +
                     " must be >= 0 (0 = no limit)");
  }
  if (c.decode_threshold < 1) throw UsageError("decode_threshold: " + str(c.decode_threshold) + " must be >= 1");
  if (c.num_speculative_tokens < 0 || c.num_speculative_tokens >= c.max_num_batched_tokens) {
    throw UsageError("--num-speculative-tokens: " + str(c.num_speculative_tokens) +
                     " must be >= 0 and leave room for the sampled token in --max-num-batched-tokens " +
                     str(c.max_num_batched_tokens));
  }
  if (!(c.spec_acceptance_rate >= 0.0 && c.spec_acceptance_rate <= 1.0)) {
    throw UsageError("--spec-acceptance-rate: " + std::to_string(c.spec_acceptance_rate) +
                     " must be a probability in [0, 1]");
  }
  if (requests.empty()) throw UsageError("--num-requests: the workload has no request");
  std::stable_sort(requests.begin(), requests.end(),
                   [](const RequestSpec& a, const RequestSpec& b) { return a.arrival_step < b.arrival_step; });
  for (const RequestSpec& spec : requests) {
    if (spec.prompt_len < 1 || spec.output_len < 1) {
      throw UsageError("request " + str(spec.id) + ": prompt length " + str(spec.prompt_len) +
                       " and output length " + str(spec.output_len) + " must both be >= 1");
    }
    int64_t total = int64_t{spec.prompt_len} + spec.output_len;
    if (total > c.max_model_len) {
      throw UsageError("--max-model-len: request " + str(spec.id) + " has " + str(spec.prompt_len) +
                       " prompt + " + str(spec.output_len) + " output tokens = " + str(total) +
                       " > max_model_len " + str(c.max_model_len));
    }
    int64_t computed = total - 1;
    int blocks = cdiv(computed, c.block_size);
    if (blocks > c.num_blocks) {
      throw UsageError("--num-blocks: " + str(c.num_blocks) + " blocks cannot hold request " + str(spec.id) +
                       ", which needs " + str(blocks) + " blocks of " + str(c.block_size) + " tokens");
    }
    if (!c.chunked_prefill && computed > c.max_num_batched_tokens) {
      throw UsageError("--max-num-batched-tokens: " + str(c.max_num_batched_tokens) +
                       " cannot hold the " + str(computed) + " tokens request " + str(spec.id) +
                       " may have to prefill at once without chunked prefill");
    }
    max_blocks_per_request_ = std::max(max_blocks_per_request_, blocks);
    max_request_len_ = std::max<int>(max_request_len_, static_cast<int>(total));
    requested_tokens_ += computed;
    SimRequest r;
    r.spec = spec;
    requests_.push_back(std::move(r));
  }
  // Ids index requests_ from here on.
  for (size_t i = 0; i < requests_.size(); ++i) requests_[i].spec.id = static_cast<int>(i);
}

int Scheduler::blocks_needed(const SimRequest& r, int num_new_tokens) const {
  int total = cdiv(int64_t{r.num_computed_tokens} + num_new_tokens, config_.block_size);
  return std::max(0, total - static_cast<int>(r.blocks.size()));
}

int Scheduler::shared_prefix_tokens(const SimRequest& r) const {
  if (!config_.prefix_caching || r.spec.shared_prefix_len <= 0) return 0;
  // Whole blocks of the system prompt, leaving at least one token to compute (as vLLM).
  int shareable = std::min(r.spec.shared_prefix_len, r.num_tokens() - 1);
  return shareable / config_.block_size * config_.block_size;
}

bool Scheduler::try_evict_prefix_cache() {
  if (prefix_blocks_.empty()) return false;
  bool frees_a_block = std::any_of(prefix_blocks_.begin(), prefix_blocks_.end(),
                                   [&](int32_t b) { return pool_.ref_count(b) == 1; });
  if (!frees_a_block) return false;
  pool_.free(prefix_blocks_);
  prefix_blocks_.clear();
  ++stats_.prefix_evictions;
  return true;
}

void Scheduler::take_prefix(SimRequest& r) {
  int tokens = shared_prefix_tokens(r);
  int num_blocks = std::min(static_cast<int>(prefix_blocks_.size()), tokens / config_.block_size);
  if (num_blocks <= 0) return;
  std::vector<int32_t> shared(prefix_blocks_.begin(), prefix_blocks_.begin() + num_blocks);
  pool_.incref(shared);
  r.blocks = std::move(shared);
  r.num_computed_tokens = num_blocks * config_.block_size;
  stats_.prefix_hit_tokens += r.num_computed_tokens;
}

void Scheduler::maybe_register_prefix(const SimRequest& r) {
  if (!prefix_blocks_.empty()) return;
  int num_blocks = shared_prefix_tokens(r) / config_.block_size;
  if (num_blocks <= 0 || r.num_computed_tokens < num_blocks * config_.block_size) return;
  prefix_blocks_.assign(r.blocks.begin(), r.blocks.begin() + num_blocks);
  pool_.incref(prefix_blocks_);
}

void Scheduler::preempt(int request_id) {
  SimRequest& r = requests_[static_cast<size_t>(request_id)];
  stats_.discarded_tokens += r.num_computed_tokens;
  ++stats_.preemptions;
  ++r.num_preemptions;
  pool_.free(r.blocks);
  r.blocks.clear();
  r.num_computed_tokens = 0;
  r.status = RequestStatus::waiting;
  running_.erase(std::find(running_.begin(), running_.end(), request_id));
  waiting_.push_front(request_id);
}

StepSchedule Scheduler::schedule() {
  StepSchedule out;
  if (done()) return out;
  auto admit_arrivals = [&] {
    while (next_arrival_ < requests_.size() && requests_[next_arrival_].spec.arrival_step <= clock_) {
      requests_[next_arrival_].status = RequestStatus::waiting;
      waiting_.push_back(static_cast<int>(next_arrival_));
      ++next_arrival_;
    }
  };
  admit_arrivals();
  if (running_.empty() && waiting_.empty()) {  // idle until the next arrival
    int next = requests_[next_arrival_].spec.arrival_step;
    stats_.idle_steps += next - clock_;
    clock_ = next;
    admit_arrivals();
  }
  out.step = clock_;

  std::vector<std::pair<int, int>> scheduled;  // (request id, tokens), in scheduling order
  std::vector<int> drafts_of(requests_.size(), 0);
  int budget = config_.max_num_batched_tokens;
  auto chunk = [&](const SimRequest& r) {
    int n = std::min(r.num_tokens() - r.num_computed_tokens, budget);
    if (config_.long_prefill_token_threshold > 0) n = std::min(n, config_.long_prefill_token_threshold);
    return n;
  };
  // Drafts of a decode (its prompt done, one sampled token left to feed back), 0 otherwise.
  auto drafts = [&](const SimRequest& r) {
    if (config_.num_speculative_tokens == 0 || r.num_output_tokens == 0 ||
        r.num_tokens() - r.num_computed_tokens != 1) {
      return 0;
    }
    return std::max(0, std::min({config_.num_speculative_tokens, r.spec.output_len - r.num_output_tokens - 1,
                                 budget - 1}));
  };

  // 1. running requests, admission order; preempt from the back when blocks run out.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    int id = running_[i];
    SimRequest& r = requests_[static_cast<size_t>(id)];
    const int d = drafts(r);
    int n = chunk(r) + d;
    int need = blocks_needed(r, n);
    bool self_preempted = false;
    while (!pool_.can_allocate(need)) {
      if (try_evict_prefix_cache()) continue;
      int victim = running_.back();
      preempt(victim);
      out.preempted.push_back(victim);
      if (victim == id) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    std::vector<int32_t> fresh = pool_.allocate(need);
    r.blocks.insert(r.blocks.end(), fresh.begin(), fresh.end());
    scheduled.emplace_back(id, n);
    drafts_of[static_cast<size_t>(id)] = d;
    budget -= n;
    ++i;
  }

  // 2. waiting requests, FCFS, only when nothing was preempted this step.
  if (out.preempted.empty()) {
    while (!waiting_.empty() && budget > 0 && static_cast<int>(running_.size()) < config_.max_num_seqs) {
      int id = waiting_.front();
      SimRequest& r = requests_[static_cast<size_t>(id)];
      int skipped = 0;
      if (r.blocks.empty() && r.num_computed_tokens == 0) {
        take_prefix(r);
        skipped = r.num_computed_tokens;
      }
      int remaining = r.num_tokens() - r.num_computed_tokens;
      int n = chunk(r);
      int need = blocks_needed(r, n);
      bool fits = (config_.chunked_prefill || n == remaining) && pool_.can_allocate(need);
      if (!fits) {
        // Give back the shared prefix; retry once the prefix cache has let go of its blocks.
        if (skipped > 0) {
          pool_.free(r.blocks);
          r.blocks.clear();
          r.num_computed_tokens = 0;
          stats_.prefix_hit_tokens -= skipped;
        }
        if (config_.chunked_prefill || n == remaining) {
          if (try_evict_prefix_cache()) continue;
        }
        break;
      }
      std::vector<int32_t> fresh = pool_.allocate(need);
      r.blocks.insert(r.blocks.end(), fresh.begin(), fresh.end());
      waiting_.pop_front();
      running_.push_back(id);
      r.status = RequestStatus::running;
      r.admitted_step = clock_;
      out.admitted.push_back(id);
      scheduled.emplace_back(id, n);
      budget -= n;
    }
  }
  if (scheduled.empty()) {
    // Cannot happen for a workload the constructor accepted: a lone request always fits.
    throw std::logic_error("Scheduler: nothing could be scheduled at step " + str(clock_) + " with " +
                           str(static_cast<int64_t>(running_.size())) + " running and " +
                           str(static_cast<int64_t>(waiting_.size())) + " waiting requests");
  }
  stats_.max_running = std::max(stats_.max_running, static_cast<int>(running_.size()));

  // 3. persistent batch: drop entries not scheduled (the last entry moves into each hole, as
  // InputBatch.condense), append new ones, then reorder decodes-first.
  std::vector<int> tokens_of(requests_.size(), 0);
  for (auto [id, n] : scheduled) tokens_of[static_cast<size_t>(id)] = n;
  std::vector<int> batch = batch_;
  std::vector<bool> hole(batch.size());
  for (size_t i = 0; i < batch.size(); ++i) hole[i] = tokens_of[static_cast<size_t>(batch[i])] == 0;
  for (size_t h = 0; h < batch.size(); ++h) {
    if (!hole[h]) continue;
    size_t last = batch.size();
    while (last > h + 1 && hole[last - 1]) --last;
    if (last <= h + 1) break;
    batch[h] = batch[last - 1];
    hole[h] = false;
    hole[last - 1] = true;
  }
  size_t kept = 0;
  while (kept < batch.size() && !hole[kept]) ++kept;
  batch.resize(kept);
  std::vector<bool> in_batch(requests_.size(), false);
  for (int id : batch) in_batch[static_cast<size_t>(id)] = true;
  for (auto [id, n] : scheduled) {
    if (!in_batch[static_cast<size_t>(id)]) batch.push_back(id);
  }
  std::vector<int32_t> num_scheduled_tokens;
  for (int id : batch) num_scheduled_tokens.push_back(tokens_of[static_cast<size_t>(id)]);
  out.reorder = reorder_batch_to_split_decodes_and_prefills(num_scheduled_tokens, config_.decode_threshold);
  if (out.reorder.order.size() == batch.size()) {
    std::vector<int> reordered(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) reordered[i] = batch[static_cast<size_t>(out.reorder.order[i])];
    batch = std::move(reordered);
  }
  batch_ = batch;

  for (int id : batch) {
    const SimRequest& r = requests_[static_cast<size_t>(id)];
    ScheduledRequest s;
    s.request_id = id;
    s.num_scheduled_tokens = tokens_of[static_cast<size_t>(id)];
    s.num_computed_tokens = r.num_computed_tokens;
    s.num_draft_tokens = drafts_of[static_cast<size_t>(id)];
    s.blocks = r.blocks;
    out.num_scheduled_tokens += s.num_scheduled_tokens;
    if (s.num_scheduled_tokens <= config_.decode_threshold) out.num_decode_tokens += s.num_scheduled_tokens;
    else out.num_prefill_tokens += s.num_scheduled_tokens;
    out.requests.push_back(std::move(s));
  }
  return out;
}

void Scheduler::complete_step(const StepSchedule& step) {
  for (const ScheduledRequest& s : step.requests) {
    SimRequest& r = requests_[static_cast<size_t>(s.request_id)];
    if (r.status != RequestStatus::running || r.num_computed_tokens != s.num_computed_tokens) {
      throw std::logic_error("Scheduler::complete_step: request " + str(s.request_id) +
                             " does not match the last schedule()");
    }
    r.num_computed_tokens += s.num_scheduled_tokens - s.num_draft_tokens;
    if (config_.prefix_caching) maybe_register_prefix(r);
    if (r.num_computed_tokens == r.num_tokens()) {
      // Sampled: the accepted drafts and the token after them (a drafted decode is always here).
      const int accepted = s.num_draft_tokens > 0 ? accepted_drafts(s.num_draft_tokens) : 0;
      if (s.num_draft_tokens > 0) {
        ++stats_.spec_decodes;
        stats_.draft_tokens += s.num_draft_tokens;
        stats_.accepted_tokens += accepted;
      }
      r.num_output_tokens += 1 + accepted;
      r.num_computed_tokens += accepted;
      if (r.num_output_tokens == r.spec.output_len) {
        pool_.free(r.blocks);
        r.blocks.clear();
        r.status = RequestStatus::finished;
        r.finished_step = clock_;
        running_.erase(std::find(running_.begin(), running_.end(), s.request_id));
        ++stats_.finished_requests;
      }
    }
  }
  ++stats_.steps;
  stats_.scheduled_tokens += step.num_scheduled_tokens;
  stats_.decode_tokens += step.num_decode_tokens;
  stats_.prefill_tokens += step.num_prefill_tokens;
  ++clock_;
}

int Scheduler::accepted_drafts(int num_drafts) {
  std::bernoulli_distribution accept(config_.spec_acceptance_rate);
  int accepted = 0;
  while (accepted < num_drafts && accept(spec_rng_)) ++accepted;
  return accepted;
}

void Scheduler::set_decode_threshold(int threshold) {
  if (threshold < 1) throw UsageError("decode_threshold: " + str(threshold) + " must be >= 1");
  config_.decode_threshold = threshold;
}

void Scheduler::release_prefix_cache() {
  if (prefix_blocks_.empty()) return;
  pool_.free(prefix_blocks_);
  prefix_blocks_.clear();
}

}  // namespace pagedattn::cli
