#include "common/tokenizer_bpe.h"

#include <queue>
#include <utility>

#include "absl/strings/str_format.h"

namespace qcal::bpe {
namespace {

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

int ParseBytePiece(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  const int hi = HexValue(piece[3]);
  const int lo = HexValue(piece[4]);
  if (hi < 0 || lo < 0) return -1;
  return hi * 16 + lo;
}

std::string BytePiece(uint8_t byte) { return absl::StrFormat("<0x%02X>", byte); }

std::string ReplaceAll(std::string_view s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (true) {
    const size_t at = s.find(from, i);
    if (at == std::string_view::npos) break;
    out.append(s.substr(i, at - i));
    out.append(to);
    i = at + from.size();
  }
  out.append(s.substr(i));
  return out;
}

StatusOr<std::unique_ptr<BpeVocab>> BpeVocab::Create(BpeVocabOptions options) {
  const size_t n = options.pieces.size();
  if (n == 0) return absl::InvalidArgumentError("BPE vocabulary is empty");
  if (n > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return absl::InvalidArgumentError("BPE vocabulary too large");
  }
  if (options.scores.size() != n || options.mergeable.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "BPE vocabulary: %d pieces but %d scores and %d mergeable flags", n,
        options.scores.size(), options.mergeable.size()));
  }
  const auto in_range = [n](int32_t id) { return id >= 0 && static_cast<size_t>(id) < n; };
  if (options.unk_id != -1 && !in_range(options.unk_id)) {
    return absl::InvalidArgumentError(absl::StrFormat("unk id %d out of range", options.unk_id));
  }
  for (int b = 0; b < 256; ++b) {
    const int32_t id = options.byte_ids[b];
    if (id == -1) {
      if (options.unk_id == -1) {
        return absl::InvalidArgumentError(
            absl::StrFormat("byte 0x%02X has neither a byte piece nor an unk id", b));
      }
    } else if (!in_range(id)) {
      return absl::InvalidArgumentError(absl::StrFormat("byte 0x%02X: id %d out of range", b, id));
    }
  }
  return std::unique_ptr<BpeVocab>(new BpeVocab(std::move(options)));
}

BpeVocab::BpeVocab(BpeVocabOptions options)
    : pieces_(std::move(options.pieces)),
      scores_(std::move(options.scores)),
      mergeable_(options.mergeable.begin(), options.mergeable.end()),
      byte_ids_(options.byte_ids),
      unk_id_(options.unk_id),
      min_merge_score_(options.min_merge_score) {
  index_.reserve(pieces_.size() * 2);
  for (size_t id = 0; id < pieces_.size(); ++id) {
    // emplace keeps the first (lowest) id of a repeated piece.
    if (mergeable_[id]) index_.emplace(std::string_view(pieces_[id]), static_cast<int32_t>(id));
  }
  canonical_.assign(pieces_.size(), -1);
  for (size_t id = 0; id < pieces_.size(); ++id) {
    if (mergeable_[id]) canonical_[id] = Find(pieces_[id]);
  }
  for (const auto& [text, id] : index_) {
    // Splits at 0 and at the end pair the piece with an empty piece, if the vocabulary has one.
    for (size_t k = 0; k <= text.size(); ++k) {
      const int32_t left = Find(text.substr(0, k));
      const int32_t right = Find(text.substr(k));
      if (left >= 0 && right >= 0) merges_.emplace(PairKey(left, right), id);
    }
  }
}

int32_t BpeVocab::Find(std::string_view piece) const {
  const auto it = index_.find(piece);
  return it == index_.end() ? -1 : it->second;
}

void BpeVocab::Segment(std::string_view text, bool escape_spaces,
                       std::vector<int32_t>* out) const {
  std::string escaped;
  ForEachChunk(text, [&](std::string_view chunk) {
    std::string_view key = chunk;
    if (escape_spaces && chunk.find(' ') != std::string_view::npos) {
      // Only the first byte of a chunk can be ' ' (the rest are continuation bytes).
      escaped.assign(kSpaceSymbol);
      escaped.append(chunk.substr(1));
      key = escaped;
    }
    const int32_t id = Find(key);
    if (id >= 0) {
      out->push_back(id);
      return;
    }
    // Byte symbols for the chunk's bytes; bytes without one give a single <unk> per chunk.
    bool pushed_unk = false;
    for (char c : chunk) {
      const int32_t byte_id = byte_ids_[static_cast<uint8_t>(c)];
      if (byte_id >= 0) {
        out->push_back(byte_id);
      } else if (!pushed_unk) {
        out->push_back(unk_id_);
        pushed_unk = true;
      }
    }
  });
}

std::vector<int32_t> BpeVocab::Merge(std::vector<int32_t> ids) const {
  const int32_t n = static_cast<int32_t>(ids.size());
  if (n < 2) return ids;

  // Doubly linked list over positions; a merge keeps the left position and removes the right.
  // Positions increase along the list, so "leftmost" is "smallest left position".
  std::vector<int32_t> prev(n), next(n);
  for (int32_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1;  // n marks the end
  }
  // Bumped whenever a symbol changes or disappears; a heap entry is live only if both of its
  // symbols still have the versions they had when it was pushed.
  std::vector<uint32_t> version(n, 0);

  struct Candidate {
    float score;
    int32_t left;
    int32_t right;
    int32_t merged;
    uint32_t left_version;
    uint32_t right_version;
  };
  // std::priority_queue pops the "largest": higher score, then smaller left position.
  const auto lower_priority = [](const Candidate& a, const Candidate& b) {
    if (a.score != b.score) return a.score < b.score;
    return a.left > b.left;
  };
  std::vector<Candidate> storage;
  storage.reserve(n);
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(lower_priority)> heap(
      lower_priority, std::move(storage));

  const auto try_push = [&](int32_t left, int32_t right) {
    const int32_t a = canonical_[ids[left]];
    const int32_t b = canonical_[ids[right]];
    if (a < 0 || b < 0) return;
    const auto it = merges_.find(PairKey(a, b));
    if (it == merges_.end()) return;
    const float s = scores_[it->second];
    if (!(s > min_merge_score_)) return;
    heap.push(Candidate{s, left, right, it->second, version[left], version[right]});
  };

  for (int32_t i = 0; i + 1 < n; ++i) try_push(i, i + 1);

  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    if (version[c.left] != c.left_version || version[c.right] != c.right_version) continue;
    ids[c.left] = c.merged;
    ++version[c.left];
    ++version[c.right];
    const int32_t after = next[c.right];
    next[c.left] = after;
    if (after < n) prev[after] = c.left;
    if (prev[c.left] >= 0) try_push(prev[c.left], c.left);
    if (after < n) try_push(c.left, after);
  }

  std::vector<int32_t> out;
  for (int32_t i = 0; i < n; i = next[i]) out.push_back(ids[i]);
  return out;
}

}  // namespace qcal::bpe
