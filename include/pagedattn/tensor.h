// Tensors: TensorView (non-owning) and Tensor (owning).
//
// Shapes and strides are in elements; up to kMaxDims dimensions, stored inline so that making
// and slicing views never allocates (views are built in `run` paths).
// Host allocations are 64-byte aligned; device allocations use cudaMalloc (only when the library
// is built with CUDA; otherwise asking for a cuda tensor throws Error).
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "pagedattn/dtype.h"

namespace pagedattn {

inline constexpr int kMaxDims = 6;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);
  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i)]; }
  int64_t& operator[](int i) { return dims_[static_cast<size_t>(i)]; }
  int64_t numel() const;
  const int64_t* begin() const { return dims_.data(); }
  const int64_t* end() const { return dims_.data() + ndim_; }
  bool operator==(const Shape& other) const;
  std::string str() const;  // "(2, 16, 8, 128)"
  void push_back(int64_t d);

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

// Row-major (contiguous) strides of a shape.
Shape contiguous_strides(const Shape& shape);

// device_index default: the calling thread's current CUDA device for Device::cuda (so a rank that
// called cudaSetDevice allocates there), 0 for the host.
inline constexpr int kCurrentDevice = -1;

class TensorView {
 public:
  TensorView() = default;  // empty: data()==nullptr, ndim()==0; "not given" for optional args
  TensorView(void* data, DType dtype, Shape shape, Device device = Device::cpu, int device_index = kCurrentDevice);
  TensorView(void* data, DType dtype, Shape shape, Shape strides, Device device = Device::cpu,
             int device_index = kCurrentDevice);

  bool defined() const { return data_ != nullptr || shape_.ndim() > 0; }
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int device_index() const { return device_index_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int ndim() const { return shape_.ndim(); }
  int64_t size(int dim) const;    // negative dims count from the end
  int64_t stride(int dim) const;
  int64_t numel() const { return shape_.numel(); }
  size_t element_size() const { return dtype_size(dtype_); }
  bool is_contiguous() const;
  // Bytes spanned from the first to one past the last element (for bounds checks / copies).
  size_t span_bytes() const;

  // Views (no copy): index dim 0, narrow a dim, permute dims, reinterpret a contiguous view.
  TensorView select(int dim, int64_t index) const;
  TensorView narrow(int dim, int64_t start, int64_t length) const;
  TensorView permute(std::span<const int> order) const;
  TensorView reshape(Shape shape) const;  // contiguous only

  // Element address from a multi-index (no bounds check beyond debug asserts).
  void* element_ptr(std::span<const int64_t> index) const;

  // "f32 (2, 16, 8, 128) cpu" — used in error messages.
  std::string describe() const;

 private:
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Shape shape_;
  Shape strides_;
  Device device_ = Device::cpu;
  int device_index_ = 0;
};

// Owning tensor. Move-only. Contents are uninitialised after construction.
class Tensor {
 public:
  Tensor() = default;
  Tensor(Shape shape, DType dtype, Device device = Device::cpu, int device_index = kCurrentDevice);
  static Tensor zeros(Shape shape, DType dtype, Device device = Device::cpu);
  // Allocates `shape` contiguous in `physical_order` (physical_order[0] = the outermost dim in
  // memory, as torch.empty_permuted) and returns the tensor whose view() is the logical-order
  // view with permuted strides. E.g. shape (2, N, B, H, D), order (0, 1, 3, 2, 4) -> strides
  // (N*H*B*D, H*B*D, D, B*D, 1).
  static Tensor empty_permuted(Shape shape, std::span<const int> physical_order, DType dtype,
                               Device device = Device::cpu, int device_index = kCurrentDevice);
  ~Tensor();
  Tensor(Tensor&& other) noexcept;
  Tensor& operator=(Tensor&& other) noexcept;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  const TensorView& view() const { return view_; }
  operator const TensorView&() const { return view_; }  // NOLINT: implicit on purpose
  void* data() const { return view_.data(); }
  template <typename T>
  T* data_as() const { return view_.data_as<T>(); }
  DType dtype() const { return view_.dtype(); }
  Device device() const { return view_.device(); }
  const Shape& shape() const { return view_.shape(); }
  int64_t numel() const { return view_.numel(); }
  size_t nbytes() const { return bytes_; }
  bool defined() const { return view_.defined(); }

  // Copies (host <-> device as needed). Shapes and dtypes must match; src may be strided only
  // when both are on the host.
  void copy_from(const TensorView& src);
  Tensor to(Device device) const;
  void fill_bytes(uint8_t byte);  // e.g. poison with 0xFF (NaN for every float dtype)

 private:
  TensorView view_;
  size_t bytes_ = 0;
};

// ---- argument checks shared by every entry point (throw Error naming `argument`) ------------
void check_dtype(const TensorView& t, std::string_view argument, std::span<const DType> allowed);
void check_ndim(const TensorView& t, std::string_view argument, int ndim);
void check_shape(const TensorView& t, std::string_view argument, const Shape& expected);
void check_device(const TensorView& t, std::string_view argument, Device expected);
void check_contiguous(const TensorView& t, std::string_view argument);
void check_defined(const TensorView& t, std::string_view argument);

}  // namespace pagedattn
