// Shape / TensorView / Tensor: strides, views, alignment, copies, argument checks, device paths.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "pagedattn/device.h"
#include "pagedattn/error.h"
#include "pagedattn/tensor.h"

namespace pagedattn {
namespace {

// Fills a host f32 tensor (any strides) with distinct random values.
void fill_random(const TensorView& t, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::array<int64_t, kMaxDims> idx{};
  for (int64_t n = 0; n < t.numel(); ++n) {
    int64_t rem = n;
    for (int d = t.ndim() - 1; d >= 0; --d) {
      idx[static_cast<size_t>(d)] = rem % t.size(d);
      rem /= t.size(d);
    }
    *static_cast<float*>(t.element_ptr(std::span<const int64_t>(idx.data(), t.ndim()))) = dist(rng);
  }
}

float at(const TensorView& t, std::initializer_list<int64_t> index) {
  return *static_cast<const float*>(t.element_ptr(std::span<const int64_t>(index.begin(), index.size())));
}

TEST(Shape, BasicsAndStrides) {
  const Shape s{2, 16, 8, 128};
  EXPECT_EQ(s.ndim(), 4);
  EXPECT_EQ(s.numel(), 2 * 16 * 8 * 128);
  EXPECT_EQ(s.str(), "(2, 16, 8, 128)");
  EXPECT_EQ(contiguous_strides(s), (Shape{16 * 8 * 128, 8 * 128, 128, 1}));
  EXPECT_EQ(Shape{}.numel(), 1);
  EXPECT_EQ(Shape{}.str(), "()");
  EXPECT_EQ((Shape{3, 0, 5}).numel(), 0);
  Shape grown;
  for (int i = 0; i < kMaxDims; ++i) grown.push_back(i + 1);
  EXPECT_THROW(grown.push_back(1), Error);
  const std::vector<int64_t> too_many(kMaxDims + 1, 1);
  EXPECT_THROW(Shape(std::span<const int64_t>(too_many)), Error);
}

// Counts that would wrap are errors naming the shape, before anything is allocated (a wrapped
// byte count allocated a small buffer that the tensor's views overran); an empty dim still gives 0.
TEST(Shape, CountsThatOverflowAreErrors) {
  const int64_t big = int64_t{1} << 40;
  const auto expect_shape_error = [](const std::function<void()>& call, const char* what) {
    try {
      call();
      ADD_FAILURE() << what << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "shape") << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("(1099511627776, 1099511627776"), std::string::npos) << e.what();
    }
  };
  expect_shape_error([&] { (void)Shape{big, big}.numel(); }, "numel");
  expect_shape_error([&] { Tensor t(Shape{big, big}, DType::f32); }, "Tensor");
  const int order[] = {1, 0, 2};
  expect_shape_error([&] { (void)Tensor::empty_permuted(Shape{big, big, 0}, order, DType::f32); },
                     "empty_permuted strides");
  EXPECT_EQ((Shape{big, big, 0}).numel(), 0);
  // 2^61 f32 elements: the count fits an int64, the bytes (2^63) do not.
  try {
    Tensor t(Shape{int64_t{1} << 61}, DType::f32);
    ADD_FAILURE() << "2^63 bytes accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "shape") << e.what();
    EXPECT_NE(std::string(e.what()).find("bytes"), std::string::npos) << e.what();
  }
}

TEST(TensorView, SizesStridesNegativeDims) {
  std::vector<float> buf(2 * 3 * 4);
  const TensorView v(buf.data(), DType::f32, Shape{2, 3, 4});
  EXPECT_TRUE(v.defined());
  EXPECT_EQ(v.size(-1), 4);
  EXPECT_EQ(v.size(-3), 2);
  EXPECT_EQ(v.stride(0), 12);
  EXPECT_EQ(v.stride(-2), 4);
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.span_bytes(), 24 * sizeof(float));
  EXPECT_EQ(v.describe(), "f32 (2, 3, 4) cpu");
  EXPECT_THROW(v.size(3), Error);
  EXPECT_THROW(v.size(-4), Error);
  EXPECT_FALSE(TensorView().defined());
  EXPECT_EQ(TensorView().describe(), "undefined");
  EXPECT_THROW(TensorView(buf.data(), DType::f32, Shape{2, -1}), Error);
  EXPECT_THROW(TensorView(buf.data(), DType::f32, Shape{2, 3}, Shape{3}), Error);
}

TEST(TensorView, SelectNarrowPermuteReshapeAreViews) {
  std::vector<float> buf(2 * 3 * 4);
  std::iota(buf.begin(), buf.end(), 0.0f);
  const TensorView v(buf.data(), DType::f32, Shape{2, 3, 4});

  const TensorView s = v.select(1, 2);  // (2, 4):(12, 1) starting at 8
  EXPECT_EQ(s.shape(), (Shape{2, 4}));
  EXPECT_EQ(s.strides(), (Shape{12, 1}));
  EXPECT_EQ(at(s, {1, 3}), 12 + 8 + 3);
  EXPECT_FALSE(s.is_contiguous());
  EXPECT_EQ(at(v.select(-1, 1), {1, 2}), 12 + 8 + 1);

  const TensorView n = v.narrow(2, 1, 2);  // (2, 3, 2):(12, 4, 1) starting at 1
  EXPECT_EQ(n.shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(at(n, {1, 2, 1}), 12 + 8 + 2);
  EXPECT_EQ(n.span_bytes(), static_cast<size_t>(12 + 8 + 1 + 1) * sizeof(float));
  EXPECT_TRUE(v.narrow(0, 1, 1).is_contiguous());

  const std::array<int, 3> order{2, 0, 1};
  const TensorView p = v.permute(order);  // (4, 2, 3):(1, 12, 4)
  EXPECT_EQ(p.shape(), (Shape{4, 2, 3}));
  EXPECT_EQ(p.strides(), (Shape{1, 12, 4}));
  EXPECT_EQ(at(p, {3, 1, 2}), at(v, {1, 2, 3}));
  EXPECT_FALSE(p.is_contiguous());

  const TensorView r = v.reshape(Shape{6, 4});
  EXPECT_EQ(r.data(), v.data());
  EXPECT_EQ(at(r, {5, 3}), 23.0f);
  EXPECT_EQ(v.reshape(Shape{-1, 2}).shape(), (Shape{12, 2}));
  EXPECT_THROW(p.reshape(Shape{24}), Error);
  EXPECT_THROW(v.reshape(Shape{5, 5}), Error);

  EXPECT_THROW(v.select(0, 2), Error);
  EXPECT_THROW(v.narrow(1, 2, 2), Error);
  const std::array<int, 3> repeated{0, 0, 1};
  EXPECT_THROW(v.permute(repeated), Error);
  const std::array<int, 2> too_short{0, 1};
  EXPECT_THROW(v.permute(too_short), Error);
}

TEST(Tensor, HostAllocationIsAlignedAndMovable) {
  for (int64_t n : {1, 3, 17, 1000, 4097}) {
    Tensor t(Shape{n}, DType::bf16);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u) << n;
    EXPECT_EQ(t.nbytes(), static_cast<size_t>(n) * 2);
    EXPECT_TRUE(t.view().is_contiguous());
  }
  Tensor empty(Shape{0, 8}, DType::f32);
  EXPECT_TRUE(empty.defined());
  EXPECT_EQ(empty.nbytes(), 0u);

  Tensor a(Shape{4}, DType::f32);
  void* p = a.data();
  Tensor b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_FALSE(a.defined());  // NOLINT(bugprone-use-after-move): moved-from state is defined
  Tensor c;
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  EXPECT_EQ(c.shape(), (Shape{4}));
  EXPECT_THROW(Tensor(Shape{2, -3}, DType::f32), Error);
}

TEST(Tensor, ZerosAndFillBytes) {
  Tensor z = Tensor::zeros(Shape{3, 5}, DType::f32);
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(z.data_as<float>()[i], 0.0f);
  z.fill_bytes(0xff);
  for (int64_t i = 0; i < 15; ++i) EXPECT_TRUE(std::isnan(z.data_as<float>()[i]));
  Tensor h = Tensor::zeros(Shape{7}, DType::bf16);
  h.fill_bytes(0xff);
  for (int64_t i = 0; i < 7; ++i) EXPECT_TRUE(std::isnan(load_f32(h.data(), DType::bf16, i)));
}

TEST(Tensor, EmptyPermutedIsPhysicallyContiguous) {
  const std::array<int, 4> order{0, 2, 1, 3};
  Tensor t = Tensor::empty_permuted(Shape{2, 5, 3, 4}, order, DType::f16);
  // Physical (2, 3, 5, 4) contiguous -> logical strides (60, 4, 20, 1).
  EXPECT_EQ(t.view().strides(), (Shape{60, 4, 20, 1}));
  EXPECT_EQ(t.nbytes(), 120u * 2);
  EXPECT_EQ(t.view().span_bytes(), t.nbytes());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data()) % 64, 0u);
  const std::array<int, 4> bad{0, 1, 1, 3};
  EXPECT_THROW(Tensor::empty_permuted(Shape{2, 5, 3, 4}, bad, DType::f16), Error);
  const std::array<int, 3> short_order{0, 1, 2};
  EXPECT_THROW(Tensor::empty_permuted(Shape{2, 5, 3, 4}, short_order, DType::f16), Error);
}

TEST(Tensor, CopyFromStridedHostSource) {
  Tensor src(Shape{4, 6, 5}, DType::f32);
  fill_random(src, 7);
  const std::array<int, 3> order{2, 0, 1};
  const TensorView strided = src.view().narrow(1, 1, 4).permute(order);  // (5, 4, 4)
  Tensor dst(Shape{5, 4, 4}, DType::f32);
  dst.fill_bytes(0xff);
  dst.copy_from(strided);
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t k = 0; k < 4; ++k)
        ASSERT_EQ(at(dst, {i, j, k}), at(src, {j, k + 1, i}));

  // Strided destination (a permuted allocation) from a contiguous source.
  const std::array<int, 3> phys{1, 0, 2};
  Tensor pdst = Tensor::empty_permuted(Shape{5, 4, 4}, phys, DType::f32);
  pdst.fill_bytes(0xff);
  pdst.copy_from(dst);
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t k = 0; k < 4; ++k) ASSERT_EQ(at(pdst, {i, j, k}), at(dst, {i, j, k}));

  Tensor wrong_shape(Shape{5, 4, 3}, DType::f32);
  EXPECT_THROW(wrong_shape.copy_from(dst), Error);
  Tensor wrong_dtype(Shape{5, 4, 4}, DType::f16);
  try {
    wrong_dtype.copy_from(dst);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "src");
  }
}

TEST(Tensor, ToCpuKeepsValuesAndLayout) {
  const std::array<int, 3> phys{1, 0, 2};
  Tensor a = Tensor::empty_permuted(Shape{3, 4, 2}, phys, DType::f32);
  fill_random(a, 11);
  Tensor b = a.to(Device::cpu);
  EXPECT_NE(b.data(), a.data());
  EXPECT_EQ(b.view().strides(), a.view().strides());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  // A view with gaps becomes contiguous.
  Tensor c(Shape{4, 6}, DType::f32);
  fill_random(c, 3);
  Tensor d(Shape{4, 3}, DType::f32);
  d.copy_from(c.view().narrow(1, 2, 3));
  Tensor e = d.to(Device::cpu);
  EXPECT_TRUE(e.view().is_contiguous());
  EXPECT_EQ(at(e, {3, 2}), at(c, {3, 4}));
}

TEST(Tensor, DeviceTensors) {
  if (!built_with_cuda()) {
    EXPECT_EQ(cuda_device_count(), 0);
    try {
      Tensor t(Shape{4}, DType::f32, Device::cuda);
      FAIL() << "expected Error";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "device");
      EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(synchronize_cuda());
    return;
  }
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  Tensor host(Shape{3, 5, 7}, DType::f32);
  fill_random(host, 5);
  Tensor dev = host.to(Device::cuda);
  EXPECT_EQ(dev.device(), Device::cuda);
  Tensor dev2(Shape{3, 5, 7}, DType::f32, Device::cuda);
  dev2.fill_bytes(0xff);
  dev2.copy_from(dev);  // device -> device
  Tensor back = dev2.to(Device::cpu);
  EXPECT_EQ(std::memcmp(back.data(), host.data(), host.nbytes()), 0);
  Tensor zeros = Tensor::zeros(Shape{9}, DType::bf16, Device::cuda).to(Device::cpu);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(load_f32(zeros.data(), DType::bf16, i), 0.0f);
  // A permuted (dense) layout survives the trip to the device and back.
  const std::array<int, 3> phys{2, 0, 1};
  Tensor permuted = Tensor::empty_permuted(Shape{3, 5, 7}, phys, DType::f32);
  permuted.copy_from(host);
  Tensor permuted_dev = permuted.to(Device::cuda);
  EXPECT_EQ(permuted_dev.view().strides(), permuted.view().strides());
  Tensor permuted_back = permuted_dev.to(Device::cpu);
  EXPECT_EQ(std::memcmp(permuted_back.data(), permuted.data(), permuted.nbytes()), 0);
  // A strided host source cannot go to the device in one copy.
  Tensor small(Shape{5, 3}, DType::f32, Device::cuda);
  EXPECT_THROW(small.copy_from(host.view().select(0, 1).narrow(1, 0, 3)), Error);
}

TEST(Streams, CurrentStreamIsThreadLocal) {
  EXPECT_EQ(current_cuda_stream(), nullptr);
  int marker = 0;
  set_current_cuda_stream(&marker);
  EXPECT_EQ(current_cuda_stream(), &marker);
  set_current_cuda_stream(nullptr);
  EXPECT_EQ(current_cuda_stream(), nullptr);
}

TEST(Checks, MessagesNameTheArgument) {
  std::vector<float> buf(8);
  const TensorView q(buf.data(), DType::f32, Shape{2, 4});
  const std::array<DType, 2> half_types{DType::bf16, DType::f16};
  try {
    check_dtype(q, "query", half_types);
    FAIL() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "query");
    EXPECT_STREQ(e.what(), "query: expected dtype bfloat16 or float16, got float32");
  }
  const std::array<DType, 3> three{DType::f32, DType::bf16, DType::f16};
  EXPECT_NO_THROW(check_dtype(q, "query", three));
  try {
    const std::array<DType, 3> others{DType::i32, DType::i64, DType::u8};
    check_dtype(q, "slot_mapping", others);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "slot_mapping: expected dtype int32, int64 or uint8, got float32");
  }
  try {
    check_ndim(q, "key", 3);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "key");
    EXPECT_STREQ(e.what(), "key: expected 3 dimensions, got 2 (f32 (2, 4) cpu)");
  }
  try {
    check_shape(q, "value", Shape{2, 8});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "value");
    EXPECT_STREQ(e.what(), "value: expected shape (2, 8), got (2, 4)");
  }
  try {
    check_device(q, "kv_cache", Device::cuda);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "kv_cache");
    EXPECT_STREQ(e.what(), "kv_cache: expected device cuda, got cpu");
  }
  const std::array<int, 2> transpose{1, 0};
  try {
    check_contiguous(q.permute(transpose), "output");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "output");
    EXPECT_NE(std::string(e.what()).find("contiguous"), std::string::npos);
  }
  try {
    check_defined(TensorView(), "sinks");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.argument(), "sinks");
  }
  EXPECT_NO_THROW(check_ndim(q, "q", 2));
  EXPECT_NO_THROW(check_shape(q, "q", Shape{2, 4}));
  EXPECT_NO_THROW(check_device(q, "q", Device::cpu));
  EXPECT_NO_THROW(check_contiguous(q, "q"));
}

}  // namespace
}  // namespace pagedattn
