// llama2.c tokenizer.bin: reproduces run.c's `encode` exactly (see tokenizer_bpe.h).
//
// Differences from run.c, none of which changes the ids of NUL-free text:
//  * run.c stops at the first NUL byte (C strings); here NUL is an ordinary byte.
//  * run.c's bsearch over the sorted vocabulary may return any of several equal pieces; here a
//    repeated piece resolves to its lowest id (the shipped tok512.bin files have no repeats).
//  * run.c pushes id -1 when the vocabulary has no " " piece; here the dummy prefix falls back to
//    the byte piece of ' ' like any other unknown character.
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/utf8.h"
#include "common/atomic_file.h"
#include "common/tokenizer.h"
#include "common/tokenizer_bpe.h"

namespace qcal {
namespace {

// run.c: "float best_score = -1e10;" and a merge needs a strictly greater score.
constexpr float kLlama2cMinMergeScore = -1e10f;
// A sanity bound on one piece; real vocabularies stay far below it.
constexpr int32_t kMaxPieceBytes = 1 << 16;
constexpr int32_t kUnkId = 0;
constexpr int32_t kBosId = 1;
constexpr int32_t kEosId = 2;
constexpr int32_t kFirstByteId = 3;  // run.c: byte b falls back to id b + 3

class Llama2cTokenizer final : public Tokenizer {
 public:
  explicit Llama2cTokenizer(std::unique_ptr<bpe::BpeVocab> vocab) : vocab_(std::move(vocab)) {}

  int vocab_size() const override { return vocab_->size(); }
  int bos_id() const override { return kBosId; }
  int eos_id() const override { return kEosId; }

  std::vector<int32_t> Encode(std::string_view text) const override {
    std::vector<int32_t> symbols;
    if (text.empty()) return symbols;
    symbols.reserve(text.size() + 1);
    // The dummy prefix is its own symbol, segmented separately from the text (run.c pushes the
    // id of " " before the chunk loop, so a leading continuation byte never joins it).
    vocab_->Segment(" ", /*escape_spaces=*/false, &symbols);
    vocab_->Segment(text, /*escape_spaces=*/false, &symbols);
    return vocab_->Merge(std::move(symbols));
  }

  std::string Piece(int32_t id) const override {
    if (id < 0 || id >= vocab_->size()) return "";
    return vocab_->piece(id);
  }

  float Score(int32_t id) const override {
    if (id < 0 || id >= vocab_->size()) return 0.0f;
    return vocab_->score(id);
  }

  std::string Decode(const std::vector<int32_t>& ids) const override {
    std::string out;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_->size() || id == kBosId || id == kEosId) continue;
      if (id == kUnkId) {
        out += " \xE2\x81\x87 ";  // sentencepiece's unk surface, " ⁇ "
        continue;
      }
      const std::string& piece = vocab_->piece(id);
      const int byte = bpe::ParseBytePiece(piece);
      if (byte >= 0) {
        out.push_back(static_cast<char>(byte));
      } else {
        out += piece;
      }
    }
    return out;
  }

 private:
  std::unique_ptr<bpe::BpeVocab> vocab_;
};

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> LoadLlama2cTokenizer(const std::string& path,
                                                          int expected_vocab) {
  QCAL_ASSIGN_OR_RETURN(const std::string data, ReadFile(path));
  const auto error = [&path](const std::string& what) {
    return absl::DataLossError(absl::StrFormat("llama2.c tokenizer %s: %s", path, what));
  };
  if (data.empty()) return error("file is empty");
  if (data.size() < 4) {
    return error(absl::StrFormat("truncated header (%d bytes, need 4)", data.size()));
  }
  const auto read_i32 = [&data](size_t at) {
    int32_t v;
    std::memcpy(&v, data.data() + at, 4);
    return v;
  };
  const int32_t max_token_length = read_i32(0);
  if (max_token_length <= 0 || max_token_length > kMaxPieceBytes) {
    return error(absl::StrFormat("max_token_length %d out of range [1, %d]", max_token_length,
                                 kMaxPieceBytes));
  }

  bpe::BpeVocabOptions opts;
  size_t at = 4;
  while (at < data.size()) {
    const size_t id = opts.pieces.size();
    if (data.size() - at < 8) {
      return error(absl::StrFormat(
          "truncated entry for token %d at byte offset %d (%d bytes left, need 8 for score and "
          "length)",
          id, at, data.size() - at));
    }
    float score;
    std::memcpy(&score, data.data() + at, 4);
    const int32_t len = read_i32(at + 4);
    at += 8;
    if (len < 0) return error(absl::StrFormat("token %d has negative length %d", id, len));
    if (len > max_token_length) {
      return error(absl::StrFormat("token %d has length %d > max_token_length %d", id, len,
                                   max_token_length));
    }
    if (static_cast<size_t>(len) > data.size() - at) {
      return error(absl::StrFormat("truncated piece of token %d: length %d but %d bytes left", id,
                                   len, data.size() - at));
    }
    opts.pieces.emplace_back(data.data() + at, static_cast<size_t>(len));
    opts.scores.push_back(score);
    at += len;
  }
  const int n = static_cast<int>(opts.pieces.size());
  if (n == 0) return error("no tokens after the header");
  if (expected_vocab > 0 && n != expected_vocab) {
    return error(absl::StrFormat("%d tokens, expected %d", n, expected_vocab));
  }
  if (n < kFirstByteId + 256) {
    return error(absl::StrFormat(
        "%d tokens: too few for <unk>, <s>, </s> and the 256 byte pieces (need at least %d)", n,
        kFirstByteId + 256));
  }
  // A piece is text (bytes have their own <0xXX> pieces): one that is not UTF-8 is damage, such
  // as a flipped byte, that would otherwise tokenize silently differently.
  for (int id = kFirstByteId + 256; id < n; ++id) {
    if (!IsValidUtf8(opts.pieces[id])) {
      return error(absl::StrFormat("token %d is not valid UTF-8 (%s): the file is damaged", id,
                                   DescribeInvalidUtf8(opts.pieces[id])));
    }
  }
  // run.c looks up every piece, special ones included.
  opts.mergeable.assign(n, true);
  for (int b = 0; b < 256; ++b) opts.byte_ids[b] = kFirstByteId + b;
  opts.unk_id = kUnkId;
  opts.min_merge_score = kLlama2cMinMergeScore;
  auto vocab = bpe::BpeVocab::Create(std::move(opts));
  if (!vocab.ok()) return Annotate(vocab.status(), path);
  return std::unique_ptr<Tokenizer>(new Llama2cTokenizer(*std::move(vocab)));
}

}  // namespace qcal
