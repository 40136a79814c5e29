// Shape, TensorView (non-owning, strided) and Tensor (owning; host 64-byte aligned, device via
// core/device_memory.h), plus the argument checks every entry point uses.
#include "pagedattn/tensor.h"

#include "pagedattn/device.h"

#include <algorithm>
#include <cassert>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "core/device_memory.h"
#include "pagedattn/error.h"

namespace pagedattn {

namespace {

constexpr size_t kHostAlignment = 64;
// Host allocations of at least kHugePageMinBytes (KV caches, large workspaces) are aligned to
// 2 MiB and advised for transparent huge pages (Linux; THP is often in `madvise` mode, where only
// advised memory gets them). A paged KV cache is read in block-table order, 16-token pages
// scattered over the whole cache: with 4 KiB pages nearly every page costs TLB misses (measured:
// CPU decode 16 x 4k +10% at 16 threads on a Xeon, docs/perf/cpu.md). The advice takes effect at
// first touch; where THP is off it is ignored. Waste: < 2 MiB per allocation of >= 32 MiB.
constexpr size_t kHugePageBytes = size_t{1} << 21;
constexpr size_t kHugePageMinBytes = size_t{32} << 20;

std::string_view dtype_short_name(DType dtype) {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::fp8_e4m3: return "fp8_e4m3";
    case DType::fp8_e5m2: return "fp8_e5m2";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "unknown";
}

// Normalizes a possibly negative dim; throws Error naming `argument` when out of range.
int wrap_dim(int dim, int ndim, std::string_view what) {
  const int d = dim < 0 ? dim + ndim : dim;
  PAGEDATTN_CHECK(d >= 0 && d < ndim, "dim", what, ": dim = ", dim,
                  " is out of range for a tensor with ", ndim, " dimensions: expected [", -ndim,
                  ", ", ndim, ")");
  return d;
}

// When the view's elements exactly tile one block of memory (some permutation of its dims is
// contiguous), returns true. Dims of size 1 are ignored (their stride is meaningless).
bool is_dense(const TensorView& v) {
  if (v.numel() == 0) return true;
  std::vector<int> dims;
  for (int d = 0; d < v.ndim(); ++d) {
    if (v.size(d) != 1) dims.push_back(d);
  }
  std::stable_sort(dims.begin(), dims.end(),
                   [&](int a, int b) { return v.stride(a) > v.stride(b); });
  int64_t expected = 1;
  for (auto it = dims.rbegin(); it != dims.rend(); ++it) {
    if (v.stride(*it) != expected) return false;
    expected *= v.size(*it);
  }
  return true;
}

// Same strides on every dim that has more than one element.
bool same_layout(const TensorView& a, const TensorView& b) {
  for (int d = 0; d < a.ndim(); ++d) {
    if (a.size(d) != 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// Physical order (outermost first) of a dense view: dims sorted by decreasing stride.
std::vector<int> physical_order_of(const TensorView& v) {
  std::vector<int> order(static_cast<size_t>(v.ndim()));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return v.stride(a) > v.stride(b); });
  return order;
}

// Host-to-host copy of equal shapes and dtypes with arbitrary (non-negative) strides.
void strided_host_copy(const TensorView& dst, const TensorView& src) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const size_t es = dst.element_size();
  if (dst.is_contiguous() && src.is_contiguous()) {
    std::memcpy(dst.data(), src.data(), static_cast<size_t>(n) * es);
    return;
  }
  const int nd = dst.ndim();
  if (nd == 0) {
    std::memcpy(dst.data(), src.data(), es);
    return;
  }
  const int64_t inner = dst.size(nd - 1);
  const bool inner_rows = dst.stride(nd - 1) == 1 && src.stride(nd - 1) == 1;
  std::array<int64_t, kMaxDims> index{};
  auto* dst_base = static_cast<char*>(dst.data());
  const auto* src_base = static_cast<const char*>(src.data());
  for (;;) {
    int64_t dst_off = 0, src_off = 0;
    for (int d = 0; d < nd - 1; ++d) {
      dst_off += index[static_cast<size_t>(d)] * dst.stride(d);
      src_off += index[static_cast<size_t>(d)] * src.stride(d);
    }
    if (inner_rows) {
      std::memcpy(dst_base + dst_off * static_cast<int64_t>(es),
                  src_base + src_off * static_cast<int64_t>(es), static_cast<size_t>(inner) * es);
    } else {
      for (int64_t i = 0; i < inner; ++i) {
        std::memcpy(dst_base + (dst_off + i * dst.stride(nd - 1)) * static_cast<int64_t>(es),
                    src_base + (src_off + i * src.stride(nd - 1)) * static_cast<int64_t>(es), es);
      }
    }
    int d = nd - 2;
    for (; d >= 0; --d) {
      if (++index[static_cast<size_t>(d)] < dst.size(d)) break;
      index[static_cast<size_t>(d)] = 0;
    }
    if (d < 0) return;
  }
}

}  // namespace

// ---- Shape -------------------------------------------------------------------------------------

Shape::Shape(std::initializer_list<int64_t> dims)
    : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  PAGEDATTN_CHECK(dims.size() <= static_cast<size_t>(kMaxDims), "shape", "shape: ", dims.size(),
                  " dimensions given, at most ", kMaxDims, " are supported");
  for (int64_t d : dims) dims_[static_cast<size_t>(ndim_++)] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  bool overflow = false;
  for (int i = 0; i < ndim_; ++i) {
    const int64_t d = dims_[static_cast<size_t>(i)];
    if (d == 0) return 0;  // empty, whatever the other dims
    overflow |= __builtin_mul_overflow(n, d, &n);
  }
  PAGEDATTN_CHECK(!overflow, "shape", "shape ", str(), " has more elements than an int64 holds");
  return n;
}

bool Shape::operator==(const Shape& other) const {
  return ndim_ == other.ndim_ && std::equal(begin(), end(), other.begin());
}

std::string Shape::str() const {
  std::ostringstream os;
  os << '(';
  for (int i = 0; i < ndim_; ++i) os << (i ? ", " : "") << dims_[static_cast<size_t>(i)];
  os << ')';
  return os.str();
}

void Shape::push_back(int64_t d) {
  PAGEDATTN_CHECK(ndim_ < kMaxDims, "shape", "shape: cannot add a dimension to ", str(),
                  ": at most ", kMaxDims, " are supported");
  dims_[static_cast<size_t>(ndim_++)] = d;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides;
  for (int i = 0; i < shape.ndim(); ++i) strides.push_back(0);
  int64_t running = 1;
  for (int i = shape.ndim() - 1; i >= 0; --i) {
    strides[i] = running;
    running *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

// ---- TensorView --------------------------------------------------------------------------------

TensorView::TensorView(void* data, DType dtype, Shape shape, Device device, int device_index)
    : TensorView(data, dtype, shape, contiguous_strides(shape), device, device_index) {}

TensorView::TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device,
                       int device_index)
    : data_(data), dtype_(dtype), shape_(shape), strides_(strides), device_(device),
      device_index_(device_index >= 0 ? device_index : device == Device::cuda ? current_cuda_device() : 0) {
  PAGEDATTN_CHECK(strides.ndim() == shape.ndim(), "strides", "strides ", strides.str(), " have ",
                  strides.ndim(), " dimensions but shape ", shape.str(), " has ", shape.ndim());
  for (int i = 0; i < shape.ndim(); ++i) {
    PAGEDATTN_CHECK(shape[i] >= 0, "shape", "shape ", shape.str(), ": dim ", i, " = ", shape[i],
                    " must be >= 0");
    PAGEDATTN_CHECK(strides[i] >= 0, "strides", "strides ", strides.str(), ": dim ", i, " = ",
                    strides[i], " must be >= 0");
  }
}

int64_t TensorView::size(int dim) const { return shape_[wrap_dim(dim, ndim(), "size")]; }
int64_t TensorView::stride(int dim) const { return strides_[wrap_dim(dim, ndim(), "stride")]; }

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int i = ndim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

size_t TensorView::span_bytes() const {
  if (numel() == 0) return 0;
  int64_t last = 0;
  for (int i = 0; i < ndim(); ++i) last += (shape_[i] - 1) * strides_[i];
  return static_cast<size_t>(last + 1) * element_size();
}

TensorView TensorView::select(int dim, int64_t index) const {
  const int d = wrap_dim(dim, ndim(), "select");
  PAGEDATTN_CHECK(index >= 0 && index < shape_[d], "index", "select: index = ", index,
                  " is out of range for dim ", d, " of ", describe(), ": expected [0, ",
                  shape_[d], ")");
  Shape shape, strides;
  for (int i = 0; i < ndim(); ++i) {
    if (i == d) continue;
    shape.push_back(shape_[i]);
    strides.push_back(strides_[i]);
  }
  char* p = static_cast<char*>(data_) + index * strides_[d] * static_cast<int64_t>(element_size());
  return TensorView(p, dtype_, shape, strides, device_, device_index_);
}

TensorView TensorView::narrow(int dim, int64_t start, int64_t length) const {
  const int d = wrap_dim(dim, ndim(), "narrow");
  PAGEDATTN_CHECK(start >= 0 && length >= 0 && start + length <= shape_[d], "start",
                  "narrow: [start, start + length) = [", start, ", ", start + length,
                  ") is out of range for dim ", d, " of ", describe(), ": expected within [0, ",
                  shape_[d], "]");
  Shape shape = shape_;
  shape[d] = length;
  char* p = static_cast<char*>(data_) + start * strides_[d] * static_cast<int64_t>(element_size());
  return TensorView(p, dtype_, shape, strides_, device_, device_index_);
}

TensorView TensorView::permute(std::span<const int> order) const {
  PAGEDATTN_CHECK(static_cast<int>(order.size()) == ndim(), "order", "permute: order has ",
                  order.size(), " entries, expected ", ndim(), " for ", describe());
  std::array<bool, kMaxDims> seen{};
  Shape shape, strides;
  for (size_t i = 0; i < order.size(); ++i) {
    const int d = wrap_dim(order[i], ndim(), "permute");
    PAGEDATTN_CHECK(!seen[static_cast<size_t>(d)], "order", "permute: order[", i, "] = ", order[i],
                    " repeats a dim: expected a permutation of 0..", ndim() - 1);
    seen[static_cast<size_t>(d)] = true;
    shape.push_back(shape_[d]);
    strides.push_back(strides_[d]);
  }
  return TensorView(data_, dtype_, shape, strides, device_, device_index_);
}

TensorView TensorView::reshape(Shape shape) const {
  PAGEDATTN_CHECK(is_contiguous(), "shape", "reshape: ", describe(),
                  " is not contiguous: expected a contiguous view");
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < shape.ndim(); ++i) {
    if (shape[i] == -1) {
      PAGEDATTN_CHECK(infer < 0, "shape", "reshape: shape ", shape.str(),
                      " has more than one -1: expected at most one inferred dim");
      infer = i;
    } else {
      PAGEDATTN_CHECK(shape[i] >= 0, "shape", "reshape: shape ", shape.str(), " has dim ", i,
                      " = ", shape[i], ": expected >= 0 or -1");
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    PAGEDATTN_CHECK(known > 0 && numel() % known == 0, "shape", "reshape: shape ", shape.str(),
                    " cannot hold the ", numel(), " elements of ", describe());
    shape[infer] = numel() / known;
  }
  PAGEDATTN_CHECK(shape.numel() == numel(), "shape", "reshape: shape ", shape.str(), " has ",
                  shape.numel(), " elements but ", describe(), " has ", numel());
  return TensorView(data_, dtype_, shape, contiguous_strides(shape), device_, device_index_);
}

void* TensorView::element_ptr(std::span<const int64_t> index) const {
  assert(static_cast<int>(index.size()) == ndim());
  int64_t off = 0;
  for (size_t i = 0; i < index.size(); ++i) {
    assert(index[i] >= 0 && index[i] < shape_[static_cast<int>(i)]);
    off += index[i] * strides_[static_cast<int>(i)];
  }
  return static_cast<char*>(data_) + off * static_cast<int64_t>(element_size());
}

std::string TensorView::describe() const {
  if (!defined()) return "undefined";
  std::ostringstream os;
  os << dtype_short_name(dtype_) << ' ' << shape_.str() << ' ' << device_name(device_);
  if (device_ == Device::cuda) os << ':' << device_index_;
  return os.str();
}

// ---- Tensor ------------------------------------------------------------------------------------

namespace {

void* allocate_bytes(size_t bytes, Device device, int device_index) {
  if (device == Device::cuda) return detail::device_malloc(std::max<size_t>(bytes, 1), device_index);
  // Rounded up to the alignment (std::aligned_alloc requires it); at least one block so that a
  // defined tensor always has a non-null data pointer.
  const size_t alignment = bytes >= kHugePageMinBytes ? kHugePageBytes : kHostAlignment;
  const size_t rounded =
      std::max<size_t>((bytes + alignment - 1) / alignment * alignment, alignment);
  void* p = std::aligned_alloc(alignment, rounded);
  PAGEDATTN_CHECK(p != nullptr, "shape", "out of host memory allocating ", bytes, " bytes");
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (alignment == kHugePageBytes) madvise(p, rounded, MADV_HUGEPAGE);  // advice only: may fail
#endif
  return p;
}

void release_bytes(void* p, Device device) noexcept {
  if (p == nullptr) return;
  if (device == Device::cuda) {
    detail::device_free(p);
  } else {
    std::free(p);
  }
}

void check_shape_nonnegative(const Shape& shape) {
  for (int i = 0; i < shape.ndim(); ++i) {
    PAGEDATTN_CHECK(shape[i] >= 0, "shape", "shape ", shape.str(), ": dim ", i, " = ", shape[i],
                    " must be >= 0");
  }
}

// Bytes of a tensor of `shape` and `dtype`, checked before anything is allocated: a dim so large
// that the count wraps would otherwise allocate a small buffer that the tensor's views overrun.
size_t allocation_bytes(const Shape& shape, DType dtype) {
  check_shape_nonnegative(shape);
  int64_t bytes = 0;
  PAGEDATTN_CHECK(!__builtin_mul_overflow(shape.numel(), static_cast<int64_t>(dtype_size(dtype)), &bytes),
                  "shape", "shape ", shape.str(), " of ", dtype_name(dtype),
                  " holds more bytes than an int64 counts");
  return static_cast<size_t>(bytes);
}

}  // namespace

Tensor::Tensor(Shape shape, DType dtype, Device device, int device_index) {
  const size_t bytes = allocation_bytes(shape, dtype);
  void* p = allocate_bytes(bytes, device, device_index);
  view_ = TensorView(p, dtype, shape, device, device_index);  // (kCurrentDevice: resolved by the view)
  bytes_ = bytes;
}

Tensor Tensor::empty_permuted(Shape shape, std::span<const int> physical_order, DType dtype,
                              Device device, int device_index) {
  const size_t bytes = allocation_bytes(shape, dtype);
  const int nd = shape.ndim();
  PAGEDATTN_CHECK(static_cast<int>(physical_order.size()) == nd, "stride_order",
                  "stride_order has ", physical_order.size(), " entries, expected ", nd,
                  " (one per dim of shape ", shape.str(), ")");
  std::array<bool, kMaxDims> seen{};
  for (size_t i = 0; i < physical_order.size(); ++i) {
    const int d = physical_order[i];
    PAGEDATTN_CHECK(d >= 0 && d < nd && !seen[static_cast<size_t>(d)], "stride_order",
                    "stride_order[", i, "] = ", d, " is invalid: expected a permutation of 0..",
                    nd - 1);
    seen[static_cast<size_t>(d)] = true;
  }
  Shape strides = shape;  // overwritten below
  int64_t running = 1;
  for (int i = nd - 1; i >= 0; --i) {
    const int d = physical_order[static_cast<size_t>(i)];
    strides[d] = running;
    // (an empty dim makes numel 0 whatever the others: their strides must still fit)
    PAGEDATTN_CHECK(!__builtin_mul_overflow(running, std::max<int64_t>(shape[d], 1), &running), "shape",
                    "shape ", shape.str(), ": its strides overflow an int64");
  }
  Tensor t;
  void* p = allocate_bytes(bytes, device, device_index);
  t.view_ = TensorView(p, dtype, shape, strides, device, device_index);
  t.bytes_ = bytes;
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, Device device) {
  Tensor t(shape, dtype, device);
  t.fill_bytes(0);
  return t;
}

Tensor::~Tensor() { release_bytes(view_.data(), view_.device()); }

Tensor::Tensor(Tensor&& other) noexcept
    : view_(std::exchange(other.view_, TensorView())), bytes_(std::exchange(other.bytes_, 0)) {}

Tensor& Tensor::operator=(Tensor&& other) noexcept {
  if (this != &other) {
    release_bytes(view_.data(), view_.device());
    view_ = std::exchange(other.view_, TensorView());
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void Tensor::copy_from(const TensorView& src) {
  check_defined(view_, "dst");
  check_defined(src, "src");
  PAGEDATTN_CHECK(src.dtype() == dtype(), "src", "copy_from: src dtype ", dtype_name(src.dtype()),
                  " does not match the destination's ", dtype_name(dtype()));
  PAGEDATTN_CHECK(src.shape() == shape(), "src", "copy_from: src shape ", src.shape().str(),
                  " does not match the destination's ", shape().str());
  if (src.device() == Device::cpu && device() == Device::cpu) {
    strided_host_copy(view_, src);
    return;
  }
  PAGEDATTN_CHECK(is_dense(src) && same_layout(src, view_), "src", "copy_from: src ",
                  src.describe(), " must have the destination's strides ",
                  view_.strides().str(), " and no gaps for a copy to or from a device (got ",
                  src.strides().str(), ")");
  const size_t bytes = src.span_bytes();
  if (device() == Device::cuda && src.device() == Device::cpu) {
    detail::memcpy_h2d(data(), src.data(), bytes);
  } else if (device() == Device::cpu && src.device() == Device::cuda) {
    detail::memcpy_d2h(data(), src.data(), bytes);
  } else {
    detail::memcpy_d2d(data(), src.data(), bytes);
  }
}

Tensor Tensor::to(Device device) const {
  if (!defined()) return Tensor();
  Tensor out;
  if (is_dense(view_)) {
    const std::vector<int> order = physical_order_of(view_);
    out = empty_permuted(shape(), order, dtype(), device);
  } else {
    out = Tensor(shape(), dtype(), device);
  }
  if (view_.device() == Device::cpu && device == Device::cuda && !is_dense(view_)) {
    // Gather to a contiguous host buffer first, then one copy.
    Tensor staging(shape(), dtype(), Device::cpu);
    staging.copy_from(view_);
    out.copy_from(staging);
  } else {
    out.copy_from(view_);
  }
  return out;
}

void Tensor::fill_bytes(uint8_t byte) {
  if (bytes_ == 0) return;
  if (device() == Device::cuda) {
    detail::device_memset(data(), byte, bytes_);
  } else {
    std::memset(data(), byte, bytes_);
  }
}

// ---- argument checks ---------------------------------------------------------------------------

void check_defined(const TensorView& t, std::string_view argument) {
  PAGEDATTN_CHECK(t.defined(), std::string(argument), argument,
                  ": expected a tensor, got none (undefined)");
}

void check_dtype(const TensorView& t, std::string_view argument, std::span<const DType> allowed) {
  check_defined(t, argument);
  if (std::find(allowed.begin(), allowed.end(), t.dtype()) != allowed.end()) return;
  std::ostringstream expected;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (i > 0) expected << (i + 1 == allowed.size() ? " or " : ", ");
    expected << dtype_name(allowed[i]);
  }
  throw Error(std::string(argument), detail::concat(argument, ": expected dtype ", expected.str(),
                                                    ", got ", dtype_name(t.dtype())));
}

void check_ndim(const TensorView& t, std::string_view argument, int ndim) {
  check_defined(t, argument);
  PAGEDATTN_CHECK(t.ndim() == ndim, std::string(argument), argument, ": expected ", ndim,
                  " dimensions, got ", t.ndim(), " (", t.describe(), ")");
}

void check_shape(const TensorView& t, std::string_view argument, const Shape& expected) {
  check_defined(t, argument);
  PAGEDATTN_CHECK(t.shape() == expected, std::string(argument), argument, ": expected shape ",
                  expected.str(), ", got ", t.shape().str());
}

void check_device(const TensorView& t, std::string_view argument, Device expected) {
  check_defined(t, argument);
  PAGEDATTN_CHECK(t.device() == expected, std::string(argument), argument, ": expected device ",
                  device_name(expected), ", got ", device_name(t.device()));
}

void check_contiguous(const TensorView& t, std::string_view argument) {
  check_defined(t, argument);
  PAGEDATTN_CHECK(t.is_contiguous(), std::string(argument), argument,
                  ": expected a contiguous tensor, got strides ", t.strides().str(),
                  " for shape ", t.shape().str());
}

}  // namespace pagedattn
