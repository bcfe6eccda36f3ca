// common/safe_fs: no write, rename, directory or copy goes through a symbolic link, at the leaf
// or at any directory above it; the target keeps its bytes; the refusal names the path.
#include "common/safe_fs.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "common/atomic_file.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

namespace fs = std::filesystem;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void Spit(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

class SafeFsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = qcal::testing::MakeTempDir("qcal_safe_fs");
    secret_ = dir_ + "/secret";
    Spit(secret_, "root:x:0:0\n");
    outside_ = dir_ + "/outside";
    fs::create_directories(outside_);
    fs::create_directories(dir_ + "/job");
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  void ExpectLinkRefusal(const Status& status, const std::string& path) {
    ASSERT_FALSE(status.ok());
    EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
    const std::string m(status.message());
    EXPECT_NE(m.find(path), std::string::npos) << m;
    EXPECT_NE(m.find("is a symbolic link"), std::string::npos) << m;
    EXPECT_NE(m.find(kLinkRefusal), std::string::npos) << m;
    EXPECT_EQ(Slurp(secret_), "root:x:0:0\n");
    EXPECT_TRUE(fs::is_empty(outside_));
  }
  std::string dir_, secret_, outside_;
};

TEST_F(SafeFsTest, OpenRefusesALinkAtTheFileForEveryWritingMode) {
  const std::string lock = dir_ + "/job/lock";
  fs::create_symlink(secret_, lock);
  for (int flags : {O_RDWR | O_CREAT, O_WRONLY | O_CREAT | O_APPEND, O_WRONLY | O_CREAT | O_TRUNC,
                    O_WRONLY}) {
    ExpectLinkRefusal(OpenNoFollow(lock, flags, 0644, "open").status(), lock);
  }
  EXPECT_TRUE(fs::is_symlink(lock));
}

TEST_F(SafeFsTest, OpenRefusesALinkAtAnyDirectoryAbove) {
  fs::create_symlink(outside_, dir_ + "/job/spill");
  const std::string spill = dir_ + "/job/spill/calibration-rank0.f32";
  ExpectLinkRefusal(OpenNoFollow(spill, O_RDWR | O_CREAT | O_TRUNC, 0600, "create").status(),
                    dir_ + "/job/spill");
  ExpectLinkRefusal(MakeDirs(dir_ + "/job/spill/deeper"), dir_ + "/job/spill");
  ExpectLinkRefusal(WriteFileAtomic(dir_ + "/job/spill/x.json", "{}"), dir_ + "/job/spill");
}

TEST_F(SafeFsTest, MakeDirsRefusesALinkToADirectory) {
  fs::create_symlink(outside_, dir_ + "/job/hessians");
  ExpectLinkRefusal(MakeDirs(dir_ + "/job/hessians"), dir_ + "/job/hessians");
  ASSERT_TRUE(MakeDirs(dir_ + "/job/activations/a/b").ok());
  EXPECT_TRUE(fs::is_directory(dir_ + "/job/activations/a/b"));
}

TEST_F(SafeFsTest, AtomicWritesRefuseALinkAtTheFinalNameAndLeaveNoTemporaryFile) {
  const std::string index = dir_ + "/job/model.safetensors.index.json";
  fs::create_symlink(secret_, index);
  ExpectLinkRefusal(WriteFileAtomic(index, "{}"), index);
  EXPECT_TRUE(fs::is_symlink(index));
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir_ + "/job")) entries += e.path() != index;
  EXPECT_EQ(entries, 0) << "the temporary file was left behind";
}

TEST_F(SafeFsTest, RenameRefusesALinkAtTheDestination) {
  Spit(dir_ + "/job/staged", "shard");
  const std::string to = dir_ + "/job/model-00001-of-00002.safetensors";
  fs::create_symlink(secret_, to);
  ExpectLinkRefusal(RenameNoFollow(dir_ + "/job/staged", to), to);
  EXPECT_TRUE(fs::exists(dir_ + "/job/staged"));
  fs::remove(to);
  ASSERT_TRUE(RenameNoFollow(dir_ + "/job/staged", to).ok());
  EXPECT_EQ(Slurp(to), "shard");
}

TEST_F(SafeFsTest, AFifoWhereAFileIsExpectedIsRefusedWithoutHanging) {
  const std::string log = dir_ + "/job/workers.log";
  ASSERT_EQ(::mkfifo(log.c_str(), 0644), 0);
  const Status s = OpenNoFollow(log, O_WRONLY | O_CREAT | O_APPEND, 0644, "open").status();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(std::string(s.message()).find("not a regular file"), std::string::npos) << s;
}

TEST_F(SafeFsTest, PlainFilesOpenAndTheDescriptorBlocksAgain) {
  const std::string path = dir_ + "/job/journal.jsonl";
  StatusOr<int> fd = OpenNoFollow(path, O_WRONLY | O_CREAT | O_APPEND, 0644, "open");
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(::fcntl(*fd, F_GETFL) & O_NONBLOCK, 0);
  ASSERT_EQ(::write(*fd, "x\n", 2), 2);
  ::close(*fd);
  EXPECT_EQ(Slurp(path), "x\n");
}

TEST_F(SafeFsTest, CheckNoLinksNamesTheLinkedComponent) {
  fs::create_symlink(outside_, dir_ + "/job/out");
  ExpectLinkRefusal(CheckNoLinks(dir_ + "/job/out/workers.log"), dir_ + "/job/out");
  EXPECT_TRUE(CheckNoLinks(dir_ + "/job/missing/workers.log").ok());
}

TEST_F(SafeFsTest, CanonicalPathResolvesTheExistingPrefixOnce) {
  fs::create_symlink(outside_, dir_ + "/scratch");
  const std::string real = fs::canonical(outside_).string();
  StatusOr<std::string> p = CanonicalPath(dir_ + "/scratch/./q2/../q4/");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(*p, real + "/q4");
  EXPECT_FALSE(CanonicalPath("").ok());
}

TEST_F(SafeFsTest, PathIsUnderComparesWholeComponents) {
  EXPECT_TRUE(PathIsUnder("/a/b", "/a"));
  EXPECT_TRUE(PathIsUnder("/a", "/a"));
  EXPECT_FALSE(PathIsUnder("/ab", "/a"));
  EXPECT_TRUE(PathIsUnder("/x", "/"));
}

TEST_F(SafeFsTest, CopiesOnlyRegularFilesInsideTheAllowedDirectories) {
  const std::string model = fs::canonical(dir_).string() + "/model";
  fs::create_directories(model + "/sub");
  Spit(model + "/tokenizer.json", "{\"ok\":1}");
  fs::create_symlink(secret_, model + "/special_tokens_map.json");
  fs::create_symlink(model + "/tokenizer.json", model + "/sub/linked.json");
  StatusOr<std::string> ok = ReadFileForCopy(model + "/tokenizer.json", {model});
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, "{\"ok\":1}");
  // A link that stays inside the model directory (a Hugging Face snapshot's) is fine.
  EXPECT_TRUE(ReadFileForCopy(model + "/sub/linked.json", {model}).ok());
  const Status out = ReadFileForCopy(model + "/special_tokens_map.json", {model}).status();
  ASSERT_FALSE(out.ok());
  EXPECT_NE(std::string(out.message()).find("outside the model directory"), std::string::npos)
      << out;
  EXPECT_NE(std::string(out.message()).find("special_tokens_map.json"), std::string::npos);
  // Not a regular file.
  ASSERT_EQ(::mkfifo((model + "/tokenizer.model").c_str(), 0644), 0);
  const Status fifo = ReadFileForCopy(model + "/tokenizer.model", {model}).status();
  EXPECT_FALSE(fifo.ok());
  EXPECT_EQ(ReadFileForCopy(model + "/missing.json", {model}).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace qcal
