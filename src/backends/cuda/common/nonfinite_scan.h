// The non-finite test of the NaN isolation's scans (value_isolation.cuh), as plain integer
// arithmetic on 32-bit words of packed elements, so that the host tests can check it exhaustively
// (tests/backends/test_cuda_nonfinite_scan.cpp) and the kernels use the same code.
//
// An element is non-finite when its bits under the format's mask (the exponent: the bits just
// below the sign) are all set: 16-bit inf and NaN, e4m3 NaN (it has no infinity), e5m2 inf and NaN.
// That holds exactly when its magnitude bits, read as an integer, are >= the mask, so adding
// (sign - mask) to each element's magnitude carries into its sign bit; no element carries into the
// next (the largest sum, 0x7FFF + 0x400 or 0x7F + 0x04, stays below the element's top). Three
// integer operations a word, where a compare per element costs several on sm_90.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define PAGEDATTN_NONFINITE_FN __host__ __device__ __forceinline__
#else
#define PAGEDATTN_NONFINITE_FN inline
#endif

namespace pagedattn::cuda {

// Exponent-all-ones masks, replicated over a 32-bit word.
inline constexpr uint32_t kNonFiniteBf16 = 0x7F807F80u;
inline constexpr uint32_t kNonFiniteF16 = 0x7C007C00u;
inline constexpr uint32_t kNonFiniteE4m3 = 0x7F7F7F7Fu;
inline constexpr uint32_t kNonFiniteE5m2 = 0x7C7C7C7Cu;
// fp8 cache format (1: e4m3, 2: e5m2).
PAGEDATTN_NONFINITE_FN uint32_t nonfinite_fp8_mask(int format) {
  return format == 2 ? kNonFiniteE5m2 : kNonFiniteE4m3;
}

// Running test of words of packed elements (kElemBytes 2 or 1 each) for a non-finite element, and
// which elements of a word are non-finite (the zeroing of the exact path).
template <int kElemBytes>
struct NonfiniteScan {
  static_assert(kElemBytes == 1 || kElemBytes == 2);
  static constexpr uint32_t kSign = kElemBytes == 2 ? 0x80008000u : 0x80808080u;
  uint32_t add;
  uint32_t seen = 0u;
  PAGEDATTN_NONFINITE_FN explicit NonfiniteScan(uint32_t mask) : add(kSign - mask) {}
  // Each element's sign bit set exactly when the element is non-finite (the other bits: noise).
  PAGEDATTN_NONFINITE_FN uint32_t carried(uint32_t w) const { return (w & ~kSign) + add; }
  PAGEDATTN_NONFINITE_FN void take(uint32_t w) { seen |= carried(w); }
  PAGEDATTN_NONFINITE_FN bool found() const { return (seen & kSign) != 0u; }
  // The non-finite elements of w as a mask of their bits (all ones per such element): each sign
  // flag moved to its element's lowest bit, times an element of ones (no carry between elements).
  PAGEDATTN_NONFINITE_FN uint32_t elements(uint32_t w) const {
    return ((carried(w) & kSign) >> (8 * kElemBytes - 1)) * ((1u << (8 * kElemBytes)) - 1u);
  }
};

}  // namespace pagedattn::cuda

#undef PAGEDATTN_NONFINITE_FN
