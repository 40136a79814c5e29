// The CPU MLA prefill backend ("CPU" in the MLA prefill registry) and the work-item runner the
// CPU MLA decode shares with it. See cpu_mla_prefill.cpp for what it computes.
#pragma once

#include <vector>

#include "cpu_kernels.h"
#include "pagedattn/mla.h"

namespace pagedattn {

// The registered class of the CPU MLA prefill backend (static lifetime). get_name() == "CPU".
const MLAPrefillBackendClass& cpu_mla_prefill_backend_class();

namespace cpu {

// Runs `items` then `merges` with `kernels` on min(threads, items) OpenMP threads; thread i uses
// args.scratch + i * args.scratch_stride. Allocates nothing.
void run_mla_work(const std::vector<WorkItem>& items, const std::vector<MergeTask>& merges,
                  const AttentionArgs& args, int threads, const KernelTable& kernels);

// Precision of a run: vdpbf16ps when the ISA has it and the operands are bf16 or an fp8 cache
// (exact in bf16), f32 FMA otherwise (as the CPU backend).
Precision mla_precision(const KernelTable& kernels, DType activation_dtype, DType kv_dtype);

}  // namespace cpu
}  // namespace pagedattn
