// Batch-invariant mode switch (pagedattn/batch_invariance.h): the builder option or the
// environment variable.
#include "pagedattn/batch_invariance.h"

#include <cstdlib>
#include <string_view>

#include "pagedattn/error.h"

namespace pagedattn {

bool batch_invariant_mode(const BuilderConfig& config) {
  if (config.batch_invariant) return true;
  const char* env = std::getenv(kBatchInvariantEnv);
  if (env == nullptr) return false;
  const std::string_view value(env);
  if (value.empty() || value == "0") return false;
  PAGEDATTN_CHECK(value == "1", kBatchInvariantEnv, kBatchInvariantEnv, " = '", value,
                  "' is not a switch: expected 1 (batch-invariant plans) or 0 / unset (the default)");
  return true;
}

}  // namespace pagedattn
