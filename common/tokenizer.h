// Tokenizers for the Llama family: the llama2.c `.bin` format and sentencepiece `tokenizer.model`
// (read through qcal's own copy of the schema in proto/sentencepiece_model.proto; libsentencepiece
// is never linked because it bundles a conflicting protobuf), and Hugging Face `tokenizer.json`
// (common/hf_tokenizer.h: Llama 3's byte-level BPE, Llama-2-style files).
//
// The first two encode the way Llama's sentencepiece BPE does: a dummy-prefix space, then repeatedly merge
// the adjacent pair whose concatenation is a vocabulary piece with the highest score (leftmost on
// ties), and fall back to byte pieces <0xXX> for characters not in the vocabulary. The merge loop
// uses a heap over a linked list, O(n log n), so a whole test set encodes in one call.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace qcal {

// Implementations are immutable after loading: every method is const and thread-safe.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int vocab_size() const = 0;
  virtual int bos_id() const = 0;
  virtual int eos_id() const = 0;
  // Encodes `text` as the model's tokenizer does, adding no BOS/EOS. The llama2.c and
  // sentencepiece tokenizers add the dummy-prefix space (none for empty text); tokenizer.json
  // files do what their normalizer and pre-tokenizer say (Llama 3: nothing is added).
  // The bytes are taken as given: no newline translation (the golden token counts read files the
  // way Python's text mode does, turning "\r\n" into "\n"), and malformed UTF-8 or characters
  // without a piece fall back to one byte piece per byte, so Decode(Encode(t)) == " " + t for
  // llama2.c tokenizers and models converted from them (sentencepiece reads a literal U+2581 in
  // `t` as a space).
  virtual std::vector<int32_t> Encode(std::string_view text) const = 0;
  // The vocabulary piece of `id` exactly as stored (llama2.c pieces use ' ' where sentencepiece
  // uses U+2581). Out-of-range ids give "".
  virtual std::string Piece(int32_t id) const = 0;
  virtual float Score(int32_t id) const = 0;
  // Decodes to text: U+2581 -> ' ', byte pieces -> raw bytes, control pieces (<s>, </s>) -> "",
  // <unk> -> " \xE2\x81\x87 " (sentencepiece's unk_surface " ⁇ "), out-of-range ids -> "".
  // The leading dummy-prefix space of the first token is kept (callers strip it if they want).
  virtual std::string Decode(const std::vector<int32_t>& ids) const = 0;
};

// llama2.c tokenizer.bin: int32 max_token_length, then per token: float32 score, int32 length,
// `length` bytes. Reads until end of file; `expected_vocab` > 0 checks the count. Ids 0/1/2 are
// <unk>/<s>/</s>, 3..258 the byte pieces <0x00>..<0xFF>. Errors name the path: NotFound for a
// missing file, DataLoss for an empty or truncated file, negative or oversized lengths (a piece
// longer than max_token_length), fewer than 259 tokens, or a count other than `expected_vocab`.
StatusOr<std::unique_ptr<Tokenizer>> LoadLlama2cTokenizer(const std::string& path,
                                                          int expected_vocab = 0);

// sentencepiece ModelProto (BPE, byte_fallback) as Llama-2 ships it. DataLoss for an empty or
// unparsable file; Unimplemented for non-BPE models, normalizers with a precompiled charsmap and
// treat_whitespace_as_suffix; InvalidArgument for inconsistent vocabularies (repeated or empty
// pieces, bad unk_id, byte_fallback without all 256 byte pieces).
StatusOr<std::unique_ptr<Tokenizer>> LoadSentencePieceTokenizer(const std::string& path);

// Writes a sentencepiece tokenizer.model equivalent to a llama2.c tokenizer (pieces with ' '
// turned back into U+2581, types NORMAL/CONTROL/UNKNOWN/BYTE, Llama-2 normalizer settings), so an
// imported model directory carries a standard tokenizer. Encoding with the written model gives
// the same ids as the llama2.c tokenizer. InvalidArgument (naming llama2c_path) when that cannot
// hold: byte pieces not at ids 3..258, empty or non-UTF-8 pieces, pieces containing U+2581, or
// pieces repeated after the ' ' -> U+2581 mapping. The file is written atomically.
Status WriteSentencePieceModelFromLlama2c(const std::string& llama2c_path,
                                          const std::string& out_path);

// Loads <dir>/tokenizer.json if present (BOS/EOS from <dir>/config.json's bos_token_id /
// eos_token_id — the first of a list — else tokenizer_config.json; special tokens in text are not
// parsed), else <dir>/tokenizer.model; NotFound naming the directory if it has neither.
StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerFromModelDir(const std::string& dir);

}  // namespace qcal
