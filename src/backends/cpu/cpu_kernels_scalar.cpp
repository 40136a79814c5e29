// Portable scalar kernels of the CPU backend (baseline flags, any architecture): the f32 tile
// algorithm of cpu_attention_tile.h with one-lane "vectors" (register block 4 rows x 4 columns).
// Used where no SIMD table is available and as the path every other ISA is checked against in
// tests/cpu. Precision: exact conversions to f32, f32 multiply-add, libm expf/tanhf-grade exp,
// one rounding at the output.
#include <cmath>

#include "backends/cpu/cpu_f32_ops.h"

namespace pagedattn::cpu {
namespace {

struct Vec1 {
  using V = float;
  using M = bool;
  static constexpr int W = 1;
  static constexpr int kMR = 4;
  static constexpr int kNC = 4;

  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return a > b ? a : b; }
  static V min(V a, V b) { return a < b ? a : b; }
  static V abs(V a) { return std::fabs(a); }
  static V iota() { return 0.f; }
  static M ge(V a, V b) { return a >= b; }
  static M lt(V a, V b) { return a < b; }
  static M and_mask(M a, M b) { return a && b; }
  static V select(M m, V a, V b) { return m ? a : b; }
  static float hmax(V v) { return v; }
  static float hsum(V v) { return v; }
  static V exp(V x) { return std::exp(x); }

  template <DType DT>
  static V load_f32(const char* src, int index) {
    if constexpr (DT == DType::f32) {
      float x;
      std::memcpy(&x, src + 4 * static_cast<size_t>(index), 4);
      return x;
    } else if constexpr (DT == DType::f16 || DT == DType::bf16) {
      uint16_t h;
      std::memcpy(&h, src + 2 * static_cast<size_t>(index), 2);
      return DT == DType::f16 ? f16_to_f32(h) : bf16_to_f32(h);
    } else if constexpr (DT == DType::fp8_e4m3) {
      return fp8_e4m3_to_f32(static_cast<uint8_t>(src[index]));
    } else {
      return fp8_e5m2_to_f32(static_cast<uint8_t>(src[index]));
    }
  }

  static void transpose16(uint32_t* dst, int dst_stride, const char* const rows[16], int ncols) {
    for (int i = 0; i < 16; ++i) {
      for (int c = 0; c < ncols; ++c) {
        std::memcpy(dst + static_cast<size_t>(c) * dst_stride + i, rows[i] + 4 * static_cast<size_t>(c), 4);
      }
    }
  }
};

void run_item_scalar(const AttentionArgs& args, const WorkItem& item, char* scratch) {
  run_item_impl<F32Ops<Vec1>>(args, item, scratch);
}

void merge_scalar(const AttentionArgs& args, const MergeTask& task) { merge_impl<Vec1>(args, task); }

const KernelTable kScalarTable = {Isa::scalar, "scalar", false, &run_item_scalar, &merge_scalar};

}  // namespace

const KernelTable* scalar_kernel_table() { return &kScalarTable; }

size_t thread_scratch_bytes(int head_size, int head_size_v, int max_rows) {
  return scratch_layout(head_size, head_size_v, max_rows).total;
}

}  // namespace pagedattn::cpu
