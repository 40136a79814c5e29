// The `pagedattn` program end to end through run_cli (same code path as main()): every preset
// runs a few steps through the real library on REFERENCE (or fails with the selector's reasons),
// --check compares with a second REFERENCE layer set, bad arguments give one line and a non-zero
// exit, and the other subcommands answer.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "calibrate.h"
#include "cli_common.h"
#include "cli_test_util.h"
#include "commands.h"
#include "pagedattn/pagedattn.h"
#include "sanitized_build.h"
#include "simulation.h"

namespace pagedattn::cli {
namespace {

using cli_test::CliResult;
using cli_test::cli;

int count_lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

// Small settings: 2 layers, short prompts, a few steps, REFERENCE, no calibration.
std::vector<std::string> small_run(const std::string& preset) {
  return {"run", "--preset", preset, "--layers", "2", "--num-requests", "3", "--prompt-len", "uniform:4:40",
          "--output-len", "uniform:2:6", "--max-steps", "4", "--backend", "REFERENCE", "--check",
          "--check-interval", "1", "--no-peaks", "--quiet"};
}

TEST(CliRun, EveryPresetRunsAFewStepsOnReferenceOrSaysWhyNot) {
  for (const ModelPreset& p : model_presets()) {
    SCOPED_TRACE(p.name);
    std::vector<std::string> args = small_run(p.name);
    if (p.name == "deepseek-v3") {
      // MLA layers: the standard REFERENCE cannot run them (the selector's reasons, one line)...
      CliResult r = cli(args);
      EXPECT_EQ(r.code, kExitUnsupported) << r.err;
      EXPECT_EQ(count_lines(r.err), 1) << r.err;
      EXPECT_NE(r.err.find("use_mla"), std::string::npos) << r.err;
      // ... CPU_MLA does, checked against REFERENCE_MLA (one TP-8 rank: 16 heads, fast under ASan).
      args = {"run", "--preset", "deepseek-v3", "--layers", "1", "--tp", "8", "--num-requests", "3",
              "--prompt-len", "uniform:4:40",
              "--output-len", "uniform:2:6", "--max-steps", "4", "--backend", "CPU_MLA", "--check",
              "--check-interval", "1", "--no-peaks", "--quiet"};
    }
    CliResult r = cli(args);
    EXPECT_EQ(r.code, kExitOk) << r.err << r.out;
    EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("| steps"), std::string::npos) << r.out;
    EXPECT_TRUE(r.err.empty()) << r.err;  // --quiet
  }
}

TEST(CliRun, DefaultPresetChecksAndWritesJson) {
  std::filesystem::path json = std::filesystem::temp_directory_path() / "pagedattn_cli_test_run.json";
  CliResult r = cli({"run", "--num-requests", "4", "--prompt-len", "uniform:16:96", "--output-len", "uniform:2:10",
                     "--system-prompt-len", "40", "--max-num-seqs", "2", "--no-peaks", "--json", json.string()});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;  // --check is the tiny default
  EXPECT_NE(r.out.find("checked steps: forward "), std::string::npos) << r.out;  // beside REFERENCE's time
  EXPECT_NE(r.err.find("pagedattn run: step"), std::string::npos) << "progress lines (stderr is not a tty)";
  std::ifstream in(json);
  nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["preset"]["name"], "tiny");
  EXPECT_TRUE(j["scheduler"]["completed"].get<bool>());
  EXPECT_EQ(j["scheduler"]["free_blocks_at_end"], j["options"]["num_blocks"]);
  EXPECT_GT(j["scheduler"]["prefix_shared_tokens"].get<int>(), 0);
  EXPECT_TRUE(j["check"]["passed"].get<bool>());
  EXPECT_EQ(j["layers"].size(), 4u);
  for (const auto& l : j["layers"]) EXPECT_GT(l["reference_seconds"].get<double>(), 0.0);
  EXPECT_GT(j["performance"]["flops"].get<double>(), 0);
  EXPECT_EQ(j["steps"].size(), j["scheduler"]["steps"].get<size_t>());
  std::filesystem::remove(json);
}

// run --num-speculative-tokens: decodes carry drafts, the builders take them as decodes (reorder
// threshold 1 + K; MLA: its absorbed decode), --check passes, the report and the JSON
// give the drafts and accepted tokens, and the token accounting holds.
TEST(CliRun, SpeculativeDecodingChecksAndReportsAcceptedTokens) {
  std::filesystem::path json = std::filesystem::temp_directory_path() / "pagedattn_cli_test_spec.json";
  // Under ASan every other step is checked (each REFERENCE re-run costs ~10x there).
  const char* interval = test_env::kSanitizedBuild ? "2" : "1";
  CliResult r = cli({"run", "--num-requests", "6", "--prompt-len", "uniform:16:96", "--output-len", "uniform:6:20",
                     "--num-speculative-tokens", "3", "--spec-acceptance-rate", "0.6", "--check-interval", interval,
                     "--no-peaks", "--quiet", "--json", json.string()});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("3 drafts per decode, acceptance 0.600"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("accepted tokens per step"), std::string::npos) << r.out;
  std::ifstream in(json);
  nlohmann::json j = nlohmann::json::parse(in);
  const auto& s = j["scheduler"];
  EXPECT_GT(s["draft_tokens"].get<int64_t>(), 0);
  EXPECT_GT(s["accepted_tokens"].get<int64_t>(), 0);
  EXPECT_EQ(s["draft_tokens"].get<int64_t>(), s["accepted_tokens"].get<int64_t>() + s["rejected_tokens"].get<int64_t>());
  EXPECT_EQ(s["scheduled_tokens"].get<int64_t>(),
            j["workload"]["requested_tokens"].get<int64_t>() + s["rejected_tokens"].get<int64_t>());
  int64_t drafts = 0;
  for (const auto& step : j["steps"]) drafts += step["draft_tokens"].get<int64_t>();
  EXPECT_EQ(drafts, s["draft_tokens"].get<int64_t>());
  EXPECT_EQ(j["options"]["num_speculative_tokens"], 3);
  std::filesystem::remove(json);
  // MLA: the drafted requests run in the absorbed decode, one row per token; still exact.
  r = cli({"run", "--preset", "deepseek-v3", "--layers", "1", "--tp", "8", "--num-requests", "3", "--prompt-len",
           "uniform:4:40", "--output-len", "uniform:4:8", "--max-steps", "6", "--backend", "CPU_MLA", "--check",
           "--check-interval", "1", "--num-speculative-tokens", "2", "--no-peaks", "--quiet"});
  EXPECT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("2 drafts per decode"), std::string::npos) << r.out;
}

// run --dcp N: every layer's cache striped over N ranks (threads), rank 0's output checked against
// the unsharded REFERENCE layer; the report gives the KV memory (1/N) and attention time per rank; layers DCP cannot
// run and a bad interleave are usage errors naming the flag.
TEST(CliRun, DecodeContextParallelRanksMatchReference) {
  std::filesystem::path json = std::filesystem::temp_directory_path() / "pagedattn_cli_test_dcp.json";
  CliResult r = cli({"run", "--preset", "llama3-8b", "--layers", "1", "--num-requests", "4", "--prompt-len",
                     "uniform:16:80", "--output-len", "uniform:3:6", "--dcp", "2", "--check", "--check-interval", "2",
                     "--no-peaks", "--quiet", "--json", json.string()});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("decode context parallelism: 2 ranks"), std::string::npos) << r.out;
  std::ifstream in(json);
  nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["options"]["dcp_world_size"], 2);
  EXPECT_EQ(j["options"]["kv_cache_bytes_per_rank"].get<int64_t>() * 2, j["options"]["kv_cache_bytes"].get<int64_t>());
  ASSERT_EQ(j["options"]["dcp_rank_forward_seconds"].size(), 2u);
  for (const auto& t : j["options"]["dcp_rank_forward_seconds"]) EXPECT_GT(t.get<double>(), 0.0);
  EXPECT_NE(r.out.find("attention time per rank"), std::string::npos) << r.out;
  std::filesystem::remove(json);
  r = cli({"run", "--preset", "deepseek-v3", "--layers", "1", "--tp", "8", "--backend", "CPU_MLA", "--num-requests", "3",
           "--prompt-len", "uniform:8:40", "--output-len", "uniform:2:5", "--dcp", "3", "--dcp-interleave", "16",
           "--check", "--check-interval", test_env::kSanitizedBuild ? "2" : "1", "--no-peaks", "--quiet"});
  EXPECT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;
  r = cli({"run", "--dcp", "2", "--no-peaks", "--quiet"});
  EXPECT_EQ(r.code, kExitUsage) << r.err;
  EXPECT_NE(r.err.find("--dcp"), std::string::npos) << r.err;
  r = cli({"run", "--preset", "llama3-8b", "--layers", "1", "--dcp", "2", "--dcp-interleave", "5", "--no-peaks"});
  EXPECT_EQ(r.code, kExitUsage) << r.err;
  EXPECT_NE(r.err.find("--dcp-interleave"), std::string::npos) << r.err;
}

// bench --dcp N: the long-context grid striped over N ranks (threads on the host) beside the
// unsharded layer: every point timed on both sides, each rank holding half the KV cache.
TEST(CliBench, DecodeContextParallelGridReportsBothSides) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "pagedattn_cli_test_bench_dcp";
  // tiny's layer: the same grid and report at a quarter of llama3-8b's time (this test was the
  // slowest of the ASan run).
  CliResult r = cli({"bench", "--preset", "tiny", "--backend", "CPU", "--dcp", "2", "--min-seconds", "0", "--out",
                     dir.string()});
  ASSERT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("decode context parallelism, 2 ranks"), std::string::npos) << r.out;
  std::ifstream in(dir / "cli_bench.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  ASSERT_EQ(j["dcp_points"].size(), 2u);
  for (const auto& p : j["dcp_points"]) {
    EXPECT_GT(p["one_rank_seconds"].get<double>(), 0.0);
    EXPECT_GT(p["step_seconds"].get<double>(), 0.0);
    EXPECT_GT(p["comm_seconds"].get<double>(), 0.0);
    EXPECT_LE(p["attend_seconds"].get<double>() + p["comm_seconds"].get<double>(), p["step_seconds"].get<double>() * 1.5);
    EXPECT_EQ(p["kv_bytes_per_rank"].get<int64_t>() * 2, p["kv_bytes_one_rank"].get<int64_t>());
  }
  std::filesystem::remove_all(dir);
}

TEST(Simulation, FinishesEveryRequestFreesEveryBlockAndMatchesReference) {
  RunOptions o;
  o.preset = "gpt-oss-20b";  // sinks, sliding window 128 and full layers, GQA 64/8
  o.num_layers = 2;
  o.backend = "";
  o.workload.num_requests = 5;
  o.workload.prompt_len = LengthDistribution::parse("uniform:60:120", "--prompt-len");
  o.workload.output_len = LengthDistribution::parse("uniform:2:8", "--output-len");
  o.num_blocks = 18;  // forces preemption
  o.max_num_batched_tokens = 128;
  o.check = true;
  o.check_interval = 2;
  o.measure_peaks = false;
  o.progress = false;
  Simulation sim(o);
  RunReport r = sim.run(nullptr);
  EXPECT_TRUE(r.completed);
  EXPECT_GT(r.stats.preemptions, 0);
  EXPECT_EQ(r.free_blocks_at_end, r.num_blocks);
  EXPECT_TRUE(r.check_passed);
  ASSERT_EQ(r.layers.size(), 2u);
  for (const LayerReport& l : r.layers) {
    EXPECT_GT(l.checked_steps, 0);
    EXPECT_LE(l.max_rel_error, l.tolerance);
    // Both forwards of the checked steps were timed (the speedup the report prints).
    EXPECT_GT(l.checked_seconds, 0.0);
    EXPECT_GT(l.reference_seconds, 0.0);
  }
  EXPECT_EQ(r.groups.size(), 2u);  // sliding window and full: one builder each
  EXPECT_EQ(r.stats.scheduled_tokens, r.requested_tokens - r.stats.prefix_hit_tokens + r.stats.discarded_tokens);
}

TEST(Simulation, ChunkedLocalLayersRunOnVirtualBatches) {
  RunOptions o;
  o.preset = "llama4-scout";
  o.num_layers = 4;
  o.block_size = 16;
  o.backend = "REFERENCE";
  o.workload.num_requests = 2;
  o.workload.prompt_len = LengthDistribution::parse("40", "--prompt-len");
  o.workload.output_len = LengthDistribution::parse("3", "--output-len");
  o.check = true;
  o.check_interval = 1;
  o.measure_peaks = false;
  o.progress = false;
  Simulation sim(o);
  RunReport r = sim.run(nullptr);
  EXPECT_TRUE(r.completed);
  EXPECT_TRUE(r.check_passed);
  ASSERT_EQ(r.groups.size(), 2u);
  int local = 0;
  for (const GroupReport& g : r.groups) local += g.local_virtual_batches ? g.num_layers : 0;
  EXPECT_EQ(local, 3);
}

TEST(Simulation, SharedSystemPromptTakesTheCascadePathAndStillMatches) {
  // Step 0: request 0 alone fills the 304-token budget with the 300-token system prompt + 4.
  // From step 1 every request shares its 18 full prefix blocks: 8+ requests with a common
  // 288-token prefix, so the builder's heuristic picks cascade.
  RunOptions o;
  o.preset = "tiny";
  o.num_layers = 1;         // the full-attention layer (windows never cascade)
  o.backend = "REFERENCE";  // supports cascade; the check's REFERENCE plans never cascade
  o.workload.num_requests = 12;
  o.workload.system_prompt_len = 300;
  o.workload.prompt_len = LengthDistribution::parse("4", "--prompt-len");
  o.workload.output_len = LengthDistribution::parse("uniform:4:12", "--output-len");
  o.max_num_batched_tokens = 304;
  o.check = true;
  o.check_interval = 1;
  o.measure_peaks = false;
  o.progress = false;
  Simulation sim(o);
  RunReport r = sim.run(nullptr);
  EXPECT_TRUE(r.completed);
  EXPECT_EQ(r.stats.prefix_hit_tokens, 11 * 288);
  EXPECT_GT(r.cascade_plans, 0);
  EXPECT_TRUE(r.check_passed);
  EXPECT_EQ(r.free_blocks_at_end, r.num_blocks);
}

TEST(CliRun, BadArgumentsGiveOneLineAndANonZeroExit) {
  struct Case {
    std::vector<std::string> args;
    std::string expect;  // in the message
  };
  std::vector<Case> cases = {
      {{"run", "--preset", "llama-7"}, "--preset"},
      {{"run", "--prompt-len", "-5"}, "--prompt-len"},
      {{"run", "--prompt-len=-5"}, "--prompt-len"},
      {{"run", "--output-len", "uniform:9:3"}, "--output-len"},
      {{"run", "--num-requests", "0"}, "--num-requests"},
      {{"run", "--block-size", "0"}, "--block-size"},
      {{"run", "--max-num-batched-tokens", "8"}, "smaller than one block"},
      {{"run", "--num-blocks", "2"}, "--num-blocks"},
      {{"run", "--dtype", "int8"}, "--dtype"},
      {{"run", "--kv-cache-dtype", "int4"}, "--kv-cache-dtype"},
      {{"run", "--device", "tpu"}, "--device"},
      {{"run", "--backend", "NOPE"}, "--backend"},
      {{"run", "--layers", "0"}, "--layers"},
      {{"run", "--threads", "x"}, "--threads"},
      {{"run", "--no-such-flag"}, "--no-such-flag"},
      {{"run", "--preset", "llama4-scout", "--block-size", "48"}, "attention_chunk_size"},
      {{"run", "--max-model-len", "100", "--prompt-len", "200"}, "--max-model-len"},
      {{"run", "--check", "--no-check"}, "--no-check"},
      {{"backends", "--head-size", "0"}, "--head-size"},
      {{"bench", "--grid", "huge"}, "--grid"},
      {{"plan-bench", "--num-requests", "0"}, "--num-requests"},
      {{"plan-bench", "--common-prefix-len", "24"}, "--common-prefix-len"},
      {{"plan-bench", "--backend", "NOPE"}, "--backend"},
      {{"check", "--backend", "NOPE"}, "--backend"},
      {{"calibrate", "--device", "tpu"}, "--device"},
      {{}, "subcommand"},
  };
  for (const Case& c : cases) {
    CliResult r = cli(c.args);
    SCOPED_TRACE(::testing::PrintToString(c.args));
    EXPECT_NE(r.code, kExitOk);
    EXPECT_EQ(r.code, kExitUsage) << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_EQ(r.err.rfind("pagedattn", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(c.expect), std::string::npos) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
}

TEST(CliRun, ABlockSizeTheForcedBackendRejectsIsOneLineWithItsReason) {
  // Find a backend that runs tiny's shape on the cpu but rejects some block size.
  for (const AttentionBackend* b : registered_backends()) {
    SelectorConfig c;
    c.head_size = 64;
    c.dtype = DType::bf16;
    c.device = Device::cpu;
    if (!b->validate_configuration(c).empty()) continue;
    for (int bs = 1; bs <= 256; ++bs) {
      if (block_size_supported(b->supported_kernel_block_sizes(), bs)) continue;
      CliResult r = cli({"run", "--backend", std::string(b->name()), "--block-size", std::to_string(bs), "--no-peaks"});
      EXPECT_EQ(r.code, kExitUnsupported) << r.err;
      EXPECT_EQ(count_lines(r.err), 1) << r.err;
      EXPECT_NE(r.err.find("block_size"), std::string::npos) << r.err;
      return;
    }
  }
  GTEST_SKIP() << "every registered cpu backend accepts every block size from 1 to 256";
}

TEST(CliRun, HelpListsTheFlagsAndExitsZero) {
  CliResult r = cli({"run", "--help"});
  EXPECT_EQ(r.code, kExitOk);
  for (const char* flag : {"--preset", "--device", "--backend", "--dtype", "--kv-cache-dtype", "--block-size",
                           "--threads", "--seed", "--json", "--layers", "--max-steps", "--check", "--prompt-len",
                           "--arrival-rate", "--system-prompt-len", "--max-num-batched-tokens", "full block tables"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << flag;
  }
  CliResult top = cli({"--help"});
  EXPECT_EQ(top.code, kExitOk);
  for (const char* sub : {"run", "backends", "check", "bench", "plan-bench", "calibrate"}) {
    EXPECT_NE(top.out.find(sub), std::string::npos) << sub;
  }
}

TEST(CliPlanBench, TimesBuildAndBuildForDraftingPerBackend) {
  CliResult r = cli({"plan-bench", "--preset", "tiny", "--num-requests", "8", "--context", "64",
                     "--common-prefix-len", "32", "--reps", "3", "--backend", "CPU,REFERENCE"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  for (const char* text : {"build_for_drafting", "| CPU ", "| REFERENCE ", "8 x (64 + 1), prefix 32"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " in " << r.out;
  }
}

TEST(CliBackends, ListsEveryBackendAndTheSelectorsReasons) {
  CliResult r = cli({"backends"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  for (const AttentionBackend* b : registered_backends()) {
    EXPECT_NE(r.out.find(std::string(b->name())), std::string::npos) << b->name();
  }
  EXPECT_NE(r.out.find("selected: "), std::string::npos);
  CliResult mla = cli({"backends", "--mla", "--head-size", "576"});
  EXPECT_EQ(mla.code, kExitOk) << mla.out;
  EXPECT_NE(mla.out.find("use_mla"), std::string::npos) << mla.out;  // why the standard ones do not fit
  EXPECT_NE(mla.out.find("selected: CPU_MLA"), std::string::npos) << mla.out;
  CliResult preset = cli({"backends", "--preset", "gemma2-9b"});
  EXPECT_EQ(preset.code, kExitOk) << preset.err;
  EXPECT_NE(preset.out.find("sliding window 4096 soft-cap"), std::string::npos) << preset.out;
}

TEST(CliCheck, RunsTheConformanceGridOnReference) {
  CliResult r = cli({"check", "--backend", "REFERENCE"});
  EXPECT_EQ(r.code, kExitOk) << r.err << r.out;
  EXPECT_NE(r.out.find("| REFERENCE (cpu)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;
}

TEST(Calibration, MeasuresPositivePeaksAndCachesThem) {
  std::filesystem::path path = std::filesystem::temp_directory_path() / "pagedattn_cli_test_calibration.json";
  std::filesystem::remove(path);
  const char* old = std::getenv("PAGEDATTN_CALIBRATION");
  std::string saved = old ? old : "";
  setenv("PAGEDATTN_CALIBRATION", path.c_str(), 1);
  CpuCalibration a = cpu_calibration(1, false, nullptr);
  EXPECT_GT(a.copy_bandwidth, 1e8);
  EXPECT_GT(a.fma_flops, 1e8);
  EXPECT_EQ(a.threads, 1);
  EXPECT_EQ(a.amx_present, cpu_has_amx());
  EXPECT_EQ(a.amx_bf16_flops > 0, a.amx_present);
  EXPECT_TRUE(std::filesystem::exists(path));
  CpuCalibration b = cpu_calibration(1, false, nullptr);  // from the cache
  EXPECT_EQ(a.measured_at, b.measured_at);
  EXPECT_DOUBLE_EQ(a.copy_bandwidth, b.copy_bandwidth);
  MachinePeaks p = machine_peaks(Device::cpu, DType::bf16, 1, nullptr);
  EXPECT_DOUBLE_EQ(p.bandwidth, a.copy_bandwidth);
  EXPECT_GT(p.flops, 0);
  std::filesystem::remove(path);
  if (old) setenv("PAGEDATTN_CALIBRATION", saved.c_str(), 1);
  else unsetenv("PAGEDATTN_CALIBRATION");
}

TEST(TextTable, AlignsColumnsAsMarkdown) {
  TextTable t({"a", "long header"});
  t.add_row({"x|y", "1"});
  std::string s = t.str();
  EXPECT_EQ(s, "| a    | long header |\n| ---- | ----------- |\n| x\\|y | 1           |\n");
  EXPECT_THROW(t.add_row({"only one"}), std::logic_error);
  EXPECT_EQ(format_count(1234567), "1,234,567");
  EXPECT_EQ(format_count(-1000), "-1,000");
  EXPECT_EQ(format_seconds(0.0123), "12.3 ms");
  EXPECT_EQ(format_percent(0.5), "50.0%");
}

}  // namespace
}  // namespace pagedattn::cli

namespace pagedattn::cli {
namespace {

TEST(CheckMeasure, SeesPerturbationsAndUnwrittenPoison) {
  Tensor ref(Shape{4, 8, 16}, DType::f32), out(Shape{4, 8, 16}, DType::f32);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  double norm2 = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    ref.data_as<float>()[i] = normal(rng);
    norm2 += double(ref.data_as<float>()[i]) * ref.data_as<float>()[i];
  }
  out.copy_from(ref.view());
  EXPECT_EQ(output_relative_error(out.view(), ref.view()), 0.0);
  out.data_as<float>()[77] += 0.25f;
  double d = double(out.data_as<float>()[77]) - ref.data_as<float>()[77];
  EXPECT_NEAR(output_relative_error(out.view(), ref.view()), std::sqrt(d * d / norm2), 1e-12);
  std::memset(out.data_as<float>() + 100, 0xFF, sizeof(float));  // NaN poison left in place
  EXPECT_TRUE(std::isinf(output_relative_error(out.view(), ref.view())));
  Tensor small(Shape{4, 8, 8}, DType::f32);
  EXPECT_THROW(output_relative_error(small.view(), ref.view()), Error);

  EXPECT_DOUBLE_EQ(check_tolerance(DType::f32, "auto"), 1e-5);
  EXPECT_DOUBLE_EQ(check_tolerance(DType::f16, "auto"), 2e-3);
  EXPECT_DOUBLE_EQ(check_tolerance(DType::bf16, "auto"), 8e-3);
  EXPECT_DOUBLE_EQ(check_tolerance(DType::f32, "bfloat16"), 8e-3);
  EXPECT_DOUBLE_EQ(check_tolerance(DType::bf16, "fp8"), 6e-2);
  EXPECT_DOUBLE_EQ(check_tolerance(DType::f32, "fp8_e5m2"), 6e-2);
}

}  // namespace
}  // namespace pagedattn::cli
