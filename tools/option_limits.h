// Limits of the `pagedattn` program's numeric options, and their checks.
//
// Every numeric option has a documented range (--help shows it). The simulator does integer
// arithmetic on these values — token positions in int32, block counts, bytes in int64 — and the
// ranges keep every sum and product of them in range: e.g. lengths are at most kMaxTokens =
// (2^31 - 1) / 4, so system prompt + prompt + output is still an int32 position.
//
// Checked twice, with the same words: on an option's text by the CLI11 validators below, before
// CLI11 converts it (the whole text must be a number; integers without fraction or exponent,
// floating values finite), and on converted values by check_range (RunOptions filled by code).
// Messages are one line: "<flag>: <value> is out of range: expected an integer from 1 to 1024".
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace CLI {
class Validator;
}

namespace pagedattn::cli {

inline constexpr int64_t kMaxTokens = 536870911;         // lengths: (2^31 - 1) / 4
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxThreads = 4096;             // the library's PAGEDATTN_NUM_THREADS limit
inline constexpr int64_t kMaxBlockSize = 65536;          // tokens per KV-cache block
inline constexpr int64_t kMaxNumSeqs = 65536;
inline constexpr int64_t kMaxBatchedTokens = 1 << 20;    // token budget of one step
inline constexpr int64_t kMaxNumRequests = 1000000;
inline constexpr int64_t kMaxTensorParallel = 1024;
inline constexpr int64_t kMaxDcpRanks = 64;             // --dcp: one thread and one set of caches each
inline constexpr int64_t kMaxNumBlocks = 1 << 30;        // also bounded by memory (run_checks.h)
inline constexpr int64_t kMaxHeadSize = 65536;
inline constexpr int64_t kMaxInt = 2147483647;           // counts without a tighter limit
inline constexpr double kMaxKvCacheGib = 1 << 20;        // 1 PiB; also bounded by memory
inline constexpr double kMaxArrivalRate = 1e9;           // requests per step
inline constexpr double kMaxMinSeconds = 3600;
inline constexpr double kMaxSoftCap = 1e6;

// CLI11 validators (attach with option->check(...)).
CLI::Validator integer_option(int64_t min, int64_t max);
CLI::Validator seed_option();  // an integer from 0 to 2^64 - 1
// A finite number in [min, max], or (min, max] when min_exclusive.
CLI::Validator number_option(double min, double max, bool min_exclusive = false);

// Throw UsageError with the validators' wording.
void check_range(std::string_view flag, int64_t value, int64_t min, int64_t max);
inline void check_range(std::string_view flag, int value, int64_t min, int64_t max) {
  check_range(flag, int64_t{value}, min, max);
}
void check_range(std::string_view flag, double value, double min, double max, bool min_exclusive = false);
// An output path option given as "": "<flag>: '' is not a file name: expected a path to write".
void check_file_name(std::string_view flag, const std::string& path, std::string_view what = "file name");

// "1048576", "0.5", "1e+308", "inf": integers exactly, others with 6 significant digits.
std::string format_limit(double value);

}  // namespace pagedattn::cli
