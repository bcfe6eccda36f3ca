// Crash-safe file writes: every file that marks progress is written to a temporary name in the
// same directory, flushed (fsync), renamed over the final name, and the directory is fsynced.
// A reader therefore sees either the old file or the complete new one, never a partial file.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>

#include "common/safe_fs.h"  // MakeDirs, and the no-link rule every write here follows
#include "common/status.h"

namespace qcal {

// Writes `contents` to `path` atomically. Creates no directories. Like every write below, no
// component of `path` may be a symbolic link (common/safe_fs.h).
Status WriteFileAtomic(const std::string& path, std::string_view contents);

// Reads a whole file; NotFound / PermissionDenied / DataLoss with the path in the message.
StatusOr<std::string> ReadFile(const std::string& path);
// Hex FNV-1a 64 of the file's bytes (common/hash.h), read in 1 MiB pieces; the read error
// (naming the file) otherwise.
StatusOr<std::string> FileFnv1aHex(const std::string& path);

// fsyncs the directory holding `path`, making a rename into it durable.
Status SyncParentDir(const std::string& path);

// Streaming variant for large files. Not thread-safe. If Commit() is never called (or fails),
// the destructor removes the temporary file and `path` is untouched.
class AtomicFileWriter {
 public:
  // Opens "<path>.tmp.<pid>.<n>" for writing.
  static StatusOr<std::unique_ptr<AtomicFileWriter>> Open(const std::string& path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  Status Append(const void* data, size_t size);
  Status Append(std::string_view data) { return Append(data.data(), data.size()); }
  // fsync + rename + fsync(dir). After Commit the writer is closed.
  Status Commit();

  const std::string& path() const { return path_; }
  uint64_t bytes_written() const { return bytes_written_; }

 private:
  AtomicFileWriter(std::string path, std::string tmp_path, int fd);
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  uint64_t bytes_written_ = 0;
};

}  // namespace qcal
