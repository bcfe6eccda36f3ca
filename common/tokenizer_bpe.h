// The BPE core shared by the llama2.c and sentencepiece tokenizers (private to common/).
//
// Both tokenizers encode in two steps:
//  1. Segment: split the text into llama2.c "chunks" (a byte followed by up to three UTF-8
//     continuation bytes; for valid UTF-8 exactly one codepoint). A chunk that is a vocabulary
//     piece becomes that symbol; otherwise each of its bytes becomes a byte symbol (or <unk>).
//  2. Merge: repeatedly replace the adjacent pair of symbols whose concatenated piece text is a
//     mergeable vocabulary piece with the highest score, the leftmost pair on ties, until no pair
//     merges. This is llama2.c run.c's `encode` loop, done with a max-heap over a doubly linked
//     list of symbols (O(n log n)); heap entries are invalidated lazily by per-symbol versions,
//     and pair lookups use a (left id, right id) -> merged id table built once per vocabulary.
//
// Symbols that fell back to bytes take part in merges through their piece text ("<0x41>") exactly
// as in run.c; whether such a piece is "mergeable" is decided by the tokenizer (llama2.c: every
// piece; sentencepiece: NORMAL and USER_DEFINED pieces only).
//
// Thread-safety: a BpeVocab is immutable after Create(); Segment/Merge are const and may be
// called from many threads at once.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace qcal::bpe {

// Calls f(chunk) for each llama2.c chunk of `text`: a byte plus the UTF-8 continuation bytes
// (10xxxxxx) that follow it, at most 4 bytes in all. Unlike run.c, NUL is an ordinary byte.
template <typename F>
void ForEachChunk(std::string_view text, F&& f) {
  size_t i = 0;
  const size_t n = text.size();
  while (i < n) {
    size_t len = 1;
    while (len < 4 && i + len < n && (static_cast<uint8_t>(text[i + len]) & 0xC0) == 0x80) ++len;
    f(text.substr(i, len));
    i += len;
  }
}

// "<0xAB>" -> 0xAB (exactly six characters, upper- or lower-case hex); anything else -> -1.
int ParseBytePiece(std::string_view piece);
// 0xAB -> "<0xAB>" (upper-case hex, as llama2.c and sentencepiece write them).
std::string BytePiece(uint8_t byte);

// U+2581 LOWER ONE EIGHTH BLOCK, sentencepiece's visible space.
inline constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";

// `s` with every occurrence of `from` (non-empty) replaced by `to`.
std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to);

struct BpeVocabOptions {
  std::vector<std::string> pieces;  // piece text per id
  std::vector<float> scores;        // merge priority per id (higher merges first)
  // Per id: may a merge produce this piece, may a chunk match it, and may a symbol with this id
  // take part in a merge. Pieces repeated among mergeable ids resolve to the lowest id.
  std::vector<bool> mergeable;
  // Symbol ids for bytes of chunks that are not pieces. A chunk with any -1 byte entry gives one
  // `unk_id` symbol (one <unk> per character) in place of those bytes.
  std::array<int32_t, 256> byte_ids;
  int32_t unk_id = -1;
  // A merge happens only if the merged piece's score is strictly greater than this (run.c starts
  // its best score at -1e10). NaN scores never merge.
  float min_merge_score = -std::numeric_limits<float>::infinity();
};

class BpeVocab {
 public:
  // Checks sizes and ids; InvalidArgument on inconsistent options.
  static StatusOr<std::unique_ptr<BpeVocab>> Create(BpeVocabOptions options);

  BpeVocab(const BpeVocab&) = delete;
  BpeVocab& operator=(const BpeVocab&) = delete;

  int32_t size() const { return static_cast<int32_t>(pieces_.size()); }
  const std::string& piece(int32_t id) const { return pieces_[id]; }
  float score(int32_t id) const { return scores_[id]; }
  bool mergeable(int32_t id) const { return mergeable_[id] != 0; }
  // Lowest mergeable id whose piece is `piece`, or -1.
  int32_t Find(std::string_view piece) const;

  // Appends the initial symbols of `text` to `out` (step 1 above). `escape_spaces` looks chunks
  // up with ' ' replaced by U+2581 (sentencepiece); fallback bytes are always the chunk's
  // original bytes.
  void Segment(std::string_view text, bool escape_spaces, std::vector<int32_t>* out) const;

  // Merges `symbols` (step 2 above) and returns the final ids.
  std::vector<int32_t> Merge(std::vector<int32_t> symbols) const;

 private:
  explicit BpeVocab(BpeVocabOptions options);

  std::vector<std::string> pieces_;
  std::vector<float> scores_;
  std::vector<uint8_t> mergeable_;
  std::array<int32_t, 256> byte_ids_;
  int32_t unk_id_;
  float min_merge_score_;
  // Views into pieces_, which never changes after construction.
  std::unordered_map<std::string_view, int32_t> index_;
  // Per id: the lowest mergeable id with the same piece text (-1 for ids that are not mergeable).
  std::vector<int32_t> canonical_;
  // PairKey(canonical left, canonical right) -> the mergeable id whose piece is the two pieces'
  // concatenation: every way of splitting every mergeable piece into two mergeable pieces. Gives
  // the same answer as looking the concatenated text up in index_, without building strings.
  std::unordered_map<uint64_t, int32_t> merges_;
};

}  // namespace qcal::bpe
