// Seeded request workloads for the serving simulation.
//
// A length distribution is written as a spec string (the --prompt-len / --output-len flags):
//   "N" or "fixed:N"            every request has N tokens
//   "uniform:A:B"               uniform integer in [A, B]
//   "lognormal:MEAN:STDEV[:MAX]" lognormal with that mean and standard deviation (of the
//                               lengths themselves), rounded, clamped to [1, MAX] (MAX default
//                               8 * MEAN, at most the length limit)
// Lengths (and the mean) are at most kMaxTokens (option_limits.h), so that system prompt +
// prompt + output stays an int32 token position.
// Arrivals: all requests at step 0 (arrival rate 0), or a Poisson process of `arrival_rate`
// requests per scheduler step (exponential gaps, rounded down to a step).
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn::cli {

struct LengthDistribution {
  enum class Kind { fixed, uniform, lognormal };
  Kind kind = Kind::fixed;
  int fixed = 1;
  int min = 1, max = 1;           // uniform bounds; lognormal clamp
  double mean = 1, stdev = 0;     // lognormal
  // Throws UsageError naming `flag` for a malformed spec, a length < 1 or > kMaxTokens,
  // min > max, stdev < 0.
  static LengthDistribution parse(std::string_view spec, std::string_view flag);
  int sample(std::mt19937_64& rng) const;
  int max_value() const;          // largest length it can produce
  std::string describe() const;   // "fixed 128", "uniform [32, 256]", "lognormal mean 128 stdev 64 max 1024"
};

struct WorkloadConfig {
  int num_requests = 8;
  LengthDistribution prompt_len;   // user part, after the shared system prompt
  LengthDistribution output_len;   // tokens generated (>= 1)
  int system_prompt_len = 0;       // tokens shared by every request (prefix caching), 0 = none
  double arrival_rate = 0;         // requests per step; 0 = all at step 0
  uint64_t seed = 0;
};

struct RequestSpec {
  int id = 0;
  int arrival_step = 0;
  int prompt_len = 0;          // system prompt + user prompt
  int output_len = 0;
  int shared_prefix_len = 0;   // the system-prompt tokens at the front of the prompt
};

// Throws UsageError naming the option out of its limit (option_limits.h).
void validate_workload(const WorkloadConfig& config);

// Deterministic for a given config (seed included); validates it first. Requests are sorted by
// arrival, ids 0..n-1.
std::vector<RequestSpec> generate_workload(const WorkloadConfig& config);

}  // namespace pagedattn::cli
