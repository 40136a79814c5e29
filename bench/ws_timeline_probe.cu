// Timeline probe of the warp-specialized kernel's consumers (paged_attention_ws.cuh): the same
// kernel, instantiated with a recorder as its Trace, stamps the SM clock at each phase of the
// pipelined loop (WsMark: iteration start, K/V landed, wgmma groups issued, S_{t+1} landed,
// softmax done, P_t . V_t done) for the first kMaxIters iterations of every consumer warp, on one
// causal bf16 prefill of the CUDA backend's own plan (paged cache, random block table), over a
// 16-bit cache or (--kv fp8_e4m3) an e4m3 one on the 8-bit path.
// It prints, per head size, the median cycles of each phase per iteration, the iteration time
// against the tensor core's share of a tile, and how often the two consumers of an SM
// sub-partition (warp w of each warpgroup) run their softmax at the same time. The phases of the
// branch-free (fast) and the general (masked) steps are kept apart.
// Variants (the kernel's probe-only policies, paged_attention_ws.cuh): duo (the shipped schedule),
// solo (consumer 1 computes nothing: the softmax without the other consumer on its sub-partition),
// turns1 / turns2 (the consumers take turns to issue their wgmma groups, passing the turn once
// issued / once S has landed), warp-scan (a masked tile's NaN-isolation scan by each warp over
// all its chunks, voted within the warp: no warpgroup barrier). Each also prints the launch time
// with the recorder in, and for masked steps how far apart the 4 warps of a consumer reach the
// scan (the warpgroup vote's wait) and the time from the last one's arrival to the first exit.
// Usage: ws_timeline_probe [--head-size 64|128|256 (default: all)] [--kv auto|fp8_e4m3]
//        [--variant duo|solo|turns1|turns2|warp-scan|all (default: duo)] [--seqs N] [--len L]
// Hopper only (sm_90a); the shipped kernel's trace (WsNoTrace) compiles to nothing. The recorder
// and the measurement: ws_timeline_probe.cuh; each variant's kernels: ws_timeline_probe_<variant>.cu.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "ws_timeline_probe.cuh"

using namespace ws_probe;

void ws_probe::run_duo(int head_size, bool fp8, int seqs, int len) {
  run_variant<ClockTrace>(head_size, fp8, seqs, len, "duo");
}

int main(int argc, char** argv) {
  int head_size = 0, seqs = 4, len = 4096;
  bool fp8 = false;
  std::string variant = "duo";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--head-size" && i + 1 < argc) {
      head_size = std::atoi(argv[++i]);
    } else if (a == "--kv" && i + 1 < argc && (std::string(argv[i + 1]) == "auto" || std::string(argv[i + 1]) == "fp8_e4m3")) {
      fp8 = std::string(argv[++i]) == "fp8_e4m3";
    } else if (a == "--variant" && i + 1 < argc) {
      variant = argv[++i];
    } else if (a == "--seqs" && i + 1 < argc) {
      seqs = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--len" && i + 1 < argc) {
      len = std::max(256, std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: %s [--head-size 64|128|256] [--kv auto|fp8_e4m3] [--variant duo|solo|turns1|turns2|warp-scan|all] [--seqs N] [--len L]\n", argv[0]);
      return 2;
    }
  }
  const struct {
    const char* name;
    void (*run)(int, bool, int, int);
  } variants[] = {{"duo", run_duo},
                  {"solo", run_solo},
                  {"turns1", run_turns1},
                  {"turns2", run_turns2},
                  {"warp-scan", run_warp_scan}};
  bool known = variant == "all";
  for (const auto& v : variants) known = known || variant == v.name;
  if (!known) {
    std::fprintf(stderr, "--variant %s: expected duo, solo, turns1, turns2, warp-scan or all\n", variant.c_str());
    return 2;
  }
  for (int d : {64, 128, 256}) {
    if (head_size != 0 && head_size != d) continue;
    for (const auto& v : variants) {
      if (variant == "all" || variant == v.name) v.run(d, fp8, seqs, len);
    }
  }
  return 0;
}
