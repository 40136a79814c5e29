// Random contents for the benchmark tensors (bench_fill.h).
#include "bench_fill.h"

#include <algorithm>
#include <cstring>
#include <random>

namespace pagedattn::cli {

void fill_random(Tensor& t, uint64_t seed) {
  Tensor host(t.shape(), t.dtype(), Device::cpu);
  const int64_t tile = std::min<int64_t>(t.numel(), 1 << 20);
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int64_t i = 0; i < tile; ++i) store_f32(host.data(), t.dtype(), i, normal(rng));
  const size_t esize = dtype_size(t.dtype());
  char* base = static_cast<char*>(host.data());
  for (int64_t done = tile; done < t.numel(); done += tile) {
    int64_t n = std::min(tile, t.numel() - done);
    std::memcpy(base + done * static_cast<int64_t>(esize), base, static_cast<size_t>(n) * esize);
  }
  t.copy_from(host.view());
}

}  // namespace pagedattn::cli
