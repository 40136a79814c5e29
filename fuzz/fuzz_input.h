// The byte decoder every fuzz target reads its input with, and the property-failure report.
//
// Bytes are read front to back (so a seed is easy to write by hand, fuzz/make_seeds.py) and an
// exhausted input reads as zeros (every prefix of a valid input is an input too). Most helpers
// map one byte to a small in-range value and reserve the top byte values for the corner cases a
// caller can pass: negative numbers, 0, the int32 / int64 extremes, an arbitrary 4- or 8-byte
// value. That keeps most of the search space on plausible batches while every corner stays one
// mutation away.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

namespace pagedattn::fuzz {

class ByteReader {
 public:
  ByteReader(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  bool empty() const { return pos_ >= size_; }
  size_t remaining() const { return pos_ < size_ ? size_ - pos_ : 0; }

  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  bool flag() { return (u8() & 1) != 0; }

  template <typename T>
  T raw() {  // little-endian, zero-filled past the end
    T value{};
    uint8_t bytes[sizeof(T)] = {};
    for (size_t i = 0; i < sizeof(T); ++i) bytes[i] = u8();
    std::memcpy(&value, bytes, sizeof(T));
    return value;
  }

  // One byte mapped onto [lo, hi] (hi - lo < 256).
  int small(int lo, int hi) { return lo + static_cast<int>(u8() % static_cast<unsigned>(hi - lo + 1)); }

  // A count or length: byte values below 0xF0 give [0, normal_max]; the top 16 values give -1,
  // 0, large and extreme int32 values, or an arbitrary int32 read from the next 4 bytes.
  int32_t length(int normal_max) {
    const uint8_t b = u8();
    if (b < 0xF0) return static_cast<int32_t>(b % static_cast<unsigned>(normal_max + 1));
    switch (b & 0x7) {
      case 0: return -1;
      case 1: return -static_cast<int32_t>(u8()) - 1;
      case 2: return std::numeric_limits<int32_t>::max();
      case 3: return std::numeric_limits<int32_t>::min();
      case 4: return std::numeric_limits<int32_t>::max() - u8();
      case 5: return static_cast<int32_t>(normal_max) + 1 + u8();
      case 6: return 1 << (u8() % 31);
      default: return raw<int32_t>();
    }
  }

  // Like length() for int64 quantities (num_blocks, slots).
  int64_t length64(int64_t normal_max) {
    const uint8_t b = u8();
    if (b < 0xF0) return static_cast<int64_t>(b % static_cast<uint64_t>(normal_max + 1));
    switch (b & 0x7) {
      case 0: return -1;
      case 1: return -static_cast<int64_t>(u8()) - 2;
      case 2: return std::numeric_limits<int64_t>::max();
      case 3: return std::numeric_limits<int64_t>::min();
      case 4: return std::numeric_limits<int64_t>::max() / (1 + u8());
      case 5: return normal_max + 1 + u8();
      case 6: return int64_t{1} << (u8() % 63);
      default: return raw<int64_t>();
    }
  }

  // A float: byte values below 0xF0 give one of a few ordinary values; the top ones give 0,
  // negative, NaN, +-inf, a denormal, a huge value or arbitrary bits.
  float real(const float* ordinary, int count) {
    const uint8_t b = u8();
    if (b < 0xF0) return ordinary[b % count];
    switch (b & 0x7) {
      case 0: return 0.f;
      case 1: return -1.f;
      case 2: return std::numeric_limits<float>::quiet_NaN();
      case 3: return std::numeric_limits<float>::infinity();
      case 4: return -std::numeric_limits<float>::infinity();
      case 5: return std::numeric_limits<float>::denorm_min();
      case 6: return 3.0e38f;
      default: return raw<float>();
    }
  }

  // The rest of the input as text.
  std::string rest() {
    std::string s(reinterpret_cast<const char*>(data_ + (pos_ < size_ ? pos_ : size_)), remaining());
    pos_ = size_;
    return s;
  }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

// A violated property: print it and abort, so libFuzzer saves the input as a crash artifact.
[[noreturn]] inline void property_failed(const std::string& what) {
  std::fprintf(stderr, "\n==== property violated: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define PAGEDATTN_FUZZ_ASSERT(cond, what)                                                 \
  do {                                                                                   \
    if (!(cond)) ::pagedattn::fuzz::property_failed(std::string(#cond) + ": " + (what)); \
  } while (0)

}  // namespace pagedattn::fuzz
