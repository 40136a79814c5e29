// `pagedattn run`'s progress on stderr: a bar redrawn in place on a terminal, otherwise a line every
// 10% of the requests (and at the end).
#pragma once

#include <chrono>
#include <ostream>
#include <string>

#include "cli_common.h"
#include "scheduler.h"

namespace pagedattn::cli {

class Progress {
  using Clock = std::chrono::steady_clock;

 public:
  Progress(std::ostream* os, int total_requests, bool tty)
      : os_(os), total_(total_requests), tty_(tty), last_draw_(Clock::now()) {}
  void update(const SchedulerStats& s, bool force = false) {
    if (!os_) return;
    if (tty_) {
      if (!force && std::chrono::duration<double>(Clock::now() - last_draw_).count() < 0.1) return;
      last_draw_ = Clock::now();
      const int width = 30;
      int filled = total_ ? width * s.finished_requests / total_ : width;
      *os_ << "\r[" << std::string(static_cast<size_t>(filled), '#')
           << std::string(static_cast<size_t>(width - filled), '.') << "] step " << s.steps << " | "
           << format_count(s.scheduled_tokens) << " tokens | " << s.finished_requests << "/" << total_
           << " requests done" << std::flush;
      drawn_ = true;
    } else {
      int decile = total_ ? 10 * s.finished_requests / total_ : 10;
      if (!force && decile <= last_decile_) return;
      last_decile_ = decile;
      *os_ << "pagedattn run: step " << s.steps << ", " << format_count(s.scheduled_tokens) << " tokens, "
           << s.finished_requests << "/" << total_ << " requests done\n";
    }
  }
  void finish(const SchedulerStats& s) {
    if (!os_) return;
    if (tty_) {
      update(s, true);
      if (drawn_) *os_ << "\n";
    } else if (last_decile_ < 10) {
      update(s, true);  // stopped early (--max-steps): say where
    }
  }

 private:
  std::ostream* os_;
  int total_;
  bool tty_;
  bool drawn_ = false;
  int last_decile_ = 0;
  Clock::time_point last_draw_;
};

}  // namespace pagedattn::cli
