// Bindings: decode context parallelism (pagedattn/dcp.h, pagedattn/dcp_nccl.h). The Python
// functions of python/pagedattn/_dcp.py add the defaults, the documentation and the allocation of
// outputs, then call the underscored functions here.
//
// DcpCommunicator is subclassable from Python (a nanobind trampoline): the library calls a Python
// subclass's world_size / rank / device / all_gather with the GIL taken for the call. Every call
// that may block in a collective (dcp_combine, dcp_forward, a communicator's all_gather, NCCL's
// ncclCommInitRank) runs with the GIL released, so N ranks on N Python threads of one process
// (make_in_memory_dcp_group) do not deadlock.
//
// Library errors name C++ parameters where the Python one differs: a layer's dcp.world_size /
// dcp.rank / dcp.interleave are its dcp_world_size / dcp_rank / cp_kv_cache_interleave_size
// keywords (rethrow_with_dcp_keyword_names, used by bind_layer.cpp and bind_mla.cpp); the step
// functions' dcp -> config and global -> common.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <nanobind/trampoline.h>

#include <array>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "convert.h"
#include "pagedattn/dcp_nccl.h"

namespace pagedattn::python {

using namespace nb::literals;

namespace {

// ---- error names --------------------------------------------------------------------------------

struct Rename {
  const char* from;  // the library's argument name
  const char* to;    // the Python one
  bool in_message;   // also replace `from` in the message text
};

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) {
    s.replace(at, from.size(), to);
  }
}

// Inside a catch of `e`: throws `e` with the Python names, or rethrows it unchanged.
[[noreturn]] void rethrow_renamed(const Error& e, std::span<const Rename> renames) {
  std::string message = e.what();
  std::string argument = e.argument();
  bool changed = false, argument_renamed = false;
  for (const Rename& r : renames) {
    if (!argument_renamed && argument == r.from) {
      argument = r.to;
      changed = argument_renamed = true;
    }
    if (r.in_message && message.find(r.from) != std::string::npos) {
      replace_all(message, r.from, r.to);
      changed = true;
    }
  }
  if (changed) throw Error(argument, message);
  throw;
}

// The step functions: their DcpConfig is the Python `config`, the global step `common`.
constexpr Rename kStepRenames[] = {
    {"dcp.world_size", "config.world_size", true},
    {"dcp.rank", "config.rank", true},
    {"dcp.interleave", "config.interleave", true},
    {"dcp", "config", false},
    {"global.causal", "common", false},
    {"global", "common", false},
};

template <typename F>
auto with_step_names(F&& f) {
  try {
    return f();
  } catch (const Error& e) {
    rethrow_renamed(e, kStepRenames);
  }
}

// ---- arguments ----------------------------------------------------------------------------------

// A standard or an MLA layer (pagedattn.Attention / pagedattn.MLAAttention).
struct LayerArg {
  Attention* standard = nullptr;
  MLAAttention* mla = nullptr;
  const DcpConfig& dcp() const { return standard != nullptr ? standard->params().dcp : mla->params().dcp; }
};

LayerArg layer_arg(nb::handle layer) {
  LayerArg out;
  if (nb::isinstance<Attention>(layer)) {
    out.standard = nb::cast<Attention*>(layer);
  } else if (nb::isinstance<MLAAttention>(layer)) {
    out.mla = nb::cast<MLAAttention*>(layer);
  } else {
    throw Error("layer", detail::concat("layer is a ", python_type_name(layer),
                                        ": expected a pagedattn.Attention or pagedattn.MLAAttention"));
  }
  return out;
}

DcpCommunicator& comm_arg(nb::handle comm) {
  DcpCommunicator* c = nullptr;
  PAGEDATTN_CHECK(nb::isinstance<DcpCommunicator>(comm) && nb::try_cast(comm, c) && c != nullptr, "comm", "comm is a ",
                  python_type_name(comm),
                  ": expected a pagedattn.DcpCommunicator (make_in_memory_dcp_group, NcclDcpCommunicator, "
                  "TorchDcpCommunicator or a subclass)");
  return *c;
}

// The global step: the host arrays of a CommonAttentionMetadata (query_start_loc, seq_lens,
// block_table of virtual blocks, causal); its slot mapping and overrides are not read.
CommonAttentionMetadataArgs global_args(const PyCommonAttentionMetadata& common) {
  const CommonAttentionMetadata& c = common.host().common;
  CommonAttentionMetadataArgs a;
  const auto n = static_cast<int64_t>(c.num_reqs);
  for (int64_t i = 0; i <= n; ++i) {
    a.query_start_loc.push_back(c.query_start_loc_cpu.data_as<const int32_t>()[i * c.query_start_loc_cpu.stride(0)]);
  }
  for (int64_t i = 0; i < n; ++i) {
    a.seq_lens.push_back(c.seq_lens_cpu.data_as<const int32_t>()[i * c.seq_lens_cpu.stride(0)]);
  }
  const TensorView& table = c.block_table_tensor;
  const int64_t cols = table.ndim() == 2 ? table.size(1) : 0;
  a.max_num_blocks_per_req = static_cast<int>(cols);
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      a.block_table.push_back(table.data_as<const int32_t>()[i * table.stride(0) + j * table.stride(1)]);
    }
  }
  a.causal = c.causal;
  return a;
}

// ---- the communicator ---------------------------------------------------------------------------

// A DcpCommunicator implemented in Python. Every call takes the GIL (the library calls it from
// code that released it); all_gather hands the subclass NumPy arrays / torch tensors viewing the
// library's send and recv buffers.
class PyDcpCommunicator : public DcpCommunicator {
 public:
  NB_TRAMPOLINE(DcpCommunicator);

  int world_size() const override { return int_method("world_size"); }
  int rank() const override { return int_method("rank"); }
  Device device() const override {
    nb::gil_scoped_acquire gil;
    nb::detail::ticket ticket(nb_trampoline, "device", nb::detail::str_hash("device"), false);
    if (ticket.key.is_valid()) return device_arg(nb_trampoline.base().attr(ticket.key)(), "device");
    return DcpCommunicator::device();
  }
  void all_gather(const TensorView& send, const TensorView& recv) override {
    nb::gil_scoped_acquire gil;
    nb::object s = export_view(send, nb::handle()), r = export_view(recv, nb::handle());
    nb::detail::ticket ticket(nb_trampoline, "all_gather", nb::detail::str_hash("all_gather"), true);
    nb_trampoline.base().attr(ticket.key)(s, r);
  }
  void abort() override {
    nb::gil_scoped_acquire gil;
    nb::detail::ticket ticket(nb_trampoline, "abort", nb::detail::str_hash("abort"), false);
    if (ticket.key.is_valid()) nb_trampoline.base().attr(ticket.key)();
  }

 private:
  // A pure method returning an int (Error naming "comm" when the override returns something else).
  int int_method(const char* name) const {
    nb::gil_scoped_acquire gil;
    nb::detail::ticket ticket(nb_trampoline, name, nb::detail::str_hash(name), true);
    nb::object result = nb_trampoline.base().attr(ticket.key)();
    int value = 0;
    PAGEDATTN_CHECK(nb::try_cast(result, value), "comm", "DcpCommunicator.", name, "() returned ",
                    nb::cast<std::string>(nb::repr(result)), ": expected an int");
    return value;
  }
};

#if PAGEDATTN_HAS_NCCL
// pagedattn.NcclDcpCommunicator: the library's NCCL communicator (owned), as its own Python type.
class NcclDcpCommunicator final : public DcpCommunicator {
 public:
  explicit NcclDcpCommunicator(std::unique_ptr<DcpCommunicator> inner) : inner_(std::move(inner)) {}
  int world_size() const override { return inner_->world_size(); }
  int rank() const override { return inner_->rank(); }
  Device device() const override { return inner_->device(); }
  void all_gather(const TensorView& send, const TensorView& recv) override { inner_->all_gather(send, recv); }
  void abort() override { inner_->abort(); }

 private:
  std::unique_ptr<DcpCommunicator> inner_;
};

NcclUniqueId unique_id_arg(const nb::bytes& id) {
  NcclUniqueId out;
  PAGEDATTN_CHECK(id.size() == out.bytes.size(), "unique_id", "unique_id has ", id.size(),
                  " bytes: expected the ", out.bytes.size(), " of nccl_unique_id()");
  std::memcpy(out.bytes.data(), id.c_str(), out.bytes.size());
  return out;
}
#endif

// A DcpConfig from the layout functions' Python arguments (vLLM's names), checked.
DcpConfig layout_config(int dcp_size, int dcp_rank, int interleave) {
  PAGEDATTN_CHECK(dcp_size >= 1, "dcp_size", "dcp_size = ", dcp_size, " must be >= 1");
  PAGEDATTN_CHECK(dcp_rank >= 0 && dcp_rank < dcp_size, "dcp_rank", "dcp_rank = ", dcp_rank,
                  " must be in [0, dcp_size = ", dcp_size, ")");
  PAGEDATTN_CHECK(interleave >= 1, "cp_kv_cache_interleave_size", "cp_kv_cache_interleave_size = ", interleave,
                  " must be >= 1");
  return DcpConfig{dcp_size, dcp_rank, interleave};
}

// A NumPy copy of a plan's host array.
template <typename T>
nb::object numpy_copy(const std::vector<T>& values) {
  return numpy_from_vector(std::vector<T>(values), {values.size()});
}

}  // namespace

void rethrow_with_dcp_keyword_names(const Error& e) {
  static constexpr Rename kLayerRenames[] = {
      {"dcp.world_size", "dcp_world_size", true},
      {"dcp.rank", "dcp_rank", true},
      {"dcp.interleave", "cp_kv_cache_interleave_size", true},
  };
  rethrow_renamed(e, kLayerRenames);
}

void bind_dcp(nb::module_& m) {

  nb::class_<DcpConfig>(m, "DcpConfig",
                        "A decode-context-parallel group as one rank sees it (vLLM's dcp_world_size, "
                        "dcp_rank and cp_kv_cache_interleave_size): global token t lives on rank "
                        "(t // interleave) % world_size.")
      .def(
          "__init__",
          [](DcpConfig* self, int world_size, int rank, int interleave) {
            new (self) DcpConfig{world_size, rank, interleave};
          },
          "world_size"_a = 1, "rank"_a = 0, "interleave"_a = 1)
      .def_rw("world_size", &DcpConfig::world_size, "Ranks N of the group (>= 1).")
      .def_rw("rank", &DcpConfig::rank, "This rank, in [0, world_size).")
      .def_rw("interleave", &DcpConfig::interleave,
              "Tokens I a rank holds in a row (vLLM's cp_kv_cache_interleave_size; divides the block "
              "size).")
      .def("validate", &DcpConfig::validate, "block_size"_a,
           "Raises pagedattn.Error naming dcp.world_size, dcp.rank or dcp.interleave when the group is "
           "not valid for caches of block_size tokens per block.")
      .def("__eq__", [](const DcpConfig& a, const DcpConfig& b) { return a == b; })
      .def("__eq__", [](const DcpConfig&, nb::handle) { return false; })
      .def("__hash__", [](const DcpConfig& c) {
        return std::hash<int64_t>()((int64_t{c.world_size} << 40) ^ (int64_t{c.rank} << 20) ^ c.interleave);
      })
      .def("__repr__", [](const DcpConfig& c) {
        return detail::concat("DcpConfig(world_size=", c.world_size, ", rank=", c.rank, ", interleave=", c.interleave,
                              ")");
      });

  // ---- layout ---------------------------------------------------------------------------------
  m.def(
      "dcp_owner",
      [](int64_t token, int dcp_size, int cp_kv_cache_interleave_size) {
        PAGEDATTN_CHECK(token >= 0, "token", "token = ", token, " must be >= 0");
        return dcp_owner(token, layout_config(dcp_size, 0, cp_kv_cache_interleave_size));
      },
      "token"_a, "dcp_size"_a, "cp_kv_cache_interleave_size"_a = 1,
      "The DCP rank holding global token `token`: (token // cp_kv_cache_interleave_size) % dcp_size.");
  m.def(
      "dcp_local_position",
      [](int64_t token, int dcp_size, int cp_kv_cache_interleave_size) {
        PAGEDATTN_CHECK(token >= 0, "token", "token = ", token, " must be >= 0");
        return dcp_local_position(token, layout_config(dcp_size, 0, cp_kv_cache_interleave_size));
      },
      "token"_a, "dcp_size"_a, "cp_kv_cache_interleave_size"_a = 1,
      "Position of global token `token` in its owner's local sequence: (token // (I * dcp_size)) * I "
      "+ token % I with I = cp_kv_cache_interleave_size.");
  m.def(
      "_get_dcp_local_seq_lens",
      [](const std::vector<int32_t>& seq_lens, int dcp_size, int dcp_rank, int interleave) {
        for (size_t i = 0; i < seq_lens.size(); ++i) {
          PAGEDATTN_CHECK(seq_lens[i] >= 0, "seq_lens", "seq_lens[", i, "] = ", seq_lens[i], " must be >= 0");
        }
        std::vector<int32_t> lens = get_dcp_local_seq_lens(seq_lens, layout_config(dcp_size, dcp_rank, interleave));
        const size_t n = lens.size();
        return numpy_from_vector(std::move(lens), {n});
      },
      "seq_lens"_a, "dcp_size"_a, "dcp_rank"_a, "cp_kv_cache_interleave_size"_a);

  // ---- communicators --------------------------------------------------------------------------
  nb::class_<DcpCommunicator, PyDcpCommunicator>(
      m, "DcpCommunicator",
      "The communication of a DCP group (one rank's side). Subclass it in Python to bring your own "
      "transport: implement world_size(), rank(), all_gather(send, recv) and, for CUDA tensors, "
      "device() -> \"cuda\". all_gather must copy every rank's `send` (the same shape and dtype on "
      "every rank) into recv[r] (recv has shape (world_size, *send.shape)), in rank order; every rank "
      "calls it, in the same order. send / recv are NumPy arrays (host) or torch tensors (CUDA) "
      "viewing the library's buffers, valid only during the call (bfloat16 / float8 buffers come as "
      "unsigned integers of the same width). The library calls these methods from threads that do not "
      "hold the GIL; they take it for the call.")
      .def(nb::init<>())
      .def("world_size", &DcpCommunicator::world_size, "Ranks in the group.")
      .def("rank", &DcpCommunicator::rank, "This rank, in [0, world_size()).")
      .def(
          "device", [](const DcpCommunicator& c) { return std::string(device_name(c.device())); },
          "Where the communicator's tensors live: \"cpu\" (default) or \"cuda\".")
      .def(
          "all_gather",
          [](DcpCommunicator& c, nb::handle send, nb::handle recv) {
            TensorArgs args;
            TensorView s = args.get(send, "send");
            TensorView r = args.get(recv, "recv", true);
            nb::gil_scoped_release release;
            c.all_gather(s, r);
          },
          "send"_a, "recv"_a,
          "Gathers every rank's `send` into `recv` (world_size, *send.shape), in rank order (blocks "
          "until every rank has called it; the GIL is released meanwhile).")
      .def(
          "abort",
          [](DcpCommunicator& c) {
            nb::gil_scoped_release release;
            c.abort();
          },
          "A rank failed: wake every rank blocked in (or later entering) a collective of the group with "
          "an Error naming comm instead of waiting for ever (in-memory group: its barrier; NCCL: "
          "ncclCommAbort of a communicator it made). run_dcp_ranks(..., group=) calls it. A Python "
          "subclass may override it (default: nothing).")
      .def("__repr__", [](const DcpCommunicator& c) {
        return detail::concat("<pagedattn.DcpCommunicator rank ", c.rank(), " of ", c.world_size(), " on ",
                              device_name(c.device()), ">");
      });

  m.def(
      "make_in_memory_dcp_group",
      [](int world_size) {
        PAGEDATTN_CHECK(world_size >= 1, "world_size", "world_size = ", world_size, " must be >= 1");
        nb::list out;
        for (std::unique_ptr<DcpCommunicator>& c : make_in_memory_dcp_group(world_size)) {
          out.append(nb::cast(std::move(c)));
        }
        return out;
      },
      "world_size"_a,
      "The communicators of an in-memory DCP group of world_size ranks (one list entry per rank): "
      "host tensors, the ranks being threads of this process (pagedattn.run_dcp_ranks). Their "
      "all_gather blocks until every rank has called it.");
  m.def("built_with_nccl", &built_with_nccl,
        "True when this build has the NCCL DCP communicator (NcclDcpCommunicator, nccl_unique_id, "
        "wrap_nccl_dcp_communicator, nccl_version).");
  m.def("current_cuda_device", &current_cuda_device,
        "The calling thread's current CUDA device (0 without CUDA). New CUDA layers, builders and caches "
        "live there.");
  m.def("set_current_cuda_device", &set_current_cuda_device, "index"_a,
        "Makes CUDA device `index` current for the calling thread (cudaSetDevice): a DCP rank's thread "
        "calls it (or torch.cuda.set_device) before creating its communicator, layers and caches.");

#if PAGEDATTN_HAS_NCCL
  m.def(
      "nccl_unique_id", []() {
        const NcclUniqueId id = nccl_unique_id();
        return nb::bytes(id.bytes.data(), id.bytes.size());
      },
      "A new ncclUniqueId (128 bytes): made by one rank, handed to the others (a pipe, a file, a "
      "store) before each creates its NcclDcpCommunicator.");
  m.def("nccl_version", &nccl_version, "The version of the NCCL library loaded at run time (\"2.28.9\").");
  nb::class_<NcclDcpCommunicator, DcpCommunicator>(
      m, "NcclDcpCommunicator",
      "A DCP group over NCCL, for CUDA tensors (one GPU per rank): all_gather is one ncclAllGather "
      "on pagedattn's current CUDA stream.")
      .def(
          "__init__",
          [](NcclDcpCommunicator* self, const nb::bytes& unique_id, int world_size, int rank) {
            const NcclUniqueId id = unique_id_arg(unique_id);
            std::unique_ptr<DcpCommunicator> comm;
            {
              nb::gil_scoped_release release;  // blocks until every rank has joined
              comm = make_nccl_dcp_communicator(id, world_size, rank);
            }
            new (self) NcclDcpCommunicator(std::move(comm));
          },
          "unique_id"_a, "world_size"_a, "rank"_a,
          "Joins the NCCL group of `unique_id` (nccl_unique_id() of one rank) as `rank` of "
          "`world_size` (ncclCommInitRank on the calling thread's current CUDA device; blocks until "
          "every rank has joined). The communicator owns its ncclComm_t.");
  m.def(
      "wrap_nccl_dcp_communicator",
      [](uintptr_t nccl_comm) {
        return std::make_unique<NcclDcpCommunicator>(wrap_nccl_dcp_communicator(reinterpret_cast<void*>(nccl_comm)));
      },
      "nccl_comm"_a,
      "An NcclDcpCommunicator over an existing ncclComm_t given as an integer address (e.g. the one "
      "an engine's process group holds). Not owned: keep the communicator it comes from alive. Its "
      "device is the calling thread's current CUDA device.");
#endif

  // ---- the step -------------------------------------------------------------------------------
  nb::class_<DcpPlan>(
      m, "DcpPlan",
      "One rank's share of one step of one layer (dcp_plan): the local step, the builder's plan of it "
      "and every buffer the step fills. dcp_attend / dcp_combine with a plan issue only kernels and "
      "the collective. The builder's next build() invalidates it.")
      .def_ro("config", &DcpPlan::config, "The group (DcpConfig).")
      .def_ro("identity", &DcpPlan::identity,
              "True when the local rows are the global rows in order (the layer reads the inputs in place).")
      .def_ro("num_tokens", &DcpPlan::num_tokens, "Rows T of the global step.")
      .def_prop_ro("num_local_rows", &DcpPlan::num_local_rows, "Rows this rank attends.")
      .def_ro("num_heads", &DcpPlan::num_heads)
      .def_ro("head_size_v", &DcpPlan::head_size_v)
      .def_prop_ro("dtype", [](const DcpPlan& p) { return std::string(framework_dtype_name(p.dtype)); })
      .def_prop_ro("device", [](const DcpPlan& p) { return std::string(device_name(p.device)); })
      .def_prop_ro(
          "rows", [](const DcpPlan& p) { return numpy_copy(p.step.rows); },
          "Local row i is global row rows[i] (NumPy int32 copy).")
      .def_prop_ro(
          "query_start_loc", [](const DcpPlan& p) { return numpy_copy(p.step.args.query_start_loc); },
          "The local step's query_start_loc (NumPy int32 copy).")
      .def_prop_ro(
          "seq_lens", [](const DcpPlan& p) { return numpy_copy(p.step.args.seq_lens); },
          "The local step's seq_lens: the keys of each local request on this rank (NumPy int32 copy).")
      .def_prop_ro(
          "slot_mapping", [](const DcpPlan& p) { return numpy_copy(p.step.args.slot_mapping); },
          "The local step's cache slots (-1 for tokens held elsewhere; NumPy int64 copy).")
      .def("__repr__", [](const DcpPlan& p) {
        return detail::concat("<pagedattn.DcpPlan rank ", p.config.rank, " of ", p.config.world_size, ": ",
                              p.num_local_rows(), " of ", p.num_tokens, " rows", p.identity ? " (identity)" : "", ">");
      });

  m.def(
      "_dcp_plan",
      [](nb::handle layer, nb::handle builder, std::optional<DcpConfig> config,
         const PyCommonAttentionMetadata& common) {
        const LayerArg l = layer_arg(layer);
        AttentionMetadataBuilder& b = builder_arg(builder);
        const DcpConfig c = config.value_or(l.dcp());
        CommonAttentionMetadataArgs global = global_args(common);
        nb::gil_scoped_release release;
        return with_step_names([&] {
          return l.standard != nullptr ? dcp_plan(*l.standard, b, c, global) : dcp_plan(*l.mla, b, c, global);
        });
      },
      "layer"_a, "builder"_a, "config"_a.none(), "common"_a, nb::keep_alive<0, 2>());

  m.def(
      "_dcp_attend",
      [](nb::handle layer, DcpPlan& plan, nb::handle in0, nb::handle in1, nb::handle in2, nb::handle kv_cache) {
        const LayerArg l = layer_arg(layer);
        const char* names[3] = {"query", "key", "value"};
        if (l.mla != nullptr) names[0] = "q", names[1] = "kv_c_normed", names[2] = "k_pe";
        TensorArgs args;
        TensorView a = args.get(in0, names[0]), b = args.get(in1, names[1]), c = args.get(in2, names[2]);
        TensorView cache = args.get(kv_cache, "kv_cache", true);
        nb::gil_scoped_release release;
        with_step_names([&] {
          if (l.standard != nullptr) {
            dcp_attend(*l.standard, plan, a, b, c, cache);
          } else {
            dcp_attend(*l.mla, plan, a, b, c, cache);
          }
        });
      },
      "layer"_a, "plan"_a, "in0"_a, "in1"_a, "in2"_a, "kv_cache"_a);

  m.def(
      "_dcp_combine",
      [](DcpPlan& plan, nb::handle comm, nb::handle out, nb::handle lse) {
        DcpCommunicator& c = comm_arg(comm);
        TensorArgs args;
        TensorView o = args.get(out, "out", true);
        TensorView l = args.get(lse, "lse", true, true);
        nb::gil_scoped_release release;
        with_step_names([&] { dcp_combine(plan, c, o, l); });
      },
      "plan"_a, "comm"_a, "out"_a, "lse"_a.none());

  m.def(
      "_dcp_forward",
      [](nb::handle layer, nb::handle builder, nb::handle comm, std::optional<DcpConfig> config,
         const PyCommonAttentionMetadata& common, nb::handle in0, nb::handle in1, nb::handle in2, nb::handle kv_cache,
         nb::handle out, nb::handle lse) {
        const LayerArg l = layer_arg(layer);
        AttentionMetadataBuilder& b = builder_arg(builder);
        DcpCommunicator& c = comm_arg(comm);
        const DcpConfig cfg = config.value_or(l.dcp());
        const char* names[3] = {"query", "key", "value"};
        if (l.mla != nullptr) names[0] = "q", names[1] = "kv_c_normed", names[2] = "k_pe";
        TensorArgs args;
        TensorView x = args.get(in0, names[0]), y = args.get(in1, names[1]), z = args.get(in2, names[2]);
        TensorView cache = args.get(kv_cache, "kv_cache", true);
        TensorView o = args.get(out, "out", true);
        TensorView ls = args.get(lse, "lse", true, true);
        CommonAttentionMetadataArgs global = global_args(common);
        nb::gil_scoped_release release;
        with_step_names([&] {
          if (l.standard != nullptr) {
            dcp_forward(*l.standard, b, c, cfg, global, x, y, z, cache, o, ls);
          } else {
            dcp_forward(*l.mla, b, c, cfg, global, x, y, z, cache, o, ls);
          }
        });
      },
      "layer"_a, "builder"_a, "comm"_a, "config"_a.none(), "common"_a, "in0"_a, "in1"_a, "in2"_a, "kv_cache"_a,
      "out"_a, "lse"_a.none());
}

}  // namespace pagedattn::python
