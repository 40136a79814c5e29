// `pagedattn run --check-invariance` (invariance_check.h).
#include "invariance_check.h"

#include <algorithm>
#include <cstring>
#include <sstream>

namespace pagedattn::cli {

namespace {

// A contiguous host copy of `t` (any device).
Tensor host_copy(const TensorView& t) {
  Tensor host(t.shape(), t.dtype(), Device::cpu);
  host.copy_from(t);
  return host;
}

size_t row_bytes(const Tensor& t) {
  return t.shape()[0] == 0 ? 0 : t.nbytes() / static_cast<size_t>(t.shape()[0]);
}

}  // namespace

InvarianceChecker::InvarianceChecker(uint64_t seed, Device device, int requests_per_step,
                                     int batches_per_request)
    : device_(device),
      requests_per_step_(requests_per_step),
      batches_per_request_(batches_per_request),
      rng_(seed ^ 0x1A7A51A7u) {}

void InvarianceChecker::check_layer(const std::string& layer, int group, const AttentionBackend& backend,
                                    const KVCacheSpec& spec, const BuilderConfig& config,
                                    const CommonAttentionMetadataArgs& step, int64_t num_blocks,
                                    const TensorView (&inputs)[3], const TensorView& output,
                                    const Forward& forward) {
  const int n = static_cast<int>(step.seq_lens.size());
  if (n == 0) return;
  auto& builder = builders_[group];
  if (!builder) builder = backend.make_builder(spec, config, device_);
  const int threshold = builder->reorder_batch_threshold();
  const Tensor step_inputs[3] = {host_copy(inputs[0]), host_copy(inputs[1]), host_copy(inputs[2])};
  const Tensor step_output = host_copy(output);
  const auto query_len = [&](int r) { return step.query_start_loc[r + 1] - step.query_start_loc[r]; };

  // Runs the step's requests `order` as one batch; returns the output rows of `target` (bytes).
  auto rerun = [&](std::vector<int> order, int target) {
    if (threshold > 0) {
      std::vector<int32_t> lens;
      for (int r : order) lens.push_back(query_len(r));
      const BatchReorder swaps = reorder_batch_to_split_decodes_and_prefills(lens, threshold);
      std::vector<int> reordered;
      for (int i : swaps.order) reordered.push_back(order[static_cast<size_t>(i)]);
      order = std::move(reordered);
    }
    CommonAttentionMetadataArgs args;
    args.query_start_loc.push_back(0);
    args.max_num_blocks_per_req = step.max_num_blocks_per_req;
    args.causal = step.causal;
    int64_t target_row = 0;
    for (int r : order) {
      if (r == target) target_row = args.query_start_loc.back();
      const int q0 = step.query_start_loc[r];
      args.query_start_loc.push_back(args.query_start_loc.back() + query_len(r));
      args.seq_lens.push_back(step.seq_lens[r]);
      const auto row = step.block_table.begin() + static_cast<ptrdiff_t>(r) * step.max_num_blocks_per_req;
      args.block_table.insert(args.block_table.end(), row, row + step.max_num_blocks_per_req);
      args.slot_mapping.insert(args.slot_mapping.end(), step.slot_mapping.begin() + q0,
                               step.slot_mapping.begin() + q0 + query_len(r));
    }
    const int64_t tokens = args.query_start_loc.back();
    const OwnedCommonAttentionMetadata common =
        make_common_attention_metadata(args, device_, num_blocks, spec.block_size);
    const std::shared_ptr<const AttentionMetadata> plan = builder->build(0, common.common);
    Tensor batch[3];
    for (int i = 0; i < 3; ++i) {
      Shape shape = step_inputs[i].shape();
      shape[0] = tokens;
      Tensor host(shape, step_inputs[i].dtype(), Device::cpu);
      const size_t bytes = row_bytes(step_inputs[i]);
      char* dst = static_cast<char*>(host.data());
      for (int r : order) {
        const size_t count = static_cast<size_t>(query_len(r)) * bytes;
        std::memcpy(dst, static_cast<const char*>(step_inputs[i].data()) + step.query_start_loc[r] * bytes, count);
        dst += count;
      }
      batch[i] = device_ == Device::cpu ? std::move(host) : host.to(device_);
    }
    Shape out_shape = step_output.shape();
    out_shape[0] = tokens;
    Tensor out(out_shape, step_output.dtype(), device_);
    out.fill_bytes(0xFF);  // NaN: an unwritten row differs
    forward(batch[0], batch[1], batch[2], *plan, out);
    ++stats_.reruns;
    const Tensor out_host = device_ == Device::cpu ? std::move(out) : out.to(Device::cpu);
    const size_t bytes = row_bytes(out_host);
    const auto* rows = static_cast<const uint8_t*>(out_host.data()) + target_row * bytes;
    return std::vector<uint8_t>(rows, rows + static_cast<size_t>(query_len(target)) * bytes);
  };

  std::vector<int> requests;
  for (int r = 0; r < n; ++r) {
    if (query_len(r) > 0) requests.push_back(r);
  }
  std::shuffle(requests.begin(), requests.end(), rng_);
  requests.resize(std::min<size_t>(requests.size(), static_cast<size_t>(requests_per_step_)));
  const size_t out_row = row_bytes(step_output);
  for (int target : requests) {
    const auto* first = static_cast<const uint8_t*>(step_output.data()) + step.query_start_loc[target] * out_row;
    const std::vector<uint8_t> in_step(first, first + static_cast<size_t>(query_len(target)) * out_row);
    std::vector<std::vector<int>> batches = {{target}};
    std::vector<int> others;
    for (int r = 0; r < n; ++r) {
      if (r != target && query_len(r) > 0) others.push_back(r);
    }
    for (int b = 0; b < batches_per_request_ && !others.empty(); ++b) {
      std::shuffle(others.begin(), others.end(), rng_);
      const int count = std::uniform_int_distribution<int>(1, static_cast<int>(others.size()))(rng_);
      std::vector<int> order(others.begin(), others.begin() + count);
      order.push_back(target);
      std::shuffle(order.begin(), order.end(), rng_);
      batches.push_back(std::move(order));
    }
    for (const std::vector<int>& order : batches) {
      const std::vector<uint8_t> again = rerun(order, target);
      ++stats_.comparisons;
      if (again == in_step) continue;
      ++stats_.differences;
      if (stats_.first_difference.empty()) {
        const size_t at = static_cast<size_t>(
            std::mismatch(in_step.begin(), in_step.end(), again.begin()).first - in_step.begin());
        std::ostringstream os;
        os << "layer " << layer << ", step request " << target << " (query_len " << query_len(target)
           << ", seq_len " << step.seq_lens[target] << ") "
           << (order.size() == 1 ? "alone" : "in a batch of " + std::to_string(order.size()))
           << " vs the step's batch of " << n << ": output byte " << at << " (token " << at / out_row
           << ") differs";
        stats_.first_difference = os.str();
      }
    }
  }
}

}  // namespace pagedattn::cli
