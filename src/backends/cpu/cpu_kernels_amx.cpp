// AMX kernels of the CPU backend: Q·Kᵀ and P·V on Intel AMX-BF16 tiles (tdpbf16ps), the rest of
// the tile algorithm (packing, online softmax, output) as on the AVX-512 path. Compiled with the
// AVX-512 flags of module.cmake; the tile instructions are inline assembly (no -mamx flags, so
// the compiler never emits them elsewhere). Run only when CPUID reports AMX-TILE + AMX-BF16, the
// OS enables the tile state (XCR0 bits 17, 18) and Linux grants this process the tile data
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); see cpu_dispatch.cpp.
//
// What it computes: the same as cpu_attention_tile.h for bf16 activations and fp8 caches
// (Precision::bf16_dot); f32/f16 activations run the AVX-512 f32 path unchanged.
//
// Tiles (palette 1, every register 16 rows x 64 bytes, configured once per work item):
//   tmm0..3  C: 16 rows x 16 f32 each.       Q·Kᵀ: S (16 rows, 64 keys) = 4 C tiles.
//                                            P·V:  O (16 rows, 64 dims) = up to 4 C tiles.
//   tmm4     A: 16 rows x 32 bf16.           Q (rows, 32 dims of D) or P (rows, 32 keys).
//   tmm5..7  B: 16 dword rows x 16 columns.  K pack rows = 16 d pairs x 16 keys (the AVX-512
//                                            K pack [D/2][64] dwords is already the VNNI layout
//                                            tdpbf16ps reads); V pack rows = 16 key pairs x
//                                            16 dims (the [32][Dv] pair pack, likewise).
//   Q·Kᵀ per 16 rows and 64 keys: D/32 steps of (1 A load, 4 B loads, 4 tdpbf16ps); P·V per
//   16 rows and 64 dims: load 4 C from O, 2 steps of (1 A load, 4 B loads, 4 tdpbf16ps), store.
//   Per 16 x 64 block at D = Dv = 128: 32 tdpbf16ps, 48 tile loads (Q·Kᵀ 4 A + 16 B; P·V 4 A +
//   16 B + 8 of O) and 12 stores (4 of S, 8 of O): O (16 rows x Dv f32) goes through C tiles
//   every key tile, since keeping it would take 8 C tiles and S needs 4.
//   Rows are taken 16 at a time; the rest of a run (< 16 rows: decode items, GQA tails, causal
//   diagonal runs) and head sizes that are not multiples of 32 use the AVX-512 vdpbf16ps kernels.
//   Whole items that take no tile (below) run the AVX-512 table's run_item, whose kernels are
//   compiled once, in cpu_kernels_avx512.cpp (this file instantiates only AmxOps').
//   Decode items (< 16 rows per KV head) therefore run the AVX-512 path whole: the memory-bound
//   decode would only fill 4 of a tile's 16 rows. Head-fused decode items (all KV heads of a
//   request, <= 128 rows) run a direct decode kernel where one applies (cpu_decode_avx512.h, or
//   cpu_decode_avx512_fma.h for AttentionArgs::direct_fma and the items the former does not take).
// O rescale: tiles cannot scale, so O rows with alpha != 1 are rescaled with AVX-512 before the
// C tiles are loaded. To make that rare the softmax keeps its running max while a tile's logits
// exceed it by at most kRescaleSlack = 8 (cpu_attention_tile.h: exact, P <= e^8).
//
// Memory traffic: as the AVX-512 path (K/V read once per item, packed once per tile and shared by
// every row block and GQA head of the item; Q, S, P, O in per-thread scratch: at 128 rows Q, S
// and O are 32, 32 and 64 KiB, so their tile loads and stores go to L2). Floor per 64-key tile
// and 16 rows: 16*64*(D+Dv)*2 FLOP at 1024 FLOP/cycle/core (one 16x16x32 tdpbf16ps per 16
// cycles), 512 cycles at D = Dv = 128. What the rest costs (the vector softmax is the largest
// part, then the O round trips and the packs): docs/perf/cpu.md, "AMX prefill (2026-12-06,
// session 24, issue 22)".
//
// Precision points: as the AVX-512 bf16 path (operands bf16, products summed in f32; tdpbf16ps
// flushes denormal inputs and outputs and rounds to nearest even, like vdpbf16ps; P rounded to
// bf16 once).
//
// Tests: tests/cpu runs the conformance grid on this table where the CPU has AMX, and everywhere
// with AVX-512 on amx_emulated_kernel_table(): the same kernels with each tile instruction
// replaced by plain C++ over an 8 KiB per-thread tile file, so CI checks the tiling, the VNNI
// operand layouts, the row tails and the lazy rescale without AMX hardware.
#if defined(__x86_64__) || defined(_M_X64)

#include "backends/cpu/cpu_decode_avx512.h"
#include "backends/cpu/cpu_decode_avx512_fma.h"

namespace pagedattn::cpu {
namespace {

constexpr int kTileRows = 16;   // rows of every tile register
constexpr int kTileBytes = 64;  // bytes per tile row

// LDTILECFG's 64-byte operand.
struct alignas(64) TileConfig {
  uint8_t palette_id = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

inline TileConfig full_tile_config() {
  TileConfig config;
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  return config;
}

// The AMX unit. Tile numbers are template arguments (they are encoded in the instruction).
struct HardwareTiles {
  static void configure() {
    const TileConfig config = full_tile_config();
    __asm__ volatile("ldtilecfg %0" ::"m"(config));
  }
  static void release() { __asm__ volatile("tilerelease" ::: "memory"); }
  template <int T>
  static void zero() {
    __asm__ volatile("tilezero %%tmm%c0" ::"i"(T));
  }
  template <int T>
  static void load(const void* base, size_t stride) {
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  template <int T>
  static void store(void* base, size_t stride) {
    __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "i"(T) : "memory");
  }
  // C += A · B: C (16 x 16 f32), A (16 x 32 bf16), B (16 x 16 bf16 pairs).
  template <int C, int A, int B>
  static void dpbf16() {
    __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(C), "i"(A), "i"(B));
  }
};

// The same operations in plain C++ over a per-thread tile file (see the file comment).
struct EmulatedTiles {
  struct File {
    alignas(64) unsigned char tile[8][kTileRows][kTileBytes];
    bool configured;
  };
  static File& file() {
    static thread_local File f{};
    return f;
  }
  static void configure() { file().configured = true; }
  static void release() {
    File& f = file();
    std::memset(f.tile, 0, sizeof(f.tile));  // tilerelease returns the tiles to their init state
    f.configured = false;
  }
  // The hardware raises #UD on a tile instruction before LDTILECFG: so does the emulation.
  static File& configured_file() {
    File& f = file();
    if (!f.configured) __builtin_trap();
    return f;
  }
  template <int T>
  static void zero() {
    std::memset(configured_file().tile[T], 0, sizeof(file().tile[T]));
  }
  template <int T>
  static void load(const void* base, size_t stride) {
    configured_file();
    for (int r = 0; r < kTileRows; ++r) {
      std::memcpy(file().tile[T][r], static_cast<const char*>(base) + r * stride, kTileBytes);
    }
  }
  template <int T>
  static void store(void* base, size_t stride) {
    configured_file();
    for (int r = 0; r < kTileRows; ++r) {
      std::memcpy(static_cast<char*>(base) + r * stride, file().tile[T][r], kTileBytes);
    }
  }
  template <int C, int A, int B>
  static void dpbf16() {
    File& f = configured_file();
    for (int m = 0; m < kTileRows; ++m) {
      float c[16];
      std::memcpy(c, f.tile[C][m], sizeof(c));
      uint16_t a[32];
      std::memcpy(a, f.tile[A][m], sizeof(a));
      for (int k = 0; k < 16; ++k) {
        uint16_t b[32];
        std::memcpy(b, f.tile[B][k], sizeof(b));
        for (int n = 0; n < 16; ++n) {
          c[n] += bf16_to_f32(a[2 * k]) * bf16_to_f32(b[2 * n]) +
                  bf16_to_f32(a[2 * k + 1]) * bf16_to_f32(b[2 * n + 1]);
        }
      }
      std::memcpy(f.tile[C][m], c, sizeof(c));
    }
  }
};

// Bf16Ops with Q·Kᵀ and P·V on tiles for every full 16-row block (see the file comment).
template <class Tiles>
struct AmxOps : Bf16Ops {
  static constexpr float kRescaleSlack = 8.f;

  // S rows [i, i+16) x 64 keys; q rows of head_size bf16, kp [D/2][64] dwords.
  static void qk_tile_block(float* s, const uint16_t* q, int head_size, const uint32_t* kp) {
    Tiles::template zero<0>();
    Tiles::template zero<1>();
    Tiles::template zero<2>();
    Tiles::template zero<3>();
    const size_t q_stride = static_cast<size_t>(head_size) * 2;
    const size_t k_stride = kKeyTile * 4;
    for (int d0 = 0; d0 < head_size; d0 += 32) {
      const uint32_t* kb = kp + static_cast<size_t>(d0 / 2) * kKeyTile;  // d pairs d0/2 ...
      Tiles::template load<4>(q + d0, q_stride);
      Tiles::template load<5>(kb, k_stride);
      Tiles::template dpbf16<0, 4, 5>();
      Tiles::template load<6>(kb + 16, k_stride);
      Tiles::template dpbf16<1, 4, 6>();
      Tiles::template load<7>(kb + 32, k_stride);
      Tiles::template dpbf16<2, 4, 7>();
      Tiles::template load<5>(kb + 48, k_stride);
      Tiles::template dpbf16<3, 4, 5>();
    }
    const size_t s_stride = kKeyTile * 4;
    Tiles::template store<0>(s, s_stride);
    Tiles::template store<1>(s + 16, s_stride);
    Tiles::template store<2>(s + 32, s_stride);
    Tiles::template store<3>(s + 48, s_stride);
  }

  static void qk(float* s, const void* q_tile, const void* k, int r0, int r1, int head_size,
                 const TileKeys& keys) {
    int i = r0;
    if (head_size % 32 == 0) {
      const uint16_t* q = static_cast<const uint16_t*>(q_tile);
      const uint32_t* kp = static_cast<const uint32_t*>(k);
      for (; i + kTileRows <= r1; i += kTileRows) {
        qk_tile_block(s + static_cast<size_t>(i) * kKeyTile, q + static_cast<size_t>(i) * head_size,
                      head_size, kp);
      }
    }
    if (i < r1) Bf16Ops::qk(s, q_tile, k, i, r1, head_size, keys);
  }

  // One C tile column c (dims 16c ...) of a P·V block: B from the V pack, key pairs 16*ks ...
  template <int C>
  static void pv_step(const uint16_t* vp, size_t v_stride, int ks, int head_size_v) {
    constexpr int B = 5 + C % 3;
    Tiles::template load<B>(vp + 2 * (static_cast<size_t>(16 * ks) * head_size_v + 16 * C), v_stride);
    Tiles::template dpbf16<C, 4, B>();
  }

  // O rows [i, i+16) x dims [d0, d0 + 16*NC) += P rows x V; o, vp already offset to d0.
  template <int NC>
  static void pv_tile_block(float* o, const uint16_t* p, const uint16_t* vp, int head_size_v) {
    const size_t o_stride = static_cast<size_t>(head_size_v) * 4;
    Tiles::template load<0>(o, o_stride);
    if constexpr (NC > 1) Tiles::template load<1>(o + 16, o_stride);
    if constexpr (NC > 2) Tiles::template load<2>(o + 32, o_stride);
    if constexpr (NC > 3) Tiles::template load<3>(o + 48, o_stride);
    const size_t v_stride = static_cast<size_t>(head_size_v) * 4;  // one key pair row of dwords
    for (int ks = 0; ks < kKeyTile / 32; ++ks) {
      Tiles::template load<4>(p + 32 * ks, kKeyTile * 2);
      pv_step<0>(vp, v_stride, ks, head_size_v);
      if constexpr (NC > 1) pv_step<1>(vp, v_stride, ks, head_size_v);
      if constexpr (NC > 2) pv_step<2>(vp, v_stride, ks, head_size_v);
      if constexpr (NC > 3) pv_step<3>(vp, v_stride, ks, head_size_v);
    }
    Tiles::template store<0>(o, o_stride);
    if constexpr (NC > 1) Tiles::template store<1>(o + 16, o_stride);
    if constexpr (NC > 2) Tiles::template store<2>(o + 32, o_stride);
    if constexpr (NC > 3) Tiles::template store<3>(o + 48, o_stride);
  }

  static void pv(float* o, const void* p_tile, const void* v_tile, const float* alpha, int r0,
                 int r1, int head_size_v, const TileKeys& keys) {
    const uint16_t* p = static_cast<const uint16_t*>(p_tile);
    const uint16_t* vp = static_cast<const uint16_t*>(v_tile);
    int i = r0;
    for (; i + kTileRows <= r1; i += kTileRows) {
      float* o_rows = o + static_cast<size_t>(i) * head_size_v;
      for (int r = 0; r < kTileRows; ++r) {
        const float a = alpha[i + r];
        if (a == 1.f) continue;
        float* row = o_rows + static_cast<size_t>(r) * head_size_v;
        const __m512 va = _mm512_set1_ps(a);
        for (int d = 0; d < head_size_v; d += 16) {
          _mm512_storeu_ps(row + d, _mm512_mul_ps(va, _mm512_loadu_ps(row + d)));
        }
      }
      const uint16_t* p_rows = p + static_cast<size_t>(i) * kKeyTile;
      for (int d0 = 0; d0 < head_size_v; d0 += 64) {
        const int columns = imin(4, (head_size_v - d0) / 16);
        with_static_int<4>(columns, [&](auto nc) {
          pv_tile_block<decltype(nc)::value>(o_rows + d0, p_rows, vp + 2 * d0, head_size_v);
        });
      }
    }
    if (i < r1) Bf16Ops::pv(o, p_tile, v_tile, alpha, i, r1, head_size_v, keys);
  }
};

// Every item but a bf16_dot item with a full tile of rows a KV head runs the AVX-512 table's
// run_item (its kernels compiled once, in cpu_kernels_avx512.cpp): head-fused decodes (the direct
// decode kernels, see the file comment), f32 / f16 activations, and decodes with fewer rows.
template <class Tiles>
void run_item_amx_impl(const AttentionArgs& args, const WorkItem& item, char* scratch) {
  const int rows_per_head = (item.tok_end - item.tok_begin) * args.group_size;
  const bool direct = (!args.direct_fma && direct_decode_applies(args, item)) || direct_decode_fma_applies(args, item);
  if (direct || args.precision != Precision::bf16_dot || rows_per_head < kTileRows) {
    avx512_kernel_table()->run_item(args, item, scratch);
    return;
  }
  Tiles::configure();
  run_item_impl<AmxOps<Tiles>>(args, item, scratch);
  Tiles::release();
}

void run_item_amx(const AttentionArgs& args, const WorkItem& item, char* scratch) {
  run_item_amx_impl<HardwareTiles>(args, item, scratch);
}

void run_item_amx_emulated(const AttentionArgs& args, const WorkItem& item, char* scratch) {
  run_item_amx_impl<EmulatedTiles>(args, item, scratch);
}

void merge_amx(const AttentionArgs& args, const MergeTask& task) { avx512_kernel_table()->merge(args, task); }

const KernelTable kAmxTable = {Isa::amx, "amx", true, &run_item_amx, &merge_amx};
const KernelTable kAmxEmulatedTable = {Isa::amx, "amx-emulated", true, &run_item_amx_emulated,
                                       &merge_amx};

}  // namespace

const KernelTable* amx_kernel_table() { return &kAmxTable; }
const KernelTable* amx_emulated_kernel_table() { return &kAmxEmulatedTable; }

}  // namespace pagedattn::cpu

#else  // not x86-64

#include "backends/cpu/cpu_kernels.h"

namespace pagedattn::cpu {
const KernelTable* amx_kernel_table() { return nullptr; }
const KernelTable* amx_emulated_kernel_table() { return nullptr; }
}  // namespace pagedattn::cpu

#endif
