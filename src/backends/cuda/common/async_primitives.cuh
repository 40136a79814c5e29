// Every inline-asm wrapper of the asynchronous units the CUDA kernels use, in one place:
//   cp.async       16-byte global -> shared copies (zero-fill), commit / wait groups (sm_80+);
//                  bulk L2 prefetches (sm_90);
//   mbarrier       shared-memory barriers of the warp-specialized kernels (init, arrive, arrive
//                  on a thread's cp.async copies, transaction counts of TMA copies, wait);
//   TMA            tensor copies global -> shared completing on an mbarrier (sm_90);
//   wgmma          warpgroup MMAs (sm_90a): descriptors, fence / commit / wait, register pins,
//                  the generic -> async proxy fence, and the MMA instructions themselves;
//   named barriers bar.sync / bar.arrive of a subset of a CTA's threads;
//   setmaxnreg     a warpgroup's register budget (sm_90a).
// The sm_90a instructions compile for any target but are only called from sm_90a code paths (the
// MMA instructions exist only when compiling for sm_90a).
//
// Swizzled tile: 64 rows stored as column blocks of 64 rows x 128 bytes (1024-byte aligned); the
// 16-byte chunk c of row r lives in block c / 8 at row r, chunk position (c % 8) XOR (r % 8).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "backends/cuda/common/device_primitives.cuh"

namespace pagedattn::cuda {

// ---- cp.async --------------------------------------------------------------------------------
// 16-byte global -> shared copy that bypasses L1. valid == false: writes 16 zero bytes and
// reads nothing (src may be any mapped address).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid) {
  const int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)),
               "l"(gmem_src), "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// L2 prefetch of `bytes` (a multiple of 16, 16-byte aligned) from global memory (sm_90): no
// register or shared-memory destination, so it can run further ahead than the stages hold.
__device__ __forceinline__ void prefetch_l2_bulk(const void* src, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(src), "r"(bytes) : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Byte offset of 16-byte chunk `chunk` of row `row` (0..kRows-1) of a swizzled tile of kRows rows
// (column blocks of kRows rows x 128 bytes).
template <int kRows = 64>
__device__ __forceinline__ int swizzled_offset(int row, int chunk) {
  return (chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
}

namespace wgmma {
// Shared-memory matrix descriptor: start address, leading / stride byte offsets, swizzle (layout
// type: kSwizzle128B, or kSwizzle64B for rows of 64 bytes, 8-row atoms of 512 bytes).
inline constexpr uint32_t kSwizzle128B = 1;
inline constexpr uint32_t kSwizzle64B = 2;
__device__ __forceinline__ uint64_t smem_desc(const void* ptr, uint32_t lbo, uint32_t sbo,
                                              uint32_t swizzle = kSwizzle128B) {
  const uint32_t a = smem_addr(ptr);
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFF) << 32) | (static_cast<uint64_t>(swizzle) << 62);
}
// The same descriptor as its two 32-bit words: `lo` holds the start address (>> 4) and the
// leading byte offset, `hi` the stride byte offset and the swizzle mode. A k-step moves the start
// only, so at(bytes) is one 32-bit add to lo (shared addresses stay below 2^18: no carry out of
// the 14-bit start field).
struct SmemDesc {
  uint32_t lo, hi;
  __device__ __forceinline__ uint64_t at(uint32_t bytes) const {
    return (static_cast<uint64_t>(hi) << 32) | (lo + (bytes >> 4));
  }
};
// A descriptor whose start word is broadcast from lane 0 (the warp's lanes must be converged):
// the compiler then knows it is warp-uniform and keeps it, and the per-step adds, in the uniform
// registers that wgmma reads its descriptors from, instead of 64-bit adds in ordinary registers
// and a register-to-uniform move before every wgmma. The shuffle is volatile so that it stays
// where it is called: hoisted out of a loop, its result would be kept in ordinary registers again.
__device__ __forceinline__ SmemDesc uniform_desc(const void* ptr, uint32_t lbo, uint32_t sbo,
                                                 uint32_t swizzle = kSwizzle128B) {
  const uint64_t d = smem_desc(ptr, lbo, sbo, swizzle);
  uint32_t lo;
  asm volatile("shfl.sync.idx.b32 %0, %1, 0, 0x1f, 0xffffffff;\n" : "=r"(lo) : "r"(static_cast<uint32_t>(d)));
  return SmemDesc{lo, static_cast<uint32_t>(d >> 32)};
}
// Descriptor `bytes` past d's start (either form).
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) { return d + (bytes >> 4); }
__device__ __forceinline__ uint64_t desc_at(const SmemDesc& d, uint32_t bytes) { return d.at(bytes); }

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

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// S (64 x 64 f32) += A (64 x 16, shared, K-major) . B (16 x 64, shared, K-major).
// O (64 x N f32) += A (64 x 16, registers) . B (16 x N, shared, N-major).
// One asm body per shape, the element type (bf16 / f16) pasted into the instruction name.
#define PAGEDATTN_WGMMA_SS_M64N64(INSTR, TAIL)                                   \
  asm volatile(                                                             \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                        \
      "wgmma.mma_async.sync.aligned." INSTR " {"        \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"  \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"  \
      "}, %32, %33, p, 1, 1" TAIL ";\n}\n"                                  \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))
#define PAGEDATTN_WGMMA_SS_M64N128(INSTR, TAIL)                                  \
  asm volatile(                                                             \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                        \
      "wgmma.mma_async.sync.aligned." INSTR " {"       \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"  \
      "}, %64, %65, p, 1, 1" TAIL ";\n}\n"                                  \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d))
#define PAGEDATTN_WGMMA_RS_M64N64(INSTR, TAIL)                              \
  asm volatile(                                                             \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                        \
      "wgmma.mma_async.sync.aligned." INSTR " {"       \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"  \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"  \
      "}, {%32,%33,%34,%35}, %36, p, 1, 1" TAIL ";\n}\n"                           \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
#define PAGEDATTN_WGMMA_RS_M64N128(INSTR, TAIL)                              \
  asm volatile(                                                             \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                        \
      "wgmma.mma_async.sync.aligned." INSTR " {"       \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"  \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"  \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"  \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"  \
      "}, {%64,%65,%66,%67}, %68, p, 1, 1" TAIL ";\n}\n"                           \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
#define PAGEDATTN_WGMMA_RS_M64N256(INSTR, TAIL)                              \
  asm volatile(                                                             \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"                        \
      "wgmma.mma_async.sync.aligned." INSTR " {"       \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"  \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"  \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"  \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"  \
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"  \
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"  \
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"  \
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"  \
      "}, {%128,%129,%130,%131}, %132, p, 1, 1" TAIL ";\n}\n"                           \
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
          "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
          "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
          "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
          "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
          "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
          "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), \
          "+f"(d[16][0]), "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3]), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3]), \
          "+f"(d[18][0]), "+f"(d[18][1]), "+f"(d[18][2]), "+f"(d[18][3]), "+f"(d[19][0]), "+f"(d[19][1]), "+f"(d[19][2]), "+f"(d[19][3]), \
          "+f"(d[20][0]), "+f"(d[20][1]), "+f"(d[20][2]), "+f"(d[20][3]), "+f"(d[21][0]), "+f"(d[21][1]), "+f"(d[21][2]), "+f"(d[21][3]), \
          "+f"(d[22][0]), "+f"(d[22][1]), "+f"(d[22][2]), "+f"(d[22][3]), "+f"(d[23][0]), "+f"(d[23][1]), "+f"(d[23][2]), "+f"(d[23][3]), \
          "+f"(d[24][0]), "+f"(d[24][1]), "+f"(d[24][2]), "+f"(d[24][3]), "+f"(d[25][0]), "+f"(d[25][1]), "+f"(d[25][2]), "+f"(d[25][3]), \
          "+f"(d[26][0]), "+f"(d[26][1]), "+f"(d[26][2]), "+f"(d[26][3]), "+f"(d[27][0]), "+f"(d[27][1]), "+f"(d[27][2]), "+f"(d[27][3]), \
          "+f"(d[28][0]), "+f"(d[28][1]), "+f"(d[28][2]), "+f"(d[28][3]), "+f"(d[29][0]), "+f"(d[29][1]), "+f"(d[29][2]), "+f"(d[29][3]), \
          "+f"(d[30][0]), "+f"(d[30][1]), "+f"(d[30][2]), "+f"(d[30][3]), "+f"(d[31][0]), "+f"(d[31][1]), "+f"(d[31][2]), "+f"(d[31][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d))
// Flat accumulators: D (64 x N f32, scale-d = 1: accumulate) += A (64 x 16, shared, K-major) .
// B (16 x N, shared; n64: K-major, n256_tb: N-major).
#define PAGEDATTN_WGMMA_SS_M64N64K16_FLAT(TYPE)                                              \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                               \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " {"            \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31" \
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"                                          \
        : \
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
        : "l"(desc_a), "l"(desc_b), "r"(1))
#define PAGEDATTN_WGMMA_SS_M64N256K16_TB_FLAT(TYPE)                                          \
  asm volatile(                                                                  \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                              \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " {"           \
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15," \
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31," \
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47," \
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63," \
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79," \
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95," \
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111," \
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127" \
      "}, %128, %129, p, 1, 1, 0, 1;\n}\n"                                        \
        : \
          "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
          "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
          "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
          "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
          "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
          "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
          "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
          "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
          "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
        : "l"(desc_a), "l"(desc_b), "r"(1))

// The instruction of a shape and element type; TAIL: the transpose immediates (16-bit types only).
#define PAGEDATTN_WGMMA_BY_TYPE(MACRO, SHAPE, TAIL)                                                       \
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {                                                     \
    MACRO(SHAPE "k16.f32.bf16.bf16", TAIL);                                                              \
  } else {                                                                                               \
    MACRO(SHAPE "k16.f32.f16.f16", TAIL);                                                                \
  }

template <typename T>
struct Ops {
  static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half>);
  static constexpr int kK = 16;  // the wgmma K of the type
  static __device__ __forceinline__ void ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b,
                                                int scale_d) {
    PAGEDATTN_WGMMA_BY_TYPE(PAGEDATTN_WGMMA_SS_M64N64, "m64n64", ", 0, 0")
  }
  static __device__ __forceinline__ void ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
    PAGEDATTN_WGMMA_BY_TYPE(PAGEDATTN_WGMMA_SS_M64N128, "m64n128", ", 0, 0")
  }
  // B read N-major (transposed); accumulating.
  template <int N>
  static __device__ __forceinline__ void rs_tb(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b) {
    constexpr int scale_d = 1;
    if constexpr (N == 64) {
      PAGEDATTN_WGMMA_BY_TYPE(PAGEDATTN_WGMMA_RS_M64N64, "m64n64", ", 1")
    } else if constexpr (N == 128) {
      PAGEDATTN_WGMMA_BY_TYPE(PAGEDATTN_WGMMA_RS_M64N128, "m64n128", ", 1")
    } else {
      static_assert(N == 256);
      PAGEDATTN_WGMMA_BY_TYPE(PAGEDATTN_WGMMA_RS_M64N256, "m64n256", ", 1")
    }
  }
  // Flat accumulator arrays (d[4 j + e] = n8 block j, element e), always accumulating (scale-d = 1).
  static __device__ __forceinline__ void ss_n64(float (&d)[32], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      PAGEDATTN_WGMMA_SS_M64N64K16_FLAT("bf16");
    } else {
      PAGEDATTN_WGMMA_SS_M64N64K16_FLAT("f16");
    }
  }
  static __device__ __forceinline__ void ss_n256_tb(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      PAGEDATTN_WGMMA_SS_M64N256K16_TB_FLAT("bf16");
    } else {
      PAGEDATTN_WGMMA_SS_M64N256K16_TB_FLAT("f16");
    }
  }
};
// fp8 operands (wgmma k32): A e4m3 (the kernel's own quantised Q or P), B in the cache's format,
// e4m3 or e5m2 (kBE5m2; the tensor core takes the two formats mixed); both operands K-major (8-bit
// types have no transpose), A of the RS form as 4 registers of 4 bytes (row r: columns
// 4 (lane % 4) .. + 3 and 16 + those; row r + 8: the same), f32 accumulators in the 16-bit types'
// layout.
#define PAGEDATTN_WGMMA_FP8(MACRO, SHAPE)                     \
  if constexpr (kBE5m2) {                                     \
    MACRO(SHAPE ".f32.e4m3.e5m2", "");                        \
  } else {                                                    \
    MACRO(SHAPE ".f32.e4m3.e4m3", "");                        \
  }
template <bool kBE5m2>
struct OpsFp8 {
  static constexpr int kK = 32;
  static __device__ __forceinline__ void ss_n64(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b, int scale_d) {
    PAGEDATTN_WGMMA_FP8(PAGEDATTN_WGMMA_SS_M64N64, "m64n64k32")
  }
  static __device__ __forceinline__ void ss_n128(float (&d)[16][4], uint64_t desc_a, uint64_t desc_b,
                                                 int scale_d) {
    PAGEDATTN_WGMMA_FP8(PAGEDATTN_WGMMA_SS_M64N128, "m64n128k32")
  }
  // D (+)= A (registers) . B (K-major); scale_d = 0: D = A . B (the accumulators' values ignored).
  template <int N>
  static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4], uint64_t desc_b,
                                            int scale_d = 1) {
    if constexpr (N == 64) {
      PAGEDATTN_WGMMA_FP8(PAGEDATTN_WGMMA_RS_M64N64, "m64n64k32")
    } else if constexpr (N == 128) {
      PAGEDATTN_WGMMA_FP8(PAGEDATTN_WGMMA_RS_M64N128, "m64n128k32")
    } else {
      static_assert(N == 256);
      PAGEDATTN_WGMMA_FP8(PAGEDATTN_WGMMA_RS_M64N256, "m64n256k32")
    }
  }
};
using OpsE4m3 = OpsFp8<false>;
#undef PAGEDATTN_WGMMA_FP8
#undef PAGEDATTN_WGMMA_BY_TYPE
#undef PAGEDATTN_WGMMA_SS_M64N64
#undef PAGEDATTN_WGMMA_SS_M64N128
#undef PAGEDATTN_WGMMA_RS_M64N64
#undef PAGEDATTN_WGMMA_RS_M64N128
#undef PAGEDATTN_WGMMA_RS_M64N256
#undef PAGEDATTN_WGMMA_SS_M64N64K16_FLAT
#undef PAGEDATTN_WGMMA_SS_M64N256K16_TB_FLAT
#endif

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
// One arrival that also expects `bytes` of transactions (the TMA copies of the phase).
__device__ __forceinline__ void arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
                   smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
// Makes barrier initializations visible to the async proxy (before TMA copies signal them).
__device__ __forceinline__ void fence_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
}  // namespace mbar

// Tensor copies (TMA, sm_90): `map` is the address of a CUtensorMap (a __grid_constant__ kernel
// parameter); the copy's bytes complete a transaction of `bar`.
namespace tma {
__device__ __forceinline__ void load_4d(char* dst, const void* map, int c0, int c1, int c2, int c3, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(bar))
      : "memory");
}
}  // namespace tma

// Named barriers 1..15 (0 is __syncthreads) over kThreads threads (a multiple of 32).
namespace named_barrier {
template <int kThreads>
__device__ __forceinline__ void sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
// bar.sync that also returns whether `pred` held in any of the kThreads threads.
template <int kThreads>
__device__ __forceinline__ bool any(int id, bool pred) {
  uint32_t out;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(out)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "n"(kThreads)
      : "memory");
  return out != 0u;
}
}  // namespace named_barrier

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
