// mla::batched_gemm_fixed_rows (host): the batch-invariant products give, for every m (staged
// below 64 rows, chunked with an overlapping tail above), exactly the bits of batched_gemm on the
// same operands (the host GEMM is row-invariant), with strided A and C as the MLA run passes them
// (A rows of a (T, H, P) query, C rows of a (T, H, L) buffer, batch = heads); rows of C outside
// [0, m) are untouched; short staging buffers are an Error naming a_stage.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

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
