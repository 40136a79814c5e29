// batched_gemm_fixed_rows (mla_common.h): the batch-invariant MLA runs' matrix products, as
// launches of one fixed row count over batched_gemm, staging a short product through the
// workspace. Device-agnostic: the row chunks and the staging copies go through batched_gemm and
// copy_3d, which dispatch on the device.
#include <cstdint>

#include "backends/mla/mla_common.h"
#include "pagedattn/error.h"

namespace pagedattn::mla {

void batched_gemm_fixed_rows(Device device, int batch, int m, int n, int k, const MatrixRef& a,
                             const MatrixRef& b, const MutableMatrixRef& c, const Tensor& a_stage,
                             const Tensor& c_stage) {
  constexpr int R = kFixedGemmRows;
  if (batch <= 0 || m <= 0 || n <= 0) return;
  const int64_t a_elem = static_cast<int64_t>(dtype_size(a.dtype));
  const int64_t c_elem = static_cast<int64_t>(dtype_size(c.dtype));
  // Rows [i0, i0 + R) of A and C.
  const auto chunk = [&](int64_t i0) {
    MatrixRef a_rows = a;
    a_rows.data = static_cast<const char*>(a.data) + i0 * a.row_stride * a_elem;
    MutableMatrixRef c_rows = c;
    c_rows.data = static_cast<char*>(c.data) + i0 * c.row_stride * c_elem;
    batched_gemm(device, batch, R, n, k, a_rows, b, c_rows);
  };
  if (m >= R) {
    for (int64_t i0 = 0; i0 + R <= m; i0 += R) chunk(i0);
    if (m % R != 0) chunk(m - R);
    return;
  }
  PAGEDATTN_CHECK(a_stage.defined() && c_stage.defined() &&
                      a_stage.numel() >= int64_t{R} * batch * k && c_stage.numel() >= int64_t{R} * batch * n &&
                      a_stage.dtype() == a.dtype && c_stage.dtype() == c.dtype,
                  "a_stage", "mla::batched_gemm_fixed_rows: the staging buffers (", a_stage.view().describe(), ", ",
                  c_stage.view().describe(), ") do not hold ", R, " rows of batch ", batch, " x (k ", k, ", n ", n,
                  ") in ", dtype_name(a.dtype), " / ", dtype_name(c.dtype));
  PAGEDATTN_CHECK(a.col_stride == 1 || k <= 1, "a", "mla::batched_gemm_fixed_rows: A's column stride is ",
                  a.col_stride, ", expected 1 (the short product is staged row by row)");
  const int device_index = a_stage.view().device_index();
  // A (m, batch, k) -> a_stage (R, batch, k) rows [0, m); C rows [0, m) <- c_stage.
  const TensorView a_rows(const_cast<void*>(a.data), a.dtype, Shape{m, batch, k},
                          Shape{a.row_stride, a.batch_stride, 1}, device, device_index);
  const TensorView a_staged(a_stage.data(), a.dtype, Shape{m, batch, k},
                            Shape{int64_t{batch} * k, k, 1}, device, device_index);
  copy_3d(a_rows, a_staged);
  batched_gemm(device, batch, R, n, k, MatrixRef{a_stage.data(), a.dtype, k, int64_t{batch} * k, 1}, b,
               MutableMatrixRef{c_stage.data(), c.dtype, n, int64_t{batch} * n});
  const TensorView c_staged(c_stage.data(), c.dtype, Shape{m, batch, n}, Shape{int64_t{batch} * n, n, 1},
                            device, device_index);
  const TensorView c_rows(c.data, c.dtype, Shape{m, batch, n}, Shape{c.row_stride, c.batch_stride, 1}, device,
                          device_index);
  copy_3d(c_staged, c_rows);
}

}  // namespace pagedattn::mla
