#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "common/io_util.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/utf8.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors data is little-endian; qcal reads it in place and supports little-endian hosts only"
#endif

namespace qcal {
namespace {

using io::ErrnoError;
using io::JsonParseErrorMessage;
using io::Printable;
using io::ScopedFd;
using io::ToAbsl;

using json = nlohmann::json;

constexpr char kIndexFileName[] = "model.safetensors.index.json";
constexpr char kSingleFileName[] = "model.safetensors";

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

absl::string_view DTypeStr(DType dtype) { return ToAbsl(DTypeName(dtype)); }

std::string JoinPath(absl::string_view dir, absl::string_view name) {
  if (dir.empty()) return std::string(name);
  if (dir.back() == '/') return absl::StrCat(dir, name);
  return absl::StrCat(dir, "/", name);
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

std::string RangeString(uint64_t begin, uint64_t end) {
  return absl::StrCat("[", begin, ", ", end, ")");
}

// nlohmann's type names, plus the distinction between integers and other numbers.
std::string JsonTypeName(const json& value) {
  if (value.is_number_integer()) return "integer";
  if (value.is_number_float()) return "number";
  return value.type_name();
}

// Bytes occupied by a tensor of `shape` x `dtype`, with every multiplication overflow-checked.
// Shapes with a zero dimension hold no bytes whatever their other dimensions.
StatusOr<uint64_t> ShapeBytes(const std::vector<int64_t>& shape, DType dtype) {
  for (int64_t dim : shape) {
    if (dim < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has a negative dimension ", dim));
    }
  }
  if (std::find(shape.begin(), shape.end(), int64_t{0}) != shape.end()) return uint64_t{0};
  uint64_t numel = 1;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dim), &numel) ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return absl::InvalidArgumentError(
          absl::StrCat("shape ", ShapeString(shape), " has too many elements (overflow)"));
    }
  }
  uint64_t bytes = 0;
  if (__builtin_mul_overflow(numel, static_cast<uint64_t>(DTypeSize(dtype)), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeString(shape), " x ",
                                                   DTypeStr(dtype), " overflows 64 bits"));
  }
  return bytes;
}

// Reads a JSON integer as int64 / uint64 without exceptions. Returns false for anything else
// (floats, strings, ...) or values out of the target range.
// Unsigned is tested first in both: get_ptr<number_integer_t*> also answers for unsigned values
// (reinterpreting the bits as signed).
bool JsonToInt64(const json& value, int64_t* out) {
  if (const auto* u = value.get_ptr<const json::number_unsigned_t*>()) {
    if (*u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    *out = static_cast<int64_t>(*u);
    return true;
  }
  if (const auto* i = value.get_ptr<const json::number_integer_t*>()) {
    *out = *i;
    return true;
  }
  return false;
}

bool JsonToUint64(const json& value, uint64_t* out) {
  if (const auto* u = value.get_ptr<const json::number_unsigned_t*>()) {
    *out = *u;
    return true;
  }
  if (const auto* i = value.get_ptr<const json::number_integer_t*>()) {
    if (*i < 0) return false;
    *out = static_cast<uint64_t>(*i);
    return true;
  }
  return false;
}

// Validates one header entry. Errors are returned without the file prefix; the caller adds it.
StatusOr<TensorInfo> ParseTensorEntry(const std::string& name, const json& entry,
                                      uint64_t data_size) {
  auto error = [&name](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", Printable(name), "': ", what));
  };
  if (!entry.is_object()) {
    return error(absl::StrCat("entry must be a JSON object, got ", JsonTypeName(entry)));
  }
  for (auto it = entry.begin(); it != entry.end(); ++it) {
    if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
      return error(absl::StrCat("unexpected key '", Printable(it.key()),
                                "' (expected dtype, shape, data_offsets)"));
    }
  }
  const auto dtype_it = entry.find("dtype");
  const auto shape_it = entry.find("shape");
  const auto offsets_it = entry.find("data_offsets");
  if (dtype_it == entry.end()) return error("missing 'dtype'");
  if (shape_it == entry.end()) return error("missing 'shape'");
  if (offsets_it == entry.end()) return error("missing 'data_offsets'");

  TensorInfo info;
  info.name = name;

  const auto* dtype_name = dtype_it->get_ptr<const json::string_t*>();
  if (dtype_name == nullptr) {
    return error(absl::StrCat("dtype must be a string, got ", JsonTypeName(*dtype_it)));
  }
  StatusOr<DType> dtype = ParseDType(*dtype_name);
  if (!dtype.ok()) {
    return error(absl::StrCat("unknown dtype '", Printable(*dtype_name),
                              "' (known: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL)"));
  }
  info.dtype = *dtype;

  if (!shape_it->is_array()) {
    return error(absl::StrCat("shape must be a list of integers, got ", JsonTypeName(*shape_it)));
  }
  for (const json& dim : *shape_it) {
    int64_t value = 0;
    if (!JsonToInt64(dim, &value)) {
      if (dim.is_number_unsigned()) return error("shape has a dimension too large for int64");
      return error(absl::StrCat("shape must be a list of integers, found ", JsonTypeName(dim)));
    }
    if (value < 0) {
      info.shape.push_back(value);
      return error(absl::StrCat("shape ", ShapeString(info.shape), "... has a negative dimension ",
                                value));
    }
    info.shape.push_back(value);
  }

  if (!offsets_it->is_array() || offsets_it->size() != 2 ||
      !JsonToUint64((*offsets_it)[0], &info.begin) || !JsonToUint64((*offsets_it)[1], &info.end)) {
    std::string got = JsonTypeName(*offsets_it);
    if (offsets_it->is_array()) {
      got = absl::StrCat("a list of ", offsets_it->size(), " element(s)");
      if (offsets_it->size() == 2) got += " that are not both non-negative integers";
    }
    return error(absl::StrCat("data_offsets must be a list of two non-negative integers, got ",
                              got));
  }
  if (info.begin > info.end) {
    return error(absl::StrCat("data_offsets ", RangeString(info.begin, info.end),
                              " are reversed (begin > end)"));
  }

  StatusOr<uint64_t> expected = ShapeBytes(info.shape, info.dtype);
  if (!expected.ok()) return error(expected.status().message());
  if (*expected != info.end - info.begin) {
    return error(absl::StrCat("data_offsets ", RangeString(info.begin, info.end),
                              " do not match shape ", ShapeString(info.shape), " x ",
                              DTypeStr(info.dtype), " (", *expected, " bytes)"));
  }
  if (info.end > data_size) {
    return error(absl::StrCat("data_offsets ", RangeString(info.begin, info.end),
                              " extend past the end of the data section (", data_size,
                              " bytes; is the file truncated?)"));
  }
  return info;
}

Status ParseHeaderImpl(std::string_view header_json, uint64_t data_size,
                       SafetensorsHeader* header) {
  const json root = json::parse(header_json.data(), header_json.data() + header_json.size(),
                                /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header is not valid JSON: ", JsonParseErrorMessage(header_json)));
  }
  if (!root.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("header must be a JSON object, got ", JsonTypeName(root)));
  }
  for (auto it = root.begin(); it != root.end(); ++it) {
    if (it.key() == "__metadata__") {
      const json& metadata = it.value();
      if (!metadata.is_object()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "__metadata__ must be an object of strings, got ", JsonTypeName(metadata)));
      }
      for (auto m = metadata.begin(); m != metadata.end(); ++m) {
        const auto* value = m.value().get_ptr<const json::string_t*>();
        if (value == nullptr) {
          return absl::InvalidArgumentError(
              absl::StrCat("__metadata__ value for key '", Printable(m.key()),
                           "' must be a string, got ", JsonTypeName(m.value())));
        }
        header->metadata.emplace(m.key(), *value);
      }
      continue;
    }
    QCAL_ASSIGN_OR_RETURN(TensorInfo info, ParseTensorEntry(it.key(), it.value(), data_size));
    header->tensors.push_back(std::move(info));
  }

  // Sort by range (name breaks ties between empty tensors) and require the ranges to tile the
  // data section exactly: each starts where the previous one ended, the last ends at data_size.
  std::sort(header->tensors.begin(), header->tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) {
              return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
            });
  uint64_t covered = 0;
  const TensorInfo* previous = nullptr;
  for (const TensorInfo& info : header->tensors) {
    if (info.begin < covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", Printable(info.name), "': data_offsets ", RangeString(info.begin, info.end),
          " overlap tensor '", Printable(previous->name), "' ",
          RangeString(previous->begin, previous->end)));
    }
    if (info.begin > covered) {
      return absl::InvalidArgumentError(
          absl::StrCat("hole in the data section: bytes ", RangeString(covered, info.begin),
                       " belong to no tensor (before tensor '", Printable(info.name), "')"));
    }
    covered = info.end;
    previous = &info;
  }
  if (covered != data_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("hole in the data section: bytes ", RangeString(covered, data_size),
                     " at its end belong to no tensor"));
  }
  return absl::OkStatus();
}

uint64_t ReadLittleEndian64(const uint8_t* bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

template <typename T>
T LoadUnaligned(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Parsing
// ---------------------------------------------------------------------------------------------

int64_t TensorInfo::numel() const {
  // A zero dimension makes the product 0 even when the other dimensions would overflow (the
  // parser accepts such shapes); unsigned arithmetic keeps unvalidated infos free of UB.
  uint64_t n = 1;
  for (int64_t dim : shape) {
    if (dim == 0) return 0;
    n *= static_cast<uint64_t>(dim);
  }
  return static_cast<int64_t>(n);
}

StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view header_json,
                                                   uint64_t data_size, std::string_view source) {
  SafetensorsHeader header;
  header.data_offset = 8 + header_json.size();
  Status status = ParseHeaderImpl(header_json, data_size, &header);
  if (!status.ok()) return Annotate(status, ToAbsl(source));
  return header;
}

StatusOr<SafetensorsHeader> ParseSafetensors(const uint8_t* bytes, size_t size,
                                             std::string_view source_view) {
  const absl::string_view source = ToAbsl(source_view);
  if (size < 8) {
    return absl::DataLossError(absl::StrCat(
        source, ": file is ", size, " bytes, too short to hold the 8-byte header length"));
  }
  const uint64_t header_len = ReadLittleEndian64(bytes);
  if (header_len > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": header length ", header_len,
                                                   " exceeds the limit of ",
                                                   kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (header_len > size - 8) {
    return absl::DataLossError(absl::StrCat(source, ": header length ", header_len,
                                            " extends past the end of the file (", size,
                                            " bytes; is the file truncated?)"));
  }
  const std::string_view header_json(reinterpret_cast<const char*>(bytes + 8), header_len);
  return ParseSafetensorsHeader(header_json, size - 8 - header_len, source_view);
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile
// ---------------------------------------------------------------------------------------------

StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  ScopedFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoError(errno, path, "cannot open safetensors file");
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, path, "cannot stat");
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  if (size < 8) {
    // mmap cannot map an empty file; the parser reports the short file from the size alone.
    const uint8_t empty[8] = {};
    return ParseSafetensors(empty, size, path).status();
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (map == MAP_FAILED) return ErrnoError(errno, path, "mmap failed");
  // From here the destructor unmaps, whichever way this function returns.
  file->map_ = static_cast<const uint8_t*>(map);
  file->map_size_ = size;
  QCAL_ASSIGN_OR_RETURN(file->header_, ParseSafetensors(file->map_, size, path));
  for (size_t i = 0; i < file->header_.tensors.size(); ++i) {
    file->index_.emplace(file->header_.tensors[i].name, i);
  }
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(const_cast<uint8_t*>(map_), map_size_);
}

const TensorInfo* SafetensorsFile::Find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

const uint8_t* SafetensorsFile::Data(const TensorInfo& info) const {
  return map_ + header_.data_offset + info.begin;
}

StatusOr<std::vector<float>> SafetensorsFile::ReadF32(std::string_view name) const {
  const TensorInfo* info = Find(name);
  std::vector<float> out(info == nullptr ? 0 : static_cast<size_t>(info->numel()));
  QCAL_RETURN_IF_ERROR(ReadF32Into(name, out.data(), out.size()));
  return out;
}

Status SafetensorsFile::ReadF32Into(std::string_view name, float* out, size_t count) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named '", ToAbsl(name), "'"));
  }
  if (!IsFloatingDType(info->dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor '", ToAbsl(name), "' has dtype ", DTypeStr(info->dtype),
                     "; ReadF32 converts only F64, F32, F16 and BF16"));
  }
  if (static_cast<size_t>(info->numel()) != count) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": tensor '", ToAbsl(name), "' has ",
                                                   info->numel(), " elements, not ", count));
  }
  ConvertToF32(info->dtype, Data(*info), count, out);
  ReleasePages(*info);
  return absl::OkStatus();
}

StatusOr<std::vector<float>> SafetensorsFile::ReadRowsF32(std::string_view name,
                                                          const std::vector<int64_t>& rows) const {
  const TensorInfo* info = Find(name);
  if (info == nullptr) {
    return absl::NotFoundError(absl::StrCat(path_, ": no tensor named '", ToAbsl(name), "'"));
  }
  if (!IsFloatingDType(info->dtype) || info->shape.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": tensor '", ToAbsl(name), "' is ", DTypeStr(info->dtype), " with ",
                     info->shape.size(), " dims; rows are read from 2-D F64/F32/F16/BF16 tensors"));
  }
  const int64_t num_rows = info->shape[0], cols = info->shape[1];
  const size_t row_bytes = static_cast<size_t>(cols) * DTypeSize(info->dtype);
  std::vector<float> out(rows.size() * static_cast<size_t>(cols));
  const uint8_t* base = Data(*info);
  for (size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= num_rows) {
      return absl::OutOfRangeError(absl::StrCat(path_, ": tensor '", ToAbsl(name), "' has ",
                                                num_rows, " rows; row ", rows[i],
                                                " was asked for"));
    }
    ConvertToF32(info->dtype, base + static_cast<size_t>(rows[i]) * row_bytes,
                 static_cast<size_t>(cols), out.data() + i * cols);
  }
  return out;
}

void SafetensorsFile::ReleasePages(const TensorInfo& info) const {
  ReleasePages(info, 0, info.nbytes());
}

void SafetensorsFile::ReleasePages(const TensorInfo& info, uint64_t from, uint64_t to) const {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  to = std::min<uint64_t>(to, info.nbytes());
  if (from >= to) return;
  // Whole pages inside the range only: neighbours may still be in use.
  const uintptr_t begin = reinterpret_cast<uintptr_t>(Data(info)) + from;
  const uintptr_t end = begin + (to - from);
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = end / page * page;
  if (last > first) {
    ::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
  }
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter
// ---------------------------------------------------------------------------------------------

StatusOr<uint64_t> SafetensorsWriter::CheckNewEntry(const std::string& name, DType dtype,
                                                    const std::vector<int64_t>& shape) const {
  if (name.empty()) return absl::InvalidArgumentError("SafetensorsWriter: empty tensor name");
  if (name == "__metadata__") {
    return absl::InvalidArgumentError(
        "SafetensorsWriter: '__metadata__' is reserved and cannot name a tensor");
  }
  if (!IsValidUtf8(name)) {
    return absl::InvalidArgumentError(absl::StrCat("SafetensorsWriter: tensor name '",
                                                   Printable(name), "' is not valid UTF-8"));
  }
  for (const Entry& entry : entries_) {
    if (entry.name == name) {
      return absl::InvalidArgumentError(
          absl::StrCat("SafetensorsWriter: duplicate tensor name '", name, "'"));
    }
  }
  StatusOr<uint64_t> bytes = ShapeBytes(shape, dtype);
  if (!bytes.ok()) {
    return Annotate(bytes.status(), absl::StrCat("SafetensorsWriter: tensor '", name, "'"));
  }
  return *bytes;
}

Status SafetensorsWriter::Add(std::string name, DType dtype, std::vector<int64_t> shape,
                              const void* data, size_t nbytes) {
  QCAL_ASSIGN_OR_RETURN(const uint64_t expected, CheckNewEntry(name, dtype, shape));
  if (expected != nbytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SafetensorsWriter: tensor '", name, "': ", nbytes, " bytes given for shape ",
        ShapeString(shape), " x ", DTypeStr(dtype), " (", expected, " bytes)"));
  }
  if (nbytes > 0 && data == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("SafetensorsWriter: tensor '", name, "': null data for ", nbytes, " bytes"));
  }
  Entry entry;
  entry.name = std::move(name);
  entry.dtype = dtype;
  entry.shape = std::move(shape);
  if (nbytes > 0) entry.bytes.assign(static_cast<const char*>(data), nbytes);
  entry.nbytes = nbytes;
  entries_.push_back(std::move(entry));
  data_bytes_ += nbytes;
  return absl::OkStatus();
}

Status SafetensorsWriter::AddF32(std::string name, std::vector<int64_t> shape, const float* data) {
  StatusOr<uint64_t> bytes = ShapeBytes(shape, DType::kF32);
  if (!bytes.ok()) {
    return Annotate(bytes.status(), absl::StrCat("SafetensorsWriter: tensor '", name, "'"));
  }
  return Add(std::move(name), DType::kF32, std::move(shape), data, static_cast<size_t>(*bytes));
}

void SafetensorsWriter::SetMetadata(std::string key, std::string value) {
  metadata_[std::move(key)] = std::move(value);
}

Status SafetensorsWriter::Reserve(std::string name, DType dtype, std::vector<int64_t> shape) {
  QCAL_ASSIGN_OR_RETURN(const uint64_t bytes, CheckNewEntry(name, dtype, shape));
  Entry entry;
  entry.name = std::move(name);
  entry.dtype = dtype;
  entry.shape = std::move(shape);
  entry.nbytes = bytes;
  entry.reserved = true;
  entries_.push_back(std::move(entry));
  data_bytes_ += bytes;
  return absl::OkStatus();
}

Status SafetensorsWriter::AddStreamed(std::string name, DType dtype, std::vector<int64_t> shape,
                                      Producer produce) {
  QCAL_ASSIGN_OR_RETURN(const uint64_t bytes, CheckNewEntry(name, dtype, shape));
  if (!produce) {
    return absl::InvalidArgumentError(
        absl::StrCat("SafetensorsWriter: tensor '", name, "': no producer for its bytes"));
  }
  Entry entry;
  entry.name = std::move(name);
  entry.dtype = dtype;
  entry.shape = std::move(shape);
  entry.nbytes = bytes;
  entry.produce = std::move(produce);
  entries_.push_back(std::move(entry));
  data_bytes_ += bytes;
  return absl::OkStatus();
}

StatusOr<uint64_t> SafetensorsWriter::DataOffset(const std::string& name) const {
  uint64_t offset = 0;
  for (const Entry& entry : entries_) {  // the order Prefix() lays them out in
    if (entry.name == name) return offset;
    offset += entry.nbytes;
  }
  return absl::NotFoundError(absl::StrCat("SafetensorsWriter: no tensor '", Printable(name), "'"));
}

StatusOr<std::string> SafetensorsWriter::Prefix(const std::string& path) const {
  json header = json::object();
  if (!metadata_.empty()) {
    json metadata = json::object();
    for (const auto& [key, value] : metadata_) {
      if (!IsValidUtf8(key) || !IsValidUtf8(value)) {
        return absl::InvalidArgumentError(absl::StrCat(
            path, ": __metadata__ entry '", Printable(key), "' is not valid UTF-8"));
      }
      metadata[key] = value;
    }
    header["__metadata__"] = std::move(metadata);
  }
  uint64_t offset = 0;
  for (const Entry& entry : entries_) {
    json tensor = json::object();
    tensor["dtype"] = std::string(DTypeName(entry.dtype));
    tensor["shape"] = entry.shape;
    const uint64_t end = offset + entry.nbytes;
    tensor["data_offsets"] = json::array({offset, end});
    header[entry.name] = std::move(tensor);
    offset = end;
  }
  // Every string was checked to be UTF-8, so dump() has nothing to throw about.
  std::string text = header.dump(-1, ' ', false, json::error_handler_t::replace);
  // Pad with spaces so the data section starts 8-byte aligned (8 + N is then a multiple of 8).
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxSafetensorsHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": header would be ", text.size(),
                                                   " bytes, over the limit of ",
                                                   kMaxSafetensorsHeaderBytes));
  }
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>(text.size() >> (8 * i));
  return prefix + text;
}

StatusOr<std::string> SafetensorsWriter::WriteWithChecksum(const std::string& path) const {
  for (const Entry& entry : entries_) {
    if (entry.reserved) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, ": tensor '", entry.name, "' is reserved; its bytes are written in place"));
    }
  }
  QCAL_ASSIGN_OR_RETURN(std::string prefix, Prefix(path));
  QCAL_ASSIGN_OR_RETURN(std::unique_ptr<AtomicFileWriter> writer, AtomicFileWriter::Open(path));
  Fnv1a sum;
  sum.Update(prefix.data(), prefix.size());
  QCAL_RETURN_IF_ERROR(writer->Append(prefix));
  for (const Entry& entry : entries_) {
    if (!entry.produce) {
      sum.Update(entry.bytes.data(), entry.bytes.size());
      QCAL_RETURN_IF_ERROR(writer->Append(entry.bytes));
      continue;
    }
    uint64_t handed = 0;
    const ByteSink sink = [&](const void* data, size_t size) -> Status {
      if (size == 0) return absl::OkStatus();
      if (size > entry.nbytes - handed) {
        return absl::InternalError(absl::StrCat(path, ": tensor '", entry.name, "': its producer ",
                                                "handed more than its ", entry.nbytes, " bytes"));
      }
      handed += size;
      sum.Update(data, size);
      return writer->Append(data, size);
    };
    QCAL_RETURN_IF_ERROR(Annotate(entry.produce(sink), absl::StrCat(path, ": tensor '",
                                                                    entry.name, "'")));
    if (handed != entry.nbytes) {
      return absl::InternalError(absl::StrCat(path, ": tensor '", entry.name, "': its producer ",
                                              "handed ", handed, " of its ", entry.nbytes,
                                              " bytes"));
    }
  }
  QCAL_RETURN_IF_ERROR(writer->Commit());
  return sum.Hex();
}

Status SinkStoredBytes(const SafetensorsFile& file, const TensorInfo& info,
                       const SafetensorsWriter::ByteSink& sink) {
  constexpr uint64_t kPiece = uint64_t{64} << 20;
  const uint8_t* data = file.Data(info);
  for (uint64_t at = 0; at < info.nbytes(); at += kPiece) {
    const uint64_t n = std::min(kPiece, info.nbytes() - at);
    QCAL_RETURN_IF_ERROR(sink(data + at, n));
    file.ReleasePages(info, at, at + n);
  }
  return absl::OkStatus();
}

Status AddCopiedTensor(SafetensorsWriter* writer, std::string name, const SafetensorsFile& file,
                       const TensorInfo& info) {
  const SafetensorsFile* f = &file;
  const TensorInfo* t = &info;
  return writer->AddStreamed(std::move(name), info.dtype, info.shape,
                             [f, t](const SafetensorsWriter::ByteSink& sink) {
                               return SinkStoredBytes(*f, *t, sink);
                             });
}

// ---------------------------------------------------------------------------------------------
// CheckpointReader
// ---------------------------------------------------------------------------------------------

namespace {

// A shard named by an index must be a plain file name inside the checkpoint directory.
bool IsPlainFileName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(const std::string& dir) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return ErrnoError(errno, dir, "cannot open checkpoint directory");
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": not a directory"));
  }
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->dir_ = dir;

  const std::string index_path = JoinPath(dir, kIndexFileName);
  const std::string single_path = JoinPath(dir, kSingleFileName);
  if (PathExists(index_path)) {
    QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(index_path));
    const json index = json::parse(text.data(), text.data() + text.size(), nullptr, false);
    if (index.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": not valid JSON: ", JsonParseErrorMessage(text)));
    }
    if (!index.is_object()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": must be a JSON object, got ", JsonTypeName(index)));
    }
    const auto metadata = index.find("metadata");
    if (metadata != index.end() && !metadata->is_object() && !metadata->is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_path, ": 'metadata' must be an object, got ", JsonTypeName(*metadata)));
    }
    if (metadata != index.end() && metadata->is_object()) {
      const auto sums = metadata->find("qcal_fnv1a64");
      if (sums != metadata->end()) {
        if (!sums->is_object()) {
          return absl::InvalidArgumentError(absl::StrCat(
              index_path, ": 'metadata.qcal_fnv1a64' must be an object, got ",
              JsonTypeName(*sums)));
        }
        for (auto it = sums->begin(); it != sums->end(); ++it) {
          const auto* hex = it.value().get_ptr<const json::string_t*>();
          if (hex == nullptr || hex->size() != 16 ||
              hex->find_first_not_of("0123456789abcdef") != std::string::npos) {
            return absl::InvalidArgumentError(absl::StrCat(
                index_path, ": metadata.qcal_fnv1a64 entry for '", Printable(it.key()),
                "' must be 16 lower-case hex digits"));
          }
          reader->checksums_.emplace(it.key(), *hex);
        }
      }
    }
    const auto weight_map = index.find("weight_map");
    if (weight_map == index.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": missing required field 'weight_map'"));
    }
    if (!weight_map->is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(
          index_path, ": 'weight_map' must be an object, got ", JsonTypeName(*weight_map)));
    }
    std::set<std::string> checked_shards;
    for (auto it = weight_map->begin(); it != weight_map->end(); ++it) {
      const auto* shard = it.value().get_ptr<const json::string_t*>();
      if (shard == nullptr || !IsPlainFileName(*shard)) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": weight_map entry for tensor '", Printable(it.key()),
            "' must be the file name of a shard in the same directory, got ",
            shard == nullptr ? JsonTypeName(it.value())
                             : absl::StrCat("'", Printable(*shard), "'")));
      }
      if (checked_shards.insert(*shard).second && !PathExists(JoinPath(dir, *shard))) {
        return absl::NotFoundError(absl::StrCat(index_path, ": names shard '", Printable(*shard),
                                                "' (for tensor '", Printable(it.key()),
                                                "'), which does not exist in ", dir));
      }
      reader->weight_map_.emplace(it.key(), *shard);
    }
  } else if (PathExists(single_path)) {
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(single_path));
    for (const TensorInfo& info : file->tensors()) {
      reader->weight_map_.emplace(info.name, kSingleFileName);
    }
    reader->shards_.emplace(kSingleFileName, std::move(file));
  } else {
    return absl::NotFoundError(absl::StrCat(dir, ": no checkpoint files found (neither ",
                                            kIndexFileName, " nor ", kSingleFileName, ")"));
  }
  return reader;
}

StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::OpenShards(
    const std::string& dir, const std::vector<std::string>& shard_names) {
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->dir_ = dir;
  for (const std::string& name : shard_names) {
    if (!IsPlainFileName(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, ": shard name '", Printable(name), "' is not a plain file name"));
    }
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file,
                          SafetensorsFile::Open(JoinPath(dir, name)));
    for (const TensorInfo& info : file->tensors()) {
      if (!reader->weight_map_.emplace(info.name, name).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            JoinPath(dir, name), ": tensor '", info.name, "' is also in another shard"));
      }
    }
    reader->shards_.emplace(name, std::move(file));
  }
  return reader;
}

bool CheckpointReader::Has(std::string_view name) const {
  return weight_map_.find(name) != weight_map_.end();
}

std::vector<std::string> CheckpointReader::TensorNames() const {
  std::vector<std::string> names;
  names.reserve(weight_map_.size());
  for (const auto& [name, shard] : weight_map_) names.push_back(name);
  return names;
}

StatusOr<const SafetensorsFile*> CheckpointReader::Shard(const std::string& shard_name) {
  auto it = shards_.find(shard_name);
  if (it == shards_.end()) {
    const std::string path = JoinPath(dir_, shard_name);
    const auto want = checksums_.find(shard_name);
    if (want != checksums_.end()) {
      QCAL_ASSIGN_OR_RETURN(std::string got, FileFnv1aHex(path));
      if (got != want->second) {
        return absl::DataLossError(absl::StrCat(
            path, ": checksum ", got, " does not match ", want->second, " recorded in ",
            JoinPath(dir_, kIndexFileName),
            " when the job finished: the shard was changed afterwards; re-run the job (its "
            "journal redoes the block) or restore the file"));
      }
    }
    QCAL_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
    it = shards_.emplace(shard_name, std::move(file)).first;
  }
  return it->second.get();
}

StatusOr<std::pair<const SafetensorsFile*, const TensorInfo*>> CheckpointReader::Find(
    std::string_view name) {
  const auto it = weight_map_.find(name);
  if (it == weight_map_.end()) {
    return absl::NotFoundError(
        absl::StrCat(dir_, ": no tensor named '", ToAbsl(name), "' in the checkpoint"));
  }
  QCAL_ASSIGN_OR_RETURN(const SafetensorsFile* file, Shard(it->second));
  const TensorInfo* info = file->Find(name);
  if (info == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        JoinPath(dir_, kIndexFileName), ": lists tensor '", ToAbsl(name), "' in shard '", it->second,
        "', but that shard has no such tensor"));
  }
  return std::make_pair(file, info);
}

StatusOr<std::vector<float>> CheckpointReader::ReadRowsF32(std::string_view name,
                                                           const std::vector<int64_t>& rows) {
  QCAL_ASSIGN_OR_RETURN(auto found, Find(name));
  return found.first->ReadRowsF32(name, rows);
}

StatusOr<std::vector<float>> CheckpointReader::ReadF32(std::string_view name) {
  QCAL_ASSIGN_OR_RETURN(auto found, Find(name));
  return found.first->ReadF32(name);
}

Status CheckpointReader::Validate() {
  std::map<std::string, std::set<std::string, std::less<>>> listed;  // shard -> tensors
  for (const auto& [name, shard] : weight_map_) listed[shard].insert(name);
  for (const auto& [shard_name, names] : listed) {
    QCAL_ASSIGN_OR_RETURN(const SafetensorsFile* file, Shard(shard_name));
    for (const std::string& name : names) {
      if (file->Find(name) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            JoinPath(dir_, kIndexFileName), ": lists tensor '", name, "' in shard '", shard_name,
            "', but that shard has no such tensor"));
      }
    }
    for (const TensorInfo& info : file->tensors()) {
      if (names.find(info.name) == names.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file->path(), ": holds tensor '", Printable(info.name),
                         "', which the checkpoint index does not list for this shard"));
      }
    }
  }
  return absl::OkStatus();
}

Status WriteCheckpointIndex(const std::string& dir,
                            const std::map<std::string, std::string>& weight_map,
                            uint64_t total_size,
                            const std::map<std::string, std::string>& checksums) {
  const std::string index_path = JoinPath(dir, kIndexFileName);
  json map = json::object();
  for (const auto& [name, shard] : weight_map) {
    if (!IsValidUtf8(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, ": tensor name '", Printable(name), "' is not valid UTF-8"));
    }
    if (!IsPlainFileName(shard) || !IsValidUtf8(shard)) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": shard '", Printable(shard),
                                                     "' for tensor '", name,
                                                     "' must be a plain file name"));
    }
    map[name] = shard;
  }
  json index = json::object();
  index["metadata"] = json::object({{"total_size", total_size}});
  if (!checksums.empty()) {
    json sums = json::object();
    for (const auto& [shard, hex] : checksums) {
      if (!IsPlainFileName(shard) || !IsValidUtf8(shard)) {
        return absl::InvalidArgumentError(absl::StrCat(
            index_path, ": checksum for '", Printable(shard), "', which is not a plain file name"));
      }
      sums[shard] = hex;
    }
    index["metadata"]["qcal_fnv1a64"] = std::move(sums);
  }
  index["weight_map"] = std::move(map);
  // nlohmann's default object is a std::map, so keys come out sorted.
  std::string text = index.dump(2, ' ', false, json::error_handler_t::replace);
  text.push_back('\n');
  return WriteFileAtomic(index_path, text);
}

}  // namespace qcal
