// The NaN isolation's non-finite test (src/backends/cuda/common/nonfinite_scan.h), checked on the
// host for every element value of every cache format the kernels scan, in every lane of a word,
// beside finite neighbours: it must flag a word exactly when one of its elements is inf or NaN as
// the format decodes it, and name exactly that element.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "../../src/backends/cuda/common/nonfinite_scan.h"

namespace pagedattn {
namespace {

// Whether the element's encoding decodes to inf or NaN (from the format's definition).
bool bf16_nonfinite(uint32_t e) {
  const uint32_t bits = e << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return !std::isfinite(f);
}
bool f16_nonfinite(uint32_t e) { return ((e >> 10) & 0x1Fu) == 0x1Fu; }  // exponent all ones
bool e4m3_nonfinite(uint32_t e) { return (e & 0x7Fu) == 0x7Fu; }        // S.1111.111: NaN; no inf
bool e5m2_nonfinite(uint32_t e) { return ((e >> 2) & 0x1Fu) == 0x1Fu; }  // exponent all ones

template <int kElemBytes>
void check_format(const char* name, uint32_t mask, bool (*nonfinite)(uint32_t)) {
  constexpr int kBits = 8 * kElemBytes;
  constexpr uint32_t kElemMask = (1u << kBits) - 1u;
  constexpr int kLanes = 32 / kBits;
  // Neighbours: zero, the smallest subnormal, the largest finite magnitude and its negative.
  const uint32_t largest = (mask & kElemMask) - 1u, sign = 1u << (kBits - 1);
  const uint32_t finite[] = {0u, 1u, largest, sign | largest};
  constexpr int nf = 4;
  for (uint32_t f : finite) ASSERT_FALSE(nonfinite(f)) << name << " 0x" << std::hex << f;
  const uint32_t bad = mask & kElemMask;  // +inf (e4m3: +NaN with mantissa 0x7)
  ASSERT_TRUE(nonfinite(bad)) << name;
  long errors = 0;
  for (uint32_t e = 0; e <= kElemMask; ++e) {
    for (int lane = 0; lane < kLanes; ++lane) {
      for (int n = 0; n < nf; ++n) {
        uint32_t w = 0;
        for (int l = 0; l < kLanes; ++l) w |= (l == lane ? e : finite[(n + l) % nf]) << (l * kBits);
        cuda::NonfiniteScan<kElemBytes> scan(mask);
        scan.take(w);
        if (scan.found() != nonfinite(e) && ++errors <= 5) {
          ADD_FAILURE() << name << ": element 0x" << std::hex << e << " in lane " << std::dec << lane << " (word 0x"
                        << std::hex << w << "): scan says " << scan.found();
        }
        // elements(): all ones over exactly the non-finite element (the neighbours are finite).
        const uint32_t want = nonfinite(e) ? kElemMask << (lane * kBits) : 0u;
        if (scan.elements(w) != want && ++errors <= 5) {
          ADD_FAILURE() << name << ": element 0x" << std::hex << e << " in lane " << std::dec << lane << " (word 0x"
                        << std::hex << w << "): elements 0x" << scan.elements(w) << ", want 0x" << want;
        }
      }
    }
    // Running over several words: a non-finite element in an earlier word stays found.
    cuda::NonfiniteScan<kElemBytes> scan(mask);
    scan.take(bad);
    scan.take(e * 0x01010101u);
    EXPECT_TRUE(scan.found()) << name;
  }
  EXPECT_EQ(errors, 0) << name;
}

TEST(CudaNonfiniteScan, Bf16EveryValue) { check_format<2>("bf16", cuda::kNonFiniteBf16, bf16_nonfinite); }
TEST(CudaNonfiniteScan, F16EveryValue) { check_format<2>("f16", cuda::kNonFiniteF16, f16_nonfinite); }
TEST(CudaNonfiniteScan, E4m3EveryValue) { check_format<1>("e4m3", cuda::nonfinite_fp8_mask(1), e4m3_nonfinite); }
TEST(CudaNonfiniteScan, E5m2EveryValue) { check_format<1>("e5m2", cuda::nonfinite_fp8_mask(2), e5m2_nonfinite); }

TEST(CudaNonfiniteScan, NothingTakenIsNothingFound) {
  EXPECT_FALSE(cuda::NonfiniteScan<2>(cuda::kNonFiniteBf16).found());
  EXPECT_FALSE(cuda::NonfiniteScan<1>(cuda::kNonFiniteE4m3).found());
}

}  // namespace
}  // namespace pagedattn
