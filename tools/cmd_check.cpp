// `pagedattn check`: the conformance grid (tests/conformance/harness.h, compiled into this
// program) for every available backend against the REFERENCE, as a pass/fail table.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>

#include "cli_common.h"
#include "commands.h"
#include "conformance/harness.h"
#include "option_limits.h"
#include "option_parsing.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::cli {

namespace {

struct CheckFlags {
  bool full = false;
  std::string backend;
  std::string device;
  uint64_t seed = 1;
  bool verbose = false;
  std::string json_path;
};

struct CaseRecord {
  std::string backend, device, case_description;
  bool skipped = false;
  std::string skip_reason;
  bool passed = false;
  double error = 0, tolerance = 0;
  std::string detail;  // failure description
};

struct Summary {
  int cases = 0, passed = 0, failed = 0, skipped = 0;
  double worst_ratio = 0;  // error / tolerance
  std::string worst_case;
  std::map<std::string, int> skip_reasons;
};

}  // namespace

Command add_check_command(CLI::App& parent) {
  auto f = std::make_shared<CheckFlags>();
  CLI::App* app = parent.add_subcommand(
      "check",
      "Run the conformance grid — dtypes, KV-cache dtypes, head sizes, GQA, block sizes, layouts, "
      "features (window, soft-cap, ALiBi, sinks, LSE, cascade, fp8), batch shapes — on every available "
      "backend (or --backend) and compare each case with the REFERENCE (fp64) on the same inputs: "
      "||out - ref|| / ||ref|| against the DESIGN.md tolerance, every output element written, the written "
      "cache entries equal. Cases a backend does not support are skipped with its reasons. Exit 1 on "
      "any failure.");
  app->add_flag("--full", f->full, "the full grid (minutes) instead of the CI grid (seconds)");
  app->add_option("--backend", f->backend, "check only this backend");
  app->add_option("--device", f->device, "cpu or cuda (default: every device the backend supports that is present)");
  app->add_option("--seed", f->seed, "seed of the first case (case i uses seed + i)")
      ->capture_default_str()
      ->check(seed_option());
  app->add_flag("--verbose", f->verbose, "print every case, not only failures");
  app->add_option("--json", f->json_path, "write every case's result as JSON to FILE");

  CommandAction action = [f, app](Streams& io) -> int {
    using namespace pagedattn::conformance;
    std::vector<const AttentionBackend*> backends;
    if (!f->backend.empty()) {
      const AttentionBackend* b = find_backend(f->backend);
      if (!b) {
        std::vector<std::string> names;
        for (const AttentionBackend* r : registered_backends()) names.emplace_back(r->name());
        throw UsageError("--backend: unknown backend '" + f->backend + "': expected one of " + join(names, ", "));
      }
      backends.push_back(b);
    } else {
      backends = registered_backends();
    }
    std::vector<Device> wanted;
    if (!f->device.empty()) {
      Device d = parse_device_flag(f->device, "--device");
      if (d == Device::cuda && cuda_device_count() == 0) {
        throw UsageError(std::string("--device cuda: ") +
                         (built_with_cuda() ? "no CUDA device is visible" : "this pagedattn was built without CUDA"));
      }
      wanted.push_back(d);
    } else {
      wanted.push_back(Device::cpu);
      if (cuda_device_count() > 0) wanted.push_back(Device::cuda);
    }
    std::ofstream json_file;
    if (app->count("--json") > 0) {
      check_file_name("--json", f->json_path);
      json_file.open(f->json_path);
      if (!json_file) throw UsageError("--json: cannot write '" + f->json_path + "'");
    }

    const std::vector<ConformanceCase> grid = conformance_grid(f->full);
    std::vector<CaseRecord> records;
    std::vector<std::pair<std::string, Summary>> summaries;
    const bool tty = stderr_is_terminal();
    auto t_start = std::chrono::steady_clock::now();
    for (const AttentionBackend* b : backends) {
      std::vector<Device> supported = b->capabilities().devices;
      for (Device device : wanted) {
        if (std::find(supported.begin(), supported.end(), device) == supported.end()) continue;
        const std::string label = std::string(b->name()) + " (" + std::string(device_name(device)) + ")";
        Summary s;
        for (size_t i = 0; i < grid.size(); ++i) {
          const ConformanceCase& c = grid[i];
          CaseRecord rec;
          rec.backend = std::string(b->name());
          rec.device = std::string(device_name(device));
          rec.case_description = c.describe();
          ++s.cases;
          std::vector<std::string> reasons = unsupported_reasons(*b, device, c);
          if (!reasons.empty()) {
            rec.skipped = true;
            rec.skip_reason = join(reasons, " ");
            ++s.skipped;
            ++s.skip_reasons[reasons.front()];
          } else {
            try {
              ConformanceResult r = run_case(*b, device, c, f->seed + i);
              rec.passed = r.passed();
              rec.error = r.output_rel_error;
              rec.tolerance = r.tolerance;
              if (!rec.passed) rec.detail = r.describe();
            } catch (const Error& e) {
              rec.passed = false;
              rec.detail = std::string("threw: ") + e.what();
            }
            (rec.passed ? s.passed : s.failed)++;
            double ratio = rec.tolerance > 0 ? rec.error / rec.tolerance : 0;
            if (!rec.passed) ratio = std::max(ratio, 1e30);
            if (ratio >= s.worst_ratio) {
              s.worst_ratio = ratio;
              s.worst_case = rec.case_description;
            }
          }
          if (tty) {
            io.err << "\rpagedattn check: " << label << " case " << (i + 1) << "/" << grid.size() << std::flush;
          }
          records.push_back(std::move(rec));
        }
        if (tty) io.err << "\n";
        else io.err << "pagedattn check: " << label << ": " << s.passed << " passed, " << s.failed << " failed, "
                    << s.skipped << " skipped\n";
        summaries.emplace_back(label, s);
      }
    }
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();

    std::ostream& os = io.out;
    os << "pagedattn check: " << (f->full ? "full" : "CI") << " conformance grid, " << grid.size()
       << " cases per backend and device, each against REFERENCE (fp64), " << format_seconds(seconds) << "\n\n";
    TextTable t({"backend", "cases", "passed", "failed", "skipped", "worst error / tolerance", "result"});
    int total_failed = 0, total_run = 0;
    for (const auto& [label, s] : summaries) {
      total_failed += s.failed;
      total_run += s.passed + s.failed;
      std::string worst = s.passed + s.failed == 0 ? "-" : (s.worst_ratio >= 1e29 ? "error" : format_sig(s.worst_ratio, 2));
      t.add_row({label, std::to_string(s.cases), std::to_string(s.passed), std::to_string(s.failed),
                 std::to_string(s.skipped), worst,
                 s.failed > 0 ? "FAIL" : (s.passed > 0 ? "pass" : "nothing run")});
    }
    t.print(os);
    for (const auto& [label, s] : summaries) {
      if (s.skip_reasons.empty()) continue;
      os << "\n" << label << " skipped cases, by first reason:\n";
      std::vector<std::pair<int, std::string>> by_count;
      for (const auto& [reason, n] : s.skip_reasons) by_count.emplace_back(n, reason);
      std::sort(by_count.rbegin(), by_count.rend());
      for (size_t i = 0; i < by_count.size() && i < 8; ++i) {
        os << "  " << by_count[i].first << " x " << by_count[i].second << "\n";
      }
      if (by_count.size() > 8) os << "  ... and " << by_count.size() - 8 << " more reasons\n";
    }
    TextTable detail({"backend", "device", "case", "rel error", "tolerance", "result"});
    for (const CaseRecord& r : records) {
      if (r.skipped && !f->verbose) continue;
      if (!r.skipped && r.passed && !f->verbose) continue;
      detail.add_row({r.backend, r.device, r.case_description, r.skipped ? "-" : format_sig(r.error, 3),
                      r.skipped ? "-" : format_sig(r.tolerance, 2),
                      r.skipped ? "skipped: " + r.skip_reason : (r.passed ? "pass" : "FAIL: " + r.detail)});
    }
    if (detail.num_rows() > 0) {
      os << "\n" << (f->verbose ? "Every case:" : "Failures:") << "\n\n";
      detail.print(os);
    }
    if (json_file.is_open()) {
      nlohmann::json j = nlohmann::json::array();
      for (const CaseRecord& r : records) {
        j.push_back({{"backend", r.backend}, {"device", r.device}, {"case", r.case_description},
                     {"skipped", r.skipped}, {"skip_reason", r.skip_reason}, {"passed", r.passed},
                     {"rel_error", r.error}, {"tolerance", r.tolerance}, {"detail", r.detail}});
      }
      json_file << nlohmann::json{{"command", "check"}, {"full", f->full}, {"cases", j}}.dump(2) << "\n";
    }
    if (total_run == 0) {
      os << "\nno case ran: no selected backend supports a case of the grid on the selected devices\n";
      return kExitUnsupported;
    }
    os << "\n" << (total_failed == 0 ? "check passed" : "check FAILED") << " (" << total_run << " cases run, "
       << total_failed << " failed)\n";
    return total_failed == 0 ? kExitOk : kExitFailure;
  };
  return Command{app, action};
}

}  // namespace pagedattn::cli
