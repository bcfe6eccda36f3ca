// Logging through one sink.
//
// Library code logs through these functions and never writes to stdout: stdout belongs to the
// CLI's human or --json output. The sink is stderr by default; SetLogLevel/SetLogFile change it
// for the whole process. Messages are fmt-style format strings.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

namespace qcal {

enum class LogLevel { kDebug, kInfo, kWarn, kError, kOff };

// Parses "debug", "info", "warn", "error", "off" (case-insensitive). Unknown names give kInfo.
LogLevel ParseLogLevel(const std::string& name);
void SetLogLevel(LogLevel level);
// Adds a file sink (appending) beside stderr. Thread-safe; intended to be called at start-up.
void SetLogFile(const std::string& path);

// The process-wide logger (created on first use, thread-safe).
spdlog::logger& Logger();

}  // namespace qcal

#define QCAL_LOG_DEBUG(...) SPDLOG_LOGGER_DEBUG(&::qcal::Logger(), __VA_ARGS__)
#define QCAL_LOG_INFO(...) SPDLOG_LOGGER_INFO(&::qcal::Logger(), __VA_ARGS__)
#define QCAL_LOG_WARN(...) SPDLOG_LOGGER_WARN(&::qcal::Logger(), __VA_ARGS__)
#define QCAL_LOG_ERROR(...) SPDLOG_LOGGER_ERROR(&::qcal::Logger(), __VA_ARGS__)
