// --dcp: one layer's step on every rank of the group (simulation_state.h).
#include <chrono>

#include "simulation_state.h"

namespace pagedattn::cli {

// On CUDA, rank r (GPU r) reads the same views of its own copy of the pool and writes its own
// output there: a step copies nothing across GPUs (a peer copy on the legacy stream would wait for
// the other GPU's queue, where the all-gather waits for this rank).
void Simulation::State::dcp_layer_step(LayerState& l, const CommonAttentionMetadataArgs& args,
                                       const TensorView (&in)[3], const TensorView& out) {
  const RunOptions& o = options;
  GroupState& g = groups[static_cast<size_t>(l.group)];
  dcp_ranks->run([&](int r) {
    // Rank r >= 1: the same views into its copy of the pool (CUDA), its own output.
    TensorView x[3] = {in[0], in[1], in[2]}, o_r = out;
    if (r > 0) {
      const auto rank = static_cast<size_t>(r - 1);
      if (o.device == Device::cuda) {
        for (TensorView& v : x) {
          const auto offset = static_cast<const char*>(v.data()) - static_cast<const char*>(pool_device.data());
          v = TensorView(static_cast<char*>(rank_pools[rank].data()) + offset, v.dtype(), v.shape(), v.strides(),
                         v.device(), rank_pools[rank].view().device_index());
        }
      }
      o_r = TensorView(rank_outputs[rank].data(), out.dtype(), out.shape(), out.strides(), out.device(),
                       rank_outputs[rank].view().device_index());
    }
    AttentionMetadataBuilder& b = r == 0 ? *g.builder : *g.rank_builders[static_cast<size_t>(r - 1)];
    const TensorView cache = r == 0 ? l.cache.view() : l.rank_caches[static_cast<size_t>(r - 1)].view();
    DcpCommunicator& comm = dcp_ranks->comm(r);
    const auto t0 = std::chrono::steady_clock::now();
    if (l.mla) {
      MLAAttention& layer = r == 0 ? *l.mla : *l.rank_mla[static_cast<size_t>(r - 1)];
      dcp_forward(layer, b, comm, dcp_config(r), args, x[0], x[1], x[2], cache, o_r);
    } else {
      Attention& layer = r == 0 ? *l.layer : *l.rank_layers[static_cast<size_t>(r - 1)];
      dcp_forward(layer, b, comm, dcp_config(r), args, x[0], x[1], x[2], cache, o_r);
    }
    if (o.device == Device::cuda) synchronize_cuda();
    dcp_rank_seconds[static_cast<size_t>(r)] +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  });
}

}  // namespace pagedattn::cli
