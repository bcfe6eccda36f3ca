#include "common/log.h"

#include <algorithm>
#include <cctype>
#include <memory>
#include <mutex>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

namespace qcal {
namespace {

std::shared_ptr<spdlog::logger> MakeLogger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("qcal", sink);
  logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [%s:%#] %v");
  logger->set_level(spdlog::level::info);
  return logger;
}

std::shared_ptr<spdlog::logger>& LoggerPtr() {
  static std::shared_ptr<spdlog::logger> logger = MakeLogger();
  return logger;
}

}  // namespace

spdlog::logger& Logger() { return *LoggerPtr(); }

LogLevel ParseLogLevel(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n == "debug") return LogLevel::kDebug;
  if (n == "warn" || n == "warning") return LogLevel::kWarn;
  if (n == "error") return LogLevel::kError;
  if (n == "off") return LogLevel::kOff;
  return LogLevel::kInfo;
}

void SetLogLevel(LogLevel level) {
  static const spdlog::level::level_enum kMap[] = {spdlog::level::debug, spdlog::level::info,
                                                   spdlog::level::warn, spdlog::level::err,
                                                   spdlog::level::off};
  Logger().set_level(kMap[static_cast<int>(level)]);
}

void SetLogFile(const std::string& path) {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path, /*truncate=*/false);
  sink->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] [%s:%#] %v");
  Logger().sinks().push_back(sink);
}

}  // namespace qcal
