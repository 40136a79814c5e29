// Numeric option limits (option_limits.h): the CLI11 validators and the range checks.
#include "option_limits.h"

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <optional>

#include "cli_common.h"

namespace pagedattn::cli {

namespace {

using Int128 = __int128;

std::string to_string(Int128 v) {
  if (v == 0) return "0";
  const bool negative = v < 0;
  std::string digits;
  while (v != 0) {
    const int d = static_cast<int>(v % 10);
    digits.insert(digits.begin(), static_cast<char>('0' + (negative ? -d : d)));
    v /= 10;
  }
  return negative ? "-" + digits : digits;
}

std::string integer_range(Int128 min, Int128 max) {
  return "expected an integer from " + to_string(min) + " to " + to_string(max);
}

std::string number_range(double min, double max, bool min_exclusive) {
  return std::string("expected a finite number ") + (min_exclusive ? "> " : ">= ") + format_limit(min) +
         " and <= " + format_limit(max);
}

enum class Parsed { ok, not_a_number, out_of_range };

// An optional sign and decimal digits, the whole text. Values beyond 2^64 are out of range.
Parsed parse_integer(std::string_view text, Int128& value) {
  bool negative = false;
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) {
    negative = text[0] == '-';
    text.remove_prefix(1);
  }
  if (text.empty() || text[0] < '0' || text[0] > '9') return Parsed::not_a_number;
  uint64_t magnitude = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), magnitude);
  if (ptr != text.data() + text.size() && ec != std::errc::result_out_of_range) return Parsed::not_a_number;
  if (ec == std::errc::result_out_of_range) {
    for (char c : text) {
      if (c < '0' || c > '9') return Parsed::not_a_number;
    }
    return Parsed::out_of_range;
  }
  value = negative ? -Int128{magnitude} : Int128{magnitude};
  return Parsed::ok;
}

// The validator message ("" = valid) of an integer option's text.
std::string check_integer_text(const std::string& text, Int128 min, Int128 max) {
  Int128 value = 0;
  const Parsed parsed = parse_integer(text, value);
  if (parsed == Parsed::not_a_number) return "'" + text + "' is not an integer: " + integer_range(min, max);
  if (parsed == Parsed::out_of_range || value < min || value > max) {
    return "'" + text + "' is out of range: " + integer_range(min, max);
  }
  return {};
}

CLI::Validator integer_validator(Int128 min, Int128 max) {
  return CLI::Validator([min, max](std::string& text) { return check_integer_text(text, min, max); },
                        "in [" + to_string(min) + ", " + to_string(max) + "]");
}

}  // namespace

std::string format_limit(double value) {
  if (!std::isfinite(value)) return std::isnan(value) ? "nan" : (value > 0 ? "inf" : "-inf");
  if (value == std::floor(value) && std::fabs(value) < 1e15) {
    return std::to_string(static_cast<int64_t>(value));
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", value);
  return buf;
}

CLI::Validator integer_option(int64_t min, int64_t max) { return integer_validator(min, max); }

CLI::Validator seed_option() { return integer_validator(0, Int128{UINT64_MAX}); }

CLI::Validator number_option(double min, double max, bool min_exclusive) {
  return CLI::Validator(
      [min, max, min_exclusive](std::string& text) -> std::string {
        double value = 0;
        const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (text.empty() || ec == std::errc::invalid_argument || ptr != text.data() + text.size()) {
          return "'" + text + "' is not a number: " + number_range(min, max, min_exclusive);
        }
        if (ec == std::errc::result_out_of_range || !std::isfinite(value)) {
          return "'" + text + "' is not a finite number: " + number_range(min, max, min_exclusive);
        }
        if (value > max || value < min || (min_exclusive && value == min)) {
          return "'" + text + "' is out of range: " + number_range(min, max, min_exclusive);
        }
        return {};
      },
      std::string("in ") + (min_exclusive ? "(" : "[") + format_limit(min) + ", " + format_limit(max) + "]");
}

void check_range(std::string_view flag, int64_t value, int64_t min, int64_t max) {
  if (value < min || value > max) {
    throw UsageError(std::string(flag) + ": " + std::to_string(value) + " is out of range: " +
                     integer_range(min, max));
  }
}

void check_range(std::string_view flag, double value, double min, double max, bool min_exclusive) {
  if (!std::isfinite(value)) {
    throw UsageError(std::string(flag) + ": " + format_limit(value) + " is not a finite number: " +
                     number_range(min, max, min_exclusive));
  }
  if (value > max || value < min || (min_exclusive && value == min)) {
    throw UsageError(std::string(flag) + ": " + format_limit(value) + " is out of range: " +
                     number_range(min, max, min_exclusive));
  }
}

void check_file_name(std::string_view flag, const std::string& path, std::string_view what) {
  if (path.empty()) {
    throw UsageError(std::string(flag) + ": '' is not a " + std::string(what) + ": expected a path to write");
  }
}

}  // namespace pagedattn::cli
