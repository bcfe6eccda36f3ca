// Helpers shared by qcal's tests.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <random>
#include <string>

#include <gtest/gtest.h>

#include "common/seed.h"

namespace qcal::testing {

// ../shared beside the repository (ctest sets QCAL_SHARED_DIR).
inline std::string SharedDir() {
  const char* env = std::getenv("QCAL_SHARED_DIR");
  if (env != nullptr && *env != '\0') return env;
  const char* src = std::getenv("QCAL_SOURCE_DIR");
  if (src != nullptr && *src != '\0') return std::string(src) + "/../shared";
#ifdef QCAL_DEFAULT_SHARED_DIR
  return QCAL_DEFAULT_SHARED_DIR;
#else
  return "../shared";
#endif
}

// The build directory (for invoking built programs such as the qcal CLI).
inline std::string BuildDir() {
  if (const char* env = std::getenv("QCAL_BUILD_DIR")) return env;
#ifdef QCAL_DEFAULT_BUILD_DIR
  return QCAL_DEFAULT_BUILD_DIR;
#else
  return ".";
#endif
}

// A fresh directory under the test temp dir, unique per process and call.
inline std::string MakeTempDir(const std::string& prefix) {
  std::string tmpl = ::testing::TempDir() + "/" + prefix + ".XXXXXX";
  char* dir = mkdtemp(tmpl.data());
  EXPECT_NE(dir, nullptr) << "mkdtemp " << tmpl;
  return dir ? std::string(dir) : tmpl;
}

// A seed for randomized tests: QCAL_TEST_SEED if set, else fresh; printed so a failure can be
// replayed.
inline uint64_t TestSeed() {
  uint64_t seed;
  if (const char* env = std::getenv("QCAL_TEST_SEED")) {
    seed = std::strtoull(env, nullptr, 10);
  } else {
    seed = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  std::printf("[ seed     ] QCAL_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

// The seed of this test process (TestSeed() on first use, printed once) and an independent
// generator per `salt` drawn from it.
inline uint64_t ProcessSeed() {
  static const uint64_t seed = TestSeed();
  return seed;
}
inline std::mt19937_64 SeededRng(uint64_t salt) {
  return std::mt19937_64(ProcessSeed() ^ SplitMix64(salt));
}
#define QCAL_SEED_TRACE() \
  SCOPED_TRACE("QCAL_TEST_SEED=" + std::to_string(::qcal::testing::ProcessSeed()))

// The source tree (for files checked in beside the code, such as jobs/*.yaml): ctest sets
// QCAL_SOURCE_DIR; a test target may define QCAL_DEFAULT_SOURCE_DIR for runs outside ctest.
inline std::string SourceDir() {
  if (const char* env = std::getenv("QCAL_SOURCE_DIR")) return env;
#ifdef QCAL_DEFAULT_SOURCE_DIR
  return QCAL_DEFAULT_SOURCE_DIR;
#else
  return ".";
#endif
}

// Whether the openssl CLI is there (TLS tests skip visibly without it).
inline bool HaveOpenssl() { return std::system("openssl version > /dev/null 2>&1") == 0; }

// A self-signed certificate for localhost and 127.0.0.1, valid one day: DIR/NAME.pem and
// DIR/NAME.key, made with the openssl CLI. False when openssl fails.
inline bool MakeSelfSignedCert(const std::string& dir, const std::string& name) {
  const std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                          "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
                          dir + "/" + name + ".key -out " + dir + "/" + name + ".pem > /dev/null 2>&1";
  return std::system(cmd.c_str()) == 0;
}

}  // namespace qcal::testing
