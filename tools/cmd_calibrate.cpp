// `pagedattn calibrate`: measures the machine's peaks and stores them in the calibration cache.
#include <CLI/CLI.hpp>
#include <memory>
#include <ostream>

#include "calibrate.h"
#include "cli_common.h"
#include "commands.h"
#include "option_limits.h"
#include "option_parsing.h"
#include "pagedattn/device.h"

namespace pagedattn::cli {

namespace {
struct CalibrateFlags {
  std::string device = "cpu";
  int threads = 0;
  bool show = false;
};
}  // namespace

Command add_calibrate_command(CLI::App& parent) {
  auto f = std::make_shared<CalibrateFlags>();
  CLI::App* app = parent.add_subcommand(
      "calibrate",
      "Measure this machine's ceilings and cache them (env PAGEDATTN_CALIBRATION, else "
      "~/.cache/pagedattn/calibration.json); `run` and `bench` divide by them. CPU: parallel copy "
      "bandwidth, fp32 FMA throughput at the width of the CPU kernel path that runs (AVX-512 for "
      "the avx512f / avx512 / amx paths, AVX2 for avx2, portable vectors for scalar; PAGEDATTN_CPU_ISA "
      "picks the path, and each path has its own cached entry), AMX bf16 throughput when the CPU "
      "has AMX. GPU (CUDA builds with a device): device-to-device copy and a cuBLAS bf16 GEMM.");
  app->add_option("--device", f->device, "cpu, cuda or all")->capture_default_str();
  app->add_option("--threads", f->threads, "CPU threads (0 = OpenMP's default)")->check(integer_option(0, kMaxThreads));
  app->add_flag("--show", f->show, "print the cached values (measuring only what is missing)");
  CommandAction action = [f](Streams& io) -> int {
    if (f->device != "all") parse_device_flag(f->device, "--device");
    check_range("--threads", f->threads, 0, kMaxThreads);
    int threads = apply_thread_count(f->threads);
    std::ostream& os = io.out;
    os << "calibration cache: " << calibration_path() << "\n\n";
    TextTable t({"device", "measurement", "value"});
    if (f->device == "cpu" || f->device == "all") {
      CpuCalibration c = cpu_calibration(threads, !f->show, &io.err);
      std::string who = "cpu (" + c.cpu_model + ", " + std::to_string(c.threads) + " threads)";
      t.add_row({who, "copy bandwidth (read + write)", format_bandwidth(c.copy_bandwidth)});
      t.add_row({who, "fp32 FMA (" + c.fma_isa + ")", format_flops(c.fma_flops)});
      t.add_row({who, "AMX bf16", c.amx_present ? format_flops(c.amx_bf16_flops) : "absent"});
      t.add_row({who, "measured", c.measured_at + " in " + format_seconds(c.seconds)});
    }
    if (f->device == "cuda" || f->device == "all") {
      std::string why;
      auto g = gpu_calibration(0, !f->show, &io.err, &why);
      if (!g) {
        if (f->device == "cuda") throw UsageError("--device cuda: " + why);
        t.add_row({"cuda", "(not measured)", why});
      } else {
        std::string who = "cuda:" + std::to_string(g->device_index) + " (" + g->name + ")";
        t.add_row({who, "device-to-device copy (read + write)", format_bandwidth(g->d2d_bandwidth)});
        t.add_row({who, "cuBLAS bf16 GEMM 8192^3", format_flops(g->bf16_gemm_flops)});
        t.add_row({who, "measured", g->measured_at + " in " + format_seconds(g->seconds)});
      }
    }
    t.print(os);
    return kExitOk;
  };
  return Command{app, action};
}

}  // namespace pagedattn::cli
