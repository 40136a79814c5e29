// Decode context parallelism (DCP, vLLM's dcp_world_size / dcp_rank / cp_kv_cache_interleave_size):
// a request's KV cache is striped over a group of N ranks, so a context N times longer fits, and
// N GPUs read it at once.
//
// Layout (as vLLM): token t lives on rank (t / I) % N (I = interleave), at position
//   local(t) = (t / (I N)) I + t % I
// of that rank's sequence, so each rank's share of a request is a dense sequence of its own. The
// block table is the same on every rank: entry b covers the global tokens [b B N, (b + 1) B N)
// ("virtual blocks" of B N tokens, B = the cache's block size) and names, in every rank's own
// cache, the physical block holding that rank's B tokens of them. B must be a multiple of I.
//
// A step on rank r (make_dcp_local_step): every query row p attends the keys of [0, p] that r
// holds, i.e. its first dcp_local_seq_len(p + 1) local keys, causally -- one local request per
// run of rows whose tokens r holds (each adds exactly one local key, so the local causal positions
// hold and the run's new tokens are the request's last keys, as an MLA prefill expects), one
// single-row request per row held elsewhere, a row with no local key left out. The new tokens' keys / values are written on their owner only (slot -1 elsewhere).
// Each rank computes its rows' output and LSE over its keys; dcp_combine all-gathers (output,
// LSE) over the group and merges them by LSE (merge_attn_states_n), so every rank ends with the
// full attention. Decodes are one local request each; prefill rows become as many requests as
// runs of owned tokens (exact, but each reads its keys again: the efficient DCP prefill, an
// all-gather of the context KV, is not built).
// Not with ALiBi, sliding windows, chunked local attention or sinks (positions and the sink term
// would be wrong on the local sequence): dcp_plan rejects them. DcpConfig (backend.h) is also
// the layer's (AttentionLayerParams::dcp, MLAAttentionLayerParams::dcp, passed to its impl, whose
// need_to_return_lse_for_decode() is then true); dcp_plan checks that the two agree.
// Host tensors with the in-memory group (CI's emulation), or device tensors with the NCCL group
// (pagedattn/dcp_nccl.h), one GPU per rank.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "pagedattn/backend.h"
#include "pagedattn/metadata.h"
#include "pagedattn/tensor.h"

namespace pagedattn {

class Attention;
class MLAAttention;
class AttentionMetadataBuilder;

// The rank holding global token t, and t's position in that rank's sequence.
int dcp_owner(int64_t token, const DcpConfig& config);
int64_t dcp_local_position(int64_t token, const DcpConfig& config);
// Tokens of [0, seq_len) held by config.rank (vLLM get_dcp_local_seq_lens).
int32_t dcp_local_seq_len(int64_t seq_len, const DcpConfig& config);
std::vector<int32_t> get_dcp_local_seq_lens(std::span<const int32_t> seq_lens, const DcpConfig& config);

// config.rank's share of a global step. global: query_start_loc, seq_lens, block_table (virtual
// blocks, see above), causal (must be true); its slot_mapping is ignored (derived per rank).
struct DcpLocalStep {
  CommonAttentionMetadataArgs args;  // the rank's step (its own slot_mapping, -1 for tokens it does not hold)
  std::vector<int32_t> rows;         // local token i is global token rows[i] (query / key / value row)
};
DcpLocalStep make_dcp_local_step(const CommonAttentionMetadataArgs& global, const DcpConfig& config,
                                 int block_size);

// out = sum_r e^{lse_r - lse} outs[r], lse = log sum_r e^{lse_r}: N partial results of the same
// rows merged by their LSEs (natural log; -inf = no key; a row with none anywhere: 0, -inf; a
// NaN LSE, from a NaN logit on that rank: the row's out and lse NaN).
// outs[r]: (T, H, D) activations; lses[r]: (H, T) f32; host tensors. out_lse optional.
void merge_attn_states_n(std::span<const TensorView> outs, std::span<const TensorView> lses,
                         const TensorView& out, const TensorView& out_lse = {});

// The group's communication. all_gather: every rank's `send` (same shape and dtype on every rank)
// into `recv` (N, *send.shape), in rank order; every rank calls it, in the same order. device():
// where its tensors live (the in-memory group: host; NCCL, pagedattn/dcp_nccl.h: the rank's GPU,
// enqueued on current_cuda_stream()).
class DcpCommunicator {
 public:
  virtual ~DcpCommunicator() = default;
  virtual int world_size() const = 0;
  virtual int rank() const = 0;
  virtual Device device() const { return Device::cpu; }
  virtual void all_gather(const TensorView& send, const TensorView& recv) = 0;
  // A rank failed: wake every rank blocked in (or later entering) a collective of this group with
  // an Error naming "comm", instead of letting it wait for the failed rank for ever. The in-memory
  // group's barrier throws; an NCCL communicator made by make_nccl_dcp_communicator is aborted
  // (ncclCommAbort), a wrapped one only refuses further calls (its owner aborts or frees it).
  // Called by run_dcp_ranks on every communicator of the group it is given.
  virtual void abort() {}
};

// Whether this build has the NCCL communicator (pagedattn/dcp_nccl.h).
bool built_with_nccl();

// N ranks in one process (one thread each, host tensors): the communicators of one group. The
// emulation CI runs DCP on.
std::vector<std::unique_ptr<DcpCommunicator>> make_in_memory_dcp_group(int world_size);
// Runs body(rank) for rank 0 .. world_size - 1, one thread each (the ranks of an in-memory group
// block in all_gather until all have arrived), joins them, and rethrows the exception of the rank
// that failed first. group: the ranks' communicators (rank order, or empty): when a rank throws,
// every one is aborted, so the others leave their collectives instead of waiting for it.
void run_dcp_ranks(int world_size, const std::function<void(int)>& body,
                   std::span<const std::unique_ptr<DcpCommunicator>> group = {});

// A rank's share of one step of one layer, planned on the host (dcp_plan): the local step, the
// builder's plan of it, and every buffer the step fills, on the layer's device:
//   - when the local rows are the global rows in order (a decode step whose every request has a
//     key here: `identity`), the layer reads the step's inputs in place and writes its output and
//     LSE straight into `send`;
//   - otherwise the local rows of the inputs are gathered into `inputs`, the layer writes
//     local_out / local_lse, and a pack puts them at their global rows of `send` (zeros and LSE
//     -inf for rows with no key here);
//   - `send` (output (T, H, Dv) in the layer's dtype, then its LSE (H, T) f32 at lse_offset) is
//     all-gathered into `recv` (N copies), and the N states are merged into the caller's out / lse.
// With a plan, dcp_attend / dcp_combine / dcp_forward issue only kernels and the collective (no
// host sync, no allocation), so a CUDA graph can capture them; keep the plan alive as long as the
// graph. The builder's next build() invalidates the plan's attention plan, as for any plan.
struct DcpPlan {
  DcpConfig config;
  DcpLocalStep step;
  bool identity = false;
  int64_t num_tokens = 0;  // T: rows of the global step
  int64_t num_heads = 0, head_size_v = 0;
  DType dtype = DType::bf16;
  Device device = Device::cpu;
  OwnedCommonAttentionMetadata metadata;         // the local step, on `device` (when it has rows)
  std::shared_ptr<const AttentionMetadata> attention;  // the builder's plan of it (null: no local rows)
  Tensor rows, inverse;                          // device plans: i32 (n) local -> global row, (T) global -> local or -1
  Tensor inputs[3];                              // the local rows of the layer's three inputs
  Tensor local_out, local_lse;                   // (n, H, Dv), (H, n) f32
  Tensor send, recv;                             // u8 (bytes), (N, bytes)
  int64_t lse_offset = 0;                        // bytes

  int64_t num_local_rows() const { return static_cast<int64_t>(step.rows.size()); }
  TensorView send_out() const;  // (T, H, Dv) view of send
  TensorView send_lse() const;  // (H, T) f32 view of send
};

// Plans config.rank's share of `global` for `layer`: checks the layer's dcp against config, builds
// the local step (reordered as the builder asks), has `builder` (the rank's builder of the layer's
// group; max_num_seqs must hold the local requests) plan it, and allocates the step's buffers on the
// layer's device. global: query_start_loc, seq_lens, block_table (virtual blocks), causal.
std::unique_ptr<DcpPlan> dcp_plan(const Attention& layer, AttentionMetadataBuilder& builder, const DcpConfig& config,
                                  const CommonAttentionMetadataArgs& global);
std::unique_ptr<DcpPlan> dcp_plan(const MLAAttention& layer, AttentionMetadataBuilder& builder,
                                  const DcpConfig& config, const CommonAttentionMetadataArgs& global);

// The rank's local attention: the step's new keys / values written where this rank holds them,
// attention over its keys, the result packed into plan.send. query / key / value: the global step's
// rows (T), on the plan's device.
void dcp_attend(Attention& layer, DcpPlan& plan, const TensorView& query, const TensorView& key,
                const TensorView& value, const TensorView& kv_cache);
// The same for an MLA layer (q (T, H, Dqk), kv_c_normed (T, L), k_pe (T, R)).
void dcp_attend(MLAAttention& layer, DcpPlan& plan, const TensorView& q, const TensorView& kv_c_normed,
                const TensorView& k_pe, const TensorView& kv_cache);
// The group's combine of a planned step: plan.send all-gathered over comm (which must live on the
// plan's device), the N states merged into out (T, H, Dv) and, when given, lse (H, T) f32: every
// rank ends with the full attention of every row, the same bits on every rank.
void dcp_combine(DcpPlan& plan, DcpCommunicator& comm, const TensorView& out, const TensorView& lse = {});

// dcp_attend then dcp_combine.
void dcp_forward(Attention& layer, DcpPlan& plan, DcpCommunicator& comm, const TensorView& query,
                 const TensorView& key, const TensorView& value, const TensorView& kv_cache, const TensorView& out,
                 const TensorView& lse = {});
void dcp_forward(MLAAttention& layer, DcpPlan& plan, DcpCommunicator& comm, const TensorView& q,
                 const TensorView& kv_c_normed, const TensorView& k_pe, const TensorView& kv_cache,
                 const TensorView& out, const TensorView& lse = {});

// One call: dcp_plan, then dcp_forward (host or device tensors, as the layer's).
void dcp_forward(Attention& layer, AttentionMetadataBuilder& builder, DcpCommunicator& comm,
                 const DcpConfig& config, const CommonAttentionMetadataArgs& global,
                 const TensorView& query, const TensorView& key, const TensorView& value,
                 const TensorView& kv_cache, const TensorView& out, const TensorView& lse = {});
void dcp_forward(MLAAttention& layer, AttentionMetadataBuilder& builder, DcpCommunicator& comm,
                 const DcpConfig& config, const CommonAttentionMetadataArgs& global,
                 const TensorView& q, const TensorView& kv_c_normed, const TensorView& k_pe,
                 const TensorView& kv_cache, const TensorView& out, const TensorView& lse = {});

}  // namespace pagedattn
