// Test helper: sets an environment variable for the lifetime of the guard and restores the old
// value (or unsets it) afterwards. Used by tests that steer a backend through its env knobs.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace pagedattn::conformance {

class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    if (old != nullptr) old_ = old;
    setenv(name, value, 1);
  }
  ~EnvGuard() {
    if (old_) {
      setenv(name_, old_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

}  // namespace pagedattn::conformance
