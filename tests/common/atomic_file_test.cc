// Tests for common/atomic_file: atomic writes, streaming writer cleanup, ReadFile errors, MakeDirs.
#include "common/atomic_file.h"
#include "tests/test_util.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace qcal {
namespace {

void ExpectError(const Status& status, absl::StatusCode code,
                 std::initializer_list<std::string> phrases) {
  ASSERT_FALSE(status.ok()) << "expected an error";
  EXPECT_EQ(status.code(), code) << status;
  const std::string message(status.message());
  for (const std::string& phrase : phrases) {
    EXPECT_NE(message.find(phrase), std::string::npos)
        << "message \"" << message << "\" lacks \"" << phrase << "\"";
  }
}

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = qcal::testing::MakeTempDir("qcal_atomic");
  }
  void TearDown() override {
    std::error_code ignored;
    std::filesystem::permissions(dir_, std::filesystem::perms::owner_all,
                                 std::filesystem::perm_options::add, ignored);
    std::filesystem::remove_all(dir_, ignored);
  }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::vector<std::string> ListDir() const {
    std::vector<std::string> names;
    for (const auto& entry : std::filesystem::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }
  std::string dir_;
};

TEST_F(AtomicFileTest, WriteThenRead) {
  const std::string path = Path("a.txt");
  ASSERT_TRUE(WriteFileAtomic(path, "hello\n").ok());
  auto contents = ReadFile(path);
  ASSERT_TRUE(contents.ok()) << contents.status();
  EXPECT_EQ(*contents, "hello\n");
  // Overwrite with different, binary contents.
  const std::string binary("\0\x01\xff zero", 8);
  ASSERT_TRUE(WriteFileAtomic(path, binary).ok());
  contents = ReadFile(path);
  ASSERT_TRUE(contents.ok());
  EXPECT_EQ(*contents, binary);
  // Empty file.
  ASSERT_TRUE(WriteFileAtomic(Path("empty"), "").ok());
  contents = ReadFile(Path("empty"));
  ASSERT_TRUE(contents.ok());
  EXPECT_EQ(*contents, "");
  EXPECT_EQ(ListDir(), (std::vector<std::string>{"a.txt", "empty"}));  // no temporaries left
}

TEST_F(AtomicFileTest, StreamingWriterCommits) {
  const std::string path = Path("big.bin");
  auto writer = AtomicFileWriter::Open(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  EXPECT_EQ((*writer)->path(), path);
  std::string expected;
  for (int i = 0; i < 300; ++i) {
    const std::string chunk(10007, static_cast<char>('a' + i % 26));
    ASSERT_TRUE((*writer)->Append(chunk).ok());
    expected += chunk;
  }
  EXPECT_EQ((*writer)->bytes_written(), expected.size());
  // Nothing at the final path until Commit; the temporary has the documented name.
  EXPECT_FALSE(std::filesystem::exists(path));
  const auto names = ListDir();
  ASSERT_EQ(names.size(), 1u);
  const std::string tmp_prefix = "big.bin.tmp." + std::to_string(::getpid()) + ".";
  EXPECT_EQ(names[0].rfind(tmp_prefix, 0), 0u) << names[0];
  ASSERT_TRUE((*writer)->Commit().ok());
  EXPECT_EQ(ListDir(), std::vector<std::string>{"big.bin"});
  auto contents = ReadFile(path);
  ASSERT_TRUE(contents.ok());
  EXPECT_EQ(*contents, expected);
  // The writer is closed after Commit.
  ExpectError((*writer)->Append("x"), absl::StatusCode::kFailedPrecondition, {path});
  ExpectError((*writer)->Commit(), absl::StatusCode::kFailedPrecondition, {path});
  writer->reset();
  EXPECT_EQ(ListDir(), std::vector<std::string>{"big.bin"});  // destructor removed nothing
}

TEST_F(AtomicFileTest, UncommittedWriterLeavesOriginalUntouched) {
  const std::string path = Path("state.json");
  ASSERT_TRUE(WriteFileAtomic(path, "old").ok());
  {
    auto writer = AtomicFileWriter::Open(path);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE((*writer)->Append("new, but never committed").ok());
    EXPECT_EQ(ListDir().size(), 2u);  // state.json + temporary
  }
  EXPECT_EQ(ListDir(), std::vector<std::string>{"state.json"});
  auto contents = ReadFile(path);
  ASSERT_TRUE(contents.ok());
  EXPECT_EQ(*contents, "old");
}

TEST_F(AtomicFileTest, TwoWritersUseDistinctTemporaries) {
  auto a = AtomicFileWriter::Open(Path("f"));
  auto b = AtomicFileWriter::Open(Path("f"));
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE((*a)->Append("A").ok());
  ASSERT_TRUE((*b)->Append("B").ok());
  EXPECT_EQ(ListDir().size(), 2u);
  ASSERT_TRUE((*a)->Commit().ok());
  ASSERT_TRUE((*b)->Commit().ok());  // last commit wins, whole
  auto contents = ReadFile(Path("f"));
  ASSERT_TRUE(contents.ok());
  EXPECT_EQ(*contents, "B");
  EXPECT_EQ(ListDir(), std::vector<std::string>{"f"});
}

TEST_F(AtomicFileTest, WriteIntoMissingDirectoryFails) {
  ExpectError(WriteFileAtomic(Path("no/such/dir/x"), "data"), absl::StatusCode::kNotFound,
              {Path("no/such/dir/x"), "No such file or directory"});
  ExpectError(AtomicFileWriter::Open("").status(), absl::StatusCode::kInvalidArgument, {"empty"});
}

TEST_F(AtomicFileTest, ReadMissingFileIsNotFound) {
  ExpectError(ReadFile(Path("missing.txt")).status(), absl::StatusCode::kNotFound,
              {Path("missing.txt"), "No such file or directory"});
}

TEST_F(AtomicFileTest, ReadDirectoryFails) {
  ExpectError(ReadFile(dir_).status(), absl::StatusCode::kFailedPrecondition,
              {dir_, "is a directory"});
}

TEST_F(AtomicFileTest, ReadUnreadableFileIsPermissionDenied) {
  if (::geteuid() == 0) GTEST_SKIP() << "running as root: file permissions are not enforced";
  const std::string path = Path("secret");
  ASSERT_TRUE(WriteFileAtomic(path, "x").ok());
  ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  ExpectError(ReadFile(path).status(), absl::StatusCode::kPermissionDenied,
              {path, "Permission denied"});
}

TEST_F(AtomicFileTest, MakeDirsCreatesParents) {
  const std::string nested = Path("a/b/c");
  ASSERT_TRUE(MakeDirs(nested).ok());
  EXPECT_TRUE(std::filesystem::is_directory(nested));
  ASSERT_TRUE(MakeDirs(nested).ok());  // idempotent
  ASSERT_TRUE(MakeDirs(nested + "/").ok());
  ASSERT_TRUE(MakeDirs(Path("a//d")).ok());
  EXPECT_TRUE(std::filesystem::is_directory(Path("a/d")));
  ASSERT_TRUE(WriteFileAtomic(nested + "/file", "x").ok());
  ExpectError(MakeDirs(nested + "/file/sub"), absl::StatusCode::kFailedPrecondition,
              {nested + "/file", "not a directory"});
  ExpectError(MakeDirs(""), absl::StatusCode::kInvalidArgument, {"empty path"});
}

}  // namespace
}  // namespace qcal
