// mla::batched_gemm and mla::copy_3d (host): against fp64 loops on odd shapes (row / column /
// k-block tails), transposed and strided operands, mixed dtypes, broadcast copies, bad args.
// mla::batched_gemm_fixed_rows (the batch-invariant products): for every m (staged below 64 rows,
// chunked with an overlapping tail above) exactly the bits of batched_gemm on the same operands
// (the host GEMM is row-invariant), with strided A and C as the MLA run passes them (A rows of a
// (T, H, P + R) query, C rows of a (T, H, L) buffer, batch = heads); rows of C outside [0, m)
// untouched; short staging buffers are an Error naming a_stage.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "../../src/backends/mla/mla_common.h"
#include "pagedattn/pagedattn.h"

namespace pagedattn {
namespace {

Tensor random_host(Shape shape, DType dtype, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  Tensor t(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) store_f32(t.data(), dtype, i, dist(rng));
  return t;
}

struct GemmCase {
  int batch, m, n, k;
  DType a, b, c;
  bool transpose_b;  // B read through (row stride 1, col stride k): a transposed matrix
};

TEST(MLAPrimitives, BatchedGemmMatchesFp64) {
  std::mt19937 rng(21);
  const GemmCase cases[] = {
      {1, 1, 1, 1, DType::f32, DType::f32, DType::f32, false},
      {3, 67, 131, 259, DType::f32, DType::f32, DType::f32, false},  // every tail, 2 k blocks
      {2, 130, 40, 512, DType::bf16, DType::bf16, DType::bf16, true},
      {4, 5, 300, 64, DType::f16, DType::f32, DType::bf16, false},
      {1, 70, 129, 600, DType::bf16, DType::f16, DType::f32, true},
  };
  for (const GemmCase& g : cases) {
    Tensor a = random_host(Shape{g.batch, g.m, g.k}, g.a, rng);
    // B stored as (batch, k, n), or as (batch, n, k) and read transposed.
    Tensor b = g.transpose_b ? random_host(Shape{g.batch, g.n, g.k}, g.b, rng)
                             : random_host(Shape{g.batch, g.k, g.n}, g.b, rng);
    // C rows padded (row stride n + 3) to check the stride is honoured and the pad untouched.
    Tensor c(Shape{g.batch, g.m, g.n + 3}, g.c);
    c.fill_bytes(0xFF);
    const int64_t bs = int64_t{g.k} * g.n;
    const mla::MatrixRef b_ref = g.transpose_b ? mla::MatrixRef{b.data(), g.b, bs, 1, g.k}
                                               : mla::MatrixRef{b.data(), g.b, bs, g.n, 1};
    mla::batched_gemm(Device::cpu, g.batch, g.m, g.n, g.k,
                      mla::MatrixRef{a.data(), g.a, int64_t{g.m} * g.k, g.k, 1}, b_ref,
                      mla::MutableMatrixRef{c.data(), g.c, int64_t{g.m} * (g.n + 3), g.n + 3});
    double diff = 0, norm = 0;
    for (int bi = 0; bi < g.batch; ++bi) {
      for (int i = 0; i < g.m; ++i) {
        for (int j = 0; j < g.n; ++j) {
          double want = 0;
          for (int p = 0; p < g.k; ++p) {
            const int64_t bidx = g.transpose_b ? bi * bs + int64_t{j} * g.k + p
                                               : bi * bs + int64_t{p} * g.n + j;
            want += load_f64(a.data(), g.a, (int64_t{bi} * g.m + i) * g.k + p) *
                    load_f64(b.data(), g.b, bidx);
          }
          const int64_t at = (int64_t{bi} * g.m + i) * (g.n + 3);
          const double got = load_f64(c.data(), g.c, at + j);
          ASSERT_TRUE(std::isfinite(got)) << "C[" << bi << "][" << i << "][" << j << "] unwritten";
          diff += (got - want) * (got - want);
          norm += want * want;
          if (j == 0) {
            for (int x = g.n; x < g.n + 3; ++x) {
              EXPECT_TRUE(std::isnan(load_f32(c.data(), g.c, at + x))) << "pad written";
            }
          }
        }
      }
    }
    // One rounding of each C element: f32 ~1e-7, bf16 ~2e-3, f16 ~3e-4 (relative norm).
    const double tol = g.c == DType::f32 ? 1e-6 : g.c == DType::bf16 ? 4e-3 : 1e-3;
    EXPECT_LE(std::sqrt(diff / norm), tol) << g.batch << "x" << g.m << "x" << g.n << "x" << g.k;
  }
}

TEST(MLAPrimitives, BatchedGemmArgumentChecks) {
  float x = 1.f;
  const mla::MatrixRef ok{&x, DType::f32, 0, 1, 1};
  const mla::MutableMatrixRef out{&x, DType::f32, 0, 1};
  try {
    mla::batched_gemm(Device::cpu, 1, -1, 1, 1, ok, ok, out);
    ADD_FAILURE() << "negative m accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "batch");
  }
  try {
    mla::batched_gemm(Device::cpu, 1, 1, 1, 1, mla::MatrixRef{&x, DType::i32, 0, 1, 1}, ok, out);
    ADD_FAILURE() << "int32 operand accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "a");
  }
  try {
    mla::batched_gemm(Device::cpu, 1, 1, 1, 1, ok, ok, mla::MutableMatrixRef{nullptr, DType::f32, 0, 1});
    ADD_FAILURE() << "null C accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "c");
  }
  EXPECT_NO_THROW(mla::batched_gemm(Device::cpu, 0, 5, 5, 5, ok, ok, out));  // nothing to do
}

TEST(MLAPrimitives, Copy3dConvertsAndBroadcasts) {
  std::mt19937 rng(4);
  // src (5, 1, 7) broadcast over 3 "heads" (stride 0) into a strided bf16 dst slice.
  Tensor src = random_host(Shape{5, 7}, DType::f32, rng);
  const TensorView bcast(src.data(), DType::f32, Shape{5, 3, 7}, Shape{7, 0, 1});
  Tensor dst(Shape{5, 3, 10}, DType::bf16);
  dst.fill_bytes(0xFF);
  mla::copy_3d(bcast, dst.view().narrow(2, 2, 7));
  for (int t = 0; t < 5; ++t) {
    for (int h = 0; h < 3; ++h) {
      for (int x = 0; x < 10; ++x) {
        const float got = load_f32(dst.data(), DType::bf16, (t * 3 + h) * 10 + x);
        if (x < 2 || x >= 9) {
          EXPECT_TRUE(std::isnan(got)) << "outside the slice written";
        } else {
          EXPECT_EQ(got, bf16_bits_to_f32(f32_to_bf16_bits(src.data_as<float>()[t * 7 + x - 2])));
        }
      }
    }
  }
  Tensor same(Shape{5, 3, 7}, DType::f32);
  mla::copy_3d(bcast, same);
  EXPECT_EQ(same.data_as<float>()[(4 * 3 + 2) * 7 + 6], src.data_as<float>()[4 * 7 + 6]);
  Tensor wrong(Shape{5, 3, 6}, DType::f32);
  EXPECT_THROW(mla::copy_3d(bcast, wrong), Error);
  const TensorView strided_inner(src.data(), DType::f32, Shape{5, 1, 3}, Shape{7, 0, 2});
  Tensor small(Shape{5, 1, 3}, DType::f32);
  EXPECT_THROW(mla::copy_3d(strided_inner, small), Error);
}

// ---- batched_gemm_fixed_rows ----------------------------------------------------------------

TEST(MLAFixedRowsGemm, SameBitsAsOneCallForEveryRowCount) {
  using namespace mla;
  std::mt19937 rng(5);
  const int H = 3, P = 40, L = 48, T = 200;
  for (const DType dt : {DType::f32, DType::bf16}) {
    const Tensor q = random_host(Shape{T, H, P + 8}, dt, rng);  // (T, H, P + R): A reads [:P]
    const Tensor w = random_host(Shape{H, P, L}, dt, rng);
    Tensor a_stage(Shape{int64_t{kFixedGemmRows} * H * P}, dt), c_stage(Shape{int64_t{kFixedGemmRows} * H * L}, dt);
    a_stage.fill_bytes(0);
    c_stage.fill_bytes(0);
    for (const int m : {1, 5, 63, 64, 65, 128, 130, 200}) {
      Tensor expected(Shape{T, H, L}, dt), got(Shape{T, H, L}, dt);
      expected.fill_bytes(0xFF);
      got.fill_bytes(0xFF);
      const MatrixRef a{q.data(), dt, P + 8, int64_t{H} * (P + 8), 1}, b{w.data(), dt, int64_t{P} * L, L, 1};
      batched_gemm(Device::cpu, H, m, L, P, a, b, MutableMatrixRef{expected.data(), dt, L, int64_t{H} * L});
      batched_gemm_fixed_rows(Device::cpu, H, m, L, P, a, b, MutableMatrixRef{got.data(), dt, L, int64_t{H} * L},
                              a_stage, c_stage);
      // Rows [0, m) equal bit for bit; rows [m, T) still poisoned in both.
      EXPECT_EQ(std::memcmp(expected.data(), got.data(), expected.nbytes()), 0) << dtype_name(dt) << " m = " << m;
      if (m < T) EXPECT_TRUE(std::isnan(load_f32(got.data(), dt, int64_t{m} * H * L))) << m;
    }
  }
}

TEST(MLAFixedRowsGemm, ShortStagingIsAnError) {
  using namespace mla;
  std::mt19937 rng(6);
  const Tensor a = random_host(Shape{4, 8}, DType::f32, rng), b = random_host(Shape{8, 8}, DType::f32, rng);
  Tensor c(Shape{4, 8}, DType::f32), small(Shape{8}, DType::f32), stage(Shape{kFixedGemmRows * 8}, DType::f32);
  try {
    batched_gemm_fixed_rows(Device::cpu, 1, 4, 8, 8, MatrixRef{a.data(), DType::f32, 0, 8, 1},
                            MatrixRef{b.data(), DType::f32, 0, 8, 1}, MutableMatrixRef{c.data(), DType::f32, 0, 8},
                            small, stage);
    ADD_FAILURE() << "a staging buffer of 8 elements was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "a_stage");
  }
}

}  // namespace
}  // namespace pagedattn
