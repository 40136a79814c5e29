#include "workload.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>

#include "cli_common.h"
#include "option_limits.h"

namespace pagedattn::cli {

namespace {

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (true) {
    size_t pos = s.find(sep, start);
    if (pos == std::string_view::npos) {
      parts.push_back(s.substr(start));
      return parts;
    }
    parts.push_back(s.substr(start, pos - start));
    start = pos + 1;
  }
}

[[noreturn]] void bad_spec(std::string_view flag, std::string_view spec, const std::string& why) {
  throw UsageError(std::string(flag) + ": '" + std::string(spec) + "' " + why +
                   "; expected N, fixed:N, uniform:MIN:MAX or lognormal:MEAN:STDEV[:MAX] with lengths >= 1");
}

double parse_number(std::string_view text, std::string_view flag, std::string_view spec) {
  double value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty() || !std::isfinite(value)) {
    bad_spec(flag, spec, "has '" + std::string(text) + "', which is not a number");
  }
  return value;
}

int parse_length(std::string_view text, std::string_view flag, std::string_view spec) {
  double v = parse_number(text, flag, spec);
  if (v != std::floor(v)) bad_spec(flag, spec, "has the non-integer length " + std::string(text));
  if (v < 1) bad_spec(flag, spec, "has the length " + std::string(text) + ", which is < 1");
  if (v > kMaxTokens) {
    bad_spec(flag, spec, "has the length " + std::string(text) + ", above the limit of " +
                             std::to_string(kMaxTokens) + " tokens");
  }
  return static_cast<int>(v);
}

}  // namespace

LengthDistribution LengthDistribution::parse(std::string_view spec, std::string_view flag) {
  std::vector<std::string_view> parts = split(spec, ':');
  LengthDistribution d;
  if (parts.size() == 1 || (parts.size() == 2 && parts[0] == "fixed")) {
    d.kind = Kind::fixed;
    d.fixed = parse_length(parts.back(), flag, spec);
    d.min = d.max = d.fixed;
    return d;
  }
  if (parts[0] == "uniform" && parts.size() == 3) {
    d.kind = Kind::uniform;
    d.min = parse_length(parts[1], flag, spec);
    d.max = parse_length(parts[2], flag, spec);
    if (d.min > d.max) bad_spec(flag, spec, "has MIN > MAX");
    return d;
  }
  if (parts[0] == "lognormal" && (parts.size() == 3 || parts.size() == 4)) {
    d.kind = Kind::lognormal;
    d.mean = parse_number(parts[1], flag, spec);
    d.stdev = parse_number(parts[2], flag, spec);
    if (d.mean < 1) bad_spec(flag, spec, "has a mean < 1");
    if (d.mean > kMaxTokens) {
      bad_spec(flag, spec, "has the mean " + std::string(parts[1]) + ", above the limit of " +
                               std::to_string(kMaxTokens) + " tokens");
    }
    if (d.stdev < 0) bad_spec(flag, spec, "has a negative standard deviation");
    // sample() needs a finite sigma^2 = ln(1 + stdev^2 / mean^2) (else every sample is NaN), and
    // the default MAX = 8 * MEAN must be a length.
    if (!std::isfinite(std::log1p((d.stdev * d.stdev) / (d.mean * d.mean)))) {
      bad_spec(flag, spec, "has a standard deviation that is too large");
    }
    if (parts.size() == 3 && 8 * d.mean > kMaxTokens) {
      bad_spec(flag, spec, "has a mean too large for the default MAX = 8 * MEAN (above the limit of " +
                               std::to_string(kMaxTokens) + " tokens): give MAX");
    }
    d.min = 1;
    // Default MAX: 8 x the mean (within the length limit, checked above).
    d.max = parts.size() == 4 ? parse_length(parts[3], flag, spec)
                              : static_cast<int>(std::min<double>(std::ceil(8 * d.mean), kMaxTokens));
    if (d.max < d.mean) bad_spec(flag, spec, "has MAX below the mean");
    return d;
  }
  bad_spec(flag, spec, "is not a length distribution");
}

int LengthDistribution::sample(std::mt19937_64& rng) const {
  switch (kind) {
    case Kind::fixed: return fixed;
    case Kind::uniform: return std::uniform_int_distribution<int>(min, max)(rng);
    case Kind::lognormal: {
      if (stdev == 0) return static_cast<int>(std::lround(mean));
      // Parameters of the underlying normal from the mean m and stdev s of the lognormal:
      //   sigma^2 = ln(1 + s^2/m^2), mu = ln(m) - sigma^2 / 2.
      double sigma2 = std::log1p((stdev * stdev) / (mean * mean));
      double mu = std::log(mean) - sigma2 / 2;
      double x = std::lognormal_distribution<double>(mu, std::sqrt(sigma2))(rng);
      double clamped = std::clamp(std::round(x), static_cast<double>(min), static_cast<double>(max));
      return static_cast<int>(clamped);
    }
  }
  return fixed;
}

int LengthDistribution::max_value() const { return kind == Kind::fixed ? fixed : max; }

std::string LengthDistribution::describe() const {
  switch (kind) {
    case Kind::fixed: return "fixed " + std::to_string(fixed);
    case Kind::uniform: return "uniform [" + std::to_string(min) + ", " + std::to_string(max) + "]";
    case Kind::lognormal:
      return "lognormal mean " + format_sig(mean, 4) + " stdev " + format_sig(stdev, 4) + " max " +
             std::to_string(max);
  }
  return "";
}

void validate_workload(const WorkloadConfig& config) {
  check_range("--num-requests", config.num_requests, 1, kMaxNumRequests);
  check_range("--system-prompt-len", config.system_prompt_len, 0, kMaxTokens);
  check_range("--arrival-rate", config.arrival_rate, 0.0, kMaxArrivalRate);  // 0 = all at once
  for (const auto& [d, flag] : {std::pair{&config.prompt_len, "--prompt-len"},
                                std::pair{&config.output_len, "--output-len"}}) {
    check_range(flag, d->min, 1, kMaxTokens);
    check_range(flag, d->max_value(), 1, kMaxTokens);
  }
}

std::vector<RequestSpec> generate_workload(const WorkloadConfig& config) {
  validate_workload(config);
  // Separate streams so that changing one distribution does not reshuffle the others.
  std::mt19937_64 prompt_rng(config.seed * 0x9E3779B97F4A7C15ull + 1);
  std::mt19937_64 output_rng(config.seed * 0x9E3779B97F4A7C15ull + 2);
  std::mt19937_64 arrival_rng(config.seed * 0x9E3779B97F4A7C15ull + 3);
  std::vector<RequestSpec> requests;
  double clock = 0;
  for (int i = 0; i < config.num_requests; ++i) {
    RequestSpec r;
    r.id = i;
    r.shared_prefix_len = config.system_prompt_len;
    r.prompt_len = config.system_prompt_len + config.prompt_len.sample(prompt_rng);
    r.output_len = config.output_len.sample(output_rng);
    if (config.arrival_rate > 0 && i > 0) {
      clock += std::exponential_distribution<double>(config.arrival_rate)(arrival_rng);
    }
    r.arrival_step = static_cast<int>(std::floor(clock));
    requests.push_back(r);
  }
  return requests;
}

}  // namespace pagedattn::cli
