// The `pagedattn` program's numeric options at and beyond their limits: every bad value (negative,
// zero, huge, nan/inf, trailing characters, overflowing) exits 2 with ONE line that names the
// option, the value and the limit, before any work (no report on stdout, no progress or grid
// lines on stderr), and integer arithmetic on user values never overflows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli_common.h"
#include "cli_test_util.h"
#include "commands.h"
#include "simulation.h"
#include "workload.h"

namespace pagedattn::cli {
namespace {

using cli_test::CliResult;
using cli_test::cli;

struct LimitCase {
  std::vector<std::string> args;
  std::vector<std::string> expect;  // each in the one-line message: option, value, limit
};

void expect_usage_error(const LimitCase& c) {
  SCOPED_TRACE(::testing::PrintToString(c.args));
  const CliResult r = cli(c.args);
  EXPECT_EQ(r.code, kExitUsage) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_EQ(r.err.rfind("pagedattn", 0), 0u) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_EQ(r.err.find("internal error"), std::string::npos) << r.err;
  for (const std::string& part : c.expect) EXPECT_NE(r.err.find(part), std::string::npos) << part << " in " << r.err;
}

// Fast settings so that a value accepted by mistake would still end quickly.
std::vector<std::string> run_args(std::vector<std::string> extra) {
  std::vector<std::string> args = {"run", "--max-steps", "1", "--num-requests", "2", "--no-peaks", "--quiet"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(CliLimits, TheIssueCases) {
  const std::string too_big_seed = "99999999999999999999999";
  for (const LimitCase& c : std::vector<LimitCase>{
           // Signed overflow in the workload (system prompt + prompt).
           {run_args({"--system-prompt-len", "2147483647"}), {"--system-prompt-len", "2147483647", "536870911"}},
           // Overflow sizing the virtual batches of the chunked-local layers.
           {run_args({"--preset", "llama4-scout", "--max-num-seqs", "2147483647"}),
            {"--max-num-seqs", "2147483647", "65536"}},
           {run_args({"--kv-cache-gib", "inf"}), {"--kv-cache-gib", "'inf'", "finite", "1048576"}},
           // A mean above the length limit (the default MAX, 8 x mean, used to overflow).
           {run_args({"--prompt-len", "lognormal:600000000:1"}), {"--prompt-len", "600000000", "536870911"}},
           {run_args({"--seed", too_big_seed}), {"--seed", too_big_seed, "18446744073709551615"}},
           {run_args({"--json", ""}), {"--json", "''", "file name"}},
           {run_args({"--layers", "2147483647"}), {"--layers", "2147483647", "1024"}},
           {run_args({"--num-blocks", "2147483647"}), {"--num-blocks", "2147483647", "1073741824"}},
       }) {
    expect_usage_error(c);
  }
}

TEST(CliLimits, ALognormalMeanWithoutMaxIsNotMaxBelowTheMean) {
  // The default MAX (8 x mean) would pass the length limit: a usage error naming the option,
  // the value and the limit, not "MAX below the mean".
  const CliResult r = cli(run_args({"--prompt-len", "lognormal:300000000:1"}));
  EXPECT_EQ(r.code, kExitUsage) << r.err;
  EXPECT_EQ(r.err.find("MAX below the mean"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--prompt-len: 'lognormal:300000000:1'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("536870911"), std::string::npos) << r.err;
}

TEST(CliLimits, EveryNumericOptionOfRun) {
  for (const LimitCase& c : std::vector<LimitCase>{
           {run_args({"--threads", "100000"}), {"--threads", "100000", "4096"}},
           {run_args({"--threads", "-1"}), {"--threads", "-1", "4096"}},
           {run_args({"--num-requests", "100000000"}), {"--num-requests", "100000000", "1000000"}},
           {run_args({"--num-requests", "0"}), {"--num-requests", "'0'", "1000000"}},
           {run_args({"--max-num-batched-tokens", "2147483647"}), {"--max-num-batched-tokens", "1048576"}},
           {run_args({"--block-size", "2147483647"}), {"--block-size", "2147483647", "65536"}},
           {run_args({"--block-size", "16.5"}), {"--block-size", "16.5", "not an integer"}},
           {run_args({"--max-model-len", "2147483647"}), {"--max-model-len", "2147483647", "536870911"}},
           {run_args({"--long-prefill-token-threshold", "2147483647"}),
            {"--long-prefill-token-threshold", "536870911"}},
           {run_args({"--tp", "2147483647"}), {"--tensor-parallel-size", "2147483647", "1024"}},
           {run_args({"--arrival-rate", "1e308"}), {"--arrival-rate", "1e308", "1000000000"}},
           {run_args({"--arrival-rate", "nan"}), {"--arrival-rate", "'nan'", "finite"}},
           {run_args({"--kv-cache-gib", "0"}), {"--kv-cache-gib", "'0'", "1048576"}},
           {run_args({"--kv-cache-gib", "4GiB"}), {"--kv-cache-gib", "4GiB", "not a number"}},
           {run_args({"--seed", "-1"}), {"--seed", "-1", "18446744073709551615"}},
           {run_args({"--seed", "12abc"}), {"--seed", "12abc", "not an integer"}},
           {run_args({"--layers", "3x"}), {"--layers", "3x", "1024"}},
           {run_args({"--layers", "0"}), {"--layers", "'0'", "1024"}},
           {run_args({"--check-interval", "0"}), {"--check-interval", "'0'", "2147483647"}},
           {run_args({"--max-steps", "99999999999"}), {"--max-steps", "99999999999", "2147483647"}},
           {run_args({"--num-blocks", "-1"}), {"--num-blocks", "-1", "1073741824"}},
           {run_args({"--dcp", "65"}), {"--dcp", "65", "64"}},
           {run_args({"--dcp", "0"}), {"--dcp", "'0'", "64"}},
           {run_args({"--dcp-interleave", "0"}), {"--dcp-interleave", "'0'", "65536"}},
           {run_args({"--num-speculative-tokens", "-1"}), {"--num-speculative-tokens", "-1", "536870911"}},
           {run_args({"--spec-acceptance-rate", "1.5"}), {"--spec-acceptance-rate", "1.5", "1"}},
       }) {
    expect_usage_error(c);
  }
}

TEST(CliLimits, KvCacheBeyondHostMemoryIsRefusedBeforeAllocating) {
  // 10^9 blocks of tiny's 32 KiB (all layers): 30 TiB, more than any host.
  expect_usage_error({run_args({"--num-blocks", "1000000000"}), {"--num-blocks", "1000000000", "host memory"}});
  // The automatic count: 64 requests of 5 * 10^8 tokens, a cap of 1 PiB.
  expect_usage_error({{"run", "--num-requests", "64", "--prompt-len", "500000000", "--max-model-len", "536870911",
                       "--kv-cache-gib", "1048576", "--no-peaks", "--quiet"},
                      {"--kv-cache-gib", "1048576", "host memory"}});
}

TEST(CliLimits, OtherCommands) {
  // A plain file where --out needs a folder: refused before the grid runs (no progress line).
  const std::filesystem::path file = std::filesystem::temp_directory_path() / "pagedattn_cli_limits_file";
  std::ofstream(file) << "not a folder\n";
  const std::string bad_out = (file / "sub").string();
  for (const LimitCase& c : std::vector<LimitCase>{
           {{"bench", "--backend", "REFERENCE", "--out", bad_out}, {"--out", bad_out}},
           {{"bench", "--out", ""}, {"--out", "''", "folder"}},
           {{"bench", "--min-seconds", "inf"}, {"--min-seconds", "'inf'", "3600"}},
           {{"bench", "--threads", "100000"}, {"--threads", "100000", "4096"}},
           {{"bench", "--block-size", "0"}, {"--block-size", "'0'", "65536"}},
           {{"bench", "--layer", "99999999999"}, {"--layer", "99999999999", "2147483647"}},
           {{"bench", "--seed", "99999999999999999999999"}, {"--seed", "18446744073709551615"}},
           {{"backends", "--head-size", "99999999999"}, {"--head-size", "99999999999", "65536"}},
           {{"backends", "--soft-cap", "inf"}, {"--soft-cap", "'inf'", "finite"}},
           {{"backends", "--window", "0"}, {"--window", "'0'", "536870911"}},
           {{"check", "--seed", "99999999999999999999999"}, {"--seed", "18446744073709551615"}},
           {{"check", "--json", ""}, {"--json", "''", "file name"}},
           {{"calibrate", "--threads", "100000"}, {"--threads", "100000", "4096"}},
       }) {
    expect_usage_error(c);
  }
  std::filesystem::remove(file);
}

// The same limits hold for RunOptions filled by code (no CLI11 in between).
TEST(CliLimits, SimulationAndWorkloadCheckTheirOptions) {
  WorkloadConfig w;
  w.num_requests = 2;
  w.prompt_len = LengthDistribution::parse("10", "--prompt-len");
  w.output_len = LengthDistribution::parse("10", "--output-len");
  w.system_prompt_len = 2147483647;
  try {
    generate_workload(w);
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("--system-prompt-len: 2147483647"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("536870911"), std::string::npos) << e.what();
  }
  LengthDistribution l = LengthDistribution::parse("lognormal:60000000:1", "--prompt-len");
  EXPECT_EQ(l.max, 480000000);

  auto expect_rejected = [](RunOptions o, const std::string& flag, const std::string& limit) {
    o.measure_peaks = false;
    o.progress = false;
    o.workload.num_requests = 2;
    o.workload.prompt_len = LengthDistribution::parse("10", "--prompt-len");
    o.workload.output_len = LengthDistribution::parse("10", "--output-len");
    try {
      Simulation sim(o);
      ADD_FAILURE() << flag << " accepted";
    } catch (const UsageError& e) {
      EXPECT_EQ(std::string(e.what()).rfind(flag + ":", 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(limit), std::string::npos) << e.what();
    }
  };
  RunOptions o;
  o.max_num_seqs = 2147483647;
  expect_rejected(o, "--max-num-seqs", "65536");
  o = RunOptions{};
  o.num_layers = 2147483647;
  expect_rejected(o, "--layers", "1024");
  o = RunOptions{};
  o.kv_cache_gib = INFINITY;
  expect_rejected(o, "--kv-cache-gib", "1048576");
  o = RunOptions{};
  o.threads = 100000;
  expect_rejected(o, "--threads", "4096");
}

}  // namespace
}  // namespace pagedattn::cli
