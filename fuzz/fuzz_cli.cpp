// libFuzzer target: the `pagedattn` program's command-line parsing (tools/).
//
// The input is split at newlines (and NULs) into arguments after "pagedattn". Properties:
//   1. parsing with the program's own CLI11 app (make_cli_app, what run_cli parses with) either
//      succeeds or throws CLI::ParseError (help requests included), nothing else;
//   2. when `backends` was chosen, its action (cheap: selector reports, no simulation) runs and
//      returns an exit code or throws one of the errors run_cli maps to an exit code with a
//      message (UsageError, UnsupportedConfiguration, pagedattn::Error), never anything else
//      (run_cli would report an "internal error");
//   3. every argument, read as the value of a flag, goes through the value parsers the actions
//      use (length distributions, device, dtypes, attention type, KV-cache dtype, preset name):
//      a result or UsageError / pagedattn::Error; a parsed length distribution is well formed
//      (1 <= min <= max, max_value() >= 1) and its samples lie in [1, max_value()].
// run, check, bench and calibrate actions are not run here: they are the simulation, the
// conformance grid, benchmarks and a machine calibration, not option parsing.
#include <exception>
#include <random>
#include <sstream>
#include <string>
#include <typeinfo>
#include <vector>

#include "cli_app.h"
#include "cli_common.h"
#include "fuzz_input.h"
#include "option_parsing.h"
#include "pagedattn/error.h"
#include "presets.h"
#include "workload.h"

namespace pagedattn::fuzz {
namespace {

using cli::UnsupportedConfiguration;
using cli::UsageError;

template <typename F>
void expect_result_or_usage_error(const std::string& what, F&& f) {
  try {
    f();
  } catch (const UsageError&) {
  } catch (const Error&) {
  } catch (const std::exception& e) {
    property_failed(what + " threw " + typeid(e).name() + ": " + e.what());
  }
}

void check_length_distribution(const std::string& value) {
  expect_result_or_usage_error("LengthDistribution::parse('" + value + "')", [&] {
    const cli::LengthDistribution d = cli::LengthDistribution::parse(value, "--prompt-len");
    PAGEDATTN_FUZZ_ASSERT(d.max_value() >= 1, "max_value of '" + value + "'");
    PAGEDATTN_FUZZ_ASSERT(d.kind == cli::LengthDistribution::Kind::fixed || (d.min >= 1 && d.min <= d.max),
                          "bounds of '" + value + "'");
    std::mt19937_64 rng(value.size());
    for (int i = 0; i < 4; ++i) {
      const int n = d.sample(rng);
      PAGEDATTN_FUZZ_ASSERT(n >= 1 && n <= d.max_value(), "sample " + std::to_string(n) + " of '" + value + "'");
    }
    PAGEDATTN_FUZZ_ASSERT(!d.describe().empty(), "describe of '" + value + "'");
  });
}

void check_value_parsers(const std::string& value) {
  check_length_distribution(value);
  expect_result_or_usage_error("parse_device_flag", [&] { cli::parse_device_flag(value, "--device"); });
  expect_result_or_usage_error("parse_activation_dtype_flag",
                               [&] { cli::parse_activation_dtype_flag(value, "--dtype"); });
  expect_result_or_usage_error("parse_attn_type_flag", [&] { cli::parse_attn_type_flag(value, "--attn-type"); });
  expect_result_or_usage_error("check_kv_cache_dtype_flag",
                               [&] { cli::check_kv_cache_dtype_flag(value, "--kv-cache-dtype"); });
  expect_result_or_usage_error("find_preset", [&] { (void)cli::find_preset(value); });
}

}  // namespace
}  // namespace pagedattn::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pagedattn;
  using namespace pagedattn::fuzz;
  if (size > 4096) return 0;
  std::vector<std::string> args = {"pagedattn"};
  std::string current;
  for (size_t i = 0; i < size; ++i) {
    const char c = static_cast<char>(data[i]);
    if (c == '\n' || c == '\0') {
      args.push_back(current);
      current.clear();
    } else {
      current += c;
    }
  }
  if (!current.empty()) args.push_back(current);
  for (size_t i = 1; i < args.size(); ++i) check_value_parsers(args[i]);

  cli::CliApp program = cli::make_cli_app();
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  try {
    program.app->parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return 0;
  } catch (const std::exception& e) {
    property_failed(std::string("CLI parse threw ") + typeid(e).name() + ": " + e.what());
  }
  for (cli::Command& c : program.commands) {
    if (!c.app->parsed() || c.app->get_name() != "backends") continue;
    std::ostringstream out, err;
    cli::Streams streams{out, err};
    try {
      const int code = c.action(streams);
      PAGEDATTN_FUZZ_ASSERT(code == cli::kExitOk || code == cli::kExitUnsupported, "exit code " + std::to_string(code));
    } catch (const UsageError&) {
    } catch (const UnsupportedConfiguration&) {
    } catch (const Error&) {
    } catch (const std::exception& e) {
      property_failed(std::string("backends action threw ") + typeid(e).name() + ": " + e.what());
    }
  }
  return 0;
}
