// ws_timeline_probe's warp-scan variant, in a translation unit of its own (ws_timeline_probe.cuh).
#include "ws_timeline_probe.cuh"

void ws_probe::run_warp_scan(int head_size, bool fp8, int seqs, int len) {
  run_variant<WarpScanTrace>(head_size, fp8, seqs, len, "warp-scan (each warp scans all, votes alone)");
}
