// safetensors: reading (mmap, validated before any use), writing (atomic) and sharded checkpoints.
//
// File layout (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
// N bytes of JSON header, then the data section. The header maps tensor names to
// {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative to the data section) and may
// hold "__metadata__": a map of string to string.
//
// Validation performed by ParseSafetensors / SafetensorsFile::Open, each failure an
// InvalidArgument (or DataLoss for truncation) whose message names the file and the problem:
//   * the file holds at least the 8-byte length; header length within the file and <= 100 MB;
//   * the header is a JSON object; every entry is an object with exactly known keys;
//   * dtype is known; shape is a list of non-negative integers; data_offsets two integers,
//     begin <= end; product(shape) * dtype size == end - begin (with overflow checks);
//   * every range lies inside the data section; ranges do not overlap; together they cover the
//     data section with no holes (as the reference implementation requires);
//   * "__metadata__", when present, is an object whose values are all strings.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/status.h"

namespace qcal {

inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offset within the data section
  uint64_t end = 0;    // one past the last byte
  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
  uint64_t data_offset = 0;  // where the data section starts in the file (8 + N)
};

// Validates a whole in-memory safetensors file (length prefix, header and ranges). `source`
// names the file in error messages. Pure function: this is what the fuzzer drives.
StatusOr<SafetensorsHeader> ParseSafetensors(const uint8_t* bytes, size_t size,
                                             std::string_view source);

// Validates only the JSON header given the data section's size.
StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view header_json,
                                                   uint64_t data_size, std::string_view source);

// A memory-mapped safetensors file. Immutable after Open; safe to read from many threads.
class SafetensorsFile {
 public:
  static StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  // nullptr when absent.
  const TensorInfo* Find(std::string_view name) const;
  // The tensor's raw little-endian bytes; valid while this object lives.
  const uint8_t* Data(const TensorInfo& info) const;
  // Converts a floating tensor (F64/F32/F16/BF16) to float32. NotFound / InvalidArgument. The
  // tensor's pages are released afterwards (ReleasePages).
  StatusOr<std::vector<float>> ReadF32(std::string_view name) const;
  // The same into `out`, which holds exactly numel() floats (a caller-owned tensor: no second
  // copy). InvalidArgument when `count` differs from the tensor's element count.
  Status ReadF32Into(std::string_view name, float* out, size_t count) const;
  // Rows `rows` of a 2-D floating tensor converted to float32 ([rows.size(), cols], row-major),
  // reading only those rows. NotFound / InvalidArgument (not 2-D, not floating) / OutOfRange (a
  // row index outside the tensor), naming the file and the tensor.
  StatusOr<std::vector<float>> ReadRowsF32(std::string_view name,
                                           const std::vector<int64_t>& rows) const;
  // Drops the tensor's pages from this process's resident memory; they stay in the page cache
  // and a later access reads them again. Streaming a checkpoint block by block thereby keeps one
  // block resident, not every block read so far.
  void ReleasePages(const TensorInfo& info) const;
  // The same for bytes [begin, end) of the tensor's data (a table streamed in pieces).
  void ReleasePages(const TensorInfo& info, uint64_t begin, uint64_t end) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  SafetensorsHeader header_;
  const uint8_t* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, size_t, std::less<>> index_;
};

// Collects tensors (copied in, or streamed: AddStreamed) and writes one safetensors file
// atomically. Tensors are written in the order added; the header is padded with spaces to a
// multiple of 8 bytes.
class SafetensorsWriter {
 public:
  // Appends the next `size` bytes of a streamed tensor to the file.
  using ByteSink = std::function<Status(const void* data, size_t size)>;
  // Hands a streamed tensor's bytes, in order and in pieces of any size, to the sink.
  using Producer = std::function<Status(const ByteSink& sink)>;

  // InvalidArgument when the name is duplicate/empty or nbytes != product(shape) * dtype size.
  Status Add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data,
             size_t nbytes);
  Status AddF32(std::string name, std::vector<int64_t> shape, const float* data);
  // Declares a tensor whose bytes `produce` hands over while the file is written, so the writer
  // never holds them (a 128k-row embedding table copied from its source, or transformed row
  // chunk by row chunk). Write runs each producer once, in the tensors' order; a producer that
  // hands more or fewer than product(shape)·dtype-size bytes fails the write (Internal, naming
  // the tensor), and its error fails the write as well (the file is then not created).
  Status AddStreamed(std::string name, DType dtype, std::vector<int64_t> shape,
                     Producer produce);
  void SetMetadata(std::string key, std::string value);
  // Declares a tensor whose bytes the caller writes into the file itself, at
  // Prefix().size() + its offset in the data section (a file filled in place, e.g. by several
  // processes each writing its rows). Write() refuses a writer holding one.
  Status Reserve(std::string name, DType dtype, std::vector<int64_t> shape);
  // Where tensor `name`'s bytes start in the data section (add Prefix().size() for the file
  // offset); NotFound for a name not added.
  StatusOr<uint64_t> DataOffset(const std::string& name) const;
  // Total bytes of tensor data added (or reserved) so far.
  uint64_t data_bytes() const { return data_bytes_; }
  // The file's first bytes: the 8-byte header length and the JSON header padded to 8 bytes.
  // `path` names the file in errors.
  StatusOr<std::string> Prefix(const std::string& path) const;
  // Writes the whole file atomically. Returns the FNV-1a checksum of the bytes written (the
  // journal's shard checksum, common/hash.h), computed as they are written.
  StatusOr<std::string> WriteWithChecksum(const std::string& path) const;
  Status Write(const std::string& path) const { return WriteWithChecksum(path).status(); }

 private:
  struct Entry {
    std::string name;
    DType dtype;
    std::vector<int64_t> shape;
    std::string bytes;  // empty for a reserved or streamed entry
    uint64_t nbytes = 0;
    bool reserved = false;
    Producer produce;   // streamed entries only
  };
  // The checks every new entry gets (name, no duplicate); its byte count from shape and dtype.
  StatusOr<uint64_t> CheckNewEntry(const std::string& name, DType dtype,
                                   const std::vector<int64_t>& shape) const;
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  uint64_t data_bytes_ = 0;
};

// A checkpoint directory: either model.safetensors alone, or model.safetensors.index.json naming
// the shard of every tensor ({"metadata": {...}, "weight_map": {name: file}}). Shards are opened
// lazily on first access. Thread-compatible (external locking for concurrent first access).
class CheckpointReader {
 public:
  // A finished qcal output's index carries each shard's checksum (metadata.qcal_fnv1a64); then
  // every shard is verified when first opened, and one changed after the job finished (a stale
  // writer, a bad copy) is DataLoss naming the file, never loaded.
  static StatusOr<std::unique_ptr<CheckpointReader>> Open(const std::string& dir);
  // A reader over some shard files of `dir` (plain file names), without an index: what a job
  // reads back from an output directory that is not finalized yet. Errors name the file.
  static StatusOr<std::unique_ptr<CheckpointReader>> OpenShards(
      const std::string& dir, const std::vector<std::string>& shard_names);

  const std::string& dir() const { return dir_; }
  bool Has(std::string_view name) const;
  std::vector<std::string> TensorNames() const;  // sorted
  // Info + the file holding it. NotFound naming the tensor and the directory.
  StatusOr<std::pair<const SafetensorsFile*, const TensorInfo*>> Find(std::string_view name);
  StatusOr<std::vector<float>> ReadF32(std::string_view name);
  StatusOr<std::vector<float>> ReadRowsF32(std::string_view name,
                                           const std::vector<int64_t>& rows);
  // Opens every shard now and checks that the index and the shards agree: every listed tensor is
  // in its shard and no shard holds a tensor the index does not list for it. InvalidArgument
  // (or the shard's own open/parse error) naming the file and the tensor.
  Status Validate();

 private:
  // The opened shard `shard_name` (a file in dir_), opening and caching it on first use.
  StatusOr<const SafetensorsFile*> Shard(const std::string& shard_name);

  std::string dir_;
  std::map<std::string, std::string, std::less<>> weight_map_;  // tensor -> shard file name
  std::map<std::string, std::unique_ptr<SafetensorsFile>> shards_;
  // From the index's metadata.qcal_fnv1a64 (a finished qcal output): each listed shard's bytes
  // are checked once, when it is first opened; a mismatch is DataLoss naming the shard.
  std::map<std::string, std::string> checksums_;
};

// Hands the stored bytes of tensor `info` of `file` to `sink` in 64 MiB pieces, releasing each
// piece's pages once handed over (a table streamed into another file costs one piece).
Status SinkStoredBytes(const SafetensorsFile& file, const TensorInfo& info,
                       const SafetensorsWriter::ByteSink& sink);

// Adds tensor `info` of `file` to `writer` under `name` exactly as stored (dtype, shape and
// bytes), streamed from the file in pieces whose pages are released once written: copying a
// table costs no memory beyond a piece.
Status AddCopiedTensor(SafetensorsWriter* writer, std::string name, const SafetensorsFile& file,
                       const TensorInfo& info);

// Writes model.safetensors.index.json (atomically) for shards already written into `dir`:
// `weight_map` maps tensor name -> shard file name; total_size is the sum of tensor bytes.
// `checksums` (shard file name -> Fnv1aHex of its bytes), when given, go into
// metadata.qcal_fnv1a64: a reader then refuses a listed shard whose bytes changed.
Status WriteCheckpointIndex(const std::string& dir,
                            const std::map<std::string, std::string>& weight_map,
                            uint64_t total_size,
                            const std::map<std::string, std::string>& checksums = {});

}  // namespace qcal
