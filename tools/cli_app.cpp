// make_cli_app: the program's CLI11 app and its subcommands (see cli_app.h).
#include "cli_app.h"

namespace pagedattn::cli {

CliApp make_cli_app() {
  CliApp cli;
  cli.app = std::make_unique<CLI::App>(
      "pagedattn: the attention subsystem of an LLM serving engine (paged KV cache, backends, "
      "selector, metadata builders).\n"
      "  run        serving simulation of a model preset on a seeded workload\n"
      "  backends   every backend, its capabilities, and why it can or cannot run a configuration\n"
      "  check      conformance grid: every available backend against the REFERENCE\n"
      "  bench      fixed decode / prefill / mixed grids per backend (JSON + markdown)\n"
      "  plan-bench host time of build() against build_for_drafting() per backend\n"
      "  calibrate  measure this machine's copy bandwidth and FLOP rate (cached)",
      "pagedattn");
  CLI::App& app = *cli.app;
  app.require_subcommand(1);
  app.fallthrough(false);
  cli.commands = {add_run_command(app), add_backends_command(app), add_check_command(app),
                  add_bench_command(app), add_plan_bench_command(app), add_calibrate_command(app)};
  return cli;
}

}  // namespace pagedattn::cli
