// Scheduler invariants, checked after every schedule() of whole simulated runs:
//   - a step never exceeds the token budget or max_num_seqs, and schedules something;
//   - decodes come first in the batch;
//   - slot mappings never collide between the requests of a step, and no token is written
//     into a block another request (or the prefix cache) also references;
//   - every block's reference count equals the references the requests and the prefix cache
//     hold, and the free list holds exactly the unreferenced blocks;
// and at the end: every request generated its tokens, the pool is full again, and
// scheduled tokens == requested tokens - prefix-shared tokens + tokens thrown away by preemption.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <stdexcept>

#include "cli_common.h"
#include "scheduler.h"
#include "workload.h"

namespace pagedattn::cli {
namespace {

int cdiv(int a, int b) { return (a + b - 1) / b; }

struct RunSummary {
  int steps = 0;
  int mixed_steps = 0;            // steps with both decodes and prefills
  int max_block_refs = 0;         // highest reference count seen on a block
  SchedulerStats stats;
};

void check_step(const Scheduler& s, const StepSchedule& step, RunSummary& summary) {
  const SchedulerConfig& c = s.config();
  ASSERT_FALSE(step.empty()) << "step " << step.step;
  EXPECT_LE(step.num_scheduled_tokens, c.max_num_batched_tokens);
  EXPECT_LE(static_cast<int>(step.requests.size()), c.max_num_seqs);
  int tokens = 0, decodes = 0, prefills = 0;
  bool seen_prefill = false;
  std::set<int64_t> slots;
  std::set<int> ids;
  for (const ScheduledRequest& r : step.requests) {
    EXPECT_TRUE(ids.insert(r.request_id).second) << "request " << r.request_id << " twice in step " << step.step;
    EXPECT_GT(r.num_scheduled_tokens, 0);
    EXPECT_GE(r.num_draft_tokens, 0);
    EXPECT_LE(r.num_draft_tokens, c.num_speculative_tokens);
    if (r.num_draft_tokens > 0) {
      EXPECT_EQ(r.num_scheduled_tokens, 1 + r.num_draft_tokens) << "a drafted decode feeds its sampled token + drafts";
    }
    tokens += r.num_scheduled_tokens;
    if (r.num_scheduled_tokens <= c.decode_threshold) {
      EXPECT_FALSE(seen_prefill) << "a decode after a prefill in step " << step.step;
      ++decodes;
    } else {
      seen_prefill = true;
      ++prefills;
    }
    ASSERT_EQ(static_cast<int>(r.blocks.size()), cdiv(r.seq_len(), c.block_size))
        << "request " << r.request_id << " step " << step.step;
    for (int pos = r.num_computed_tokens; pos < r.seq_len(); ++pos) {
      int32_t block = r.blocks[static_cast<size_t>(pos / c.block_size)];
      int64_t slot = int64_t{block} * c.block_size + pos % c.block_size;
      EXPECT_TRUE(slots.insert(slot).second) << "slot " << slot << " written twice in step " << step.step;
      EXPECT_EQ(s.pool().ref_count(block), 1)
          << "request " << r.request_id << " writes position " << pos << " into shared block " << block;
    }
  }
  EXPECT_EQ(tokens, step.num_scheduled_tokens);
  if (decodes > 0 && prefills > 0) ++summary.mixed_steps;

  // Reference counts: requests holding blocks (running) + the prefix cache.
  std::map<int32_t, int> refs;
  for (const SimRequest& r : s.requests()) {
    if (r.status != RequestStatus::running) {
      EXPECT_TRUE(r.blocks.empty()) << "request " << r.spec.id << " holds blocks while not running";
    }
    for (int32_t b : r.blocks) ++refs[b];
  }
  for (int32_t b : s.prefix_cache_blocks()) ++refs[b];
  int unreferenced = 0;
  for (int32_t b = 0; b < s.pool().num_blocks(); ++b) {
    int expected = refs.count(b) ? refs[b] : 0;
    EXPECT_EQ(s.pool().ref_count(b), expected) << "block " << b << " step " << step.step;
    if (expected == 0) ++unreferenced;
    summary.max_block_refs = std::max(summary.max_block_refs, expected);
  }
  EXPECT_EQ(s.pool().num_free_blocks(), unreferenced);
}

RunSummary run_to_completion(Scheduler& s) {
  RunSummary summary;
  while (!s.done()) {
    StepSchedule step = s.schedule();
    check_step(s, step, summary);
    if (::testing::Test::HasFatalFailure()) return summary;
    s.complete_step(step);
    if (++summary.steps > 100000) {
      ADD_FAILURE() << "no progress after 100000 steps";
      return summary;
    }
  }
  s.release_prefix_cache();
  summary.stats = s.stats();
  EXPECT_TRUE(s.schedule().empty());
  EXPECT_EQ(s.pool().num_free_blocks(), s.pool().num_blocks()) << "blocks were not all returned";
  for (const SimRequest& r : s.requests()) {
    EXPECT_EQ(r.status, RequestStatus::finished);
    EXPECT_EQ(r.num_output_tokens, r.spec.output_len) << "request " << r.spec.id;
    EXPECT_GE(r.admitted_step, r.spec.arrival_step) << "request " << r.spec.id << " admitted before it arrived";
  }
  const SchedulerStats& st = s.stats();
  EXPECT_EQ(st.scheduled_tokens,
            s.requested_tokens() - st.prefix_hit_tokens + st.discarded_tokens + st.rejected_tokens());
  EXPECT_LE(st.accepted_tokens, st.draft_tokens);
  EXPECT_EQ(st.scheduled_tokens, st.decode_tokens + st.prefill_tokens);
  EXPECT_EQ(st.finished_requests, static_cast<int>(s.requests().size()));
  return summary;
}

WorkloadConfig workload(int n, const std::string& prompt, const std::string& output, uint64_t seed,
                        int system_prompt = 0, double rate = 0) {
  WorkloadConfig w;
  w.num_requests = n;
  w.prompt_len = LengthDistribution::parse(prompt, "--prompt-len");
  w.output_len = LengthDistribution::parse(output, "--output-len");
  w.system_prompt_len = system_prompt;
  w.arrival_rate = rate;
  w.seed = seed;
  return w;
}

SchedulerConfig config(int num_blocks, int budget = 256, int block_size = 16, int max_seqs = 64) {
  SchedulerConfig c;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = max_seqs;
  c.max_model_len = 1 << 20;
  return c;
}

TEST(Scheduler, AllAtOnceSchedulesExactlyTheRequestedTokens) {
  Scheduler s(config(1000), generate_workload(workload(12, "uniform:10:300", "uniform:1:40", 3)));
  RunSummary r = run_to_completion(s);
  EXPECT_EQ(r.stats.preemptions, 0);
  EXPECT_EQ(r.stats.prefix_hit_tokens, 0);
  EXPECT_EQ(r.stats.scheduled_tokens, s.requested_tokens());
  int64_t requested = 0;
  for (const SimRequest& q : s.requests()) requested += q.spec.prompt_len + q.spec.output_len - 1;
  EXPECT_EQ(s.requested_tokens(), requested);
  EXPECT_GT(r.mixed_steps, 0) << "the workload should mix decodes and prefills in some step";
}

TEST(Scheduler, ChunkedPrefillSplitsAPromptLongerThanTheBudget) {
  Scheduler s(config(200, 128), generate_workload(workload(1, "1000", "3", 0)));
  StepSchedule first = s.schedule();
  ASSERT_EQ(first.requests.size(), 1u);
  EXPECT_EQ(first.num_scheduled_tokens, 128);
  s.complete_step(first);
  RunSummary r = run_to_completion(s);
  // ceil(1000 / 128) = 8 prefill steps, then 2 decodes.
  EXPECT_EQ(r.steps + 1, 10);
}

TEST(Scheduler, LongPrefillThresholdCapsEveryChunk) {
  SchedulerConfig c = config(200, 256);
  c.long_prefill_token_threshold = 48;
  Scheduler s(c, generate_workload(workload(3, "200", "2", 0)));
  while (!s.done()) {
    StepSchedule step = s.schedule();
    for (const ScheduledRequest& r : step.requests) EXPECT_LE(r.num_scheduled_tokens, 48);
    s.complete_step(step);
  }
}

TEST(Scheduler, PreemptionFreesAndRecomputesUntilEveryRequestCompletes) {
  // 24 blocks of 16 tokens for 10 requests of up to ~200 tokens: the pool runs out.
  Scheduler s(config(24, 128), generate_workload(workload(10, "uniform:40:150", "uniform:20:60", 11)));
  RunSummary r = run_to_completion(s);
  EXPECT_GT(r.stats.preemptions, 0);
  EXPECT_GT(r.stats.discarded_tokens, 0);
  EXPECT_GT(r.stats.scheduled_tokens, s.requested_tokens());
  int preempted_requests = 0;
  for (const SimRequest& q : s.requests()) preempted_requests += q.num_preemptions > 0;
  EXPECT_GT(preempted_requests, 0);
}

TEST(Scheduler, SharedSystemPromptIsSharedThroughBlockReferenceCounts) {
  // 100-token system prompt, block 16: 6 full blocks shared by every later request.
  Scheduler s(config(400, 512), generate_workload(workload(8, "uniform:5:50", "uniform:2:20", 5, 100)));
  RunSummary r = run_to_completion(s);
  EXPECT_GT(r.stats.prefix_hit_tokens, 0);
  EXPECT_EQ(r.stats.prefix_hit_tokens % 96, 0);  // whole shared blocks (6 x 16) per admission
  EXPECT_GE(r.max_block_refs, 3);                // cache + at least two requests
  EXPECT_LT(r.stats.scheduled_tokens, s.requested_tokens());
}

TEST(Scheduler, SharedPrefixSurvivesPreemptionAndEviction) {
  Scheduler s(config(30, 96), generate_workload(workload(10, "uniform:10:120", "uniform:10:50", 9, 64)));
  RunSummary r = run_to_completion(s);
  EXPECT_GT(r.stats.preemptions, 0);
  EXPECT_GT(r.stats.prefix_hit_tokens, 0);
}

TEST(Scheduler, ArrivalsAreAdmittedNoEarlierThanTheyArrive) {
  Scheduler s(config(500), generate_workload(workload(10, "uniform:10:60", "uniform:2:8", 2, 0, 0.05)));
  RunSummary r = run_to_completion(s);
  EXPECT_GT(r.stats.idle_steps, 0) << "a rate of 0.05 requests/step leaves the engine idle at times";
  int last_arrival = 0;
  for (const SimRequest& q : s.requests()) last_arrival = std::max(last_arrival, q.spec.arrival_step);
  EXPECT_GT(last_arrival, 10);
}

TEST(Scheduler, MaxNumSeqsBoundsTheRunningSet) {
  Scheduler s(config(500, 512, 16, 3), generate_workload(workload(9, "uniform:5:40", "uniform:5:30", 4)));
  RunSummary r = run_to_completion(s);
  EXPECT_LE(r.stats.max_running, 3);
  EXPECT_EQ(r.stats.max_running, 3);
}

TEST(Scheduler, InvariantsHoldAcrossRandomConfigurations) {
  for (uint64_t seed = 0; seed < 24; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    std::mt19937_64 rng(seed);
    const int block_size = std::vector<int>{1, 4, 16, 32}[seed % 4];
    const int budget = block_size * std::uniform_int_distribution<int>(2, 24)(rng);
    const int num_blocks = std::uniform_int_distribution<int>(cdiv(260, block_size) + 1, 120 + 300 / block_size)(rng);
    SchedulerConfig c = config(num_blocks, budget, block_size, std::uniform_int_distribution<int>(1, 12)(rng));
    c.chunked_prefill = true;
    int system_prompt = seed % 3 == 0 ? 40 : 0;
    double rate = seed % 2 ? 0.3 : 0;
    Scheduler s(c, generate_workload(workload(12, "uniform:1:150", "uniform:1:60", seed, system_prompt, rate)));
    s.set_decode_threshold(1 + static_cast<int>(seed % 4));  // as a builder's reorder_batch_threshold
    run_to_completion(s);
    if (HasFatalFailure()) return;
    // The same with speculative decoding (K = 1..4 drafts, acceptance 0, 0.45 or 0.9).
    c.num_speculative_tokens = 1 + static_cast<int>(seed % 4);
    c.spec_acceptance_rate = 0.45 * static_cast<double>(seed % 3);
    c.spec_seed = seed;
    Scheduler spec(c, generate_workload(workload(12, "uniform:1:150", "uniform:1:60", seed, system_prompt, rate)));
    spec.set_decode_threshold(1 + c.num_speculative_tokens);
    run_to_completion(spec);
    if (HasFatalFailure()) return;
  }
}

// Speculative decoding: a decode feeds its sampled token plus K drafts (fewer near the end of its
// output); with acceptance 1 every draft is kept, with 0 none; the seeded draws repeat.
TEST(Scheduler, SpeculativeDecodesCarryDraftsAndKeepTheAcceptedOnes) {
  const auto run = [](int k, double rate, uint64_t seed) {
    SchedulerConfig c = config(500);
    c.num_speculative_tokens = k;
    c.spec_acceptance_rate = rate;
    c.spec_seed = seed;
    c.decode_threshold = 1 + k;
    Scheduler s(c, generate_workload(workload(8, "uniform:10:80", "uniform:20:40", 3)));
    return run_to_completion(s);
  };
  const RunSummary plain = run(0, 0.7, 1);
  EXPECT_EQ(plain.stats.draft_tokens, 0);
  const RunSummary all = run(3, 1.0, 1);
  EXPECT_GT(all.stats.draft_tokens, 0);
  EXPECT_EQ(all.stats.accepted_tokens, all.stats.draft_tokens);
  EXPECT_LT(all.steps * 2, plain.steps) << "4 tokens per decode step instead of 1";
  const RunSummary none = run(3, 0.0, 1);
  EXPECT_EQ(none.stats.accepted_tokens, 0);
  EXPECT_EQ(none.steps, plain.steps) << "every draft rejected: one token per decode step, as without drafts";
  const RunSummary some = run(3, 0.6, 7), again = run(3, 0.6, 7);
  EXPECT_GT(some.stats.accepted_tokens, 0);
  EXPECT_LT(some.stats.accepted_tokens, some.stats.draft_tokens);
  EXPECT_EQ(some.stats.accepted_tokens, again.stats.accepted_tokens) << "seeded";
  EXPECT_EQ(some.steps, again.steps);
}

TEST(Scheduler, RejectsConfigurationsThatCannotRun) {
  auto make = [](SchedulerConfig c, const std::string& prompt) {
    Scheduler s(c, generate_workload(workload(2, prompt, "4", 0)));
  };
  SchedulerConfig budget_below_block = config(100, 8, 16);
  EXPECT_THROW(make(budget_below_block, "10"), UsageError);
  EXPECT_THROW(make(config(3, 256, 16), "100"), UsageError);  // 7 blocks needed
  SchedulerConfig short_model = config(100);
  short_model.max_model_len = 50;
  EXPECT_THROW(make(short_model, "60"), UsageError);
  SchedulerConfig unchunked = config(100, 64);
  unchunked.chunked_prefill = false;
  EXPECT_THROW(make(unchunked, "100"), UsageError);
  EXPECT_THROW(make(config(0), "10"), UsageError);
  SchedulerConfig spec = config(100, 64);
  spec.num_speculative_tokens = 64;  // no room for the sampled token
  EXPECT_THROW(make(spec, "10"), UsageError);
  spec.num_speculative_tokens = 2;
  spec.spec_acceptance_rate = 1.5;
  EXPECT_THROW(make(spec, "10"), UsageError);
  try {
    make(budget_below_block, "10");
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--max-num-batched-tokens"), std::string::npos) << e.what();
  }
}

TEST(Scheduler, WithoutChunkedPrefillAPrefillRunsWhole) {
  SchedulerConfig c = config(200, 128);
  c.chunked_prefill = false;
  Scheduler s(c, generate_workload(workload(6, "uniform:60:120", "uniform:1:5", 8)));
  while (!s.done()) {
    StepSchedule step = s.schedule();
    for (const ScheduledRequest& r : step.requests) {
      if (r.num_computed_tokens == 0) {
        EXPECT_EQ(r.num_scheduled_tokens, s.requests()[static_cast<size_t>(r.request_id)].num_tokens());
      }
    }
    s.complete_step(step);
  }
}

}  // namespace
}  // namespace pagedattn::cli
