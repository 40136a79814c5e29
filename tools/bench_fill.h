// Random contents for the benchmark tensors of `pagedattn bench` (bench_fill.cpp).
#pragma once

#include <cstdint>

#include "pagedattn/tensor.h"

namespace pagedattn::cli {

// Fills a contiguous tensor with N(0, 1) values of its dtype by repeating a random tile (fast for
// GiBs), generated on the host and copied to the tensor's device.
void fill_random(Tensor& t, uint64_t seed);

}  // namespace pagedattn::cli
