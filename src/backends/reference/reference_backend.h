// The REFERENCE attention backend: fp64, naive, every feature; the oracle every other backend is
// checked against (DESIGN.md §6). Registered last (lowest priority) in backends/registry.cpp.
#pragma once

#include "pagedattn/backend.h"

namespace pagedattn {

// The one REFERENCE backend object (static lifetime). name() == "REFERENCE".
const AttentionBackend& reference_backend();

}  // namespace pagedattn
