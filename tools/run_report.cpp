// The report of `pagedattn run`: the final table (stdout) and the --json document.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>

#include "cli_common.h"
#include "pagedattn/kv_cache.h"
#include "simulation.h"

namespace pagedattn::cli {

namespace {

std::string mib(int64_t bytes) { return format_sig(static_cast<double>(bytes) / (1 << 20), 3) + " MiB"; }

}  // namespace

void print_run_report(const RunReport& r, std::ostream& os) {
  const RunOptions& o = r.options;
  os << "pagedattn run: " << o.preset << ", " << r.preset_summary << "\n";
  os << "  config: " << r.preset_source << "\n";
  os << "  device " << device_name(o.device);
  if (o.device == Device::cpu) os << " (" << r.threads << " threads)";
  os << ", dtype " << dtype_name(o.dtype) << ", kv cache " << o.kv_cache_dtype << ", block size "
     << o.block_size << ", " << format_count(r.num_blocks) << " blocks (" << mib(r.kv_cache_bytes)
     << " of KV cache)\n";
  if (o.dcp_world_size > 1) {
    os << "  decode context parallelism: " << o.dcp_world_size
       << (o.device == Device::cuda ? " ranks (one GPU and thread each, NCCL)" : " ranks (threads, in-memory group)")
       << ", interleave " << o.dcp_interleave << ": " << mib(r.kv_cache_bytes_per_rank) << " of KV cache per rank (1/"
       << o.dcp_world_size << " of " << mib(r.kv_cache_bytes) << "), virtual blocks of "
       << o.block_size * o.dcp_world_size << " tokens\n";
    if (!r.dcp_rank_forward_seconds.empty()) {
      os << "  attention time per rank (its own forward, synchronized):";
      for (size_t k = 0; k < r.dcp_rank_forward_seconds.size(); ++k) {
        os << (k ? ", " : " ") << "rank " << k << " " << format_sig(r.dcp_rank_forward_seconds[k] * 1e3, 3) << " ms";
      }
      os << "\n";
    }
  }
  os << "  workload: " << r.num_requests << " requests, prompt " << o.workload.prompt_len.describe();
  if (o.workload.system_prompt_len > 0) os << " + shared system prompt " << o.workload.system_prompt_len;
  os << ", output " << o.workload.output_len.describe() << ", "
     << (o.workload.arrival_rate > 0 ? "arrival rate " + format_sig(o.workload.arrival_rate) + " req/step"
                                     : std::string("all at once"))
     << ", seed " << o.workload.seed << "\n";
  os << "  scheduler: " << o.max_num_batched_tokens << " tokens/step, " << o.max_num_seqs
     << " seqs max, chunked prefill " << (o.chunked_prefill ? "on" : "off") << "\n\n";

  TextTable groups({"KV-cache group", "backend", "spec", "layers"});
  for (size_t g = 0; g < r.groups.size(); ++g) {
    const GroupReport& gr = r.groups[g];
    groups.add_row({std::to_string(g), gr.backend,
                    gr.spec + (gr.local_virtual_batches ? " (virtual batches)" : ""),
                    std::to_string(gr.num_layers)});
  }
  groups.print(os);
  os << "\n";

  const SchedulerStats& s = r.stats;
  const double attn = r.attention_seconds();
  const double fwd = r.forward_seconds;
  const double bandwidth = fwd > 0 ? r.kv_bytes / fwd : 0;
  const double flops = fwd > 0 ? r.flops / fwd : 0;
  TextTable t({"metric", "value", "of machine peak"});
  t.add_row({"steps", format_count(s.steps), ""});
  t.add_row({"requests finished",
             std::to_string(s.finished_requests) + " / " + std::to_string(r.num_requests) +
                 (r.completed ? "" : " (stopped by --max-steps)"),
             ""});
  t.add_row({"preemptions", format_count(s.preemptions) + " (" + format_count(s.discarded_tokens) +
                                " tokens recomputed)", ""});
  if (o.workload.system_prompt_len > 0) {
    t.add_row({"prefix-shared tokens", format_count(s.prefix_hit_tokens), ""});
  }
  if (o.num_speculative_tokens > 0) {
    const double per_decode = s.spec_decodes > 0 ? double(s.spec_decodes + s.accepted_tokens) / double(s.spec_decodes) : 0;
    t.add_row({"speculative decoding",
               std::to_string(o.num_speculative_tokens) + " drafts per decode, acceptance " +
                   format_sig(o.spec_acceptance_rate) + ": " + format_count(s.draft_tokens) + " drafts, " +
                   format_count(s.accepted_tokens) + " accepted",
               ""});
    t.add_row({"accepted tokens per step",
               (s.steps > 0 ? format_sig(double(s.accepted_tokens) / double(s.steps)) : std::string("n/a")) +
                   " (tokens per drafted decode " + format_sig(per_decode) + ")",
               ""});
  }
  t.add_row({"cascade plans", format_count(r.cascade_plans) + " of " + format_count(r.plans) + " plans", ""});
  t.add_row({"prefill tokens", format_count(s.prefill_tokens), ""});
  t.add_row({"decode tokens", format_count(s.decode_tokens), ""});
  t.add_row({"attention time", format_seconds(attn) + " (plan " + format_seconds(r.plan_seconds) +
                                   ", forward " + format_seconds(fwd) + ")", ""});
  t.add_row({"tokens/s", attn > 0 ? format_count(static_cast<int64_t>(s.scheduled_tokens / attn)) : "n/a", ""});
  std::string bw_peak = "n/a", fl_peak = "n/a";
  if (r.peaks) {
    bw_peak = format_percent(bandwidth / r.peaks->bandwidth) + " of " + format_bandwidth(r.peaks->bandwidth) +
              " (" + r.peaks->bandwidth_source + ")";
    fl_peak = format_percent(flops / r.peaks->flops) + " of " + format_flops(r.peaks->flops) + " (" +
              r.peaks->flops_source + ")";
  } else if (!r.peaks_unavailable.empty()) {
    bw_peak = fl_peak = "n/a: " + r.peaks_unavailable;
  }
  t.add_row({"KV bandwidth", format_bandwidth(bandwidth), bw_peak});
  t.add_row({"compute", format_flops(flops), fl_peak});
  t.add_row({"blocks free at end", format_count(r.free_blocks_at_end) + " / " + format_count(r.num_blocks), ""});
  t.print(os);

  if (r.check_enabled) {
    os << "\ncheck: " << r.checked_steps << " of " << s.steps << " steps re-run on REFERENCE (every "
       << o.check_interval << (o.check_interval == 1 ? "" : "th") << " step), max ||out - ref|| / ||ref|| per layer, tolerance "
       << format_sig(r.layers.empty() ? 0 : r.layers.front().tolerance, 2) << "\n";
    // The checked steps' forward times, the layer's backend beside REFERENCE on the same inputs.
    TextTable c({"layer", "kind", "backend", "steps", "max rel error", "result", "forward", "REFERENCE", "speedup"});
    double checked = 0, reference = 0;
    for (const LayerReport& l : r.layers) {
      const bool ran = l.checked_steps > 0;
      c.add_row({l.name, l.kind, l.backend, std::to_string(l.checked_steps), format_sig(l.max_rel_error, 3),
                 !ran ? "not run" : (l.passed() ? "pass" : "FAIL"), ran ? format_seconds(l.checked_seconds) : "",
                 ran ? format_seconds(l.reference_seconds) : "",
                 ran && l.checked_seconds > 0 ? format_sig(l.reference_seconds / l.checked_seconds, 3) + "x" : ""});
      checked += l.checked_seconds;
      reference += l.reference_seconds;
    }
    c.print(os);
    if (checked > 0) {
      os << "checked steps: forward " << format_seconds(checked) << ", REFERENCE " << format_seconds(reference)
         << " on the same inputs (" << format_sig(reference / checked, 3) << "x)\n";
    }
    const bool reference_passed = std::all_of(r.layers.begin(), r.layers.end(), [](const LayerReport& l) {
      return l.checked_steps == 0 || l.passed();
    });
    os << (reference_passed ? "check passed\n" : "check FAILED: a layer differs from REFERENCE beyond the tolerance\n");
  } else {
    os << "\nlayers: ";
    std::vector<std::string> parts;
    for (const LayerReport& l : r.layers) parts.push_back(l.backend);
    // Compact: "REFERENCE x4" when every layer runs on one backend.
    bool same = std::all_of(parts.begin(), parts.end(), [&](const std::string& p) { return p == parts.front(); });
    os << (same && !parts.empty() ? parts.front() + " x" + std::to_string(parts.size()) : join(parts, ", "))
       << " (check off; --check re-runs sampled steps on REFERENCE)\n";
  }
  os << "batch-invariant plans: " << (r.batch_invariant_plans ? "yes" : "no")
     << (r.batch_invariant_plans ? "" : " (--batch-invariant or PAGEDATTN_BATCH_INVARIANT=1)") << "\n";
  if (r.invariance_enabled) {
    const InvarianceStats& v = r.invariance;
    os << "check-invariance: " << v.checked_steps << " steps, " << v.comparisons
       << " (request, sub-batch) pairs re-run alone or in shuffled sub-batches, " << v.differences
       << " differ in some bit\n";
    if (v.differences > 0) os << "check-invariance FAILED: " << v.first_difference << "\n";
  }
}

std::string run_report_json(const RunReport& r) {
  using nlohmann::json;
  const RunOptions& o = r.options;
  json j;
  j["command"] = "run";
  j["preset"] = {{"name", o.preset}, {"summary", r.preset_summary}, {"source", r.preset_source}};
  j["options"] = {{"device", device_name(o.device)},
                  {"backend", o.backend.empty() ? "auto" : o.backend},
                  {"dtype", dtype_name(o.dtype)},
                  {"kv_cache_dtype", o.kv_cache_dtype},
                  {"block_size", o.block_size},
                  {"threads", r.threads},
                  {"seed", o.seed},
                  {"num_layers", r.layers.size()},
                  {"tensor_parallel_size", o.tensor_parallel_size},
                  {"num_blocks", r.num_blocks},
                  {"kv_cache_bytes", r.kv_cache_bytes},
                  {"dcp_world_size", o.dcp_world_size},
                  {"dcp_interleave", o.dcp_interleave},
                  {"kv_cache_bytes_per_rank", r.kv_cache_bytes_per_rank},
                  {"dcp_rank_forward_seconds", r.dcp_rank_forward_seconds},
                  {"max_num_batched_tokens", o.max_num_batched_tokens},
                  {"max_num_seqs", o.max_num_seqs},
                  {"chunked_prefill", o.chunked_prefill},
                  {"max_steps", o.max_steps},
                  {"num_speculative_tokens", o.num_speculative_tokens},
                  {"spec_acceptance_rate", o.spec_acceptance_rate}};
  j["workload"] = {{"num_requests", r.num_requests},
                   {"prompt_len", o.workload.prompt_len.describe()},
                   {"output_len", o.workload.output_len.describe()},
                   {"system_prompt_len", o.workload.system_prompt_len},
                   {"arrival_rate", o.workload.arrival_rate},
                   {"seed", o.workload.seed},
                   {"requested_tokens", r.requested_tokens}};
  const SchedulerStats& s = r.stats;
  j["scheduler"] = {{"steps", s.steps},
                    {"idle_steps", s.idle_steps},
                    {"scheduled_tokens", s.scheduled_tokens},
                    {"prefill_tokens", s.prefill_tokens},
                    {"decode_tokens", s.decode_tokens},
                    {"preemptions", s.preemptions},
                    {"recomputed_tokens", s.discarded_tokens},
                    {"prefix_shared_tokens", s.prefix_hit_tokens},
                    {"spec_decodes", s.spec_decodes},
                    {"draft_tokens", s.draft_tokens},
                    {"accepted_tokens", s.accepted_tokens},
                    {"rejected_tokens", s.rejected_tokens()},
                    {"finished_requests", s.finished_requests},
                    {"max_running", s.max_running},
                    {"completed", r.completed},
                    {"free_blocks_at_end", r.free_blocks_at_end}};
  const double fwd = r.forward_seconds, attn = r.attention_seconds();
  json perf = {{"plan_seconds", r.plan_seconds},
               {"forward_seconds", fwd},
               {"attention_seconds", attn},
               {"wall_seconds", r.wall_seconds},
               {"tokens_per_second", attn > 0 ? s.scheduled_tokens / attn : 0.0},
               {"kv_bytes", r.kv_bytes},
               {"flops", r.flops},
               {"bandwidth_bytes_per_second", fwd > 0 ? r.kv_bytes / fwd : 0.0},
               {"flop_per_second", fwd > 0 ? r.flops / fwd : 0.0}};
  if (r.peaks) {
    perf["peak_bandwidth_bytes_per_second"] = r.peaks->bandwidth;
    perf["peak_flop_per_second"] = r.peaks->flops;
    perf["peak_bandwidth_source"] = r.peaks->bandwidth_source;
    perf["peak_flops_source"] = r.peaks->flops_source;
    perf["bandwidth_fraction_of_peak"] = fwd > 0 ? r.kv_bytes / fwd / r.peaks->bandwidth : 0.0;
    perf["flops_fraction_of_peak"] = fwd > 0 ? r.flops / fwd / r.peaks->flops : 0.0;
  } else {
    perf["peaks_unavailable"] = r.peaks_unavailable;
  }
  perf["plans"] = r.plans;
  perf["cascade_plans"] = r.cascade_plans;
  j["performance"] = perf;
  json groups = json::array();
  for (const GroupReport& g : r.groups) {
    groups.push_back({{"backend", g.backend}, {"spec", g.spec}, {"layers", g.num_layers},
                      {"virtual_batches", g.local_virtual_batches}});
  }
  j["groups"] = groups;
  json layers = json::array();
  for (const LayerReport& l : r.layers) {
    json lj = {{"name", l.name}, {"kind", l.kind}, {"backend", l.backend}, {"group", l.group}};
    if (r.check_enabled) {
      lj["checked_steps"] = l.checked_steps;
      lj["max_rel_error"] = l.max_rel_error;
      lj["tolerance"] = l.tolerance;
      lj["passed"] = l.passed();
      lj["checked_seconds"] = l.checked_seconds;
      lj["reference_seconds"] = l.reference_seconds;
    }
    layers.push_back(lj);
  }
  j["layers"] = layers;
  j["check"] = {{"enabled", r.check_enabled}, {"interval", o.check_interval},
                {"checked_steps", r.checked_steps}, {"passed", r.check_passed}};
  j["batch_invariant_plans"] = r.batch_invariant_plans;
  if (r.invariance_enabled) {
    j["check_invariance"] = {{"steps", r.invariance.checked_steps}, {"reruns", r.invariance.reruns},
                             {"comparisons", r.invariance.comparisons},
                             {"differences", r.invariance.differences},
                             {"first_difference", r.invariance.first_difference}};
  }
  json steps = json::array();
  for (const StepRecord& st : r.steps) {
    steps.push_back({{"step", st.step}, {"reqs", st.num_reqs}, {"tokens", st.num_tokens},
                     {"decode_tokens", st.num_decode_tokens}, {"prefill_tokens", st.num_prefill_tokens},
                     {"draft_tokens", st.num_draft_tokens},
                     {"preempted", st.num_preempted}, {"plan_seconds", st.plan_seconds},
                     {"forward_seconds", st.forward_seconds}, {"cascade_plans", st.cascade_plans},
                     {"checked", st.checked}});
  }
  j["steps"] = steps;
  return j.dump(2);
}

}  // namespace pagedattn::cli
