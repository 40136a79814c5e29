// Hopper wgmma primitives shared by the kernels that use warpgroup MMAs (paged_prefill_wgmma.cuh,
// mla_decode_wgmma.cu): the 128-byte swizzled tile layout, shared-memory matrix descriptors, the
// wgmma fence / commit / wait instructions, register pins and the generic -> async proxy fence.
// The instructions need sm_90a; the functions compile for any target but are only called from
// sm_90a code paths.
//
// Swizzled tile: 64 rows stored as column blocks of 64 rows x 128 bytes (1024-byte aligned); the
// 16-byte chunk c of row r lives in block c / 8 at row r, chunk position (c % 8) XOR (r % 8).
#pragma once

#include <cstdint>

#include "backends/cuda/common/device_primitives.cuh"

namespace pagedattn::cuda {

// Byte offset of 16-byte chunk `chunk` of row `row` (0..kRows-1) of a swizzled tile of kRows rows
// (column blocks of kRows rows x 128 bytes).
template <int kRows = 64>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return (chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

namespace wgmma {
// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading / stride byte offsets.
__device__ __forceinline__ uint64_t smem_desc(const void* ptr, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = smem_addr(ptr);
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (uint64_t{1} << 62);
}
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins register values at this point of the instruction stream (the compiler may not move their
// reads / writes across the asynchronous MMA region).
template <int N>
__device__ __forceinline__ void reg_fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void reg_fence(float (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+f"(r[i][j])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void reg_fence(uint32_t (&r)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}
// Ordinary shared-memory writes (cp.async, st.shared) -> reads by the tensor cores.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace wgmma

// Shared-memory barriers (mbarrier) of the warp-specialized kernels: a phase completes when its
// expected number of arrivals happened; waiters name the parity of the phase they wait for.
namespace mbar {
__device__ __forceinline__ void init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_addr(bar))
               : "memory");
}
// One arrival when every cp.async this thread issued so far has landed (the count at init
// includes it: .noinc).
__device__ __forceinline__ void arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// try_wait with a suspend-time hint: the thread sleeps until the phase completes (or the hint,
// in ns, runs out) instead of spinning on issue slots the other warps need.
__device__ __forceinline__ bool try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity), "r"(0x989680)
      : "memory");
  return done != 0;
}
// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void wait(uint64_t* bar, uint32_t parity) {
  while (!try_wait(bar, parity)) {
  }
}
}  // namespace mbar

// Register budget of a warpgroup (every thread of it executes the call; sm_90a).
template <int kRegs>
__device__ __forceinline__ void warpgroup_regs_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_regs_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
#endif
}
}  // namespace pagedattn::cuda
