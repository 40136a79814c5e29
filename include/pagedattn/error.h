// Errors. Every message names the argument, the value it had and what was expected, e.g.
//   "reshape_and_cache: slot_mapping[3] = 4096 is out of range: expected -1 or a slot in [0, 4096)"
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace pagedattn {

// The one exception type of the library. `argument()` is the name of the offending argument
// ("" when the error is not about one argument); Python maps Error to ValueError.
class Error : public std::runtime_error {
 public:
  Error(std::string argument, const std::string& message)
      : std::runtime_error(message), argument_(std::move(argument)) {}
  explicit Error(const std::string& message) : std::runtime_error(message) {}
  const std::string& argument() const noexcept { return argument_; }

 private:
  std::string argument_;
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// Throws pagedattn::Error(argument, message) where message is the concatenation of the parts.
// Usage: PAGEDATTN_CHECK(n >= 0, "num_blocks", "num_blocks = ", n, " must be >= 0");
#define PAGEDATTN_CHECK(cond, argument, ...)                                        \
  do {                                                                             \
    if (!(cond)) [[unlikely]] {                                                    \
      throw ::pagedattn::Error((argument), ::pagedattn::detail::concat(__VA_ARGS__)); \
    }                                                                              \
  } while (0)

}  // namespace pagedattn
