// MLA device primitives (mla_common.h): batched_gemm and copy_3d, dispatched on the device; the
// host implementations live here, the CUDA ones in src/backends/cuda/mla/mla_device_ops.cu.
//
// batched_gemm: C[b] (m, n) = A[b] (m, k) · B[b] (k, n), operands f32/f16/bf16 with any strides.
//   Tiling (host): one task per (batch b, column panel of kNB = 128, row block of kMB = 64);
//   per task the k axis is walked in blocks of kKB = 256: the B block (kKB x kNB) and the A block
//   (kMB x kKB) are converted once to f32 (128 KiB + 64 KiB, L2-resident), then a 4 x 16
//   register tile of C (16 vector accumulators) walks the k block: each B row segment loaded
//   serves 4 rows, each A element 16 columns. The micro-kernel is compiled for AVX-512, AVX2+FMA
//   and baseline x86-64 (GCC target_clones, picked at load time). Memory traffic: A is read
//   n / kNB times, B m / kMB times, C written once; the floor is the 2·m·n·k flops over the
//   host's f32 FMA rate for the sizes MLA uses (m = tokens, n = 512..4096, k = 128..512).
//   Precision: operands converted exactly to f32, f32 accumulation (k summed in order within a
//   row), ONE rounding of each C element to C's dtype.
// copy_3d: dst = convert(src) element by element (one rounding, RNE), broadcast strides allowed.
// quantize_e4m3_3d: dst (e4m3) = saturate(src / scale[0]) element by element: one f32 division
//   (IEEE, as the CUDA kernel's __fdiv_rn), then the library's saturating RNE conversion; an
//   invalid scale (not positive and finite) writes NaN (0x7F) everywhere.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "backends/cpu/cpu_convert.h"
#include "backends/mla/mla_common.h"
#include "pagedattn/error.h"

namespace pagedattn::mla {
namespace {

constexpr int kMB = 64;   // rows of C per task
constexpr int kNB = 128;  // columns of C per task
constexpr int kKB = 256;  // k per B panel

inline float load_one(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(base)[index];
    case DType::bf16: return cpu::bf16_to_f32(static_cast<const uint16_t*>(base)[index]);
    case DType::f16: return cpu::f16_to_f32(static_cast<const uint16_t*>(base)[index]);
    default: return 0.f;  // unreachable: dtypes are checked by the callers
  }
}

inline void store_one(void* base, DType dtype, int64_t index, float x) {
  switch (dtype) {
    case DType::f32: static_cast<float*>(base)[index] = x; break;
    case DType::bf16: static_cast<uint16_t*>(base)[index] = cpu::f32_to_bf16(x); break;
    case DType::f16: static_cast<uint16_t*>(base)[index] = cpu::f32_to_f16(x); break;
    default: break;
  }
}

bool is_activation(DType d) { return d == DType::f32 || d == DType::f16 || d == DType::bf16; }

// What copy_3d and quantize_e4m3_3d both need: src and dst 3-D of one shape on one device, src in
// an activation dtype, innermost dims contiguous. Error naming the argument, `fn` first.
void check_3d_pair(const char* fn, const TensorView& src, const TensorView& dst) {
  PAGEDATTN_CHECK(src.ndim() == 3, "src", fn, "src is ", src.describe(), ", expected 3-D");
  PAGEDATTN_CHECK(dst.ndim() == 3, "dst", fn, "dst is ", dst.describe(), ", expected 3-D");
  PAGEDATTN_CHECK(src.shape() == dst.shape(), "src", fn, "src shape ", src.shape().str(),
                  " differs from dst shape ", dst.shape().str());
  PAGEDATTN_CHECK(is_activation(src.dtype()), "src", fn, "src is ", dtype_name(src.dtype()),
                  ", expected float32, float16 or bfloat16");
  PAGEDATTN_CHECK(src.device() == dst.device(), "src", fn, "src is on ", device_name(src.device()),
                  ", dst on ", device_name(dst.device()), ": expected one device");
  PAGEDATTN_CHECK(src.size(2) <= 1 || (src.stride(2) == 1 && dst.stride(2) == 1), "src", fn,
                  "the innermost dim must be contiguous (src strides ", src.strides().str(),
                  ", dst strides ", dst.strides().str(), ")");
}

void check_gemm_args(int batch, int m, int n, int k, const MatrixRef& a, const MatrixRef& b,
                     const MutableMatrixRef& c) {
  constexpr const char* fn = "mla::batched_gemm: ";
  PAGEDATTN_CHECK(batch >= 0 && m >= 0 && n >= 0 && k >= 0, "batch", fn, "batch = ", batch,
                  ", m = ", m, ", n = ", n, ", k = ", k, " must all be >= 0");
  PAGEDATTN_CHECK(is_activation(a.dtype), "a", fn, "a is ", dtype_name(a.dtype),
                  ", expected float32, float16 or bfloat16");
  PAGEDATTN_CHECK(is_activation(b.dtype), "b", fn, "b is ", dtype_name(b.dtype),
                  ", expected float32, float16 or bfloat16");
  PAGEDATTN_CHECK(is_activation(c.dtype), "c", fn, "c is ", dtype_name(c.dtype),
                  ", expected float32, float16 or bfloat16");
  const bool work = batch > 0 && m > 0 && n > 0;
  PAGEDATTN_CHECK(!work || c.data != nullptr, "c", fn, "c has no data");
  PAGEDATTN_CHECK(!work || k == 0 || (a.data != nullptr && b.data != nullptr), "a", fn,
                  "a and b must have data");
}

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define PAGEDATTN_MLA_CLONES __attribute__((target_clones("avx512f", "arch=haswell", "default")))
#else
#define PAGEDATTN_MLA_CLONES
#endif

// acc (mb, kNB) += ablock (mb, kb) · panel (kb, kNB) over the first nb columns; all f32,
// row strides kKB / kNB / kNB.
PAGEDATTN_MLA_CLONES
void micro_kernel(const float* __restrict ablock, const float* __restrict panel,
                  float* __restrict acc, int mb, int nb, int kb) {
  int i = 0;
  for (; i + 4 <= mb; i += 4) {
    int j = 0;
    for (; j + 16 <= nb; j += 16) {
      float c[4][16];
      for (int r = 0; r < 4; ++r) {
        for (int x = 0; x < 16; ++x) c[r][x] = acc[(i + r) * kNB + j + x];
      }
      for (int p = 0; p < kb; ++p) {
        const float* bp = panel + p * kNB + j;
        const float a0 = ablock[(i + 0) * kKB + p], a1 = ablock[(i + 1) * kKB + p],
                    a2 = ablock[(i + 2) * kKB + p], a3 = ablock[(i + 3) * kKB + p];
        for (int x = 0; x < 16; ++x) {
          c[0][x] += a0 * bp[x];
          c[1][x] += a1 * bp[x];
          c[2][x] += a2 * bp[x];
          c[3][x] += a3 * bp[x];
        }
      }
      for (int r = 0; r < 4; ++r) {
        for (int x = 0; x < 16; ++x) acc[(i + r) * kNB + j + x] = c[r][x];
      }
    }
    for (int r = 0; r < 4 && j < nb; ++r) {  // column tail
      for (int p = 0; p < kb; ++p) {
        const float a = ablock[(i + r) * kKB + p];
        for (int x = j; x < nb; ++x) acc[(i + r) * kNB + x] += a * panel[p * kNB + x];
      }
    }
  }
  for (; i < mb; ++i) {  // row tail
    for (int p = 0; p < kb; ++p) {
      const float a = ablock[i * kKB + p];
      for (int x = 0; x < nb; ++x) acc[i * kNB + x] += a * panel[p * kNB + x];
    }
  }
}

void host_batched_gemm(int batch, int m, int n, int k, const MatrixRef& a, const MatrixRef& b,
                       const MutableMatrixRef& c) {
  const int row_blocks = (m + kMB - 1) / kMB;
  const int col_blocks = (n + kNB - 1) / kNB;
  const int64_t tasks = int64_t{batch} * row_blocks * col_blocks;
  const bool parallel = int64_t{m} * n * std::max(k, 1) * batch >= (int64_t{1} << 18);
#pragma omp parallel if (parallel)
  {
    // Per-thread scratch, grown once per thread (kept across calls: no allocation in steady state).
    thread_local std::vector<float> panel, acc, ablock;
    panel.resize(static_cast<size_t>(kKB) * kNB);
    acc.resize(static_cast<size_t>(kMB) * kNB);
    ablock.resize(static_cast<size_t>(kMB) * kKB);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int bi = static_cast<int>(task / (int64_t{row_blocks} * col_blocks));
      const int rest = static_cast<int>(task % (int64_t{row_blocks} * col_blocks));
      const int j0 = (rest % col_blocks) * kNB;
      const int i0 = (rest / col_blocks) * kMB;
      const int nb = std::min(kNB, n - j0);
      const int mb = std::min(kMB, m - i0);
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t a_base = bi * a.batch_stride;
      const int64_t b_base = bi * b.batch_stride;
      for (int p0 = 0; p0 < k; p0 += kKB) {
        const int kb = std::min(kKB, k - p0);
        // panel (kb, kNB) = B[p0 : p0 + kb, j0 : j0 + nb]; ablock (mb, kKB) = A[i0 :, p0 :]
        for (int p = 0; p < kb; ++p) {
          const int64_t row = b_base + (p0 + p) * b.row_stride + j0 * b.col_stride;
          float* dst = panel.data() + static_cast<size_t>(p) * kNB;
          for (int j = 0; j < nb; ++j) dst[j] = load_one(b.data, b.dtype, row + j * b.col_stride);
        }
        for (int i = 0; i < mb; ++i) {
          const int64_t row = a_base + (i0 + i) * a.row_stride + p0 * a.col_stride;
          float* dst = ablock.data() + static_cast<size_t>(i) * kKB;
          for (int p = 0; p < kb; ++p) dst[p] = load_one(a.data, a.dtype, row + p * a.col_stride);
        }
        micro_kernel(ablock.data(), panel.data(), acc.data(), mb, nb, kb);
      }
      for (int i = 0; i < mb; ++i) {
        const int64_t row = bi * c.batch_stride + (i0 + i) * c.row_stride + j0;
        const float* src = acc.data() + static_cast<size_t>(i) * kNB;
        for (int j = 0; j < nb; ++j) store_one(c.data, c.dtype, row + j, src[j]);
      }
    }
  }
}

}  // namespace

void batched_gemm(Device device, int batch, int m, int n, int k, const MatrixRef& a,
                  const MatrixRef& b, const MutableMatrixRef& c) {
  check_gemm_args(batch, m, n, k, a, b, c);
  if (batch == 0 || m == 0 || n == 0) return;
  if (device == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    cuda_batched_gemm(batch, m, n, k, a, b, c);
    return;
#else
    throw Error("device", "mla::batched_gemm: device = cuda but pagedattn was built without CUDA");
#endif
  }
  host_batched_gemm(batch, m, n, k, a, b, c);
}

void copy_3d(const TensorView& src, const TensorView& dst) {
  constexpr const char* fn = "mla::copy_3d: ";
  check_3d_pair(fn, src, dst);
  PAGEDATTN_CHECK(is_activation(dst.dtype()), "dst", fn, "dst is ", dtype_name(dst.dtype()),
                  ", expected float32, float16 or bfloat16");
  if (dst.numel() == 0) return;
  if (dst.device() == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    cuda_copy_3d(src, dst);
    return;
#else
    throw Error("dst", "mla::copy_3d: dst is on cuda but pagedattn was built without CUDA");
#endif
  }
  const int64_t d0 = dst.size(0), d1 = dst.size(1), d2 = dst.size(2);
  const bool same = src.dtype() == dst.dtype();
  const size_t elem = dtype_size(dst.dtype());
#pragma omp parallel for collapse(2) schedule(static) if (d0 * d1 * d2 >= (int64_t{1} << 16))
  for (int64_t i = 0; i < d0; ++i) {
    for (int64_t j = 0; j < d1; ++j) {
      const int64_t s = i * src.stride(0) + j * src.stride(1);
      const int64_t o = i * dst.stride(0) + j * dst.stride(1);
      if (same) {
        std::memcpy(static_cast<char*>(dst.data()) + o * static_cast<int64_t>(elem),
                    static_cast<const char*>(src.data()) + s * static_cast<int64_t>(elem),
                    static_cast<size_t>(d2) * elem);
      } else {
        for (int64_t x = 0; x < d2; ++x) {
          store_one(dst.data(), dst.dtype(), o + x, load_one(src.data(), src.dtype(), s + x));
        }
      }
    }
  }
}

void quantize_e4m3_3d(const TensorView& src, const TensorView& dst, const TensorView& scale) {
  constexpr const char* fn = "mla::quantize_e4m3_3d: ";
  check_3d_pair(fn, src, dst);
  PAGEDATTN_CHECK(dst.dtype() == DType::fp8_e4m3, "dst", fn, "dst is ", dtype_name(dst.dtype()),
                  ", expected fp8_e4m3");
  PAGEDATTN_CHECK(scale.defined() && scale.dtype() == DType::f32 && scale.numel() == 1 &&
                      scale.device() == dst.device(),
                  "scale", fn, "scale is ", scale.describe(), ", expected float32 (1,) on ",
                  device_name(dst.device()));
  if (dst.numel() == 0) return;
  if (dst.device() == Device::cuda) {
#if PAGEDATTN_HAS_CUDA
    cuda_quantize_e4m3_3d(src, dst, scale);
    return;
#else
    throw Error("dst", "mla::quantize_e4m3_3d: dst is on cuda but pagedattn was built without CUDA");
#endif
  }
  const float s = scale.data_as<const float>()[0];
  const bool valid = s > 0.f && s <= std::numeric_limits<float>::max();  // NaN fails both
  const int64_t d0 = dst.size(0), d1 = dst.size(1), d2 = dst.size(2);
  auto* out = static_cast<uint8_t*>(dst.data());
#pragma omp parallel for collapse(2) schedule(static) if (d0 * d1 * d2 >= (int64_t{1} << 16))
  for (int64_t i = 0; i < d0; ++i) {
    for (int64_t j = 0; j < d1; ++j) {
      const int64_t si = i * src.stride(0) + j * src.stride(1);
      const int64_t o = i * dst.stride(0) + j * dst.stride(1);
      for (int64_t x = 0; x < d2; ++x) {
        out[o + x] = valid ? f32_to_fp8_e4m3_bits(load_one(src.data(), src.dtype(), si + x) / s)
                           : uint8_t{0x7F};
      }
    }
  }
}

}  // namespace pagedattn::mla
