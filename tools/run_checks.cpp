// `pagedattn run`'s option and memory checks (run_checks.h).
#include "run_checks.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "calibrate.h"
#include "cli_common.h"
#include "option_limits.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::cli {

namespace {

// "30.5 TiB", "125 GiB", "512 MiB".
std::string format_bytes(double bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  return format_sig(bytes, 3) + " " + units[u];
}

}  // namespace

int64_t host_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return int64_t{pages} * page_size;
}

void validate_run_options(const RunOptions& o) {
  check_range("--layers", o.num_layers, 0, kMaxLayers);  // 0 = the preset's
  check_range("--tensor-parallel-size", o.tensor_parallel_size, 1, kMaxTensorParallel);
  check_range("--block-size", o.block_size, 1, kMaxBlockSize);
  check_range("--threads", o.threads, 0, kMaxThreads);  // 0 = OpenMP's default
  if (o.dtype != DType::f32 && o.dtype != DType::f16 && o.dtype != DType::bf16) {
    throw UsageError("--dtype: " + std::string(dtype_name(o.dtype)) +
                     " is not an activation dtype: expected float32, float16 or bfloat16");
  }
  try {
    validate_kv_cache_dtype(o.kv_cache_dtype);
  } catch (const Error& e) {
    throw UsageError(std::string("--kv-cache-dtype: ") + e.what());
  }
  if (!o.backend.empty() && find_backend(o.backend) == nullptr) {
    std::vector<std::string> names;
    for (const AttentionBackend* b : registered_backends()) names.emplace_back(b->name());
    throw UsageError("--backend: unknown backend '" + o.backend + "': expected one of " + join(names, ", "));
  }
  if (o.device == Device::cuda && cuda_device_count() == 0) {
    throw UsageError(std::string("--device cuda: ") +
                     (built_with_cuda() ? "no CUDA device is visible" : "this pagedattn was built without CUDA"));
  }
  check_range("--max-num-batched-tokens", o.max_num_batched_tokens, 1, kMaxBatchedTokens);
  check_range("--max-num-seqs", o.max_num_seqs, 1, kMaxNumSeqs);
  check_range("--max-model-len", o.max_model_len, 0, kMaxTokens);  // 0 = the preset's
  check_range("--num-blocks", o.num_blocks, 0, kMaxNumBlocks);     // 0 = automatic
  check_range("--kv-cache-gib", o.kv_cache_gib, 0.0, kMaxKvCacheGib, true);
  check_range("--long-prefill-token-threshold", o.long_prefill_token_threshold, 0, kMaxTokens);
  check_range("--max-steps", o.max_steps, 0, kMaxInt);
  check_range("--check-interval", o.check_interval, 1, kMaxInt);
  check_range("--dcp", o.dcp_world_size, 1, kMaxDcpRanks);
  check_range("--dcp-interleave", o.dcp_interleave, 1, kMaxBlockSize);
  if (o.dcp_world_size > 1 || o.dcp_interleave > 1) {
    if (o.block_size % o.dcp_interleave != 0) {
      throw UsageError("--dcp-interleave: " + std::to_string(o.dcp_interleave) + " does not divide --block-size " +
                       std::to_string(o.block_size) + " (a block holds whole interleave stripes)");
    }
    if (o.check_invariance) throw UsageError("--check-invariance: not with --dcp (it re-runs layers unsharded)");
  }
  validate_workload(o.workload);
}

void check_run_memory(const RunOptions& o, const RunMemory& m) {
  const int64_t host_memory = host_memory_bytes();
  const int64_t device_memory = o.device == Device::cuda ? gpu_memory_bytes(0) : 0;
  if (host_memory > 0 && m.activation_bytes > host_memory) {
    throw UsageError("--max-num-batched-tokens: " + std::to_string(o.max_num_batched_tokens) + " tokens need " +
                     format_bytes(static_cast<double>(m.activation_bytes)) +
                     " of activations, more than this machine's " + format_bytes(static_cast<double>(host_memory)) +
                     " of host memory");
  }
  // Each block: page_bytes in every cache of it (the run's, --check's REFERENCE copy on the
  // host) and 8 bytes of block-pool bookkeeping on the host.
  const double page = static_cast<double>(m.page_bytes);
  const double host_caches = (o.device == Device::cpu ? 1 : 0) + (m.check ? 1 : 0);
  struct Budget {
    const char* where;
    double memory, per_block, fixed;
  };
  std::vector<Budget> budgets;
  if (host_memory > 0) {
    budgets.push_back({"host memory", static_cast<double>(host_memory), host_caches * page + 8,
                       static_cast<double>(m.activation_bytes)});
  }
  if (device_memory > 0) {
    budgets.push_back({"memory of cuda:0", static_cast<double>(device_memory), page,
                       static_cast<double>(m.activation_bytes)});
  }
  for (const Budget& b : budgets) {
    const double need = static_cast<double>(m.num_blocks) * b.per_block + b.fixed;
    if (need <= b.memory) continue;
    const double fit = std::max(0.0, std::floor((b.memory - b.fixed) / b.per_block));
    const std::string caches = std::to_string(m.num_blocks) + " blocks x " + std::to_string(m.page_bytes) +
                               " bytes (all " + std::to_string(m.num_layers) + " layers" +
                               (m.check && host_caches > 1 ? ", twice: --check keeps REFERENCE caches" : "") + ") = " +
                               format_bytes(static_cast<double>(m.num_blocks) * b.per_block) + " of KV cache";
    const std::string limit = "more than the " + format_bytes(b.memory) + " of " + b.where + ": at most " +
                              format_limit(fit) + " blocks fit";
    if (m.automatic_num_blocks) {
      const double fit_gib = fit * page / double(int64_t{1} << 30);
      throw UsageError("--kv-cache-gib: " + format_limit(o.kv_cache_gib) + " lets the automatic --num-blocks reach " +
                       caches + ", " + limit + " (--kv-cache-gib " + format_sig(fit_gib, 3) + ")");
    }
    throw UsageError("--num-blocks: " + caches + ", " + limit);
  }
}

}  // namespace pagedattn::cli
