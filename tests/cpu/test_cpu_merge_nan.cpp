// NaN partial rows in the CPU split-KV merge (merge_impl in cpu_attention_tile.h, the `merge` of
// every kernel table), called directly on hand-made partial rows, on every CPU kernel path this
// machine runs (cpu_kernel_paths.h). The rule, as REFERENCE: a NaN logit a row sees makes the
// row's whole output and its LSE NaN. A split in which the row saw a NaN logit has a NaN partial
// max m_s (and NaN O_s, l_s); a split in which the row sees no key has m_s = -inf. The merge's
// overall max must stay NaN once a split's is: the old `a > b ? a : b` max turned a NaN back into
// -inf when a fully masked split came after it in split order (NaN, -inf), and the row was then
// written as "nothing visible" (0, LSE -inf). Rows, each with and without an attention sink:
//   2 splits: A (NaN, -inf)  B (-inf, NaN)  D (NaN, finite)  E (finite, -inf)
//   3 splits: C (finite, -inf, finite)  F (finite, NaN, -inf)  G (-inf, -inf, -inf)
// A, B, D, F: NaN in every output element and the LSE. C, E: the exact merge (double here).
// G: nothing visible (0, LSE -inf; with a sink 0, LSE = sink). The output and LSE are poisoned
// with a sentinel first, so every element must be written.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../../src/backends/cpu/cpu_kernels.h"
#include "cpu_kernel_paths.h"

namespace pagedattn::cpu {
namespace {

constexpr int kDv = 32;  // several vectors of every ISA (W = 1, 8, 16)
constexpr float kSentinel = -7777.f;
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

enum class Want { nan, exact };

struct RowCase {
  const char* name;
  std::vector<float> m;  // per split; NaN: the split saw a NaN logit; -inf: nothing visible
  Want want;
};

struct Group {
  std::vector<RowCase> rows;  // one token each (group size 1)
  int splits;
};

const std::vector<Group>& groups() {
  static const std::vector<Group> g = {
      {{{"A (NaN, -inf)", {kNan, -kInf}, Want::nan},
        {"B (-inf, NaN)", {-kInf, kNan}, Want::nan},
        {"D (NaN, finite)", {kNan, 1.5f}, Want::nan},
        {"E (finite, -inf)", {0.7f, -kInf}, Want::exact}},
       2},
      {{{"C (finite, -inf, finite)", {2.0f, -kInf, 3.0f}, Want::exact},
        {"F (finite, NaN, -inf)", {1.0f, kNan, -kInf}, Want::nan},
        {"G (-inf, -inf, -inf)", {-kInf, -kInf, -kInf}, Want::exact}},
       3},
  };
  return g;
}

// Partial O of (split s, row r, dim d) for a split with a finite max; l of the split.
float partial_o_value(int s, int r, int d) { return 0.25f * static_cast<float>((s * 7 + r * 3 + d) % 11) - 1.f; }
float partial_l_value(int s, int r) { return 1.f + 0.5f * static_cast<float>(s + 2 * r); }

using MergeNanTest = KernelPathTest;

TEST_P(MergeNanTest, NanPartialMaxStaysNanWhateverTheSplitOrder) {
  for (const bool with_sink : {false, true}) {
    SCOPED_TRACE(with_sink ? "with a sink" : "no sink");
    const float sink = 2.5f;
    int tokens = 0, slots = 0;
    for (const Group& g : groups()) {
      tokens += static_cast<int>(g.rows.size());
      slots += static_cast<int>(g.rows.size()) * g.splits;
    }
    std::vector<float> partial_o(static_cast<size_t>(slots) * kDv, 0.f);
    std::vector<float> partial_ml(static_cast<size_t>(slots) * 2, 0.f);
    std::vector<float> output(static_cast<size_t>(tokens) * kDv, kSentinel);
    std::vector<float> lse(static_cast<size_t>(tokens), kSentinel);

    AttentionArgs a;
    a.output = output.data();
    a.o_dtype = DType::f32;
    a.o_stride_t = kDv;
    a.o_stride_h = kDv;
    a.lse = lse.data();
    a.lse_stride_h = tokens;
    a.lse_stride_t = 1;
    a.num_heads = 1;
    a.num_kv_heads = 1;
    a.group_size = 1;
    a.head_size = kDv;
    a.head_size_v = kDv;
    a.kv.dtype = DType::bf16;  // value scale 1
    a.sinks = with_sink ? &sink : nullptr;
    a.partial_o = partial_o.data();
    a.partial_ml = partial_ml.data();
    a.partial_o_stride = kDv;

    std::vector<MergeTask> tasks;
    int tok = 0, base = 0;
    for (const Group& g : groups()) {
      const int rows = static_cast<int>(g.rows.size());
      MergeTask t;
      t.kv_head = 0;
      t.tok_begin = tok;
      t.tok_end = tok + rows;
      t.num_splits = g.splits;
      t.partial_base = base;
      for (int r = 0; r < rows; ++r) {
        ASSERT_EQ(static_cast<int>(g.rows[r].m.size()), g.splits);
        for (int s = 0; s < g.splits; ++s) {
          const int64_t slot = base + s * rows + r;
          const float m = g.rows[r].m[s];
          float* o = partial_o.data() + slot * kDv;
          if (std::isnan(m)) {  // what a split that saw a NaN logit holds: m, l and O NaN
            partial_ml[2 * slot] = kNan;
            partial_ml[2 * slot + 1] = kNan;
            for (int d = 0; d < kDv; ++d) o[d] = kNan;
          } else if (m == -kInf) {  // nothing visible: m -inf, l 0, O 0
            partial_ml[2 * slot] = -kInf;
            partial_ml[2 * slot + 1] = 0.f;
          } else {
            partial_ml[2 * slot] = m;
            partial_ml[2 * slot + 1] = partial_l_value(s, r);
            for (int d = 0; d < kDv; ++d) o[d] = partial_o_value(s, r, d);
          }
        }
      }
      tasks.push_back(t);
      tok += rows;
      base += rows * g.splits;
    }

    const KernelTable& kernels = active_kernels();
    for (const MergeTask& t : tasks) kernels.merge(a, t);

    tok = 0;
    for (const Group& g : groups()) {
      const int rows = static_cast<int>(g.rows.size());
      for (int r = 0; r < rows; ++r, ++tok) {
        const RowCase& row = g.rows[r];
        SCOPED_TRACE(row.name);
        const float* out = output.data() + static_cast<size_t>(tok) * kDv;
        if (row.want == Want::nan) {
          for (int d = 0; d < kDv; ++d) EXPECT_TRUE(std::isnan(out[d])) << "dim " << d << ": " << out[d];
          EXPECT_TRUE(std::isnan(lse[tok])) << "LSE " << lse[tok];
          continue;
        }
        // Exact merge in double: out = sum e^{m_s} O_s / (sum e^{m_s} l_s + e^{sink}).
        double shift = with_sink ? sink : -INFINITY;
        for (float m : row.m) shift = std::max(shift, static_cast<double>(m));
        if (shift == -INFINITY) {  // nothing visible, no sink
          for (int d = 0; d < kDv; ++d) EXPECT_EQ(out[d], 0.f) << "dim " << d;
          EXPECT_EQ(lse[tok], -kInf);
          continue;
        }
        double total = with_sink ? std::exp(sink - shift) : 0.0;
        std::vector<double> num(kDv, 0.0);
        for (int s = 0; s < g.splits; ++s) {
          if (row.m[s] == -kInf) continue;
          const double w = std::exp(row.m[s] - shift);
          total += w * partial_l_value(s, r);
          for (int d = 0; d < kDv; ++d) num[d] += w * partial_o_value(s, r, d);
        }
        for (int d = 0; d < kDv; ++d) {
          EXPECT_NEAR(out[d], num[d] / total, 1e-5 * (1.0 + std::fabs(num[d] / total))) << "dim " << d;
        }
        EXPECT_NEAR(lse[tok], shift + std::log(total), 1e-5 * (1.0 + std::fabs(shift)));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, MergeNanTest, every_kernel_path(), kernel_path_name);

}  // namespace
}  // namespace pagedattn::cpu
