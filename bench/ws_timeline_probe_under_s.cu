// ws_timeline_probe's under-s variant, in a translation unit of its own (ws_timeline_probe.cuh).
#include "ws_timeline_probe.cuh"

void ws_probe::run_under_s(int head_size, bool fp8, int seqs, int len) {
  run_variant<UnderSTrace>(head_size, fp8, seqs, len, "under-s (O rescaled under S)");
}
