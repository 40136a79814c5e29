// Masked keys never reach the output (issue 17): NaN in the K and V rows of keys a query row cannot
// see — outside its sliding window but in the same 16/64-key tile, past its causal end (the
// later tokens of a spec decode or prefill chunk), past the sequence end in the last page — must
// leave that row bit-identical to the run where those slots hold finite data. Checked on every
// CPU kernel path (scalar, avx2, avx512f, avx512, amx, amx emulated; the direct decode kernel and the tile
// kernel; one thread with head-fused items and four threads with split-KV) and on REFERENCE.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../../src/backends/cpu/cpu_internal.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn::cpu {
namespace {

constexpr int kHeads = 8, kKvHeads = 2, kHeadSize = 64, kBlockSize = 16, kBlocks = 400;

struct Request {
  int context, query;
};

// A decode past the window (split on 4 threads), a spec decode, a prefill chunk with context, a
// short decode, a decode whose context ends inside a page.
const std::vector<Request> kBatch = {{1000, 1}, {500, 3}, {100, 20}, {33, 1}, {301, 1}};

struct Fixture {
  std::unique_ptr<Attention> layer;
  OwnedCommonAttentionMetadata common;
  std::shared_ptr<const AttentionMetadata> plan;
  std::vector<int32_t> block_table;  // (num_reqs, cols)
  int cols = 0;
  Tensor query, key, value, cache;
};

Fixture make_fixture(const char* backend, DType dtype, std::optional<int> window, int threads) {
  Fixture f;
  AttentionLayerParams p;
  p.num_heads = kHeads;
  p.head_size = kHeadSize;
  p.num_kv_heads = kKvHeads;
  p.scale = 0.125f;
  p.sliding_window = window;
  p.dtype = dtype;
  p.block_size = kBlockSize;
  p.prefix = "layers.0.attn";
  p.backend = backend;
  f.layer = std::make_unique<Attention>(p);
  BuilderConfig config = f.layer->builder_config(8, 256, 2048);
  config.num_sms = threads;
  auto builder = f.layer->backend().make_builder(f.layer->kv_cache_spec(), config, Device::cpu);
  CommonAttentionMetadataArgs args;
  args.query_start_loc = {0};
  for (const Request& r : kBatch) {
    args.query_start_loc.push_back(args.query_start_loc.back() + r.query);
    args.seq_lens.push_back(r.context + r.query);
    f.cols = std::max(f.cols, (r.context + r.query + kBlockSize - 1) / kBlockSize);
  }
  args.max_num_blocks_per_req = f.cols;
  std::vector<int32_t> pages(kBlocks);
  for (int i = 0; i < kBlocks; ++i) pages[i] = i;
  std::mt19937 rng(11);
  std::shuffle(pages.begin(), pages.end(), rng);
  for (size_t i = 0; i < kBatch.size() * f.cols; ++i) f.block_table.push_back(pages.at(i));
  args.block_table = f.block_table;
  args.slot_mapping.assign(args.query_start_loc.back(), -1);  // the cache is only read
  f.common = make_common_attention_metadata(args);
  f.plan = builder->build(0, f.common.common);
  const int64_t tokens = args.query_start_loc.back();
  std::normal_distribution<float> dist(0.f, 1.f);
  auto random = [&](Shape shape, DType t) {
    Tensor x(shape, t);
    for (int64_t i = 0; i < x.numel(); ++i) store_f32(x.data(), t, i, dist(rng));
    return x;
  };
  f.query = random(Shape{tokens, kHeads, kHeadSize}, dtype);
  f.key = random(Shape{tokens, kKvHeads, kHeadSize}, dtype);
  f.value = random(Shape{tokens, kKvHeads, kHeadSize}, dtype);
  f.cache = f.layer->allocate_kv_cache(kBlocks);
  Tensor noise = random(f.cache.shape(), f.cache.dtype());
  std::memcpy(f.cache.data(), noise.data(), f.cache.nbytes());  // dense: same storage order
  return f;
}

Tensor run(Fixture& f, const Tensor& cache) {
  Tensor out(f.query.shape(), f.query.dtype());
  out.fill_bytes(0xFF);
  f.layer->impl().forward(f.layer->scales(), f.query, f.key, f.value, cache, *f.plan, out);
  return out;
}

// Writes NaN into the K (kv = 0) and V (kv = 1) rows of every KV head at position `pos` of
// request `req` (through its block table).
void poison(Fixture& f, Tensor& cache, int req, int pos, int kv) {
  const TensorView v = cache.view();  // (2, num_blocks, block_size, Hkv, D) in any stride order
  const int64_t block = f.block_table[static_cast<size_t>(req) * f.cols + pos / kBlockSize];
  for (int h = 0; h < kKvHeads; ++h) {
    for (int d = 0; d < kHeadSize; ++d) {
      const int64_t at = kv * v.stride(0) + block * v.stride(1) + (pos % kBlockSize) * v.stride(2) +
                         h * v.stride(3) + d * v.stride(4);
      store_f32(cache.data(), cache.dtype(), at, std::nanf(""));
    }
  }
}

// Positions of request r that no row of it sees (within 24 keys below the window, and the rest of
// its last page), and the "ragged" ones seen by only some rows (the first key of the window and
// the last key, when the request has several query tokens).
struct Poisoned {
  std::vector<int> hidden, ragged;
};

Poisoned poisoned_positions(const Request& r, std::optional<int> window) {
  Poisoned out;
  const int first = r.context, seq_len = r.context + r.query;
  if (window) {
    const int lo = first - (*window - 1);
    for (int k = std::max(0, lo - 24); k < lo; ++k) out.hidden.push_back(k);
    if (r.query > 1 && lo >= 0) out.ragged.push_back(lo);
  }
  for (int k = seq_len; k % kBlockSize != 0; ++k) out.hidden.push_back(k);
  if (r.query > 1) out.ragged.push_back(seq_len - 1);
  return out;
}

bool sees(int pos, int key, std::optional<int> window) {
  return key <= pos && (!window || key >= pos - (*window - 1));
}

// Runs clean and poisoned and returns a description of every row (token, head) that should be
// unaffected but differs.
std::string check_isolation(Fixture& f, std::optional<int> window, bool poison_keys) {
  const Tensor clean = run(f, f.cache);
  Tensor dirty_cache(f.cache.shape(), f.cache.dtype());
  std::memcpy(dirty_cache.data(), f.cache.data(), f.cache.nbytes());
  std::vector<Poisoned> sets;
  for (size_t r = 0; r < kBatch.size(); ++r) {
    sets.push_back(poisoned_positions(kBatch[r], window));
    for (const std::vector<int>* list : {&sets.back().hidden, &sets.back().ragged}) {
      for (int pos : *list) {
        poison(f, dirty_cache, static_cast<int>(r), pos, 1);
        if (poison_keys) poison(f, dirty_cache, static_cast<int>(r), pos, 0);
      }
    }
  }
  const Tensor dirty = run(f, dirty_cache);
  std::string problems;
  const size_t row_bytes = static_cast<size_t>(kHeadSize) * dtype_size(clean.dtype());
  int token = 0;
  for (size_t r = 0; r < kBatch.size(); ++r) {
    for (int t = 0; t < kBatch[r].query; ++t, ++token) {
      const int pos = kBatch[r].context + t;
      bool affected = false;
      for (int k : sets[r].ragged) affected |= sees(pos, k, window);
      if (affected) continue;  // this row sees a poisoned key: NaN is its right answer
      for (int h = 0; h < kHeads; ++h) {
        const char* a = static_cast<const char*>(clean.data()) + (token * kHeads + h) * row_bytes;
        const char* b = static_cast<const char*>(dirty.data()) + (token * kHeads + h) * row_bytes;
        if (std::memcmp(a, b, row_bytes) != 0) {
          problems += "request " + std::to_string(r) + " token " + std::to_string(t) + " head " +
                      std::to_string(h) + " (out[0] = " +
                      std::to_string(load_f32(dirty.data(), dirty.dtype(),
                                              (token * kHeads + h) * int64_t{kHeadSize})) +
                      "); ";
          break;
        }
      }
    }
  }
  return problems;
}

enum class Path { scalar, avx2, avx512f, avx512, amx, amx_emulated };

struct PathGuard {
  explicit PathGuard(Path path) {
    switch (path) {
      case Path::scalar: set_isa_override(Isa::scalar); break;
      case Path::avx2: set_isa_override(Isa::avx2); break;
      case Path::avx512f: set_isa_override(Isa::avx512f); break;
      case Path::avx512: set_isa_override(Isa::avx512); break;
      case Path::amx: set_isa_override(Isa::amx); break;
      case Path::amx_emulated: set_kernel_table_override(amx_emulated_kernel_table()); break;
    }
  }
  ~PathGuard() {
    set_kernel_table_override(nullptr);
    clear_isa_override();
    clear_decode_kernel_override();
  }
};

bool path_available(Path path) {
  switch (path) {
    case Path::scalar: return true;
    case Path::avx2: return isa_supported(Isa::avx2);
    case Path::avx512f: return isa_supported(Isa::avx512f);
    case Path::avx512:
    case Path::amx_emulated: return isa_supported(Isa::avx512);
    case Path::amx: return isa_supported(Isa::amx);
  }
  return false;
}

std::string path_name(const ::testing::TestParamInfo<Path>& info) {
  static const char* const names[] = {"scalar", "avx2", "avx512f", "avx512", "amx", "amx_emulated"};
  return names[static_cast<int>(info.param)];
}

class CpuMaskedNan : public ::testing::TestWithParam<Path> {};

TEST_P(CpuMaskedNan, MaskedKeysNeverReachTheOutput) {
  if (!path_available(GetParam())) GTEST_SKIP() << "this kernel path cannot run here";
  const PathGuard guard(GetParam());
  for (DecodeKernel kernel : {DecodeKernel::automatic, DecodeKernel::tile}) {
    set_decode_kernel_override(kernel);
    for (DType dtype : {DType::bf16, DType::f32}) {
      for (std::optional<int> window : {std::optional<int>(40), std::optional<int>()}) {
        for (int threads : {1, 4}) {
          for (bool poison_keys : {false, true}) {
            Fixture f = make_fixture("CPU", dtype, window, threads);
            const std::string problems = check_isolation(f, window, poison_keys);
            EXPECT_TRUE(problems.empty())
                << dtype_name(dtype) << (kernel == DecodeKernel::tile ? " tile" : " auto")
                << " window " << window.value_or(0) << ", " << threads << " threads, NaN in V"
                << (poison_keys ? " and K" : "") << ": rows changed by keys they cannot see: "
                << problems;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuMaskedNan,
                         ::testing::Values(Path::scalar, Path::avx2, Path::avx512f, Path::avx512,
                                           Path::amx, Path::amx_emulated),
                         path_name);

TEST(ReferenceMaskedNan, MaskedKeysNeverReachTheOutput) {
  for (std::optional<int> window : {std::optional<int>(40), std::optional<int>()}) {
    Fixture f = make_fixture("REFERENCE", DType::f32, window, 1);
    const std::string problems = check_isolation(f, window, true);
    EXPECT_TRUE(problems.empty()) << "window " << window.value_or(0) << ": " << problems;
  }
}

}  // namespace
}  // namespace pagedattn::cpu
