// llama.cpp's CPU flash attention (ggml's ggml_flash_attn_ext) on the shapes of bench/cpu_bench.cpp
// and of `pagedattn bench --grid quick`: the llama.cpp peer of issue 22. Built and run by
// scripts/ggml-peer against ggml's source from PyPI (llama-cpp-python's sdist, in the ignored
// .peer-src/); it calls ggml's public C API only.
//
// What one row runs, as llama.cpp builds a layer's attention (llm_graph_context::build_attn_mha,
// llama_kv_cache::get_k/get_v, build_attn_inp_kq_mask) with flash attention on and its default
// non-unified KV cache (kv_unified = false: one stream per sequence):
//   * the cache of each stream is [n_kv cells][Hkv * D] (all KV heads of a token adjacent, the
//     NHD layout), K and V in F16 (llama.cpp's default cache type; --kv bf16 for BF16);
//     n_kv = the visible keys padded to 256 (llama_kv_cache::get_n_kv), the padding masked;
//   * Q is F32 [D, Hq, tokens] viewed per stream and permuted to [D, tokens/stream, Hq, streams],
//     K/V views permuted to [D, n_kv, Hkv, streams]; GQA by broadcast (Hq % Hkv == 0);
//   * the KQ mask is F16 [n_kv, tokens/stream, 1, streams]: 0 where a key is visible (causal:
//     key position <= the query's position), -inf elsewhere (the padding included);
//   * ggml_flash_attn_ext(q, k, v, mask, 1/sqrt(D), 0, 0) with F32 accumulation
//     (ggml_prec_set_acc), one graph per row, computed with ggml_graph_plan/ggml_graph_compute on
//     a ggml CPU threadpool of --threads threads.
// A batch of B independent decodes is one ubatch of B streams (llama.cpp's split of a batch over
// a non-unified cache): one flash-attention node whose dimension 3 is the sequence, each reading
// only its own sequence's cells, so the work equals cpu_bench's (every visible key once per
// (request, kv head)). The mixed rows are two ubatches in one graph (decodes; the prefill chunk),
// as llama.cpp splits a mixed batch over a non-unified cache into equal-length ubatches. A prefill
// runs as one ubatch of all its tokens (llama.cpp's n_ubatch >= the prompt; its default 512 would
// split a 2048-token prompt into four calls over a growing cache).
//
// Rows: the names of cpu_bench's rows without "CPU/" (bench grid) and Quick/... (the quick grid
// of `pagedattn bench`: decode contexts count the new token, as there). Counters follow
// cpu_bench: FLOPs = 4 * visible keys * D * Hq per query token; bytes = K/V once per
// (request, kv head) + Q + O at 2 bytes an element (ggml's Q and O are F32; counted as cpu_bench
// counts its bf16 Q and O, so GB/s compare directly).
// Checks: before timing, a self-test compares every output of small graphs that take each CPU
// flash-attention path (batched decode, single-sequence split-KV decode, the tiled prefill, a
// mixed graph) against an f64 reference on the same F16 data; and each row's first computed
// output is compared on a few (stream, token, head) rows against the f64 reference. A mismatch
// exits 1 before any time is reported.
// Usage: cpu_ggml_peer [--threads N] [--json FILE] [--grid bench|quick|all] [--rows A,B,...]
//                      [--filter REGEX] [--kv f16|bf16] [--reps N] [--min-seconds S]
//                      [--self-test-only]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ggml-cpu.h"
#include "ggml.h"

#ifndef PEER_LLAMA_CPP_PYTHON
#define PEER_LLAMA_CPP_PYTHON "unknown"
#endif
#ifndef PEER_LLAMA_CPP_COMMIT
#define PEER_LLAMA_CPP_COMMIT "unknown"
#endif

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPad = 256;

// One ubatch: `streams` sequences of `tokens` new tokens each over `context` cached tokens.
struct Ubatch {
  int streams = 1, tokens = 1, context = 0;
  int keys() const { return context + tokens; }
  int n_kv() const { return std::max(kPad, (keys() + kPad - 1) / kPad * kPad); }
};

struct Case {
  std::string name;
  std::vector<Ubatch> ubatches;
};

std::vector<Case> bench_cases() {
  std::vector<Case> cases = {{"Prefill/1x2048", {{1, 2048, 0}}}, {"Prefill/4x1024", {{4, 1024, 0}}}};
  for (int b : {1, 16, 64}) {
    for (int c : {1024, 4096, 16384}) {
      cases.push_back({"Decode/" + std::to_string(b) + "x" + std::to_string(c / 1024) + "k", {{b, 1, c}}});
    }
  }
  cases.push_back({"Mixed/512chunk+32x2k", {{32, 1, 2048}, {1, 512, 1536}}});
  cases.push_back({"Prefill/1x256", {{1, 256, 0}}});
  return cases;
}

std::vector<Case> quick_cases() {  // `pagedattn bench --grid quick` (tools/cmd_bench.cpp)
  std::vector<Case> cases;
  for (int b : {1, 8}) {
    for (int c : {512, 2048}) {
      cases.push_back({"Quick/Decode/" + std::to_string(b) + "x" + std::to_string(c), {{b, 1, c - 1}}});
    }
  }
  for (int len : {128, 512}) cases.push_back({"Quick/Prefill/1x" + std::to_string(len), {{1, len, 0}}});
  cases.push_back({"Quick/Mixed/8x1024+256chunk", {{8, 1, 1023}, {1, 256, 256}}});
  return cases;
}

double case_flops(const Case& c) {
  double flops = 0;
  for (const Ubatch& u : c.ubatches) {
    for (int i = 0; i < u.tokens; ++i) flops += 4.0 * (u.context + i + 1) * kD * kHq * u.streams;
  }
  return flops;
}

double case_bytes(const Case& c) {
  double bytes = 0;
  for (const Ubatch& u : c.ubatches) {
    bytes += 2.0 * u.streams * u.keys() * kHkv * kD * 2;    // K and V
    bytes += 2.0 * u.streams * u.tokens * kHq * kD * 2;     // Q and O
  }
  return bytes;
}

// The tensors of one ubatch inside a row's graph.
struct UbatchTensors {
  Ubatch shape;
  ggml_tensor* k_cache = nullptr;  // [Hkv * D, n_kv * streams]
  ggml_tensor* v_cache = nullptr;
  ggml_tensor* q = nullptr;        // [D, Hq, tokens * streams] F32
  ggml_tensor* mask = nullptr;     // [n_kv, tokens, 1, streams] F16
  ggml_tensor* out = nullptr;      // [D, Hq, tokens, streams] F32
};

struct Graph {
  ggml_context* ctx = nullptr;
  ggml_cgraph* graph = nullptr;
  std::vector<UbatchTensors> parts;
  ggml_type kv_type = GGML_TYPE_F16;
  ~Graph() {
    if (ctx) ggml_free(ctx);
  }
};

size_t graph_bytes(const std::vector<Ubatch>& ubatches, ggml_type kv_type) {
  size_t bytes = ggml_graph_overhead() + (1u << 20);
  for (const Ubatch& u : ubatches) {
    const size_t cells = static_cast<size_t>(u.n_kv()) * u.streams;
    const size_t rows = static_cast<size_t>(u.tokens) * u.streams;
    bytes += 2 * ggml_row_size(kv_type, static_cast<int64_t>(kHkv) * kD) * cells;
    bytes += 2 * rows * kHq * kD * sizeof(float);                       // q, out
    bytes += cells * u.tokens * sizeof(ggml_fp16_t);                    // mask
    bytes += 16 * (ggml_tensor_overhead() + 64);                        // tensors and views
  }
  return bytes;
}

// Fills a 16-bit K/V buffer with a repeated block of 2^19 random values in [-1, 1) (as cpu_bench).
void fill_kv(ggml_tensor* t, std::mt19937& rng) {
  const size_t pattern_elems = size_t{1} << 19;
  const size_t n = ggml_nelements(t);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> values(std::min(pattern_elems, n));
  for (float& v : values) v = dist(rng);
  char* data = static_cast<char*>(t->data);
  const size_t esize = ggml_type_size(t->type);
  if (t->type == GGML_TYPE_F16) {
    ggml_fp32_to_fp16_row(values.data(), reinterpret_cast<ggml_fp16_t*>(data), static_cast<int64_t>(values.size()));
  } else {
    ggml_fp32_to_bf16_row(values.data(), reinterpret_cast<ggml_bf16_t*>(data), static_cast<int64_t>(values.size()));
  }
  for (size_t done = values.size(); done < n; done += values.size()) {
    std::memcpy(data + done * esize, data, std::min(values.size(), n - done) * esize);
  }
}

std::unique_ptr<Graph> build_graph(const std::vector<Ubatch>& ubatches, ggml_type kv_type, uint32_t seed) {
  auto g = std::make_unique<Graph>();
  g->kv_type = kv_type;
  ggml_init_params params{graph_bytes(ubatches, kv_type), nullptr, false};
  g->ctx = ggml_init(params);
  if (!g->ctx) {
    std::fprintf(stderr, "cpu_ggml_peer: ggml_init of %zu bytes failed\n", params.mem_size);
    std::exit(1);
  }
  g->graph = ggml_new_graph(g->ctx);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (const Ubatch& u : ubatches) {
    UbatchTensors p;
    p.shape = u;
    const int64_t n_kv = u.n_kv(), ns = u.streams, tps = u.tokens, embd = int64_t{kHkv} * kD;
    // The caches: llama.cpp's per-layer K and V tensors [n_embd_k_gqa, kv_size * n_stream].
    p.k_cache = ggml_new_tensor_2d(g->ctx, kv_type, embd, n_kv * ns);
    p.v_cache = ggml_new_tensor_2d(g->ctx, kv_type, embd, n_kv * ns);
    fill_kv(p.k_cache, rng);
    fill_kv(p.v_cache, rng);
    p.q = ggml_new_tensor_3d(g->ctx, GGML_TYPE_F32, kD, kHq, tps * ns);
    float* qd = static_cast<float*>(p.q->data);
    for (int64_t i = 0; i < ggml_nelements(p.q); ++i) qd[i] = dist(rng);
    p.mask = ggml_new_tensor_4d(g->ctx, GGML_TYPE_F16, n_kv, tps, 1, ns);
    auto* md = static_cast<ggml_fp16_t*>(p.mask->data);
    const ggml_fp16_t zero = ggml_fp32_to_fp16(0.f), ninf = ggml_fp32_to_fp16(-INFINITY);
    for (int64_t s = 0; s < ns; ++s) {
      for (int64_t t = 0; t < tps; ++t) {
        const int64_t pos = u.context + t;  // the query's position; keys 0..pos are visible
        ggml_fp16_t* row = md + (s * tps + t) * n_kv;
        for (int64_t j = 0; j < n_kv; ++j) row[j] = j <= pos ? zero : ninf;
      }
    }
    // get_k / get_v: [D, Hkv, n_kv, ns] views of the caches, then build_attn_mha's permutes.
    const size_t row_d = ggml_row_size(kv_type, kD), row_embd = ggml_row_size(kv_type, embd);
    ggml_tensor* k = ggml_view_4d(g->ctx, p.k_cache, kD, kHkv, n_kv, ns, row_d, row_embd, row_embd * n_kv, 0);
    ggml_tensor* v = ggml_view_4d(g->ctx, p.v_cache, kD, kHkv, n_kv, ns, row_d, row_embd, row_embd * n_kv, 0);
    ggml_tensor* q = ggml_view_4d(g->ctx, p.q, kD, kHq, tps, ns, p.q->nb[1], p.q->nb[2], p.q->nb[2] * tps, 0);
    q = ggml_permute(g->ctx, q, 0, 2, 1, 3);
    k = ggml_permute(g->ctx, k, 0, 2, 1, 3);
    v = ggml_permute(g->ctx, v, 0, 2, 1, 3);
    p.out = ggml_flash_attn_ext(g->ctx, q, k, v, p.mask, 1.f / std::sqrt(static_cast<float>(kD)), 0.f, 0.f);
    ggml_prec_set_acc(p.out, GGML_PREC_F32);
    ggml_build_forward_expand(g->graph, p.out);
    g->parts.push_back(p);
  }
  return g;
}

struct Runner {
  int threads;
  ggml_threadpool* pool = nullptr;
  std::vector<uint8_t> work;
  explicit Runner(int n) : threads(n) {
    ggml_threadpool_params tp = ggml_threadpool_params_default(n);
    pool = ggml_threadpool_new(&tp);
  }
  ~Runner() { ggml_threadpool_free(pool); }
  void compute(Graph& g) {
    ggml_cplan plan = ggml_graph_plan(g.graph, threads, pool);
    if (work.size() < plan.work_size) work.resize(plan.work_size);
    plan.work_data = work.data();
    if (ggml_graph_compute(g.graph, &plan) != GGML_STATUS_SUCCESS) {
      std::fprintf(stderr, "cpu_ggml_peer: ggml_graph_compute failed\n");
      std::exit(1);
    }
  }
};

float kv_value(const ggml_tensor* t, int64_t cell_row, int64_t col) {
  const char* p = static_cast<const char*>(t->data) + cell_row * t->nb[1];
  if (t->type == GGML_TYPE_F16) return ggml_fp16_to_fp32(reinterpret_cast<const ggml_fp16_t*>(p)[col]);
  return ggml_bf16_to_fp32(reinterpret_cast<const ggml_bf16_t*>(p)[col]);
}

// f64 attention of one (stream, token, head) row from the same stored values; returns the max
// absolute difference to ggml's output and the row's max |reference|.
std::pair<double, double> check_row(const UbatchTensors& p, int s, int t, int h) {
  const Ubatch& u = p.shape;
  const int64_t n_kv = u.n_kv(), kvh = h / (kHq / kHkv);
  const float* q = static_cast<const float*>(p.q->data) + ((int64_t{s} * u.tokens + t) * kHq + h) * kD;
  const int visible = u.context + t + 1;
  std::vector<double> logits(visible);
  double mx = -INFINITY;
  for (int j = 0; j < visible; ++j) {
    double dot = 0;
    for (int d = 0; d < kD; ++d) dot += double{q[d]} * kv_value(p.k_cache, s * n_kv + j, kvh * kD + d);
    logits[j] = dot / std::sqrt(double{kD});
    mx = std::max(mx, logits[j]);
  }
  double sum = 0;
  for (double& l : logits) sum += (l = std::exp(l - mx));
  const float* out = static_cast<const float*>(p.out->data) + ((int64_t{s} * u.tokens + t) * kHq + h) * kD;
  double err = 0, mag = 0;
  for (int d = 0; d < kD; ++d) {
    double o = 0;
    for (int j = 0; j < visible; ++j) o += logits[j] * kv_value(p.v_cache, s * n_kv + j, kvh * kD + d);
    o /= sum;
    err = std::max(err, std::abs(o - out[d]));
    mag = std::max(mag, std::abs(o));
  }
  return {err, mag};
}

struct CheckResult {
  double err = 0, mag = 0;
};

// Max error over the given rows of every ubatch; exits when above tolerance.
CheckResult check_graph(const Graph& g, const std::string& what, bool all_rows) {
  double worst = 0, mag = 0;
  for (const UbatchTensors& p : g.parts) {
    const Ubatch& u = p.shape;
    std::vector<int> ss, ts, hs;
    if (all_rows) {
      for (int i = 0; i < u.streams; ++i) ss.push_back(i);
      for (int i = 0; i < u.tokens; ++i) ts.push_back(i);
      for (int i = 0; i < kHq; ++i) hs.push_back(i);
    } else {
      ss = {0, u.streams - 1};
      ts = {0, u.tokens - 1};
      hs = {0, 13, kHq - 1};
      for (std::vector<int>* v : {&ss, &ts}) v->erase(std::unique(v->begin(), v->end()), v->end());
    }
    for (int s : ss) {
      for (int t : ts) {
        for (int h : hs) {
          auto [err, m] = check_row(p, s, t, h);
          worst = std::max(worst, err);
          mag = std::max(mag, m);
        }
      }
    }
  }
  // Tolerance: ggml's row-wise path (decode) converts Q to F16 (the K vec-dot type) and
  // accumulates V in F16, an error that grows with the keys of one accumulation: measured 7e-4 at
  // 40 keys, 1.6e-3 at 4k, 9.4e-3 at 16k (outputs up to 0.085 there); with BF16 K/V (F32
  // accumulator) 5e-5 at 16k. The self-test's small graphs are held to 2e-3; a row's check at its
  // own shape to 2e-3 * (1 + keys / 2048). A wrong mask, head, stream or layout moves the outputs
  // by about their own size (0.05 to 0.5 here).
  int max_keys = 0;
  for (const UbatchTensors& p : g.parts) max_keys = std::max(max_keys, p.shape.keys());
  const double tol = all_rows ? 2e-3 : 2e-3 * (1.0 + max_keys / 2048.0);
  if (!(worst <= tol)) {
    std::fprintf(stderr, "cpu_ggml_peer: CHECK FAILED for %s: max |ggml - f64 reference| = %.3g (tolerance %.2g, "
                 "max |reference| %.3g)\n", what.c_str(), worst, tol, mag);
    std::exit(1);
  }
  return {worst, mag};
}

void self_test(Runner& runner, ggml_type kv_type) {
  struct T {
    const char* what;
    std::vector<Ubatch> ubatches;
  };
  const T tests[] = {
      {"batched decode (3 streams x 1 token over 40 cached, n_kv 256)", {{3, 1, 40}}},
      {"split-KV decode (1 stream, 700 cached, n_kv 768)", {{1, 1, 700}}},
      {"tiled prefill (2 streams x 80 tokens over 30 cached)", {{2, 80, 30}}},
      {"mixed graph (4 decodes over 300 + a 70-token chunk over 20)", {{4, 1, 300}, {1, 70, 20}}},
  };
  for (const T& t : tests) {
    auto g = build_graph(t.ubatches, kv_type, 11);
    runner.compute(*g);
    const CheckResult r = check_graph(*g, std::string("self-test ") + t.what, true);
    std::fprintf(stderr, "self-test %-64s max err %.2g (max |ref| %.2g): ok\n", t.what, r.err, r.mag);
  }
}

std::string json_escape(const std::string& s) {
  std::string r;
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) r += c;
  }
  return r;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  }
  return "unknown";
}

std::string isa_flags() {
  std::string r;
  const std::pair<const char*, int> flags[] = {
      {"avx", ggml_cpu_has_avx()},           {"avx2", ggml_cpu_has_avx2()},
      {"f16c", ggml_cpu_has_f16c()},         {"fma", ggml_cpu_has_fma()},
      {"avx512", ggml_cpu_has_avx512()},     {"avx512_vnni", ggml_cpu_has_avx512_vnni()},
      {"avx512_bf16", ggml_cpu_has_avx512_bf16()}, {"amx_int8", ggml_cpu_has_amx_int8()}};
  for (auto [name, on] : flags) {
    if (!on) continue;
    if (!r.empty()) r += ' ';
    r += name;
  }
  return r;
}

int usage(int rc) {
  std::fprintf(rc ? stderr : stdout,
               "usage: cpu_ggml_peer [--threads N] [--json FILE] [--grid bench|quick|all] [--rows A,B,...]\n"
               "                     [--filter REGEX] [--kv f16|bf16] [--reps N] [--min-seconds S] [--self-test-only]\n"
               "  threads default: PAGEDATTN_NUM_THREADS, else every core. Rows: cpu_bench's names without\n"
               "  'CPU/' (Decode/16x4k, Prefill/1x2048, Mixed/512chunk+32x2k, ...) and Quick/... (--grid quick).\n");
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0, reps = 5;
  double min_seconds = 0.5;
  std::string json, grid = "bench", rows, filter, kv = "f16";
  bool self_test_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) std::exit(usage(2));
      return argv[++i];
    };
    if (a == "--threads") threads = std::atoi(value().c_str());
    else if (a == "--json") json = value();
    else if (a == "--grid") grid = value();
    else if (a == "--rows") rows = value();
    else if (a == "--filter") filter = value();
    else if (a == "--kv") kv = value();
    else if (a == "--reps") reps = std::atoi(value().c_str());
    else if (a == "--min-seconds") min_seconds = std::atof(value().c_str());
    else if (a == "--self-test-only") self_test_only = true;
    else if (a == "-h" || a == "--help") return usage(0);
    else return usage(2);
  }
  if (grid != "bench" && grid != "quick" && grid != "all") return usage(2);
  if (kv != "f16" && kv != "bf16") return usage(2);
  if (threads <= 0) {
    const char* env = std::getenv("PAGEDATTN_NUM_THREADS");
    threads = env && std::atoi(env) > 0 ? std::atoi(env) : static_cast<int>(std::thread::hardware_concurrency());
  }
  const ggml_type kv_type = kv == "f16" ? GGML_TYPE_F16 : GGML_TYPE_BF16;

  std::vector<Case> cases;
  if (grid != "quick") cases = bench_cases();
  if (grid != "bench") {
    for (Case& c : quick_cases()) cases.push_back(std::move(c));
  }
  if (!rows.empty()) {
    std::vector<std::string> wanted;
    std::stringstream ss(rows);
    for (std::string r; std::getline(ss, r, ',');) {
      if (!r.empty()) wanted.push_back(r);
    }
    std::vector<Case> all = bench_cases();
    for (Case& c : quick_cases()) all.push_back(std::move(c));
    cases.clear();
    for (const std::string& w : wanted) {
      auto it = std::find_if(all.begin(), all.end(), [&](const Case& c) { return c.name == w; });
      if (it == all.end()) {
        std::fprintf(stderr, "cpu_ggml_peer: no row '%s' (skipped)\n", w.c_str());
      } else if (std::none_of(cases.begin(), cases.end(), [&](const Case& c) { return c.name == w; })) {
        cases.push_back(*it);
      }
    }
  }
  if (!filter.empty()) {
    const std::regex re(filter);
    std::erase_if(cases, [&](const Case& c) { return !std::regex_search(c.name, re); });
  }

  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S", std::gmtime(&now));
  std::ostringstream info;
  info << "{\"peer\": \"llama.cpp CPU flash attention (ggml_flash_attn_ext)\", \"llama_cpp_python\": \""
       << PEER_LLAMA_CPP_PYTHON << "\", \"llama_cpp_commit\": \"" << PEER_LLAMA_CPP_COMMIT
       << "\", \"ggml_version\": \"" << ggml_version() << "\", \"ggml_commit\": \"" << ggml_commit()
       << "\", \"kv_type\": \"" << ggml_type_name(kv_type) << "\", \"q_type\": \"f32\", \"threads\": " << threads
       << ", \"cpu\": \"" << json_escape(cpu_model()) << "\", \"ggml_cpu_isa\": \"" << isa_flags()
       << "\", \"build\": \"GGML_NATIVE=ON (-march=native), GGML_OPENMP=ON, no BLAS, static\""
       << ", \"layout\": \"llama.cpp non-unified KV cache: one stream per sequence, [n_kv][Hkv*D] cells, n_kv padded to "
       << kPad << ", F16 causal mask\", \"date\": \"" << date << "\"}";
  std::printf("%s\n", info.str().c_str());
  std::fflush(stdout);

  Runner runner(threads);
  self_test(runner, kv_type);
  if (self_test_only) return 0;

  std::ostringstream results;
  bool first = true;
  for (const Case& c : cases) {
    auto g = build_graph(c.ubatches, kv_type, 1);
    runner.compute(*g);  // warm-up, checked
    const CheckResult check = check_graph(*g, c.name, false);
    runner.compute(*g);
    std::vector<double> times;
    const auto start_all = std::chrono::steady_clock::now();
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      runner.compute(*g);
      const auto stop = std::chrono::steady_clock::now();
      times.push_back(std::chrono::duration<double>(stop - start).count());
      const double elapsed = std::chrono::duration<double>(stop - start_all).count();
      if ((static_cast<int>(times.size()) >= reps && elapsed >= min_seconds) || times.size() >= 100000) break;
    }
    std::vector<double> sorted = times;
    std::sort(sorted.begin(), sorted.end());
    const double med = sorted.size() % 2 ? sorted[sorted.size() / 2]
                                         : 0.5 * (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]);
    const double flops = case_flops(c), bytes = case_bytes(c);
    std::printf("GGML/%-28s %10.3f ms (min %.3f, %zu calls)  %8.1f GFLOP/s  %7.1f GB/s  check err %.2g of %.2g\n",
                c.name.c_str(), med * 1e3, sorted.front() * 1e3, times.size(), flops / med / 1e9,
                bytes / med / 1e9, check.err, check.mag);
    std::fflush(stdout);
    results << (first ? "" : ",\n  ") << "{\"name\": \"GGML/" << c.name << "\", \"median_ms\": " << med * 1e3
            << ", \"min_ms\": " << sorted.front() * 1e3 << ", \"calls\": " << times.size()
            << ", \"GFLOP/s\": " << flops / med / 1e9 << ", \"GB/s\": " << bytes / med / 1e9
            << ", \"kv_type\": \"" << ggml_type_name(kv_type) << "\", \"check_max_abs_err\": " << check.err
            << ", \"check_max_abs_ref\": " << check.mag << "}";
    first = false;
  }
  if (!json.empty()) {
    std::ofstream f(json);
    f << "{\"info\": " << info.str() << ",\n \"results\": [\n  " << results.str() << "]}\n";
    if (!f) {
      std::fprintf(stderr, "cpu_ggml_peer: cannot write %s\n", json.c_str());
      return 1;
    }
  }
  return 0;
}
