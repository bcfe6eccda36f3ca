#include "common/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <functional>
#include <queue>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "common/utf8.h"

namespace qcal {
namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// UTF-8 helpers. Text is made well-formed (U+FFFD per malformed byte) before anything else, so
// the helpers below may assume it.

constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";

std::string MakeWellFormed(std::string_view text) {
  size_t bad = FirstInvalidUtf8(text);
  if (bad == std::string_view::npos) return std::string(text);
  std::string out;
  out.reserve(text.size() + 16);
  while (bad != std::string_view::npos) {
    out.append(text.substr(0, bad));
    out.append(kReplacementChar);
    text.remove_prefix(bad + 1);
    bad = FirstInvalidUtf8(text);
  }
  out.append(text);
  return out;
}

// Length of the UTF-8 sequence starting with lead byte `b` (well-formed text).
inline size_t Utf8Len(uint8_t b) {
  if (b < 0x80) return 1;
  if (b < 0xE0) return 2;
  if (b < 0xF0) return 3;
  return 4;
}

std::string EncodeUtf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

// The GPT-2 byte-to-unicode map: printable Latin-1 bytes stand for themselves, the other 68
// bytes for U+0100.. in byte order.
struct ByteLevelMap {
  std::array<std::string, 256> to_char;
  std::unordered_map<std::string, uint8_t> to_byte;
  ByteLevelMap() {
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_char[b] = EncodeUtf8(printable ? static_cast<uint32_t>(b) : next++);
      to_byte[to_char[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteLevelMap& ByteLevel() {
  static const ByteLevelMap map;
  return map;
}

std::string ByteLevelEncode(std::string_view s) {
  const auto& map = ByteLevel();
  std::string out;
  out.reserve(s.size() * 2);
  for (unsigned char c : s) out.append(map.to_char[c]);
  return out;
}

// Each character's byte, or the token's own bytes if a character is outside the map (as
// `tokenizers` does).
std::string ByteLevelDecode(std::string_view token) {
  const auto& map = ByteLevel();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const size_t n = std::min(Utf8Len(static_cast<uint8_t>(token[i])), token.size() - i);
    auto it = map.to_byte.find(std::string(token.substr(i, n)));
    if (it == map.to_byte.end()) return std::string(token);
    out.push_back(static_cast<char>(it->second));
    i += n;
  }
  return out;
}

std::string ReplaceAllOf(std::string_view s, std::string_view from, std::string_view to) {
  if (from.empty()) return std::string(s);
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string_view::npos) break;
    out.append(s.substr(pos, hit - pos));
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s.substr(pos));
  return out;
}

bool IsAsciiSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// ---------------------------------------------------------------------------------------------
// PCRE2 regex, compiled once (UTF + Unicode properties for \s \d \w, JIT where available),
// matched with per-call match data, so one Regex serves many threads.

class Regex {
 public:
  static StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern,
                                                  const std::string& where) {
    int error = 0;
    PCRE2_SIZE offset = 0;
    pcre2_code* code =
        pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                      PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error, &offset, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(error, message, sizeof(message));
      return absl::InvalidArgumentError(absl::StrFormat(
          "%s: the regex does not compile (PCRE2: %s, at offset %d): %s", where,
          reinterpret_cast<const char*>(message), static_cast<int>(offset), pattern));
    }
    auto r = std::unique_ptr<Regex>(new Regex(code));
    r->jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
    return r;
  }
  ~Regex() { pcre2_code_free(code_); }

  // Calls f(begin, end) for each non-empty match in `s` (well-formed UTF-8), left to right.
  // Empty matches are skipped (they make no piece). Returns false if PCRE2 gave up (its match
  // limit or JIT stack) — the caller then treats the rest of `s` as unmatched.
  template <typename F>
  bool ForEachMatch(std::string_view s, F&& f) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    pcre2_match_context* mc = pcre2_match_context_create(nullptr);
    pcre2_jit_stack* stack = jit_ ? pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr)
                                  : nullptr;
    if (stack != nullptr) pcre2_jit_stack_assign(mc, nullptr, stack);
    bool ok = true;
    size_t start = 0;
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    while (start <= s.size()) {
      const int rc = pcre2_match(code_, subject, s.size(), start, PCRE2_NO_UTF_CHECK, md, mc);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        ok = false;
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t b = ov[0], e = ov[1];
      if (e > b) {
        f(b, e);
        start = e;
      } else {
        if (b >= s.size()) break;
        start = b + Utf8Len(static_cast<uint8_t>(s[b]));
      }
    }
    if (stack != nullptr) pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
    return ok;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
  bool jit_ = false;
};

// ---------------------------------------------------------------------------------------------
// Pre-tokenization works on pieces of text; `first` marks the piece that starts the input (for
// Metaspace's prepend_scheme "first").

struct TextPiece {
  std::string text;
  bool first = false;
};

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

// Splits `p` at the spans `matches` (sorted, disjoint, non-empty) as `tokenizers`' split does.
void SplitPiece(const TextPiece& p, const std::vector<std::pair<size_t, size_t>>& found, bool invert,
                SplitBehavior behavior, std::vector<TextPiece>* out) {
  // Spans of the whole text, each flagged as a match (after `invert`).
  std::vector<std::pair<std::pair<size_t, size_t>, bool>> spans;
  size_t pos = 0;
  for (const auto& [b, e] : found) {
    if (b > pos) spans.push_back({{pos, b}, invert});
    spans.push_back({{b, e}, !invert});
    pos = e;
  }
  if (pos < p.text.size()) spans.push_back({{pos, p.text.size()}, invert});

  std::vector<std::pair<size_t, size_t>> pieces;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& [span, m] : spans) pieces.push_back(span);
      break;
    case SplitBehavior::kRemoved:
      for (const auto& [span, m] : spans) {
        if (!m) pieces.push_back(span);
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const auto& [span, m] : spans) {
        if (m && !pieces.empty()) pieces.back().second = span.second;
        else pieces.push_back(span);
      }
      break;
    case SplitBehavior::kMergedWithNext: {
      bool pending = false;
      for (const auto& [span, m] : spans) {
        if (pending) pieces.back().second = span.second;
        else pieces.push_back(span);
        pending = m;
      }
      break;
    }
    case SplitBehavior::kContiguous: {
      bool last_match = false;
      for (const auto& [span, m] : spans) {
        if (m && last_match && !pieces.empty()) pieces.back().second = span.second;
        else pieces.push_back(span);
        last_match = m;
      }
      break;
    }
  }
  for (const auto& [b, e] : pieces) {
    if (e <= b) continue;
    out->push_back(TextPiece{p.text.substr(b, e - b), p.first && b == 0});
  }
}

// The GPT-2 pre-tokenizer pattern (ByteLevel with use_regex).
constexpr char kGpt2Pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// One pattern: a regex or a literal string.
struct Pattern {
  std::unique_ptr<Regex> regex;
  std::string literal;
  std::vector<std::pair<size_t, size_t>> Find(std::string_view s, bool* ok) const {
    std::vector<std::pair<size_t, size_t>> found;
    *ok = true;
    if (regex) {
      *ok = regex->ForEachMatch(s, [&](size_t b, size_t e) { found.push_back({b, e}); });
    } else if (!literal.empty()) {
      size_t pos = 0;
      while ((pos = s.find(literal, pos)) != std::string_view::npos) {
        found.push_back({pos, pos + literal.size()});
        pos += literal.size();
      }
    }
    return found;
  }
};

// ---------------------------------------------------------------------------------------------
// Components read from the JSON. Field paths in messages are "tokenizer.json: a.b[3].c".

class Reader {
 public:
  explicit Reader(std::string name) : name_(std::move(name)) {}
  Status Error(const std::string& field, const std::string& what) const {
    return absl::InvalidArgumentError(absl::StrCat(name_, ": ", field, ": ", what));
  }
  Status Unsupported(const std::string& field, const std::string& type,
                     const std::string& supported) const {
    return absl::UnimplementedError(absl::StrCat(name_, ": ", field, ": type '", type,
                                                 "' is not supported (supported: ", supported,
                                                 ")"));
  }
  StatusOr<std::string> String(const json& j, const std::string& field, const char* key,
                               bool required = true, std::string fallback = "") const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
      if (required) return Error(field, absl::StrCat("missing '", key, "'"));
      return fallback;
    }
    if (!it->is_string()) return Error(absl::StrCat(field, ".", key), "not a string");
    return it->get<std::string>();
  }
  StatusOr<bool> Bool(const json& j, const std::string& field, const char* key,
                      bool fallback) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_boolean()) return Error(absl::StrCat(field, ".", key), "not a boolean");
    return it->get<bool>();
  }
  StatusOr<int64_t> Int(const json& j, const std::string& field, const char* key,
                        int64_t fallback) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return fallback;
    if (!it->is_number_integer()) return Error(absl::StrCat(field, ".", key), "not an integer");
    return it->get<int64_t>();
  }
  StatusOr<std::string> Type(const json& j, const std::string& field) const {
    if (!j.is_object()) return Error(field, "not an object");
    return String(j, field, "type");
  }
  // {"String": s} or {"Regex": r} (the Split pre-tokenizer's and Replace's pattern).
  StatusOr<Pattern> ReadPattern(const json& j, const std::string& field) const {
    Pattern p;
    if (!j.is_object()) return Error(field, "not an object with 'String' or 'Regex'");
    if (j.contains("Regex")) {
      if (!j["Regex"].is_string()) return Error(field + ".Regex", "not a string");
      QCAL_ASSIGN_OR_RETURN(p.regex,
                            Regex::Compile(j["Regex"].get<std::string>(),
                                           absl::StrCat(name_, ": ", field, ".Regex")));
      return p;
    }
    if (j.contains("String")) {
      if (!j["String"].is_string()) return Error(field + ".String", "not a string");
      p.literal = j["String"].get<std::string>();
      return p;
    }
    return Error(field, "has neither 'String' nor 'Regex'");
  }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
};

struct Normalizer {
  enum Kind { kPrepend, kReplace } kind;
  std::string text;  // Prepend: the prefix; Replace: the content
  Pattern pattern;   // Replace
  std::string Apply(const std::string& s) const {
    if (kind == kPrepend) return s.empty() ? s : text + s;
    if (pattern.regex) {
      std::string out;
      size_t pos = 0;
      pattern.regex->ForEachMatch(s, [&](size_t b, size_t e) {
        out.append(s, pos, b - pos);
        out.append(text);
        pos = e;
      });
      out.append(s, pos, std::string::npos);
      return out;
    }
    return ReplaceAllOf(s, pattern.literal, text);
  }
};

Status ReadNormalizers(const Reader& r, const json& j, const std::string& field,
                       std::vector<Normalizer>* out) {
  if (j.is_null()) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(std::string type, r.Type(j, field));
  if (type == "Sequence") {
    auto it = j.find("normalizers");
    if (it == j.end() || !it->is_array()) return r.Error(field, "Sequence without 'normalizers'");
    for (size_t i = 0; i < it->size(); ++i) {
      QCAL_RETURN_IF_ERROR(
          ReadNormalizers(r, (*it)[i], absl::StrCat(field, ".normalizers[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  Normalizer n;
  if (type == "Prepend") {
    n.kind = Normalizer::kPrepend;
    QCAL_ASSIGN_OR_RETURN(n.text, r.String(j, field, "prepend"));
  } else if (type == "Replace") {
    n.kind = Normalizer::kReplace;
    QCAL_ASSIGN_OR_RETURN(n.text, r.String(j, field, "content"));
    if (!j.contains("pattern")) return r.Error(field, "Replace without 'pattern'");
    QCAL_ASSIGN_OR_RETURN(n.pattern, r.ReadPattern(j["pattern"], field + ".pattern"));
  } else {
    return r.Unsupported(field, type, "Sequence, Prepend, Replace");
  }
  out->push_back(std::move(n));
  return absl::OkStatus();
}

struct PreTokenizer {
  enum Kind { kSplit, kByteLevel, kMetaspace } kind;
  // Split
  Pattern pattern;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // ByteLevel
  bool add_prefix_space = false;
  std::unique_ptr<Regex> gpt2;  // use_regex
  // Metaspace
  std::string replacement;
  enum Prepend { kAlways, kFirst, kNever } prepend = kAlways;
  bool split = true;

  void Apply(std::vector<TextPiece>* pieces, bool* regex_ok) const {
    std::vector<TextPiece> out;
    out.reserve(pieces->size());
    for (TextPiece& p : *pieces) {
      switch (kind) {
        case kSplit: {
          bool ok = true;
          const auto found = pattern.Find(p.text, &ok);
          if (!ok) *regex_ok = false;
          SplitPiece(p, found, invert, behavior, &out);
          break;
        }
        case kByteLevel: {
          if (add_prefix_space && (p.text.empty() || p.text[0] != ' ')) p.text.insert(0, " ");
          std::vector<TextPiece> parts;
          if (gpt2) {
            bool ok = true;
            std::vector<std::pair<size_t, size_t>> found;
            ok = gpt2->ForEachMatch(p.text, [&](size_t b, size_t e) { found.push_back({b, e}); });
            if (!ok) *regex_ok = false;
            SplitPiece(p, found, false, SplitBehavior::kIsolated, &parts);
          } else {
            parts.push_back(std::move(p));
          }
          for (TextPiece& q : parts) {
            q.text = ByteLevelEncode(q.text);
            out.push_back(std::move(q));
          }
          break;
        }
        case kMetaspace: {
          p.text = ReplaceAllOf(p.text, " ", replacement);
          const bool starts = p.text.compare(0, replacement.size(), replacement) == 0;
          if (!starts && (prepend == kAlways || (prepend == kFirst && p.first))) {
            p.text.insert(0, replacement);
          }
          if (split) {
            Pattern lit;
            lit.literal = replacement;
            bool ok = true;
            SplitPiece(p, lit.Find(p.text, &ok), false, SplitBehavior::kMergedWithNext, &out);
          } else if (!p.text.empty()) {
            out.push_back(std::move(p));
          }
          break;
        }
      }
    }
    *pieces = std::move(out);
  }
};

Status ReadPreTokenizers(const Reader& r, const json& j, const std::string& field,
                         std::vector<PreTokenizer>* out) {
  if (j.is_null()) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(std::string type, r.Type(j, field));
  if (type == "Sequence") {
    auto it = j.find("pretokenizers");
    if (it == j.end() || !it->is_array()) {
      return r.Error(field, "Sequence without 'pretokenizers'");
    }
    for (size_t i = 0; i < it->size(); ++i) {
      QCAL_RETURN_IF_ERROR(
          ReadPreTokenizers(r, (*it)[i], absl::StrCat(field, ".pretokenizers[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  PreTokenizer p;
  if (type == "Split") {
    p.kind = PreTokenizer::kSplit;
    if (!j.contains("pattern")) return r.Error(field, "Split without 'pattern'");
    QCAL_ASSIGN_OR_RETURN(p.pattern, r.ReadPattern(j["pattern"], field + ".pattern"));
    QCAL_ASSIGN_OR_RETURN(std::string behavior, r.String(j, field, "behavior"));
    static const std::vector<std::pair<std::string, SplitBehavior>> kBehaviors = {
        {"Isolated", SplitBehavior::kIsolated},
        {"Removed", SplitBehavior::kRemoved},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous}};
    bool known = false;
    for (const auto& [n, b] : kBehaviors) {
      if (n == behavior) {
        p.behavior = b;
        known = true;
      }
    }
    if (!known) {
      return r.Error(field + ".behavior",
                     absl::StrCat("'", behavior, "' is not one of Isolated, Removed, "
                                  "MergedWithPrevious, MergedWithNext, Contiguous"));
    }
    QCAL_ASSIGN_OR_RETURN(p.invert, r.Bool(j, field, "invert", false));
  } else if (type == "ByteLevel") {
    p.kind = PreTokenizer::kByteLevel;
    QCAL_ASSIGN_OR_RETURN(p.add_prefix_space, r.Bool(j, field, "add_prefix_space", true));
    QCAL_ASSIGN_OR_RETURN(bool use_regex, r.Bool(j, field, "use_regex", true));
    if (use_regex) {
      QCAL_ASSIGN_OR_RETURN(p.gpt2, Regex::Compile(kGpt2Pattern, field));
    }
  } else if (type == "Metaspace") {
    p.kind = PreTokenizer::kMetaspace;
    QCAL_ASSIGN_OR_RETURN(p.replacement, r.String(j, field, "replacement"));
    if (p.replacement.empty()) return r.Error(field + ".replacement", "empty");
    QCAL_ASSIGN_OR_RETURN(p.split, r.Bool(j, field, "split", true));
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      QCAL_ASSIGN_OR_RETURN(std::string scheme, r.String(j, field, "prepend_scheme"));
      if (scheme == "always") p.prepend = PreTokenizer::kAlways;
      else if (scheme == "first") p.prepend = PreTokenizer::kFirst;
      else if (scheme == "never") p.prepend = PreTokenizer::kNever;
      else return r.Error(field + ".prepend_scheme",
                          absl::StrCat("'", scheme, "' is not one of always, first, never"));
    } else {
      QCAL_ASSIGN_OR_RETURN(bool add, r.Bool(j, field, "add_prefix_space", true));
      p.prepend = add ? PreTokenizer::kAlways : PreTokenizer::kNever;
    }
  } else {
    return r.Unsupported(field, type, "Sequence, Split, ByteLevel, Metaspace");
  }
  out->push_back(std::move(p));
  return absl::OkStatus();
}

struct Decoder {
  enum Kind { kByteLevel, kMetaspace, kReplace, kByteFallback, kFuse, kStrip } kind;
  std::string from, to;  // Replace (literal pattern) / Metaspace (replacement)
  bool strip_first_space = false;  // Metaspace with a prepend scheme other than never
  std::string strip_content;
  int64_t strip_start = 0, strip_stop = 0;

  void Apply(std::vector<std::string>* tokens) const {
    switch (kind) {
      case kByteLevel: {
        std::string all;
        for (const auto& t : *tokens) all += ByteLevelDecode(t);
        *tokens = {all};
        break;
      }
      case kMetaspace:
        for (size_t i = 0; i < tokens->size(); ++i) {
          std::string t = ReplaceAllOf((*tokens)[i], from, " ");
          if (i == 0 && strip_first_space && !t.empty() && t[0] == ' ') t.erase(0, 1);
          (*tokens)[i] = std::move(t);
        }
        break;
      case kReplace:
        for (auto& t : *tokens) t = ReplaceAllOf(t, from, to);
        break;
      case kByteFallback: {
        std::vector<std::string> out;
        std::string bytes;
        auto flush = [&] {
          if (bytes.empty()) return;
          if (IsValidUtf8(bytes)) {
            out.push_back(bytes);
          } else {
            std::string r;
            for (size_t i = 0; i < bytes.size(); ++i) r += kReplacementChar;
            out.push_back(r);
          }
          bytes.clear();
        };
        for (const auto& t : *tokens) {
          int byte = -1;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
            auto hex = [](char c) -> int {
              if (c >= '0' && c <= '9') return c - '0';
              if (c >= 'A' && c <= 'F') return c - 'A' + 10;
              if (c >= 'a' && c <= 'f') return c - 'a' + 10;
              return -1;
            };
            const int hi = hex(t[3]), lo = hex(t[4]);
            if (hi >= 0 && lo >= 0) byte = hi * 16 + lo;
          }
          if (byte >= 0) {
            bytes.push_back(static_cast<char>(byte));
          } else {
            flush();
            out.push_back(t);
          }
        }
        flush();
        *tokens = std::move(out);
        break;
      }
      case kFuse: {
        std::string all;
        for (const auto& t : *tokens) all += t;
        *tokens = {all};
        break;
      }
      case kStrip:
        for (auto& t : *tokens) {
          for (int64_t i = 0; i < strip_start && t.compare(0, strip_content.size(),
                                                           strip_content) == 0 && !t.empty();
               ++i) {
            t.erase(0, strip_content.size());
          }
          for (int64_t i = 0; i < strip_stop && t.size() >= strip_content.size() &&
                              t.compare(t.size() - strip_content.size(), strip_content.size(),
                                        strip_content) == 0 && !t.empty();
               ++i) {
            t.erase(t.size() - strip_content.size());
          }
        }
        break;
    }
  }
};

Status ReadDecoders(const Reader& r, const json& j, const std::string& field,
                    std::vector<Decoder>* out) {
  if (j.is_null()) return absl::OkStatus();
  QCAL_ASSIGN_OR_RETURN(std::string type, r.Type(j, field));
  if (type == "Sequence") {
    auto it = j.find("decoders");
    if (it == j.end() || !it->is_array()) return r.Error(field, "Sequence without 'decoders'");
    for (size_t i = 0; i < it->size(); ++i) {
      QCAL_RETURN_IF_ERROR(
          ReadDecoders(r, (*it)[i], absl::StrCat(field, ".decoders[", i, "]"), out));
    }
    return absl::OkStatus();
  }
  Decoder d;
  if (type == "ByteLevel") {
    d.kind = Decoder::kByteLevel;
  } else if (type == "Metaspace") {
    d.kind = Decoder::kMetaspace;
    QCAL_ASSIGN_OR_RETURN(d.from, r.String(j, field, "replacement"));
    std::string scheme = "always";
    if (j.contains("prepend_scheme") && !j["prepend_scheme"].is_null()) {
      QCAL_ASSIGN_OR_RETURN(scheme, r.String(j, field, "prepend_scheme"));
    } else {
      QCAL_ASSIGN_OR_RETURN(bool add, r.Bool(j, field, "add_prefix_space", true));
      if (!add) scheme = "never";
    }
    d.strip_first_space = scheme != "never";
  } else if (type == "Replace") {
    d.kind = Decoder::kReplace;
    QCAL_ASSIGN_OR_RETURN(d.to, r.String(j, field, "content"));
    if (!j.contains("pattern")) return r.Error(field, "Replace without 'pattern'");
    QCAL_ASSIGN_OR_RETURN(Pattern p, r.ReadPattern(j["pattern"], field + ".pattern"));
    if (p.regex) return r.Unsupported(field + ".pattern", "Regex", "String");
    d.from = p.literal;
  } else if (type == "ByteFallback") {
    d.kind = Decoder::kByteFallback;
  } else if (type == "Fuse") {
    d.kind = Decoder::kFuse;
  } else if (type == "Strip") {
    d.kind = Decoder::kStrip;
    QCAL_ASSIGN_OR_RETURN(d.strip_content, r.String(j, field, "content"));
    if (d.strip_content.empty()) return r.Error(field + ".content", "empty");
    QCAL_ASSIGN_OR_RETURN(d.strip_start, r.Int(j, field, "start", 0));
    QCAL_ASSIGN_OR_RETURN(d.strip_stop, r.Int(j, field, "stop", 0));
  } else {
    return r.Unsupported(field, type, "Sequence, ByteLevel, Metaspace, Replace, ByteFallback, "
                                      "Fuse, Strip");
  }
  out->push_back(std::move(d));
  return absl::OkStatus();
}

struct AddedToken {
  int32_t id;
  std::string content;
  bool special;
  bool lstrip;
  bool rstrip;
};

// ---------------------------------------------------------------------------------------------

class HfTokenizer final : public Tokenizer {
 public:
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  int bos_id() const override { return bos_id_; }
  int eos_id() const override { return eos_id_; }
  float Score(int32_t) const override { return 0.0f; }
  std::string Piece(int32_t id) const override {
    return id >= 0 && id < vocab_size() ? pieces_[id] : std::string();
  }

  std::vector<int32_t> Encode(std::string_view raw) const override {
    const std::string text = MakeWellFormed(raw);
    std::vector<int32_t> ids;
    std::unordered_map<std::string, std::vector<int32_t>> cache;
    bool first = true;
    bool warned = false;
    auto encode_text = [&](std::string_view segment) {
      if (segment.empty()) return;
      std::string s(segment);
      for (const Normalizer& n : normalizers_) s = n.Apply(s);
      std::vector<TextPiece> pieces{{std::move(s), first}};
      first = false;
      bool regex_ok = true;
      for (const PreTokenizer& p : pre_tokenizers_) p.Apply(&pieces, &regex_ok);
      if (!regex_ok && !warned) {
        // PCRE2 hit its match or JIT-stack limit: the rest of that piece was left unsplit, so
        // these ids can differ from `tokenizers`'.
        QCAL_LOG_WARN("tokenizer.json: the pre-tokenizer regex gave up (PCRE2 limit) on a {}-byte "
                      "piece of text; it was tokenized without that split",
                      segment.size());
        warned = true;
      }
      for (const auto& piece : pieces) {
        auto hit = cache.find(piece.text);
        if (hit == cache.end()) hit = cache.emplace(piece.text, EncodeWord(piece.text)).first;
        ids.insert(ids.end(), hit->second.begin(), hit->second.end());
      }
    };
    std::string_view rest = text;
    while (!rest.empty()) {
      size_t begin = 0, end = 0;
      int32_t id = -1;
      if (!FindAddedToken(rest, &begin, &end, &id)) {
        encode_text(rest);
        break;
      }
      encode_text(rest.substr(0, begin));
      ids.push_back(id);
      first = false;
      rest.remove_prefix(end);
    }
    return ids;
  }

  std::string Decode(const std::vector<int32_t>& ids) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      if (id >= 0 && id < vocab_size() && !pieces_[id].empty()) tokens.push_back(pieces_[id]);
    }
    for (const Decoder& d : decoders_) d.Apply(&tokens);
    std::string out;
    for (const auto& t : tokens) out += t;
    return out;
  }

  // --- loading ---
  Status Load(const json& root, const Reader& r, const HfTokenizerOptions& options);

 private:
  static uint64_t PairKey(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  // The leftmost (then longest) added token in `s` that may be matched, with its lstrip /
  // rstrip extension: [begin, end) is the text it consumes.
  bool FindAddedToken(std::string_view s, size_t* begin, size_t* end, int32_t* id) const {
    if (added_by_first_byte_.empty()) return false;
    for (size_t i = 0; i < s.size(); ++i) {
      const auto& candidates = added_by_first_byte_[static_cast<uint8_t>(s[i])];
      for (const AddedToken* t : candidates) {  // longest first
        if (s.compare(i, t->content.size(), t->content) != 0) continue;
        size_t b = i, e = i + t->content.size();
        if (t->lstrip) {
          while (b > 0 && IsAsciiSpace(s[b - 1])) --b;
        }
        if (t->rstrip) {
          while (e < s.size() && IsAsciiSpace(s[e])) ++e;
        }
        *begin = b;
        *end = e;
        *id = t->id;
        return true;
      }
    }
    return false;
  }

  // BPE of one pre-token.
  std::vector<int32_t> EncodeWord(const std::string& word) const {
    if (ignore_merges_) {
      auto it = vocab_.find(word);
      if (it != vocab_.end()) return {it->second};
    }
    struct Sym {
      int32_t id;
      int32_t prev, next;
    };
    std::vector<Sym> syms;
    syms.reserve(word.size());
    bool last_unk = false;
    auto push = [&](int32_t id) {
      syms.push_back(Sym{id, static_cast<int32_t>(syms.size()) - 1,
                         static_cast<int32_t>(syms.size()) + 1});
    };
    for (size_t i = 0; i < word.size();) {
      const size_t n = std::min(Utf8Len(static_cast<uint8_t>(word[i])), word.size() - i);
      const std::string ch = word.substr(i, n);
      i += n;
      auto it = vocab_.find(ch);
      if (it != vocab_.end()) {
        push(it->second);
        last_unk = false;
        continue;
      }
      if (byte_fallback_) {
        bool all = true;
        for (unsigned char c : ch) all = all && byte_ids_[c] >= 0;
        if (all) {
          for (unsigned char c : ch) push(byte_ids_[c]);
          last_unk = false;
          continue;
        }
      }
      if (unk_id_ >= 0) {
        if (!(fuse_unk_ && last_unk)) push(unk_id_);
        last_unk = true;
      }
      // Without an unk token `tokenizers` drops the character; so does qcal.
    }
    if (syms.empty()) return {};
    syms.back().next = -1;

    struct Candidate {
      int32_t rank, pos, left, right, merged;
      bool operator>(const Candidate& o) const {
        return rank != o.rank ? rank > o.rank : pos > o.pos;
      }
    };
    std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
    auto consider = [&](int32_t pos) {
      if (pos < 0 || syms[pos].next < 0) return;
      const int32_t nxt = syms[pos].next;
      auto it = merges_.find(PairKey(syms[pos].id, syms[nxt].id));
      if (it == merges_.end()) return;
      heap.push(Candidate{it->second.first, pos, syms[pos].id, syms[nxt].id, it->second.second});
    };
    for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) consider(i);
    std::vector<uint8_t> dead(syms.size(), 0);
    while (!heap.empty()) {
      const Candidate c = heap.top();
      heap.pop();
      if (dead[c.pos] || syms[c.pos].id != c.left) continue;
      const int32_t nxt = syms[c.pos].next;
      if (nxt < 0 || syms[nxt].id != c.right) continue;
      syms[c.pos].id = c.merged;
      dead[nxt] = 1;
      syms[c.pos].next = syms[nxt].next;
      if (syms[nxt].next >= 0) syms[syms[nxt].next].prev = c.pos;
      consider(syms[c.pos].prev);
      consider(c.pos);
    }
    std::vector<int32_t> out;
    for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
    return out;
  }

  std::vector<std::string> pieces_;  // per id ("" for ids without one)
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;  // -> (rank, merged id)
  std::array<int32_t, 256> byte_ids_{};
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  int32_t unk_id_ = -1;
  std::vector<AddedToken> added_;
  std::vector<std::vector<const AddedToken*>> added_by_first_byte_;
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::vector<Decoder> decoders_;
  int32_t bos_id_ = -1, eos_id_ = -1;
};

// The id of a token given as a string or as {"content": ...} (tokenizer_config.json).
StatusOr<int32_t> TokenId(const json& j, const std::string& where,
                          const std::function<int32_t(const std::string&)>& find) {
  std::string content;
  if (j.is_string()) {
    content = j.get<std::string>();
  } else if (j.is_object() && j.contains("content") && j["content"].is_string()) {
    content = j["content"].get<std::string>();
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": neither a string nor an object with 'content'"));
  }
  const int32_t id = find(content);
  if (id < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": '", content, "' is not a token of the tokenizer"));
  }
  return id;
}

Status HfTokenizer::Load(const json& root, const Reader& r, const HfTokenizerOptions& options) {
  if (!root.is_object()) return r.Error("(top level)", "not a JSON object");
  auto model_it = root.find("model");
  if (model_it == root.end() || model_it->is_null()) return r.Error("model", "missing");
  const json& model = *model_it;
  if (!model.is_object()) return r.Error("model", "not an object");
  // Older files have no model.type; a vocab + merges is BPE.
  std::string type = "BPE";
  if (model.contains("type")) {
    QCAL_ASSIGN_OR_RETURN(type, r.String(model, "model", "type"));
  }
  if (type != "BPE") return r.Unsupported("model", type, "BPE");
  if (model.contains("dropout") && !model["dropout"].is_null()) {
    return r.Error("model.dropout", "BPE dropout is not supported (it makes encoding random)");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    QCAL_ASSIGN_OR_RETURN(std::string v, r.String(model, "model", key, false));
    if (!v.empty()) return r.Error(absl::StrCat("model.", key), "is not supported (Llama BPE "
                                                                "has none)");
  }
  QCAL_ASSIGN_OR_RETURN(ignore_merges_, r.Bool(model, "model", "ignore_merges", false));
  QCAL_ASSIGN_OR_RETURN(byte_fallback_, r.Bool(model, "model", "byte_fallback", false));
  QCAL_ASSIGN_OR_RETURN(fuse_unk_, r.Bool(model, "model", "fuse_unk", false));

  // Vocabulary.
  auto vocab_it = model.find("vocab");
  if (vocab_it == model.end() || !vocab_it->is_object()) {
    return r.Error("model.vocab", "missing or not an object of token -> id");
  }
  constexpr int64_t kMaxId = 1 << 24;
  int64_t max_id = -1;
  for (auto it = vocab_it->begin(); it != vocab_it->end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 ||
        it.value().get<int64_t>() >= kMaxId) {
      return r.Error(absl::StrCat("model.vocab[\"", it.key(), "\"]"),
                     absl::StrCat("the id is not an integer in [0, ", kMaxId, ")"));
    }
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  // Added tokens (they may extend the id range).
  auto added_it = root.find("added_tokens");
  if (added_it != root.end() && !added_it->is_null()) {
    if (!added_it->is_array()) return r.Error("added_tokens", "not an array");
    for (size_t i = 0; i < added_it->size(); ++i) {
      const json& t = (*added_it)[i];
      const std::string field = absl::StrCat("added_tokens[", i, "]");
      if (!t.is_object()) return r.Error(field, "not an object");
      AddedToken a;
      QCAL_ASSIGN_OR_RETURN(int64_t id, r.Int(t, field, "id", -1));
      if (id < 0 || id >= kMaxId) {
        return r.Error(field + ".id", absl::StrCat("missing or not in [0, ", kMaxId, ")"));
      }
      a.id = static_cast<int32_t>(id);
      QCAL_ASSIGN_OR_RETURN(a.content, r.String(t, field, "content"));
      if (a.content.empty()) return r.Error(field + ".content", "empty");
      if (!IsValidUtf8(a.content)) return r.Error(field + ".content", "not valid UTF-8");
      QCAL_ASSIGN_OR_RETURN(a.special, r.Bool(t, field, "special", false));
      QCAL_ASSIGN_OR_RETURN(a.lstrip, r.Bool(t, field, "lstrip", false));
      QCAL_ASSIGN_OR_RETURN(a.rstrip, r.Bool(t, field, "rstrip", false));
      QCAL_ASSIGN_OR_RETURN(bool single_word, r.Bool(t, field, "single_word", false));
      if (single_word) return r.Error(field + ".single_word", "true is not supported");
      max_id = std::max<int64_t>(max_id, a.id);
      added_.push_back(std::move(a));
    }
  }
  if (max_id < 0) return r.Error("model.vocab", "empty");
  pieces_.assign(max_id + 1, std::string());
  for (auto it = vocab_it->begin(); it != vocab_it->end(); ++it) {
    const int32_t id = it.value().get<int32_t>();
    if (!pieces_[id].empty()) {
      return r.Error(absl::StrCat("model.vocab[\"", it.key(), "\"]"),
                     absl::StrCat("id ", id, " is also the id of '", pieces_[id], "'"));
    }
    if (it.key().empty()) return r.Error("model.vocab", absl::StrCat("id ", id, " has an empty token"));
    pieces_[id] = it.key();
    vocab_.emplace(it.key(), id);
  }
  for (const AddedToken& a : added_) {
    if (!pieces_[a.id].empty() && pieces_[a.id] != a.content) {
      return r.Error("added_tokens", absl::StrCat("id ", a.id, " is '", a.content,
                                                  "' but the vocabulary has '", pieces_[a.id],
                                                  "' there"));
    }
    pieces_[a.id] = a.content;
  }
  byte_ids_.fill(-1);
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(absl::StrFormat("<0x%02X>", b));
    if (it != vocab_.end()) byte_ids_[b] = it->second;
  }
  QCAL_ASSIGN_OR_RETURN(std::string unk, r.String(model, "model", "unk_token", false));
  if (!unk.empty()) {
    auto it = vocab_.find(unk);
    if (it == vocab_.end()) {
      return r.Error("model.unk_token", absl::StrCat("'", unk, "' is not in model.vocab"));
    }
    unk_id_ = it->second;
  }

  // Merges, by rank.
  auto merges_it = model.find("merges");
  if (merges_it == model.end() || !merges_it->is_array()) {
    return r.Error("model.merges", "missing or not an array");
  }
  merges_.reserve(merges_it->size());
  for (size_t i = 0; i < merges_it->size(); ++i) {
    const json& m = (*merges_it)[i];
    const std::string field = absl::StrCat("model.merges[", i, "]");
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return r.Error(field, absl::StrCat("'", s, "' is not two tokens separated by a space"));
      }
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    } else {
      return r.Error(field, "neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    for (const auto& [it, token] : {std::pair{ia, a}, std::pair{ib, b}, std::pair{iab, a + b}}) {
      if (it == vocab_.end()) {
        return r.Error(field, absl::StrCat("the merge '", a, "' + '", b, "' names '", token,
                                           "', which is not in model.vocab"));
      }
    }
    // The first (lowest-rank) occurrence of a pair wins, as in `tokenizers`.
    merges_.emplace(PairKey(ia->second, ib->second),
                    std::pair<int32_t, int32_t>(static_cast<int32_t>(i), iab->second));
  }

  // Added tokens that may be matched in text, longest first per first byte.
  std::vector<const AddedToken*> eligible;
  for (const AddedToken& a : added_) {
    if (!a.special || options.parse_special) eligible.push_back(&a);
  }
  if (!eligible.empty()) {
    added_by_first_byte_.resize(256);
    std::stable_sort(eligible.begin(), eligible.end(), [](const AddedToken* x,
                                                          const AddedToken* y) {
      return x->content.size() > y->content.size();
    });
    for (const AddedToken* a : eligible) {
      added_by_first_byte_[static_cast<uint8_t>(a->content[0])].push_back(a);
    }
  }

  QCAL_RETURN_IF_ERROR(ReadNormalizers(r, root.value("normalizer", json()), "normalizer",
                                       &normalizers_));
  QCAL_RETURN_IF_ERROR(ReadPreTokenizers(r, root.value("pre_tokenizer", json()), "pre_tokenizer",
                                         &pre_tokenizers_));
  QCAL_RETURN_IF_ERROR(ReadDecoders(r, root.value("decoder", json()), "decoder", &decoders_));

  // BOS / EOS.
  auto find = [this](const std::string& content) -> int32_t {
    for (const AddedToken& a : added_) {
      if (a.content == content) return a.id;
    }
    auto it = vocab_.find(content);
    return it == vocab_.end() ? -1 : it->second;
  };
  bos_id_ = options.bos_id;
  eos_id_ = options.eos_id;
  if (!options.tokenizer_config_path.empty() && (bos_id_ < 0 || eos_id_ < 0)) {
    QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(options.tokenizer_config_path));
    const json config = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      return absl::DataLossError(
          absl::StrCat(options.tokenizer_config_path, ": not a JSON object"));
    }
    for (auto [key, target] : {std::pair{"bos_token", &bos_id_}, std::pair{"eos_token", &eos_id_}}) {
      if (*target >= 0 || !config.contains(key) || config[key].is_null()) continue;
      QCAL_ASSIGN_OR_RETURN(*target, TokenId(config[key],
                                             absl::StrCat(options.tokenizer_config_path, ": ",
                                                          key),
                                             find));
    }
  }
  if (bos_id_ < 0) {
    // TemplateProcessing: {"single": [{"SpecialToken": {"id": "<s>"}}, ...]}.
    const json pp = root.value("post_processor", json());
    std::vector<json> processors;
    // A post-processor's "type", or "" when it is not a string (post-processors are not
    // otherwise read, so a malformed one is not an error).
    auto type_of = [](const json& j) -> std::string {
      auto it = j.find("type");
      return it != j.end() && it->is_string() ? it->get<std::string>() : std::string();
    };
    if (pp.is_object() && type_of(pp) == "Sequence" && pp.contains("processors") &&
        pp["processors"].is_array()) {
      for (const auto& p : pp["processors"]) processors.push_back(p);
    } else {
      processors.push_back(pp);
    }
    for (const json& p : processors) {
      if (!p.is_object() || type_of(p) != "TemplateProcessing") continue;
      const json single = p.value("single", json());
      if (single.is_array() && !single.empty() && single[0].is_object() &&
          single[0].contains("SpecialToken") && single[0]["SpecialToken"].is_object()) {
        const json id = single[0]["SpecialToken"].value("id", json());
        if (id.is_string()) bos_id_ = find(id.get<std::string>());
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> ParseHfTokenizer(const std::string& text,
                                                      const std::string& name,
                                                      const HfTokenizerOptions& options) {
  const json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) {
    return absl::DataLossError(absl::StrCat(
        name, ": not valid JSON (", text.empty() ? "empty" : "truncated or damaged", ")"));
  }
  auto tokenizer = std::make_unique<HfTokenizer>();
  QCAL_RETURN_IF_ERROR(tokenizer->Load(root, Reader(name), options));
  return std::unique_ptr<Tokenizer>(std::move(tokenizer));
}

StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& path,
                                                     const HfTokenizerOptions& options) {
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseHfTokenizer(text, path, options);
}

namespace {

bool IsRegularFile(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// config.json's bos_token_id / eos_token_id (an int, or a list whose first entry is used);
// -1 where absent or null.
Status ReadConfigTokenIds(const std::string& path, int* bos, int* eos) {
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  const json config = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return absl::DataLossError(absl::StrCat(path, ": not a JSON object"));
  }
  for (auto [key, target] : {std::pair{"bos_token_id", bos}, std::pair{"eos_token_id", eos}}) {
    auto it = config.find(key);
    if (it == config.end() || it->is_null()) continue;
    const json& v = it->is_array() && !it->empty() ? (*it)[0] : *it;
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= (1 << 24)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": ", key, " is not a token id or a list of them"));
    }
    *target = v.get<int>();
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromModelDir(const std::string& dir) {
  const std::string json_path = dir + "/tokenizer.json";
  if (IsRegularFile(json_path)) {
    HfTokenizerOptions options;
    if (IsRegularFile(dir + "/config.json")) {
      QCAL_RETURN_IF_ERROR(
          ReadConfigTokenIds(dir + "/config.json", &options.bos_id, &options.eos_id));
    }
    if (IsRegularFile(dir + "/tokenizer_config.json")) {
      options.tokenizer_config_path = dir + "/tokenizer_config.json";
    }
    QCAL_ASSIGN_OR_RETURN(auto tokenizer, LoadHfTokenizer(json_path, options));
    for (const auto& [what, id] : {std::pair{"bos", tokenizer->bos_id()},
                                   std::pair{"eos", tokenizer->eos_id()}}) {
      if (id >= tokenizer->vocab_size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(dir, ": the ", what, " token id ", id, " is outside the ",
                         tokenizer->vocab_size(), "-token vocabulary of ", json_path));
      }
    }
    return tokenizer;
  }
  const std::string model_path = dir + "/tokenizer.model";
  if (!IsRegularFile(model_path)) {
    return absl::NotFoundError(absl::StrFormat(
        "model directory %s has neither tokenizer.json nor tokenizer.model (looked for %s and %s)",
        dir, json_path, model_path));
  }
  return LoadSentencePieceTokenizer(model_path);
}

}  // namespace qcal
