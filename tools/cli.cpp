// Argument parsing and error mapping of the `pagedattn` program.
#include <CLI/CLI.hpp>
#include <exception>
#include <iostream>

#include "cli_app.h"
#include "cli_common.h"
#include "commands.h"
#include "pagedattn/error.h"
#include "simulation.h"

namespace pagedattn::cli {

namespace {

std::string single_line(std::string s) {
  for (char& c : s) {
    if (c == '\n') c = ' ';
  }
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

}  // namespace

int run_cli(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  CliApp cli = make_cli_app();
  CLI::App& app = *cli.app;
  std::vector<Command>& commands = cli.commands;

  std::vector<char*> argv;
  std::vector<std::string> storage = args.empty() ? std::vector<std::string>{"pagedattn"} : args;
  for (std::string& a : storage) argv.push_back(a.data());

  auto chosen_name = [&]() -> std::string {
    for (const Command& c : commands) {
      if (c.app->parsed()) return "pagedattn " + c.app->get_name();
    }
    return "pagedattn";
  };
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e, out, err);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e, out, err);
  } catch (const CLI::ParseError& e) {
    err << chosen_name() << ": " << single_line(e.what()) << " (see --help)\n";
    return kExitUsage;
  }

  for (Command& c : commands) {
    if (!c.app->parsed()) continue;
    Streams streams{out, err};
    const std::string who = "pagedattn " + c.app->get_name();
    try {
      return c.action(streams);
    } catch (const UsageError& e) {
      err << who << ": " << single_line(e.what()) << "\n";
      return kExitUsage;
    } catch (const UnsupportedConfiguration& e) {
      err << who << ": " << single_line(e.what()) << "\n";
      return kExitUnsupported;
    } catch (const Error& e) {
      err << who << ": " << single_line(e.what()) << "\n";
      return kExitFailure;
    } catch (const std::exception& e) {
      err << who << ": internal error: " << single_line(e.what()) << "\n";
      return kExitFailure;
    }
  }
  err << "pagedattn: no subcommand (see --help)\n";
  return kExitUsage;
}

}  // namespace pagedattn::cli
