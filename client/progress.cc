#include "client/progress.h"

#include <unistd.h>

#include <cstdio>

namespace qcal::client {

ProgressBar::ProgressBar(std::string label, int64_t total)
    : label_(std::move(label)),
      total_(total),
      enabled_(isatty(STDERR_FILENO) == 1),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(int64_t done) {
  if (!enabled_ || finished_) return;
  const auto now = std::chrono::steady_clock::now();
  if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  const double frac = total_ > 0 ? static_cast<double>(done) / total_ : 1.0;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = frac > 0 ? elapsed * (1 - frac) / frac : 0;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(frac * kWidth);
  std::string bar(filled, '#');
  bar.resize(kWidth, '.');
  std::fprintf(stderr, "\r%s [%s] %lld/%lld  %.0fs elapsed, ETA %.0fs ", label_.c_str(),
               bar.c_str(), static_cast<long long>(done), static_cast<long long>(total_), elapsed,
               eta);
  std::fflush(stderr);
}

void ProgressBar::Finish() {
  if (!enabled_ || finished_) return;
  finished_ = true;
  std::fprintf(stderr, "\n");
}

}  // namespace qcal::client
