// `pagedattn bench`: fixed workload grids per backend — decode (batch x context), prefill
// (batch x length), mixed (decodes + prefill chunks in one batch) — timed through the Attention
// layer (cache write + attention) after one plan, reported against the calibrated peaks.
// Writes cli_bench.json and cli_bench.md to --out, and cli_roofline.png when python3 with
// matplotlib is there (bench/cli_roofline.py; optional, not a dependency).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <numeric>
#include <ostream>
#include <random>

#include "bench_dcp.h"
#include "bench_fill.h"
#include "calibrate.h"
#include "cli_common.h"
#include "commands.h"
#include "option_limits.h"
#include "option_parsing.h"
#include "pagedattn/pagedattn.h"
#include "presets.h"
#include "work_model.h"

#ifndef PAGEDATTN_CLI_ROOFLINE_SCRIPT
#define PAGEDATTN_CLI_ROOFLINE_SCRIPT ""
#endif

namespace pagedattn::cli {

namespace {

using Clock = std::chrono::steady_clock;

struct BenchFlags {
  std::string preset = "llama3-8b";
  int layer = 0;
  std::vector<std::string> backends;
  bool include_reference = false;
  std::string device = "cpu";
  std::string dtype = "bfloat16";
  std::string kv_cache_dtype = "auto";
  int block_size = 16;
  int threads = 0;
  std::string grid = "quick";
  double min_seconds = 0.2;
  std::string out = "bench-out";
  uint64_t seed = 0;
  int dcp = 1;  // > 1: also the long-context DCP grid on that many ranks (bench_dcp.h)
};

struct Request {
  int context = 0;  // cached tokens
  int query = 0;    // new tokens this step
};

struct GridPoint {
  std::string kind;   // decode, prefill, mixed
  std::string label;  // "B=8 ctx=2048"
  std::vector<Request> batch;
};

std::vector<GridPoint> make_grid(const std::string& grid) {
  const bool full = grid == "full";
  std::vector<GridPoint> points;
  for (int b : full ? std::vector<int>{1, 16, 64} : std::vector<int>{1, 8}) {
    for (int ctx : full ? std::vector<int>{1024, 4096, 16384} : std::vector<int>{512, 2048}) {
      points.push_back({"decode", "B=" + std::to_string(b) + " ctx=" + std::to_string(ctx),
                        std::vector<Request>(static_cast<size_t>(b), Request{ctx - 1, 1})});
    }
  }
  for (int b : full ? std::vector<int>{1, 4} : std::vector<int>{1}) {
    for (int len : full ? std::vector<int>{512, 2048, 8192} : std::vector<int>{128, 512}) {
      points.push_back({"prefill", "B=" + std::to_string(b) + " len=" + std::to_string(len),
                        std::vector<Request>(static_cast<size_t>(b), Request{0, len})});
    }
  }
  struct Mixed {
    int decodes, decode_ctx, prefills, chunk, chunk_ctx;
  };
  for (Mixed m : full ? std::vector<Mixed>{{32, 2048, 2, 512, 1024}, {64, 4096, 1, 2048, 0}}
                      : std::vector<Mixed>{{8, 1024, 1, 256, 256}}) {
    GridPoint p{"mixed",
                std::to_string(m.decodes) + " decodes ctx=" + std::to_string(m.decode_ctx) + " + " +
                    std::to_string(m.prefills) + " x " + std::to_string(m.chunk) + "-token chunk ctx=" +
                    std::to_string(m.chunk_ctx),
                {}};
    for (int i = 0; i < m.decodes; ++i) p.batch.push_back({m.decode_ctx - 1, 1});
    for (int i = 0; i < m.prefills; ++i) p.batch.push_back({m.chunk_ctx, m.chunk});
    points.push_back(p);
  }
  return points;
}

// The backend's cache as kv_cache.h lays it out: stored contiguously in kv_cache_stride_order,
// viewed in logical order. `storage` owns the bytes (flat, so it can be filled from the host).
TensorView paged_cache_view(const AttentionBackend& backend, const Tensor& storage, const Shape& logical) {
  std::vector<int> order = backend.kv_cache_stride_order();
  if (static_cast<int>(order.size()) != logical.ndim()) {
    order.resize(static_cast<size_t>(logical.ndim()));
    std::iota(order.begin(), order.end(), 0);
  }
  Shape physical;
  for (int dim : order) physical.push_back(logical[dim]);
  Shape physical_strides = contiguous_strides(physical);
  Shape strides = logical;
  for (size_t i = 0; i < order.size(); ++i) strides[order[i]] = physical_strides[static_cast<int>(i)];
  return TensorView(storage.data(), storage.dtype(), logical, strides, storage.device());
}

struct PointResult {
  std::string backend, kind, label;
  int num_reqs = 0, num_tokens = 0;
  double plan_seconds = 0, median_seconds = 0, min_seconds = 0;
  int reps = 0;
  double bytes = 0, flops = 0;
};

PointResult run_point(const AttentionBackend& backend, const LayerShape& shape, const GridPoint& point,
                      const BenchFlags& f, Device device, DType dtype, int threads, uint64_t seed) {
  const int bs = f.block_size;
  AttentionLayerParams p;
  p.num_heads = shape.num_heads;
  if (shape.num_kv_heads > 0) p.num_kv_heads = shape.num_kv_heads;  // presets: 0 = unset
  p.head_size = shape.head_size;
  p.head_size_v = shape.head_size_v;
  if (shape.scale > 0.f) p.scale = shape.scale;
  if (shape.kind == LayerKind::sliding_window) p.sliding_window = shape.sliding_window;
  p.logits_soft_cap = shape.logits_soft_cap;
  if (shape.has_sinks) p.sinks.assign(static_cast<size_t>(shape.num_heads), 0.5f);
  p.kv_cache_dtype = f.kv_cache_dtype;
  p.block_size = bs;
  p.prefix = "bench.layer";
  p.dtype = dtype;
  p.device = device;
  p.backend = std::string(backend.name());
  Attention layer(p);

  // Block tables: distinct blocks, shuffled (a fragmented pool, as after hours of serving).
  int total_blocks = 0, cols = 1, num_tokens = 0, max_seq = 1;
  for (const Request& r : point.batch) {
    int blocks = (r.context + r.query + bs - 1) / bs;
    total_blocks += blocks;
    cols = std::max(cols, blocks);
    num_tokens += r.query;
    max_seq = std::max(max_seq, r.context + r.query);
  }
  std::vector<int32_t> ids(static_cast<size_t>(total_blocks));
  std::iota(ids.begin(), ids.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  CommonAttentionMetadataArgs args;
  args.query_start_loc.push_back(0);
  args.max_num_blocks_per_req = cols;
  args.block_table.assign(point.batch.size() * static_cast<size_t>(cols), 0);
  size_t next = 0;
  std::vector<int32_t> query_lens, seq_lens;
  for (size_t r = 0; r < point.batch.size(); ++r) {
    const Request& req = point.batch[r];
    int seq = req.context + req.query;
    int blocks = (seq + bs - 1) / bs;
    for (int b = 0; b < blocks; ++b) args.block_table[r * static_cast<size_t>(cols) + static_cast<size_t>(b)] = ids[next++];
    for (int pos = req.context; pos < seq; ++pos) {
      args.slot_mapping.push_back(int64_t{args.block_table[r * static_cast<size_t>(cols) + static_cast<size_t>(pos / bs)]} * bs + pos % bs);
    }
    args.query_start_loc.push_back(args.query_start_loc.back() + req.query);
    args.seq_lens.push_back(seq);
    query_lens.push_back(req.query);
    seq_lens.push_back(seq);
  }
  OwnedCommonAttentionMetadata common = make_common_attention_metadata(args, device, total_blocks, bs);
  BuilderConfig config = layer.builder_config(static_cast<int>(point.batch.size()), num_tokens, max_seq);
  config.num_sms = device == Device::cuda ? gpu_sm_count(0) : threads;
  auto builder = backend.make_builder(layer.kv_cache_spec(), config, device);

  const int64_t hq = shape.num_heads, hkv = shape.num_kv_heads, d = shape.head_size, dv = shape.value_head_size();
  Tensor q(Shape{num_tokens, hq, d}, dtype, device), k(Shape{num_tokens, hkv, d}, dtype, device),
      v(Shape{num_tokens, hkv, dv}, dtype, device), out(Shape{num_tokens, hq, dv}, dtype, device);
  Shape cache_shape = backend.kv_cache_shape(total_blocks, bs, static_cast<int>(hkv), static_cast<int>(std::max(d, dv)),
                                             f.kv_cache_dtype);
  Tensor cache_storage(Shape{cache_shape.numel()}, layer.kv_cache_storage_dtype(), device);
  fill_random(cache_storage, seed + 1);  // stale but finite contents in the storage dtype
  TensorView cache = paged_cache_view(backend, cache_storage, cache_shape);
  fill_random(q, seed + 2);
  fill_random(k, seed + 3);
  fill_random(v, seed + 4);

  PointResult res;
  res.backend = std::string(backend.name());
  res.kind = point.kind;
  res.label = point.label;
  res.num_reqs = static_cast<int>(point.batch.size());
  res.num_tokens = num_tokens;
  auto t0 = Clock::now();
  std::shared_ptr<const AttentionMetadata> md = builder->build(0, common.common, false);
  if (device == Device::cuda) synchronize_cuda();
  res.plan_seconds = std::chrono::duration<double>(Clock::now() - t0).count();

  auto once = [&] {
    auto t = Clock::now();
    layer.forward(q, k, v, cache, *md, out);
    if (device == Device::cuda) synchronize_cuda();
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  once();  // warm-up
  std::vector<double> times;
  double spent = 0;
  while (times.size() < 3 || (spent < f.min_seconds && times.size() < 1000)) {
    times.push_back(once());
    spent += times.back();
  }
  std::sort(times.begin(), times.end());
  res.reps = static_cast<int>(times.size());
  res.median_seconds = times[times.size() / 2];
  res.min_seconds = times.front();
  AttentionWork w = attention_work(shape, dtype, kv_cache_storage_dtype(f.kv_cache_dtype, dtype), query_lens, seq_lens);
  res.bytes = w.bytes;
  res.flops = w.flops;
  return res;
}

bool python_has_matplotlib() {
  return std::system("python3 -c 'import matplotlib' >/dev/null 2>&1") == 0;
}

}  // namespace

Command add_bench_command(CLI::App& parent) {
  auto f = std::make_shared<BenchFlags>();
  CLI::App* app = parent.add_subcommand(
      "bench",
      "Fixed grids per backend on one layer shape of a preset: decode (batch x context), prefill "
      "(batch x length), mixed (decodes + prefill chunks). Each point: one plan, one warm-up, then "
      "forward (cache write + attention) repeated for --min-seconds (>= 3 runs); the median is "
      "reported with the bytes that must move and the FLOPs (DESIGN.md §7) as fractions of the "
      "calibrated peaks. Writes cli_bench.json and cli_bench.md to --out, and cli_roofline.png when "
      "python3 has matplotlib. REFERENCE (the fp64 oracle) is left out unless named or "
      "--include-reference.");
  app->add_option("--preset", f->preset, "model preset whose layer shape is benchmarked")->capture_default_str();
  app->add_option("--layer", f->layer, "which layer of the preset (its pattern index)")
      ->capture_default_str()
      ->check(integer_option(0, kMaxInt));
  app->add_option("--backend", f->backends, "backend(s) to run (default: every usable one but REFERENCE)")->delimiter(',');
  app->add_flag("--include-reference", f->include_reference, "also benchmark REFERENCE");
  app->add_option("--device", f->device, "cpu or cuda")->capture_default_str();
  app->add_option("--dtype", f->dtype, "activation dtype")->capture_default_str();
  app->add_option("--kv-cache-dtype", f->kv_cache_dtype, "KV-cache dtype string")->capture_default_str();
  app->add_option("--block-size", f->block_size, "KV-cache block size")
      ->capture_default_str()
      ->check(integer_option(1, kMaxBlockSize));
  app->add_option("--threads", f->threads, "CPU threads (0 = OpenMP's default)")->check(integer_option(0, kMaxThreads));
  app->add_option("--grid", f->grid, "quick (seconds) or full (decode to 64 x 16k, prefill to 4 x 8k)")->capture_default_str();
  app->add_option("--min-seconds", f->min_seconds, "time spent per point (after the warm-up)")
      ->capture_default_str()
      ->check(number_option(0, kMaxMinSeconds));
  app->add_option("--out", f->out, "output folder (created; checked before the grid runs)")->capture_default_str();
  app->add_option("--seed", f->seed, "seed of the inputs")->capture_default_str()->check(seed_option());
  app->add_option("--dcp", f->dcp,
                  "also the long-context decode grid of decode context parallelism on N ranks (quick: B4 x 16k, "
                  "B8 x 32k; full: B8 x 64k, B8 x 256k): the layer unsharded on one rank, then striped over N "
                  "(threads; --device cuda: one GPU and NCCL communicator each), with each rank's local attention "
                  "and communication (all-gather + merge) timed apart")
      ->capture_default_str()
      ->check(integer_option(1, kMaxDcpRanks));

  CommandAction action = [f](Streams& io) -> int {
    if (f->grid != "quick" && f->grid != "full") throw UsageError("--grid: '" + f->grid + "' is not a grid: expected quick or full");
    check_range("--block-size", f->block_size, 1, kMaxBlockSize);
    check_range("--threads", f->threads, 0, kMaxThreads);
    check_range("--min-seconds", f->min_seconds, 0.0, kMaxMinSeconds);
    const ModelPreset& preset = find_preset(f->preset);
    if (f->layer < 0 || f->layer >= static_cast<int>(preset.pattern.size())) {
      throw UsageError("--layer: " + std::to_string(f->layer) + " is not a layer of " + preset.name +
                       "'s pattern: expected 0 to " + std::to_string(preset.pattern.size() - 1));
    }
    const LayerShape shape = preset.layer(f->layer);
    if (shape.kind == LayerKind::mla || shape.kind == LayerKind::chunked_local) {
      throw UsageError("--preset " + preset.name + " --layer " + std::to_string(f->layer) + ": " +
                       std::string(layer_kind_name(shape.kind)) +
                       " layers are not benchmarked here (use `pagedattn run`); pick a full or sliding-window layer");
    }
    Device device = parse_device_flag(f->device, "--device");
    if (device == Device::cuda && cuda_device_count() == 0) {
      throw UsageError(std::string("--device cuda: ") +
                       (built_with_cuda() ? "no CUDA device is visible" : "this pagedattn was built without CUDA"));
    }
    DType dtype = parse_activation_dtype_flag(f->dtype, "--dtype");
    check_kv_cache_dtype_flag(f->kv_cache_dtype, "--kv-cache-dtype");
    const int threads = apply_thread_count(f->threads);

    SelectorConfig sc;
    sc.head_size = shape.head_size;
    sc.head_size_v = shape.head_size_v;
    sc.dtype = dtype;
    sc.kv_cache_dtype = f->kv_cache_dtype;
    sc.block_size = f->block_size;
    sc.has_sink = shape.has_sinks;
    sc.device = device;
    sc.use_sliding_window = shape.kind == LayerKind::sliding_window;
    sc.use_logits_soft_cap = shape.logits_soft_cap.has_value();
    std::vector<const AttentionBackend*> backends;
    if (!f->backends.empty()) {
      for (const std::string& name : f->backends) {
        const AttentionBackend* b = find_backend(name);
        if (!b) throw UsageError("--backend: unknown backend '" + name + "'");
        std::vector<std::string> reasons = b->validate_configuration(sc);
        if (!reasons.empty()) throw UnsupportedConfiguration("--backend " + name + ": " + join(reasons, " "));
        backends.push_back(b);
      }
    } else {
      for (const BackendReport& r : explain_backends(sc)) {
        if (!r.usable()) continue;
        if (r.backend->name() == "REFERENCE" && !f->include_reference) continue;
        backends.push_back(r.backend);
      }
      if (backends.empty()) {
        throw UnsupportedConfiguration(
            "no backend other than REFERENCE can run " + preset.name + " layer " + std::to_string(f->layer) + " (" +
            shape.describe() + ") on " + std::string(device_name(device)) +
            "; pass --include-reference to benchmark the fp64 oracle (see `pagedattn backends`)");
      }
    }

    // The output folder and files, before the calibration and the grid (minutes) run.
    check_file_name("--out", f->out, "folder");
    const std::filesystem::path dir(f->out);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw UsageError("--out: cannot create '" + f->out + "': " + ec.message());
    for (const char* name : {"cli_bench.json", "cli_bench.md"}) {
      if (!std::ofstream(dir / name, std::ios::app)) {
        throw UsageError("--out: cannot write '" + (dir / name).string() + "'");
      }
    }

    std::optional<MachinePeaks> peaks;
    std::string peaks_why;
    try {
      peaks = machine_peaks(device, dtype, threads, &io.err);
    } catch (const Error& e) {
      peaks_why = e.what();
    }
    std::vector<GridPoint> grid = make_grid(f->grid);
    std::vector<PointResult> results;
    for (const AttentionBackend* b : backends) {
      for (size_t i = 0; i < grid.size(); ++i) {
        io.err << "pagedattn bench: " << b->name() << " " << grid[i].kind << " " << grid[i].label << "\n";
        results.push_back(run_point(*b, shape, grid[i], *f, device, dtype, threads, f->seed + 17 * i));
      }
    }

    std::vector<DcpBenchResult> dcp_results;
    if (f->dcp > 1) {
      DcpBenchConfig dc;
      dc.ranks = f->dcp;
      dc.block_size = f->block_size;
      dc.kv_cache_dtype = f->kv_cache_dtype;
      dc.device = device;
      dc.dtype = dtype;
      dc.min_seconds = f->min_seconds;
      dc.seed = f->seed;
      for (const AttentionBackend* b : backends) {
        for (const DcpBenchPoint& point : dcp_bench_grid(f->grid)) {
          io.err << "pagedattn bench: " << b->name() << " dcp x" << f->dcp << " B=" << point.batch
                 << " ctx=" << point.context + 1 << "\n";
          dcp_results.push_back(run_dcp_bench_point(*b, shape, point, dc));
        }
      }
    }

    TextTable t({"backend", "grid", "point", "tokens", "time (median)", "plan", "bandwidth", "of peak", "compute",
                 "of peak"});
    nlohmann::json points = nlohmann::json::array();
    for (const PointResult& r : results) {
      double bw = r.bytes / r.median_seconds, fl = r.flops / r.median_seconds;
      t.add_row({r.backend, r.kind, r.label, format_count(r.num_tokens), format_seconds(r.median_seconds),
                 format_seconds(r.plan_seconds), format_bandwidth(bw),
                 peaks ? format_percent(bw / peaks->bandwidth) : "n/a", format_flops(fl),
                 peaks ? format_percent(fl / peaks->flops) : "n/a"});
      nlohmann::json pj = {{"backend", r.backend}, {"grid", r.kind}, {"point", r.label}, {"num_reqs", r.num_reqs},
                           {"num_tokens", r.num_tokens}, {"median_seconds", r.median_seconds},
                           {"min_seconds", r.min_seconds}, {"reps", r.reps}, {"plan_seconds", r.plan_seconds},
                           {"bytes", r.bytes}, {"flops", r.flops}, {"bandwidth_bytes_per_second", bw},
                           {"flop_per_second", fl}, {"arithmetic_intensity", r.flops / r.bytes}};
      if (peaks) {
        pj["bandwidth_fraction_of_peak"] = bw / peaks->bandwidth;
        pj["flops_fraction_of_peak"] = fl / peaks->flops;
      }
      points.push_back(pj);
    }
    std::string header = "pagedattn bench: " + preset.name + " layer " + std::to_string(f->layer) + " (" +
                         shape.describe() + ", " + std::to_string(shape.num_heads) + " q / " +
                         std::to_string(shape.num_kv_heads) + " kv heads, d " + std::to_string(shape.head_size) +
                         "), " + std::string(device_name(device)) +
                         (device == Device::cpu ? " (" + std::to_string(threads) + " threads)" : std::string()) +
                         ", " + std::string(dtype_name(dtype)) + ", kv " + f->kv_cache_dtype + ", block " +
                         std::to_string(f->block_size) + ", " + f->grid + " grid";
    std::string peak_line = peaks ? "peaks: " + format_bandwidth(peaks->bandwidth) + " (" + peaks->bandwidth_source + "), " +
                                        format_flops(peaks->flops) + " (" + peaks->flops_source + ")"
                                  : "peaks: n/a (" + peaks_why + ")";
    TextTable dt({"backend", "dcp point", "ranks", "1 rank", "N ranks", "speed-up", "attend", "communication",
                  "KV per rank"});
    nlohmann::json dcp_points = nlohmann::json::array();
    for (const DcpBenchResult& r : dcp_results) {
      dt.add_row({r.backend, r.label, std::to_string(r.ranks), format_seconds(r.one_rank_seconds),
                  format_seconds(r.step_seconds), format_sig(r.one_rank_seconds / r.step_seconds) + "x",
                  format_seconds(r.attend_seconds),
                  format_seconds(r.comm_seconds) + " (" + format_percent(r.comm_seconds / r.step_seconds) + ")",
                  format_percent(static_cast<double>(r.kv_bytes_per_rank) / static_cast<double>(r.kv_bytes_one_rank))});
      dcp_points.push_back({{"backend", r.backend}, {"point", r.label}, {"ranks", r.ranks},
                            {"one_rank_seconds", r.one_rank_seconds}, {"step_seconds", r.step_seconds},
                            {"attend_seconds", r.attend_seconds}, {"comm_seconds", r.comm_seconds},
                            {"kv_bytes_one_rank", r.kv_bytes_one_rank}, {"kv_bytes_per_rank", r.kv_bytes_per_rank},
                            {"iterations", r.iterations}});
    }
    const std::string dcp_title = "decode context parallelism, " + std::to_string(f->dcp) + " ranks" +
                                  (device == Device::cuda ? " (one GPU each, NCCL)" : " (threads sharing the host's cores)") +
                                  ": medians; communication = the all-gather + merge of the rank that waited least";
    io.out << header << "\n" << peak_line << "\n\n";
    t.print(io.out);
    if (!dcp_results.empty()) {
      io.out << "\n" << dcp_title << "\n\n";
      dt.print(io.out);
    }

    nlohmann::json doc = {{"command", "bench"}, {"header", header}, {"preset", preset.name}, {"layer", f->layer},
                          {"device", device_name(device)}, {"threads", threads}, {"dtype", dtype_name(dtype)},
                          {"kv_cache_dtype", f->kv_cache_dtype}, {"block_size", f->block_size}, {"grid", f->grid},
                          {"points", points}};
    if (!dcp_results.empty()) doc["dcp_points"] = dcp_points;
    if (peaks) {
      doc["peak_bandwidth_bytes_per_second"] = peaks->bandwidth;
      doc["peak_flop_per_second"] = peaks->flops;
      doc["peak_bandwidth_source"] = peaks->bandwidth_source;
      doc["peak_flops_source"] = peaks->flops_source;
    }
    std::ofstream(dir / "cli_bench.json") << doc.dump(2) << "\n";
    std::ofstream(dir / "cli_bench.md") << "# " << header << "\n\n" << peak_line << "\n\n" << t.str()
                                        << (dcp_results.empty() ? "" : "\n" + dcp_title + "\n\n" + dt.str());
    io.out << "\nwrote " << (dir / "cli_bench.json").string() << " and " << (dir / "cli_bench.md").string() << "\n";

    std::filesystem::path script = PAGEDATTN_CLI_ROOFLINE_SCRIPT;
    if (!peaks) {
      io.out << "roofline PNG skipped: no measured peaks\n";
    } else if (script.empty() || !std::filesystem::exists(script)) {
      io.out << "roofline PNG skipped: bench/cli_roofline.py not found\n";
    } else if (!python_has_matplotlib()) {
      io.out << "roofline PNG skipped: python3 with matplotlib not found (optional: pip install matplotlib)\n";
    } else {
      std::string cmd = "python3 '" + script.string() + "' '" + (dir / "cli_bench.json").string() + "' '" +
                        (dir / "cli_roofline.png").string() + "'";
      if (std::system(cmd.c_str()) == 0) io.out << "wrote " << (dir / "cli_roofline.png").string() << "\n";
      else io.out << "roofline PNG failed: " << cmd << "\n";
    }
    return kExitOk;
  };
  return Command{app, action};
}

}  // namespace pagedattn::cli
