// ws_timeline_probe's solo variant, in a translation unit of its own (ws_timeline_probe.cuh).
#include "ws_timeline_probe.cuh"

void ws_probe::run_solo(int head_size, bool fp8, int seqs, int len) {
  run_variant<SoloTrace>(head_size, fp8, seqs, len, "solo (consumer 1 idle)");
}
