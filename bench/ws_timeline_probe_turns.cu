// ws_timeline_probe's turns1 and turns2 variants, in a translation unit of their own (ws_timeline_probe.cuh).
#include "ws_timeline_probe.cuh"

void ws_probe::run_turns1(int head_size, bool fp8, int seqs, int len) {
  run_variant<Turns1Trace>(head_size, fp8, seqs, len, "turns1 (passed at issue)");
}
void ws_probe::run_turns2(int head_size, bool fp8, int seqs, int len) {
  run_variant<Turns2Trace>(head_size, fp8, seqs, len, "turns2 (passed at S landed)");
}
