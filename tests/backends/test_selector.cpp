// Registry and selector: priority order, case-insensitive lookup, forcing by argument and by
// env PAGEDATTN_BACKEND (read at each call), the errors for unknown / unusable names and the
// every-backend error when nothing fits.
#include <gtest/gtest.h>

#include <algorithm>

#include <cstdlib>
#include <optional>
#include <set>
#include <string>

#include "backends/ops_test_util.h"
#include "pagedattn/selector.h"

namespace pagedattn {
namespace {

using testing_ops::expect_error;

// Sets (or clears) PAGEDATTN_BACKEND for one scope and restores the previous value.
class ScopedBackendEnv {
 public:
  explicit ScopedBackendEnv(const char* value) {
    if (const char* old = std::getenv("PAGEDATTN_BACKEND")) previous_ = old;
    if (value) {
      setenv("PAGEDATTN_BACKEND", value, 1);
    } else {
      unsetenv("PAGEDATTN_BACKEND");
    }
  }
  ~ScopedBackendEnv() {
    if (previous_) {
      setenv("PAGEDATTN_BACKEND", previous_->c_str(), 1);
    } else {
      unsetenv("PAGEDATTN_BACKEND");
    }
  }

 private:
  std::optional<std::string> previous_;
};

SelectorConfig cpu_config() {
  SelectorConfig c;
  c.head_size = 64;
  c.dtype = DType::f32;
  c.kv_cache_dtype = "auto";
  c.block_size = 16;
  c.device = Device::cpu;
  return c;
}

std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an Error";
  return "";
}

TEST(Registry, ReferenceIsRegisteredLastAndNamesAreUnique) {
  const auto& backends = registered_backends();
  ASSERT_FALSE(backends.empty());
  // REFERENCE is the last standard backend (MLA backends, e.g. REFERENCE_MLA, follow it).
  const AttentionBackend* last_standard = nullptr;
  for (const AttentionBackend* b : backends) {
    if (b->as_mla() == nullptr) last_standard = b;
  }
  ASSERT_NE(last_standard, nullptr);
  EXPECT_EQ(last_standard->name(), "REFERENCE");
  std::set<std::string> names;
  for (const AttentionBackend* b : backends) {
    ASSERT_NE(b, nullptr);
    std::string upper(b->name());
    for (char& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    EXPECT_TRUE(names.insert(upper).second) << "duplicate backend name " << b->name();
  }
}

TEST(Registry, FindBackendIsCaseInsensitive) {
  const AttentionBackend* reference = find_backend("REFERENCE");
  ASSERT_NE(reference, nullptr);
  EXPECT_EQ(find_backend("reference"), reference);
  EXPECT_EQ(find_backend("ReFeReNcE"), reference);
  EXPECT_EQ(find_backend("no_such_backend"), nullptr);
  EXPECT_EQ(find_backend(""), nullptr);
  for (const AttentionBackend* b : registered_backends()) EXPECT_EQ(find_backend(b->name()), b);
}

TEST(Selector, ExplainBackendsListsEveryBackendInOrder) {
  const auto reports = explain_backends(cpu_config());
  const auto& backends = registered_backends();
  ASSERT_EQ(reports.size(), backends.size());
  for (size_t i = 0; i < reports.size(); ++i) EXPECT_EQ(reports[i].backend, backends[i]);
  const auto reference_report = std::find_if(reports.begin(), reports.end(), [](const auto& r) {
    return r.backend->name() == "REFERENCE";
  });
  ASSERT_NE(reference_report, reports.end());
  EXPECT_TRUE(reference_report->usable()) << "REFERENCE rejects a plain f32 CPU decoder config";
  for (const auto& r : reports) {
    for (const auto& reason : r.reasons) EXPECT_FALSE(reason.empty());
  }
}

TEST(Selector, PicksFirstUsableInPriorityOrder) {
  ScopedBackendEnv env(nullptr);
  const SelectorConfig config = cpu_config();
  const AttentionBackend& chosen = get_attn_backend(config);
  for (const auto& r : explain_backends(config)) {
    if (r.usable()) {
      EXPECT_EQ(&chosen, r.backend);
      break;
    }
  }
  // Positional overload: same answer.
  EXPECT_EQ(&get_attn_backend(64, DType::f32, "auto", 16), &chosen);
  // vLLM's kv_cache_dtype=None is "auto".
  EXPECT_EQ(&get_attn_backend(64, DType::f32, "", 16), &chosen);
}

TEST(Selector, ForcedByName) {
  ScopedBackendEnv env(nullptr);
  EXPECT_EQ(get_attn_backend(cpu_config(), "reference").name(), "REFERENCE");
  for (const auto& r : explain_backends(cpu_config())) {
    if (r.usable()) EXPECT_EQ(&get_attn_backend(cpu_config(), r.backend->name()), r.backend);
  }
}

TEST(Selector, ForcedByEnvironmentReadAtEachCall) {
  {
    ScopedBackendEnv env("Reference");
    EXPECT_EQ(get_attn_backend(cpu_config()).name(), "REFERENCE");
    EXPECT_EQ(get_attn_backend(64, DType::f32, "auto", 16).name(), "REFERENCE");
  }
  {
    ScopedBackendEnv env("bogus_backend");
    expect_error([] { get_attn_backend(cpu_config()); }, "PAGEDATTN_BACKEND", "bogus_backend");
    // The argument wins over the environment.
    EXPECT_EQ(get_attn_backend(cpu_config(), "REFERENCE").name(), "REFERENCE");
  }
  {
    ScopedBackendEnv env("");  // empty = not set
    EXPECT_NO_THROW(get_attn_backend(cpu_config()));
  }
}

TEST(Selector, UnknownNameListsRegisteredNames) {
  ScopedBackendEnv env(nullptr);
  const std::string message = error_message([] { get_attn_backend(cpu_config(), "FLASH_ATTN_9"); });
  EXPECT_NE(message.find("FLASH_ATTN_9"), std::string::npos) << message;
  for (const AttentionBackend* b : registered_backends()) {
    EXPECT_NE(message.find(std::string(b->name())), std::string::npos) << message;
  }
  expect_error([] { get_attn_backend(cpu_config(), "FLASH_ATTN_9"); }, "backend");
}

TEST(Selector, ForcedButUnusableGivesItsReasons) {
  ScopedBackendEnv env(nullptr);
  SelectorConfig config = cpu_config();
  config.use_sparse = true;
  const auto reports = explain_backends(config);
  const auto reference_report = std::find_if(reports.begin(), reports.end(), [](const auto& r) {
    return r.backend->name() == "REFERENCE";
  });
  ASSERT_NE(reference_report, reports.end());
  ASSERT_FALSE(reference_report->usable()) << "REFERENCE should not claim sparse attention";
  const std::string message = error_message([&] { get_attn_backend(config, "REFERENCE"); });
  for (const auto& reason : reference_report->reasons) {
    EXPECT_NE(message.find(reason), std::string::npos) << message;
  }
  expect_error([&] { get_attn_backend(config, "REFERENCE"); }, "backend");
}

void expect_every_backend_error(const SelectorConfig& config) {
  const auto reports = explain_backends(config);
  for (const auto& r : reports) ASSERT_FALSE(r.usable()) << r.backend->name() << " accepted it";
  const std::string message = error_message([&] { get_attn_backend(config); });
  EXPECT_EQ(message.rfind("no attention backend supports this configuration (head_size=", 0), 0u)
      << message;
  EXPECT_NE(message.find("device=" + std::string(device_name(config.device))), std::string::npos);
  for (const auto& r : reports) {
    const std::string line = "\n  " + std::string(r.backend->name()) + ": ";
    const size_t at = message.find(line);
    ASSERT_NE(at, std::string::npos) << message;
    for (const auto& reason : r.reasons) {
      EXPECT_NE(message.find(reason, at), std::string::npos) << message;
    }
  }
}

TEST(Selector, NothingFitsListsEveryBackendWithReasons) {
  ScopedBackendEnv env(nullptr);
  SelectorConfig sparse = cpu_config();
  sparse.use_sparse = true;
  expect_every_backend_error(sparse);
#if !PAGEDATTN_HAS_CUDA
  SelectorConfig cuda = cpu_config();
  cuda.device = Device::cuda;
  expect_every_backend_error(cuda);
#endif
}

TEST(Selector, RejectsMalformedConfiguration) {
  ScopedBackendEnv env(nullptr);
  SelectorConfig c = cpu_config();
  c.head_size = 0;
  expect_error([&] { get_attn_backend(c); }, "head_size");
  expect_error([&] { explain_backends(c); }, "head_size");
  c = cpu_config();
  c.block_size = -16;
  expect_error([&] { get_attn_backend(c); }, "block_size");
  c = cpu_config();
  c.kv_cache_dtype = "int4";
  expect_error([&] { get_attn_backend(c); }, "kv_cache_dtype");
  c = cpu_config();
  c.head_size_v = -1;
  expect_error([&] { get_attn_backend(c); }, "head_size_v");
}

}  // namespace
}  // namespace pagedattn
