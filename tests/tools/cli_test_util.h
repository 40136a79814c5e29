// Runs the `pagedattn` program in-process through run_cli (the code path of main()) and keeps its
// exit code and output: shared by the tests of tests/tools.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "commands.h"

namespace pagedattn::cli::cli_test {

struct CliResult {
  int code = -1;
  std::string out, err;
};

// args without the program name.
inline CliResult cli(std::vector<std::string> args) {
  args.insert(args.begin(), "pagedattn");
  std::ostringstream out, err;
  CliResult r;
  r.code = run_cli(args, out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

}  // namespace pagedattn::cli::cli_test
