// The subcommands of `pagedattn` (CLI11). Each add_*_command registers its options on a
// subcommand of `parent` and returns the action to run when that subcommand was chosen.
#pragma once

#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace pagedattn::cli {

struct Streams {
  std::ostream& out;  // reports
  std::ostream& err;  // progress, diagnostics
};

// Returns the exit code. May throw UsageError (bad arguments found after parsing),
// UnsupportedConfiguration, pagedattn::Error; run_cli maps them to exit codes.
using CommandAction = std::function<int(Streams&)>;

struct Command {
  CLI::App* app = nullptr;
  CommandAction action;
};

Command add_run_command(CLI::App& parent);
Command add_backends_command(CLI::App& parent);
Command add_check_command(CLI::App& parent);
Command add_bench_command(CLI::App& parent);
Command add_plan_bench_command(CLI::App& parent);
Command add_calibrate_command(CLI::App& parent);

// The whole program: parses `args` (args[0] is the program name), runs the chosen subcommand,
// returns the exit code (cli_common.h). Errors are one line on `err`:
//   "pagedattn <subcommand>: <message>".
int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

}  // namespace pagedattn::cli
