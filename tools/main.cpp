// The `pagedattn` program. Everything but this function is in the pagedattn_cli_lib library
// (tools/CMakeLists.txt), which the tests link.
#include <iostream>
#include <string>
#include <vector>

#include "commands.h"

int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  return pagedattn::cli::run_cli(args, std::cout, std::cerr);
}
