// The CPU attention backend: flash-style paged attention with AVX-512 (vdpbf16ps) / AVX2 /
// scalar kernels chosen once at run time, OpenMP threads, split-KV decode and cascade prefixes.
// Registered above REFERENCE in backends/registry.cpp. See docs/perf/cpu.md.
#pragma once

#include "pagedattn/backend.h"

namespace pagedattn {

// The one CPU backend object (static lifetime). name() == "CPU".
const AttentionBackend& cpu_backend();

}  // namespace pagedattn
