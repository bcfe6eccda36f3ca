#include "client/progress.h"

#include <unistd.h>

#include <cstdio>

namespace qcal::client {
namespace {

// "95 s", "12 min 5 s", "2 h 10 min".
std::string Duration(double s) {
  char buf[64];
  if (s < 120) {
    std::snprintf(buf, sizeof(buf), "%.0f s", s);
  } else if (s < 7200) {
    std::snprintf(buf, sizeof(buf), "%d min %d s", static_cast<int>(s / 60),
                  static_cast<int>(s) % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%d h %d min", static_cast<int>(s / 3600),
                  static_cast<int>(s / 60) % 60);
  }
  return buf;
}

}  // namespace

ProgressBar::ProgressBar(std::string label, int64_t total, bool lines)
    : label_(std::move(label)),
      total_(total),
      tty_(isatty(STDERR_FILENO) == 1),
      lines_(lines),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(int64_t done) {
  if (finished_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done != done_) note_.clear();  // the note was about the step before
  done_ = done;
  if (!tty_) {
    if (!lines_) return;
    // A log or a batch job's output: a plain line when a phase is done, and at most every
    // kLineEvery while it runs, so a long phase is never silent.
    const bool complete = total_ > 0 && done >= total_;
    if (done == last_done_ || (!complete && now - last_draw_ < kLineEvery)) return;
  } else if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) {
    return;
  }
  Draw(done, now);
}

void ProgressBar::Note(const std::string& note) {
  if (finished_) return;
  note_ = note;
  const auto now = std::chrono::steady_clock::now();
  const auto every = tty_ ? std::chrono::milliseconds(100) : kLineEvery;
  if (now - last_draw_ < every) return;
  Draw(done_, now);
}

void ProgressBar::Draw(int64_t done, std::chrono::steady_clock::time_point now) {
  const double frac = total_ > 0 ? static_cast<double>(done) / total_ : 1.0;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = frac > 0 ? elapsed * (1 - frac) / frac : 0;
  const bool complete = total_ > 0 && done >= total_;
  last_draw_ = now;
  last_done_ = done;
  const std::string note = note_.empty() ? "" : ", " + note_;
  if (!tty_) {
    std::fprintf(stderr, "%s %lld/%lld%s, %s elapsed%s\n", label_.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total_), note.c_str(),
                 Duration(elapsed).c_str(),
                 complete || frac <= 0 ? "" : (", ETA " + Duration(eta)).c_str());
    std::fflush(stderr);
    return;
  }
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  std::fprintf(stderr, "\r\033[K%s [%s] %lld/%lld  %.0fs elapsed, ETA %.0fs%s ", label_.c_str(),
               bar.c_str(), static_cast<long long>(done), static_cast<long long>(total_), elapsed,
               eta, note.c_str());
  std::fflush(stderr);
}

void ProgressBar::Finish() {
  if (finished_) return;
  finished_ = true;
  if (tty_) std::fprintf(stderr, "\n");
}

}  // namespace qcal::client
