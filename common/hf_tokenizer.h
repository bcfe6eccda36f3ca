// Hugging Face `tokenizer.json` (the `tokenizers` library's format) for the Llama families.
//
// Supported, as Llama 2, Llama 3.x and Mistral files use them:
//  * model: BPE — `vocab`, `merges` ("a b" strings or ["a", "b"] pairs) applied by rank (lowest
//    first, leftmost on ties), `ignore_merges` (a pre-token that is itself a vocabulary entry is
//    one token), `byte_fallback` (<0xNN> tokens for characters outside the vocabulary),
//    `unk_token`, `fuse_unk`. Dropout, `continuing_subword_prefix` and `end_of_word_suffix` are
//    refused.
//  * added tokens: matched in the raw text before everything else, longest match first; special
//    ones only when HfTokenizerOptions::parse_special is set (off for calibration and evaluation
//    text, so text that happens to contain "<|begin_of_text|>" is tokenized as text); `lstrip` /
//    `rstrip` take the whitespace beside a match into the token; `single_word` is refused.
//  * normalizers: Sequence, Prepend, Replace (a string pattern), null.
//  * pre-tokenizers: Sequence; Split with a regex (PCRE2 in UTF + Unicode-property mode, JIT
//    compiled: the Llama 3 pattern needs \p{L}, \p{N} and a look-ahead) or a string, behaviours
//    Isolated, Removed, MergedWithPrevious, MergedWithNext, Contiguous, `invert`; ByteLevel (the
//    GPT-2 byte-to-unicode map, `add_prefix_space`, `use_regex` with the GPT-2 pattern);
//    Metaspace (`replacement`, `prepend_scheme` first/always/never or the older
//    `add_prefix_space`, `split`); null.
//  * decoders: ByteLevel, Metaspace, Sequence, Replace, ByteFallback, Fuse, Strip; null.
//  * post-processors are not applied (qcal adds BOS itself); TemplateProcessing's first special
//    token is the BOS of last resort (see LoadHfTokenizer).
//
// Text that is not valid UTF-8 is read with each malformed byte replaced by U+FFFD (what a
// Python caller decoding with errors="replace" hands to `tokenizers`); Decode(Encode(t)) == t for
// valid UTF-8 t under the Llama 3 file.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "common/tokenizer.h"

namespace qcal {

struct HfTokenizerOptions {
  // Match special added tokens (<|begin_of_text|>, <|eot_id|>, ...) in the text. Non-special
  // added tokens are always matched, as in `tokenizers`.
  bool parse_special = false;
  // BOS / EOS ids; -1: from `tokenizer_config_path` (bos_token / eos_token), else from the
  // TemplateProcessing post-processor (BOS only), else -1.
  int bos_id = -1;
  int eos_id = -1;
  std::string tokenizer_config_path;  // tokenizer_config.json; empty: none
};

// Loads `path` (a tokenizer.json). Errors name the file and the field: NotFound for a missing
// file, DataLoss for a file that is not JSON (a truncated one), InvalidArgument for a field of
// the wrong type, a merge naming a token not in the vocabulary, repeated ids or a regex PCRE2
// cannot compile (with its message and offset), Unimplemented for a model, normalizer,
// pre-tokenizer or decoder type qcal does not support (named, with the supported ones).
StatusOr<std::unique_ptr<Tokenizer>> LoadHfTokenizer(const std::string& path,
                                                     const HfTokenizerOptions& options = {});

// Parses tokenizer.json text (`name` is used in messages); LoadHfTokenizer reads the file and
// calls this. The tokenizer_config.json of `options`, if any, is read from disk.
StatusOr<std::unique_ptr<Tokenizer>> ParseHfTokenizer(const std::string& text,
                                                      const std::string& name,
                                                      const HfTokenizerOptions& options = {});

}  // namespace qcal
