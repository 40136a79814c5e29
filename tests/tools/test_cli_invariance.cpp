// `pagedattn run --batch-invariant --check-invariance` end to end (run_cli): sampled requests
// re-run alone and in shuffled sub-batches give the same bits under the mode (exit 0, standard
// and MLA layers, also through PAGEDATTN_BATCH_INVARIANT=1), and the same check fails with
// exit 1 on the default plans, whose split-KV follows the batch and the threads.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cli_common.h"
#include "cli_test_util.h"
#include "commands.h"
#include "conformance/env_guard.h"
#include "pagedattn/pagedattn.h"
#include "sanitized_build.h"

namespace pagedattn::cli {
namespace {

using cli_test::CliResult;
using cli_test::cli;

// The tiny preset on the CPU backend, 4 threads (so the default plans split decodes), every
// step checked.
std::vector<std::string> invariance_run(std::vector<std::string> extra) {
  std::vector<std::string> args = {"run", "--backend", "CPU", "--threads", "4", "--num-requests", "12",
                                    "--max-steps", "40", "--check-invariance", "--check-interval", "1",
                                    "--no-check", "--no-peaks", "--quiet"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

TEST(CliInvariance, BatchInvariantRunPassesAndReportsIt) {
  const std::filesystem::path json = std::filesystem::temp_directory_path() / "pagedattn_cli_invariance.json";
  const CliResult r = cli(invariance_run({"--batch-invariant", "--json", json.string()}));
  EXPECT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("batch-invariant plans: yes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(", 0 differ in some bit"), std::string::npos) << r.out;
  std::ifstream in(json);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_TRUE(j["batch_invariant_plans"].get<bool>());
  EXPECT_EQ(j["check_invariance"]["steps"].get<int>(), 40);
  EXPECT_GT(j["check_invariance"]["comparisons"].get<int>(), 100);
  EXPECT_EQ(j["check_invariance"]["differences"].get<int>(), 0);
  std::filesystem::remove(json);
}

TEST(CliInvariance, DefaultPlansFailTheCheck) {
  const CliResult r = cli(invariance_run({}));
  EXPECT_EQ(r.code, kExitFailure) << r.err << r.out;
  EXPECT_NE(r.out.find("batch-invariant plans: no"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("check-invariance FAILED: layer model.layers."), std::string::npos) << r.out;
}

TEST(CliInvariance, EnvironmentVariableTurnsTheModeOn) {
  conformance::EnvGuard env(kBatchInvariantEnv, "1");
  const CliResult r = cli(invariance_run({}));
  EXPECT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("batch-invariant plans: yes"), std::string::npos) << r.out;
}

// (Every step checked; every third under ASan, where a check of these 576-wide latents costs most.)
TEST(CliInvariance, MlaLayers) {
  const char* interval = test_env::kSanitizedBuild ? "3" : "1";
  const CliResult r = cli({"run", "--preset", "deepseek-v3", "--layers", "1", "--tp", "8", "--backend", "CPU_MLA",
                           "--threads", "4", "--num-requests", "6", "--prompt-len", "uniform:4:300",
                           "--output-len", "uniform:2:12", "--max-steps", "12", "--batch-invariant",
                           "--check-invariance", "--check-interval", interval, "--no-check", "--no-peaks",
                           "--quiet"});
  EXPECT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find(", 0 differ in some bit"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace pagedattn::cli
