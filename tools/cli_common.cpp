#include "cli_common.h"

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <sstream>

namespace pagedattn::cli {

TextTable::TextTable(std::vector<std::string> header) : header_(std::move(header)) {}

void TextTable::add_row(std::vector<std::string> row) {
  if (row.size() != header_.size()) {
    throw std::logic_error("TextTable::add_row: row has " + std::to_string(row.size()) +
                           " cells, header has " + std::to_string(header_.size()));
  }
  rows_.push_back(std::move(row));
}

namespace {
// Display width of a UTF-8 string (counts code points; enough for the characters we print).
size_t display_width(const std::string& s) {
  size_t width = 0;
  for (unsigned char c : s) {
    if ((c & 0xC0) != 0x80) ++width;
  }
  return width;
}
std::string escape_cell(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '|') out += "\\|";
    else if (c == '\n') out += ' ';
    else out += c;
  }
  return out;
}
}  // namespace

void TextTable::print(std::ostream& os) const {
  std::vector<size_t> widths(header_.size(), 3);
  auto measure = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size(); ++i) widths[i] = std::max(widths[i], display_width(escape_cell(row[i])));
  };
  measure(header_);
  for (const auto& r : rows_) measure(r);
  auto emit = [&](const std::vector<std::string>& row) {
    os << '|';
    for (size_t i = 0; i < row.size(); ++i) {
      std::string cell = escape_cell(row[i]);
      os << ' ' << cell << std::string(widths[i] - display_width(cell), ' ') << " |";
    }
    os << '\n';
  };
  emit(header_);
  os << '|';
  for (size_t w : widths) os << ' ' << std::string(w, '-') << " |";
  os << '\n';
  for (const auto& r : rows_) emit(r);
}

std::string TextTable::str() const {
  std::ostringstream os;
  print(os);
  return os.str();
}

std::string format_count(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  int n = static_cast<int>(digits.size());
  for (int i = 0; i < n; ++i) {
    out += digits[static_cast<size_t>(i)];
    if ((n - i - 1) % 3 == 0 && i != n - 1) out += ',';
  }
  return value < 0 ? "-" + out : out;
}

std::string format_sig(double value, int digits) {
  if (!std::isfinite(value)) return value != value ? "nan" : (value > 0 ? "inf" : "-inf");
  if (value == 0) return "0";
  char buf[64];
  double mag = std::fabs(value);
  if (mag >= 1e-3 && mag < 1e6) {
    int decimals = std::max(0, digits - 1 - static_cast<int>(std::floor(std::log10(mag))));
    std::snprintf(buf, sizeof buf, "%.*f", decimals, value);
  } else {
    std::snprintf(buf, sizeof buf, "%.*e", std::max(0, digits - 1), value);
  }
  return buf;
}

std::string format_seconds(double seconds) {
  if (seconds >= 1.0) return format_sig(seconds, 3) + " s";
  if (seconds >= 1e-3) return format_sig(seconds * 1e3, 3) + " ms";
  return format_sig(seconds * 1e6, 3) + " us";
}

std::string format_bandwidth(double bps) {
  if (bps >= 1e12) return format_sig(bps / 1e12, 3) + " TB/s";
  if (bps >= 1e9) return format_sig(bps / 1e9, 3) + " GB/s";
  return format_sig(bps / 1e6, 3) + " MB/s";
}

std::string format_flops(double fps) {
  if (fps >= 1e12) return format_sig(fps / 1e12, 3) + " TFLOP/s";
  if (fps >= 1e9) return format_sig(fps / 1e9, 3) + " GFLOP/s";
  return format_sig(fps / 1e6, 3) + " MFLOP/s";
}

std::string format_percent(double fraction) {
  if (!std::isfinite(fraction)) return "n/a";
  return format_sig(fraction * 100.0, 3) + "%";
}

std::string join(const std::vector<std::string>& parts, std::string_view separator) {
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i) out += separator;
    out += parts[i];
  }
  return out;
}

bool stderr_is_terminal() { return isatty(STDERR_FILENO) != 0; }

int apply_thread_count(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
  return omp_get_max_threads();
}

}  // namespace pagedattn::cli
