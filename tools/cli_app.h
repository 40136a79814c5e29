// The `pagedattn` program's command line as an object: the CLI11 app with every subcommand and
// its options, and each subcommand's action. run_cli (cli.cpp) parses with it and runs the chosen
// action; fuzz/fuzz_cli.cpp parses with the very same app without running anything.
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <vector>

#include "commands.h"

namespace pagedattn::cli {

struct CliApp {
  std::unique_ptr<CLI::App> app;   // the program; commands[i].app are its subcommands
  std::vector<Command> commands;   // run, backends, check, bench, calibrate
};

CliApp make_cli_app();

}  // namespace pagedattn::cli
