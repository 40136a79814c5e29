// Batch-invariant mode: a request's output rows are bitwise identical whatever the batch it runs
// in (size, composition, its position, decode-only or mixed, the other requests' lengths).
//
// Turned on per builder (BuilderConfig::batch_invariant) or for every builder of the process
// (env PAGEDATTN_BATCH_INVARIANT=1). Under it each backend's plan is a function of every request
// alone: no cascade, split-KV sizes fixed in tokens (or no split), one kernel per (head size,
// dtype, query-length class), one reduction order for every split combine, and on the CPU the
// same per-row accumulation order whatever the thread count. What is and is not invariant, and
// the audit of every batch-dependent decision: docs/batch_invariance.md.
#pragma once

#include "pagedattn/backend.h"

namespace pagedattn {

// The environment variable; "1" turns the mode on for every builder, "0" or unset leaves it to
// BuilderConfig::batch_invariant. Any other value is an Error naming the variable.
inline constexpr const char* kBatchInvariantEnv = "PAGEDATTN_BATCH_INVARIANT";

// Whether a builder made from `config` plans batch-invariantly: config.batch_invariant, or the
// environment variable (read at every call, so a builder reads it when it is constructed).
bool batch_invariant_mode(const BuilderConfig& config);

}  // namespace pagedattn
