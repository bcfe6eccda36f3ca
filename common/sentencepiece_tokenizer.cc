// sentencepiece tokenizer.model (BPE with byte fallback, identity normalizer: Llama / Llama-2),
// read through qcal's own schema copy, and the llama2.c -> tokenizer.model converter.
//
// Encoding follows sentencepiece's BPE model for the identity normalizer:
//   normalize: optionally remove extra spaces, prepend the dummy prefix " ", escape ' ' -> U+2581;
//   segment into characters; merge by best piece score, leftmost on ties; emit pieces, and for
//   characters with no piece their UTF-8 bytes as <0xXX> pieces (byte_fallback) or unk_id.
// Choices where qcal differs from upstream sentencepiece (documented in the report and tests):
//  * Unknown characters become byte symbols (or <unk>) BEFORE merging, as llama2.c does, instead
//    of staying character symbols until the end. The two agree unless a NORMAL piece contains a
//    character that has no piece of its own (never the case for a trained vocabulary).
//  * Malformed UTF-8 is not replaced by U+FFFD: text is split into llama2.c chunks (a byte plus up
//    to 3 continuation bytes) and an unknown chunk falls back to its original bytes, so any byte
//    string encodes exactly like the llama2.c tokenizer and decodes back to itself.
//  * A literal U+2581 in the input is indistinguishable from an escaped space (as upstream).
//  * USER_DEFINED pieces are treated like NORMAL pieces (matched through merges, not by an
//    up-front longest match); UNUSED pieces are never produced.
//  * With byte_fallback off, each unknown character gives one unk_id (upstream may fold a run of
//    unknown characters into one <unk>).
//  * Decode keeps the leading dummy-prefix space (the Tokenizer contract) and does not fix up
//    malformed UTF-8 produced by byte pieces; <unk> decodes to trainer_spec.unk_surface (" ⁇ ").
#include <sys/stat.h>

#include <memory>
#include <string>
#include <unordered_set>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/tokenizer.h"
#include "common/tokenizer_bpe.h"
#include "common/utf8.h"
#include "proto/sentencepiece_model.pb.h"

namespace qcal {
namespace {

namespace sp = ::qcal::sentencepiece;
using PieceType = sp::ModelProto::SentencePiece::Type;

class SentencePieceTokenizer final : public Tokenizer {
 public:
  struct Settings {
    bool add_dummy_prefix = true;
    bool remove_extra_whitespaces = false;
    bool escape_whitespaces = true;
    int32_t bos_id = -1;
    int32_t eos_id = -1;
    std::string unk_surface;
  };

  SentencePieceTokenizer(std::unique_ptr<bpe::BpeVocab> vocab, std::vector<PieceType> types,
                         Settings settings)
      : vocab_(std::move(vocab)), types_(std::move(types)), settings_(std::move(settings)) {}

  int vocab_size() const override { return vocab_->size(); }
  int bos_id() const override { return settings_.bos_id; }
  int eos_id() const override { return settings_.eos_id; }

  std::vector<int32_t> Encode(std::string_view text) const override {
    std::string trimmed;
    if (settings_.remove_extra_whitespaces) {
      trimmed = RemoveExtraSpaces(text);
      text = trimmed;
    }
    std::vector<int32_t> symbols;
    if (text.empty()) return symbols;
    symbols.reserve(text.size() + 1);
    const bool escape = settings_.escape_whitespaces;
    // Segmented on its own so that a leading continuation byte in `text` never joins it (the
    // llama2.c tokenizer does the same).
    if (settings_.add_dummy_prefix) vocab_->Segment(" ", escape, &symbols);
    vocab_->Segment(text, escape, &symbols);
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
      if (id < 0 || id >= vocab_->size()) continue;
      switch (types_[id]) {
        case sp::ModelProto::SentencePiece::CONTROL:
          break;
        case sp::ModelProto::SentencePiece::UNKNOWN:
          out += settings_.unk_surface;
          break;
        case sp::ModelProto::SentencePiece::BYTE:
          out.push_back(static_cast<char>(bpe::ParseBytePiece(vocab_->piece(id))));
          break;
        default:
          if (settings_.escape_whitespaces) {
            out += bpe::ReplaceAll(vocab_->piece(id), bpe::kSpaceSymbol, " ");
          } else {
            out += vocab_->piece(id);
          }
      }
    }
    return out;
  }

 private:
  // sentencepiece's remove_extra_whitespaces: drop leading and trailing ' ', fold runs of ' '.
  static std::string RemoveExtraSpaces(std::string_view text) {
    std::string out;
    out.reserve(text.size());
    bool pending_space = false;
    for (char c : text) {
      if (c == ' ') {
        pending_space = !out.empty();
        continue;
      }
      if (pending_space) out.push_back(' ');
      pending_space = false;
      out.push_back(c);
    }
    return out;
  }

  std::unique_ptr<bpe::BpeVocab> vocab_;
  std::vector<PieceType> types_;
  Settings settings_;
};

std::string TypeName(PieceType type) {
  return sp::ModelProto::SentencePiece::Type_IsValid(type)
             ? sp::ModelProto::SentencePiece::Type_Name(type)
             : absl::StrFormat("type %d", static_cast<int>(type));
}

StatusOr<std::unique_ptr<Tokenizer>> BuildSentencePieceTokenizer(const sp::ModelProto& model,
                                                                 const std::string& path) {
  const auto error = [&path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrFormat("sentencepiece model %s: %s", path, what));
  };
  const sp::TrainerSpec& trainer = model.trainer_spec();
  const sp::NormalizerSpec& normalizer = model.normalizer_spec();
  if (trainer.model_type() != sp::TrainerSpec::BPE) {
    return absl::UnimplementedError(absl::StrFormat(
        "sentencepiece model %s: model type %s is not supported (qcal implements BPE only)%s",
        path,
        sp::TrainerSpec::ModelType_IsValid(trainer.model_type())
            ? sp::TrainerSpec::ModelType_Name(trainer.model_type())
            : std::to_string(trainer.model_type()),
        model.has_trainer_spec() ? "" : "; the file has no trainer_spec, so the type defaults"));
  }
  if (!normalizer.precompiled_charsmap().empty()) {
    return absl::UnimplementedError(absl::StrFormat(
        "sentencepiece model %s: normalizer '%s' needs a precompiled charsmap (%d bytes); only the "
        "identity normalizer (empty charsmap) is supported",
        path, normalizer.name(), normalizer.precompiled_charsmap().size()));
  }
  if (model.has_denormalizer_spec() && !model.denormalizer_spec().precompiled_charsmap().empty()) {
    return absl::UnimplementedError(absl::StrFormat(
        "sentencepiece model %s: a denormalizer with a precompiled charsmap is not supported",
        path));
  }
  if (trainer.treat_whitespace_as_suffix()) {
    return absl::UnimplementedError(absl::StrFormat(
        "sentencepiece model %s: treat_whitespace_as_suffix is not supported", path));
  }
  const int n = model.pieces_size();
  if (n == 0) return error("no pieces (empty file, or not a tokenizer.model)");

  bpe::BpeVocabOptions opts;
  opts.pieces.reserve(n);
  opts.scores.reserve(n);
  opts.mergeable.reserve(n);
  opts.byte_ids.fill(-1);
  std::vector<PieceType> types;
  types.reserve(n);
  std::unordered_set<std::string_view> seen;
  int unknown_count = 0;
  for (int id = 0; id < n; ++id) {
    const auto& p = model.pieces(id);
    const PieceType type = p.type();
    if (p.piece().empty()) return error(absl::StrFormat("piece %d is empty", id));
    if (!seen.insert(p.piece()).second) {
      return error(absl::StrFormat("piece %d '%s' is repeated", id, p.piece()));
    }
    // Pieces are UTF-8 text (raw bytes have BYTE pieces <0xXX>): anything else is a damaged file.
    if (!IsValidUtf8(p.piece())) {
      return error(absl::StrFormat("piece %d is not valid UTF-8 (%s): the file is damaged", id,
                                   DescribeInvalidUtf8(p.piece())));
    }
    switch (type) {
      case sp::ModelProto::SentencePiece::NORMAL:
      case sp::ModelProto::SentencePiece::USER_DEFINED:
      case sp::ModelProto::SentencePiece::CONTROL:
      case sp::ModelProto::SentencePiece::UNUSED:
        break;
      case sp::ModelProto::SentencePiece::UNKNOWN:
        ++unknown_count;
        break;
      case sp::ModelProto::SentencePiece::BYTE: {
        const int byte = bpe::ParseBytePiece(p.piece());
        if (byte < 0) {
          return error(absl::StrFormat("BYTE piece %d '%s' is not of the form <0xXX>", id,
                                       p.piece()));
        }
        opts.byte_ids[byte] = id;
        break;
      }
      default:
        return error(absl::StrFormat("piece %d has unknown %s", id, TypeName(type)));
    }
    opts.pieces.push_back(p.piece());
    opts.scores.push_back(p.score());
    opts.mergeable.push_back(type == sp::ModelProto::SentencePiece::NORMAL ||
                             type == sp::ModelProto::SentencePiece::USER_DEFINED);
    types.push_back(type);
  }

  const int32_t unk_id = trainer.unk_id();
  if (unk_id < 0 || unk_id >= n) {
    return error(absl::StrFormat("unk_id %d is outside the vocabulary of %d", unk_id, n));
  }
  if (types[unk_id] != sp::ModelProto::SentencePiece::UNKNOWN || unknown_count != 1) {
    return error(absl::StrFormat(
        "need exactly one UNKNOWN piece at unk_id %d (found %d; piece %d has %s)", unk_id,
        unknown_count, unk_id, TypeName(types[unk_id])));
  }
  for (const int32_t special : {trainer.bos_id(), trainer.eos_id(), trainer.pad_id()}) {
    if (special < -1 || special >= n) {
      return error(absl::StrFormat("special id %d is outside the vocabulary of %d", special, n));
    }
  }
  if (trainer.byte_fallback()) {
    for (int b = 0; b < 256; ++b) {
      if (opts.byte_ids[b] < 0) {
        return error(absl::StrFormat("byte_fallback is on but there is no BYTE piece %s",
                                     bpe::BytePiece(static_cast<uint8_t>(b))));
      }
    }
  } else {
    opts.byte_ids.fill(-1);  // unknown characters become unk_id
  }
  opts.unk_id = unk_id;

  SentencePieceTokenizer::Settings settings;
  settings.add_dummy_prefix = normalizer.add_dummy_prefix();
  settings.remove_extra_whitespaces = normalizer.remove_extra_whitespaces();
  settings.escape_whitespaces = normalizer.escape_whitespaces();
  settings.bos_id = trainer.bos_id();
  settings.eos_id = trainer.eos_id();
  settings.unk_surface = trainer.unk_surface();

  auto vocab = bpe::BpeVocab::Create(std::move(opts));
  if (!vocab.ok()) return Annotate(vocab.status(), path);
  return std::unique_ptr<Tokenizer>(
      new SentencePieceTokenizer(*std::move(vocab), std::move(types), std::move(settings)));
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(const std::string data, ReadFile(path));
  if (data.empty()) {
    return absl::DataLossError(absl::StrFormat("sentencepiece model %s: file is empty", path));
  }
  sp::ModelProto model;
  if (!model.ParseFromString(data)) {
    return absl::DataLossError(absl::StrFormat(
        "sentencepiece model %s: not a valid ModelProto (%d bytes; truncated or another format?)",
        path, data.size()));
  }
  return BuildSentencePieceTokenizer(model, path);
}

Status WriteSentencePieceModelFromLlama2c(const std::string& llama2c_path,
                                          const std::string& out_path) {
  QCAL_ASSIGN_OR_RETURN(const std::unique_ptr<Tokenizer> src, LoadLlama2cTokenizer(llama2c_path));
  const auto error = [&llama2c_path](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "cannot convert llama2.c tokenizer %s to sentencepiece: %s", llama2c_path, what));
  };
  const int n = src->vocab_size();
  sp::ModelProto model;
  std::unordered_set<std::string> seen;
  for (int id = 0; id < n; ++id) {
    const std::string raw = src->Piece(id);
    auto* piece = model.add_pieces();
    piece->set_score(src->Score(id));
    if (id == 0) {
      piece->set_piece("<unk>");
      piece->set_type(sp::ModelProto::SentencePiece::UNKNOWN);
    } else if (id == 1 || id == 2) {
      piece->set_piece(id == 1 ? "<s>" : "</s>");
      piece->set_type(sp::ModelProto::SentencePiece::CONTROL);
    } else if (id < 3 + 256) {
      // run.c sends byte b to id b + 3 whatever the piece says, so the layout must be standard.
      const std::string expected = bpe::BytePiece(static_cast<uint8_t>(id - 3));
      if (raw != expected) {
        return error(absl::StrFormat("token %d is '%s', expected the byte piece %s", id, raw,
                                     expected));
      }
      piece->set_piece(raw);
      piece->set_type(sp::ModelProto::SentencePiece::BYTE);
    } else {
      if (raw.empty()) return error(absl::StrFormat("token %d is empty", id));
      if (!IsValidUtf8(raw)) {
        return error(absl::StrFormat("token %d is not valid UTF-8", id));
      }
      if (raw.find(bpe::kSpaceSymbol) != std::string::npos) {
        return error(absl::StrFormat(
            "token %d contains U+2581, which sentencepiece reserves for the space", id));
      }
      piece->set_piece(bpe::ReplaceAll(raw, " ", bpe::kSpaceSymbol));
      piece->set_type(sp::ModelProto::SentencePiece::NORMAL);
    }
    if (!seen.insert(piece->piece()).second) {
      return error(absl::StrFormat("token %d: piece '%s' appears twice", id, piece->piece()));
    }
  }

  sp::TrainerSpec* trainer = model.mutable_trainer_spec();
  trainer->set_model_type(sp::TrainerSpec::BPE);
  trainer->set_vocab_size(n);
  trainer->set_byte_fallback(true);
  trainer->set_unk_id(0);
  trainer->set_bos_id(1);
  trainer->set_eos_id(2);
  trainer->set_pad_id(-1);
  sp::NormalizerSpec* normalizer = model.mutable_normalizer_spec();
  normalizer->set_name("identity");
  normalizer->set_precompiled_charsmap("");
  normalizer->set_add_dummy_prefix(true);
  normalizer->set_remove_extra_whitespaces(false);
  normalizer->set_escape_whitespaces(true);

  std::string bytes;
  if (!model.SerializeToString(&bytes)) {
    return absl::InternalError(absl::StrFormat("serializing the sentencepiece model for %s failed",
                                               out_path));
  }
  return WriteFileAtomic(out_path, bytes);
}

}  // namespace qcal
