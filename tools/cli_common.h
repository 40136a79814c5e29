// Shared pieces of the `pagedattn` program: the usage-error type, text tables, number formatting,
// terminal detection and thread settings.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace pagedattn::cli {

// A bad command-line argument. main() prints "pagedattn <command>: <message>" (one line) and
// exits with kExitUsage.
class UsageError : public std::runtime_error {
 public:
  explicit UsageError(const std::string& message) : std::runtime_error(message) {}
};

// No backend can run the requested model/configuration (main() exits with kExitUnsupported).
// The message carries the selector's reasons.
class UnsupportedConfiguration : public std::runtime_error {
 public:
  explicit UnsupportedConfiguration(const std::string& message) : std::runtime_error(message) {}
};

// Exit codes of the program.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;      // a check failed (mismatch beyond tolerance, ...)
inline constexpr int kExitUsage = 2;        // bad arguments
inline constexpr int kExitUnsupported = 3;  // no backend can run the requested configuration

// A table printed as GitHub markdown with aligned columns (readable in a terminal, pastes into
// a README as is).
class TextTable {
 public:
  explicit TextTable(std::vector<std::string> header);
  void add_row(std::vector<std::string> row);  // must have as many cells as the header
  size_t num_rows() const { return rows_.size(); }
  void print(std::ostream& os) const;
  std::string str() const;

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

// "1,234,567"
std::string format_count(int64_t value);
// Fixed or scientific notation with `digits` significant digits: 0.0123, 1.23e-05.
std::string format_sig(double value, int digits = 3);
// Seconds as "1.23 s", "12.3 ms", "45.6 us".
std::string format_seconds(double seconds);
// Bytes per second as "12.3 GB/s" (decimal units, as bandwidth is quoted).
std::string format_bandwidth(double bytes_per_second);
// FLOP per second as "1.23 TFLOP/s" / "456 GFLOP/s".
std::string format_flops(double flop_per_second);
// 0.1234 -> "12.3%".
std::string format_percent(double fraction);
// Joins with a separator.
std::string join(const std::vector<std::string>& parts, std::string_view separator);

bool stderr_is_terminal();

// Number of threads the CPU work uses: sets OpenMP's count when threads > 0 and returns the
// count in effect.
int apply_thread_count(int threads);

}  // namespace pagedattn::cli
