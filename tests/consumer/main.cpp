// Links against the installed package and makes one call into each layer of the library.
#include <cstdio>

#include "pagedattn/pagedattn.h"

int main() {
  const auto& backends = pagedattn::registered_backends();
  std::printf("consumer: %zu backends, last = %s, f16(1.5) bits = 0x%04x\n", backends.size(),
              std::string(backends.back()->name()).c_str(), pagedattn::f32_to_f16_bits(1.5f));
  return backends.empty() ? 1 : 0;
}
