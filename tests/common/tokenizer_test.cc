// Tokenizers: llama2.c tokenizer.bin and sentencepiece tokenizer.model against the golden
// reference (../shared/golden/reference.json), against a naive O(n^2) transcription of llama2.c
// run.c's `encode`, and against each other.
#include "common/tokenizer.h"

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/atomic_file.h"
#include "common/text.h"
#include "common/tokenizer_bpe.h"
#include "common/utf8.h"
#include "proto/sentencepiece_model.pb.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

namespace sp = ::qcal::sentencepiece;
using ::qcal::testing::MakeTempDir;
using ::qcal::testing::SharedDir;
using ::qcal::testing::TestSeed;

const char* const kModels[] = {"stories260K", "aidreams260K"};

bool FileExists(const std::string& path) { return std::ifstream(path).good(); }

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The file as Python's open(path).read() sees it: universal newlines turn "\r\n" and lone "\r"
// into "\n". The golden token counts were made that way ("read as text"); the TinyStories sample
// has 18 CRLF line ends, each of which would otherwise add a <0x0D> token.
std::string ReadAsText(const std::string& path) {
  const std::string raw = ReadAll(path);
  std::string out;
  out.reserve(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
    } else {
      out.push_back(raw[i]);
    }
  }
  return out;
}

void WriteAll(const std::string& path, std::string_view data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

std::string TokPath(const std::string& model) {
  return SharedDir() + "/models/" + model + "/tok512.bin";
}

const nlohmann::json& Golden() {
  static const nlohmann::json* golden = [] {
    const std::string path = SharedDir() + "/golden/reference.json";
    return new nlohmann::json(nlohmann::json::parse(ReadAll(path)));
  }();
  return *golden;
}

// Value of the first key of golden[model] that starts with `prefix` (e.g. "ppl_tinystories_").
const nlohmann::json& GoldenByPrefix(const std::string& model, const std::string& prefix) {
  for (const auto& [key, value] : Golden().at(model).items()) {
    if (key.rfind(prefix, 0) == 0) return value;
  }
  static const nlohmann::json kNull;
  ADD_FAILURE() << "no key " << prefix << "* for " << model;
  return kNull;
}

std::unique_ptr<Tokenizer> LoadLlama2c(const std::string& path) {
  auto tok = LoadLlama2cTokenizer(path, 0);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// Converts a llama2.c tokenizer into <temp dir>/tokenizer.model and loads it back the way a model
// directory is loaded.
std::unique_ptr<Tokenizer> ConvertAndLoad(const std::string& llama2c_path) {
  const std::string dir = MakeTempDir("tok");
  const Status st = WriteSentencePieceModelFromLlama2c(llama2c_path, dir + "/tokenizer.model");
  EXPECT_TRUE(st.ok()) << st;
  auto tok = LoadTokenizerFromModelDir(dir);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

std::string Show(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size() && i < 64; ++i) s += std::to_string(ids[i]) + " ";
  if (ids.size() > 64) s += "...";
  return s;
}

// First position where two id sequences differ, for readable failures on long encodings.
std::string FirstDifference(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  if (i == a.size() && i == b.size()) return "identical";
  return "sizes " + std::to_string(a.size()) + " vs " + std::to_string(b.size()) +
         ", first difference at " + std::to_string(i) + ": " +
         (i < a.size() ? std::to_string(a[i]) : "end") + " vs " +
         (i < b.size() ? std::to_string(b[i]) : "end");
}

// -----------------------------------------------------------------------------------------------
// A line-by-line transcription of llama2.c run.c `encode` (bsearch over the sorted vocabulary,
// O(n^2) merge loop), sharing no code with the library. Repeated pieces resolve to the lowest id.
class NaiveLlama2c {
 public:
  explicit NaiveLlama2c(const Tokenizer& tok) {
    for (int id = 0; id < tok.vocab_size(); ++id) {
      vocab_.push_back(tok.Piece(id));
      scores_.push_back(tok.Score(id));
      sorted_.emplace_back(vocab_.back(), id);
    }
    std::sort(sorted_.begin(), sorted_.end());
  }

  int Lookup(const std::string& s) const {
    const auto it = std::lower_bound(sorted_.begin(), sorted_.end(), std::make_pair(s, INT_MIN));
    return (it != sorted_.end() && it->first == s) ? it->second : -1;
  }

  std::vector<int32_t> Encode(const std::string& text) const {
    std::vector<int32_t> tokens;
    if (text.empty()) return tokens;
    tokens.push_back(Lookup(" "));
    std::string buf;
    for (size_t i = 0; i < text.size(); ++i) {
      if ((static_cast<uint8_t>(text[i]) & 0xC0) != 0x80) buf.clear();
      buf.push_back(text[i]);
      if (i + 1 < text.size() && (static_cast<uint8_t>(text[i + 1]) & 0xC0) == 0x80 &&
          buf.size() < 4) {
        continue;
      }
      const int id = Lookup(buf);
      if (id != -1) {
        tokens.push_back(id);
      } else {
        for (char c : buf) tokens.push_back(static_cast<uint8_t>(c) + 3);
      }
      buf.clear();
    }
    while (true) {
      float best_score = -1e10f;
      int best_id = -1;
      int best_idx = -1;
      for (size_t i = 0; i + 1 < tokens.size(); ++i) {
        const int id = Lookup(vocab_[tokens[i]] + vocab_[tokens[i + 1]]);
        if (id != -1 && scores_[id] > best_score) {
          best_score = scores_[id];
          best_id = id;
          best_idx = static_cast<int>(i);
        }
      }
      if (best_idx == -1) break;
      tokens[best_idx] = best_id;
      tokens.erase(tokens.begin() + best_idx + 1);
    }
    return tokens;
  }

 private:
  std::vector<std::string> vocab_;
  std::vector<float> scores_;
  std::vector<std::pair<std::string, int>> sorted_;
};

// The bytes of a llama2.c tokenizer.bin; max_len 0 means the longest piece.
std::string Llama2cBytes(int32_t max_len, const std::vector<std::pair<std::string, float>>& toks) {
  if (max_len == 0) {
    for (const auto& t : toks) max_len = std::max<int32_t>(max_len, static_cast<int32_t>(t.first.size()));
  }
  std::string out(reinterpret_cast<const char*>(&max_len), 4);
  for (const auto& [piece, score] : toks) {
    const int32_t len = static_cast<int32_t>(piece.size());
    out.append(reinterpret_cast<const char*>(&score), 4);
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += piece;
  }
  return out;
}

// <unk>, <s>, </s> and the 256 byte pieces, as llama2.c lays them out.
std::vector<std::pair<std::string, float>> Llama2cSpecials() {
  std::vector<std::pair<std::string, float>> toks = {
      {"<unk>", 0.0f}, {"\n<s>\n", 0.0f}, {"\n</s>\n", 0.0f}};
  for (int b = 0; b < 256; ++b) toks.emplace_back(bpe::BytePiece(static_cast<uint8_t>(b)), 0.0f);
  return toks;
}

// Random UTF-8 text: mostly ASCII letters and spaces, some newlines, multi-byte codepoints
// (including ones outside both vocabularies), and occasionally raw bytes.
std::string RandomText(std::mt19937_64& rng, size_t approx_len, bool allow_bad_bytes,
                       bool allow_u2581) {
  static const char* const kPieces[] = {
      "a", "e", "t", "h", " ", " ", " ", "  ", "\n", "\n\n", "the", " the", "ing", "Lily", ".",
      ",", "\xC3\xA9", "\xE2\x80\x9C", "\xE2\x80\x9D", "\xCE\xBB", "\xF0\x9F\x98\x80",
      "\xE4\xB8\xAD", "\xC2\xA0", "\t", "0", "9", "\xE2\x96\x81"};
  std::string s;
  std::uniform_int_distribution<int> kind(0, 9);
  while (s.size() < approx_len) {
    const int k = kind(rng);
    if (k < 6) {
      const char* p = kPieces[rng() % (sizeof(kPieces) / sizeof(kPieces[0]))];
      if (!allow_u2581 && std::string_view(p) == bpe::kSpaceSymbol) continue;
      s += p;
    } else if (k < 8) {
      s.push_back(static_cast<char>('a' + rng() % 26));
    } else if (k < 9) {
      // A random codepoint from the BMP or above, skipping surrogates and U+2581.
      uint32_t cp = static_cast<uint32_t>(rng() % 0x2FFFF) + 0x80;
      if ((cp >= 0xD800 && cp <= 0xDFFF) || cp == 0x2581) continue;
      char buf[4];
      int n;
      if (cp < 0x800) {
        buf[0] = static_cast<char>(0xC0 | (cp >> 6));
        buf[1] = static_cast<char>(0x80 | (cp & 0x3F));
        n = 2;
      } else if (cp < 0x10000) {
        buf[0] = static_cast<char>(0xE0 | (cp >> 12));
        buf[1] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        buf[2] = static_cast<char>(0x80 | (cp & 0x3F));
        n = 3;
      } else {
        buf[0] = static_cast<char>(0xF0 | (cp >> 18));
        buf[1] = static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        buf[2] = static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        buf[3] = static_cast<char>(0x80 | (cp & 0x3F));
        n = 4;
      }
      s.append(buf, n);
    } else if (allow_bad_bytes) {
      // Raw bytes: stray continuation bytes, truncated sequences, NUL, 0xFF.
      const int n = 1 + static_cast<int>(rng() % 6);
      for (int i = 0; i < n; ++i) s.push_back(static_cast<char>(rng() % 256));
    }
  }
  return s;
}

// Texts every tokenizer pair is compared on.
std::vector<std::string> EdgeCaseTexts() {
  return {"",
          " ",
          "  ",
          "\n",
          "\n\n",
          " \n ",
          "a",
          "Once upon a time",
          " Once upon a time",
          "Once upon a time ",
          "Once  upon   a    time",
          "   leading and trailing   ",
          "line one\nline two\n\nline four\n",
          "\t tabs\tand  spaces \t",
          "caf\xC3\xA9 na\xC3\xAFve \xE2\x80\x9Cquoted\xE2\x80\x9D \xF0\x9F\x98\x80 \xE4\xB8\xAD\xE6\x96\x87",
          "<s> </s> <unk> <0x41>",
          "\x80\x80\x80\x80\x80\x80",
          " \x80",
          "\xC3",
          "\xF0\x9F\x98",
          "a\xFF" "b\xFE",
          std::string("nul\0inside", 10)};
}

// -----------------------------------------------------------------------------------------------
// Golden checks, once per model.
class GoldenTokenizerTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!FileExists(TokPath(GetParam())) || !FileExists(SharedDir() + "/golden/reference.json")) {
      GTEST_SKIP() << "shared data not found under " << SharedDir()
                   << " (set QCAL_SHARED_DIR to the shared/ folder)";
    }
    llama2c_ = LoadLlama2c(TokPath(GetParam()));
    ASSERT_NE(llama2c_, nullptr);
    sp_ = ConvertAndLoad(TokPath(GetParam()));
    ASSERT_NE(sp_, nullptr);
  }

  const nlohmann::json& golden() const { return Golden().at(GetParam()); }

  std::unique_ptr<Tokenizer> llama2c_;
  std::unique_ptr<Tokenizer> sp_;
};

TEST_P(GoldenTokenizerTest, VocabularyShape) {
  for (const Tokenizer* tok : {llama2c_.get(), sp_.get()}) {
    EXPECT_EQ(tok->vocab_size(), 512);
    EXPECT_EQ(tok->bos_id(), 1);
    EXPECT_EQ(tok->eos_id(), 2);
  }
  EXPECT_EQ(llama2c_->Piece(0), "<unk>");
  EXPECT_EQ(llama2c_->Piece(1), "\n<s>\n");
  EXPECT_EQ(llama2c_->Piece(2), "\n</s>\n");
  EXPECT_EQ(sp_->Piece(1), "<s>");
  for (int b = 0; b < 256; ++b) {
    EXPECT_EQ(llama2c_->Piece(3 + b), bpe::BytePiece(static_cast<uint8_t>(b)));
    EXPECT_EQ(sp_->Piece(3 + b), bpe::BytePiece(static_cast<uint8_t>(b)));
  }
  EXPECT_EQ(llama2c_->Piece(-1), "");
  EXPECT_EQ(llama2c_->Piece(512), "");

  // Repeated pieces would make "lowest id" matter; the shipped vocabularies have none.
  std::map<std::string, int> first_id;
  for (int id = 0; id < 512; ++id) {
    const auto [it, inserted] = first_id.emplace(llama2c_->Piece(id), id);
    EXPECT_TRUE(inserted) << "piece '" << it->first << "' at ids " << it->second << " and " << id;
  }
  // llama2.c looks merges up among ALL pieces, sentencepiece among NORMAL ones only; the two agree
  // because no concatenation of two pieces is a special or byte piece.
  for (int a = 0; a < 512; ++a) {
    for (int b = 0; b < 512; ++b) {
      const auto it = first_id.find(llama2c_->Piece(a) + llama2c_->Piece(b));
      if (it != first_id.end()) {
        EXPECT_GE(it->second, 3 + 256) << "merge " << a << "+" << b << " gives special piece";
        EXPECT_GE(a, 3 + 256) << "byte/special piece " << a << " merges";
        EXPECT_GE(b, 3 + 256) << "byte/special piece " << b << " merges";
      }
    }
  }
}

TEST_P(GoldenTokenizerTest, PromptIdsMatchGolden) {
  const std::string prompt = golden().at("prompt");
  const std::vector<int32_t> expected = golden().at("prompt_ids");
  for (const Tokenizer* tok : {llama2c_.get(), sp_.get()}) {
    std::vector<int32_t> ids = {tok->bos_id()};
    const std::vector<int32_t> enc = tok->Encode(prompt);
    ids.insert(ids.end(), enc.begin(), enc.end());
    EXPECT_EQ(ids, expected) << (tok == sp_.get() ? "sentencepiece" : "llama2.c") << ": "
                             << Show(ids);
  }
}

TEST_P(GoldenTokenizerTest, GreedyTextIsConcatenatedPieces) {
  const std::vector<int32_t> ids = golden().at("greedy64_ids");
  const std::string expected = golden().at("greedy64_text");
  ASSERT_FALSE(ids.empty());
  ASSERT_EQ(ids[0], 1);
  const std::vector<int32_t> rest(ids.begin() + 1, ids.end());
  std::string from_llama2c, from_sp;
  for (int32_t id : rest) {
    from_llama2c += llama2c_->Piece(id);
    from_sp += sp_->Piece(id);
  }
  EXPECT_EQ(from_llama2c, expected);
  std::string sp_spaces;
  for (size_t i = 0; i < from_sp.size();) {
    if (from_sp.compare(i, 3, bpe::kSpaceSymbol) == 0) {
      sp_spaces += ' ';
      i += 3;
    } else {
      sp_spaces += from_sp[i++];
    }
  }
  EXPECT_EQ(sp_spaces, expected);

  // Decode turns byte pieces into bytes: the golden "<0x0A>" become real newlines.
  std::string decoded_expected;
  for (size_t i = 0; i < expected.size();) {
    const int byte = i + 6 <= expected.size() ? bpe::ParseBytePiece(expected.substr(i, 6)) : -1;
    if (byte >= 0) {
      decoded_expected.push_back(static_cast<char>(byte));
      i += 6;
    } else {
      decoded_expected.push_back(expected[i++]);
    }
  }
  if (expected.find("<0x0A>") != std::string::npos) {
    EXPECT_NE(decoded_expected.find('\n'), std::string::npos);
    EXPECT_EQ(decoded_expected.find("<0x0A>"), std::string::npos);
  }
  EXPECT_EQ(llama2c_->Decode(rest), decoded_expected);
  EXPECT_EQ(sp_->Decode(rest), decoded_expected);
  // BOS/EOS decode to nothing.
  EXPECT_EQ(llama2c_->Decode(ids), decoded_expected);
  EXPECT_EQ(sp_->Decode({1, 2}), "");
}

TEST_P(GoldenTokenizerTest, CorpusTokenCountsMatchGolden) {
  struct Corpus {
    const char* golden_prefix;
    std::string path;
  } corpora[] = {
      {"ppl_tinystories_sample_ctx", SharedDir() + "/data/tinystories/TinyStories-valid.sample30k.txt"},
      {"ppl_wikitext2_test_joined_ctx", SharedDir() + "/data/wikitext2/wiki.test.joined.txt"},
  };
  for (const Corpus& corpus : corpora) {
    const std::string raw = ReadAll(corpus.path);
    const std::string text = ReadAsText(corpus.path);
    const int64_t expected = GoldenByPrefix(GetParam(), corpus.golden_prefix).at("tokens_encoded");
    // Raw bytes: each CRLF keeps its '\r' as one extra <0x0D> byte token in these vocabularies.
    const int64_t crlf = static_cast<int64_t>(raw.size() - text.size());
    EXPECT_EQ(static_cast<int64_t>(llama2c_->Encode(raw).size()), expected + crlf) << corpus.path;
    auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = llama2c_->Encode(text);
    auto t1 = std::chrono::steady_clock::now();
    const std::vector<int32_t> sp_ids = sp_->Encode(text);
    auto t2 = std::chrono::steady_clock::now();
    const double llama2c_s = std::chrono::duration<double>(t1 - t0).count();
    const double sp_s = std::chrono::duration<double>(t2 - t1).count();
    std::printf("[ timing   ] %s %s: %zu bytes -> %zu tokens; llama2.c %.3f s, sentencepiece %.3f s\n",
                GetParam(), corpus.golden_prefix, text.size(), ids.size(), llama2c_s, sp_s);
    EXPECT_EQ(static_cast<int64_t>(ids.size()), expected) << corpus.path;
    EXPECT_EQ(ids, sp_ids) << corpus.path << ": " << FirstDifference(ids, sp_ids);
    // Every byte of the file comes back (after the dummy-prefix space).
    EXPECT_EQ(llama2c_->Decode(ids), " " + text);
    // "A couple of seconds" for the 1.3 MB file even in an unoptimized build.
    EXPECT_LT(llama2c_s, 10.0);
  }
}

TEST_P(GoldenTokenizerTest, HeapMatchesNaiveOnRealText) {
  const NaiveLlama2c naive(*llama2c_);
  std::vector<std::string> texts;
  const std::string stories =
      ReadAll(SharedDir() + "/data/tinystories/TinyStories-valid.sample30k.txt");
  const std::string wiki = ReadAll(SharedDir() + "/data/wikitext2/wiki.test.joined.txt");
  const std::string ptb = ReadAll(SharedDir() + "/data/ptb/ptb.test.txt");
  for (const std::string* src : {&stories, &wiki, &ptb}) {
    for (int k = 0; k < 7; ++k) texts.push_back(src->substr(k * (src->size() / 7), 1500));
  }
  for (const std::string& text : texts) {
    const std::vector<int32_t> fast = llama2c_->Encode(text);
    const std::vector<int32_t> slow = naive.Encode(text);
    ASSERT_EQ(fast, slow) << FirstDifference(fast, slow) << " on text: " << text.substr(0, 200);
  }
}

TEST_P(GoldenTokenizerTest, HeapMatchesNaiveOnRandomText) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  const NaiveLlama2c naive(*llama2c_);
  for (int trial = 0; trial < 300; ++trial) {
    const std::string text = RandomText(rng, 1 + rng() % 300, /*allow_bad_bytes=*/true, true);
    const std::vector<int32_t> fast = llama2c_->Encode(text);
    const std::vector<int32_t> slow = naive.Encode(text);
    ASSERT_EQ(fast, slow) << "seed " << seed << " trial " << trial << ": "
                          << FirstDifference(fast, slow);
    // Byte fallback makes every byte string round-trip.
    ASSERT_EQ(llama2c_->Decode(fast), " " + text) << "seed " << seed << " trial " << trial;
  }
}

TEST_P(GoldenTokenizerTest, SentencePieceMatchesLlama2c) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  std::vector<std::string> texts = EdgeCaseTexts();
  texts.push_back(ReadAll(SharedDir() + "/data/tinystories/TinyStories-valid.sample30k.txt"));
  texts.push_back(ReadAll(SharedDir() + "/data/wikitext2/wiki.test.joined.txt").substr(0, 100000));
  texts.push_back(ReadAll(SharedDir() + "/data/ptb/ptb.test.txt"));
  for (int i = 0; i < 200; ++i) {
    // U+2581 is left out: sentencepiece reads it as a space (by design), llama2.c as a character.
    texts.push_back(RandomText(rng, 1 + rng() % 400, /*allow_bad_bytes=*/i % 2 == 1, false));
  }
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> a = llama2c_->Encode(texts[i]);
    const std::vector<int32_t> b = sp_->Encode(texts[i]);
    ASSERT_EQ(a, b) << "text " << i << " (seed " << seed << "): " << FirstDifference(a, b)
                    << "\n" << texts[i].substr(0, 200);
    ASSERT_EQ(sp_->Decode(b), texts[i].empty() ? "" : " " + texts[i]) << "text " << i;
  }
  EXPECT_TRUE(llama2c_->Encode("").empty());
  // The documented difference: a literal U+2581 is a space to sentencepiece.
  EXPECT_EQ(sp_->Encode("a\xE2\x96\x81" "b"), sp_->Encode("a b"));
}

INSTANTIATE_TEST_SUITE_P(SharedModels, GoldenTokenizerTest, ::testing::ValuesIn(kModels),
                         [](const auto& info) { return std::string(info.param); });

// -----------------------------------------------------------------------------------------------
// A synthetic vocabulary with many equal scores, so that the leftmost-on-ties rule decides most
// merges: every string of length 2..4 over {a, b, ' '} plus single letters, scores in {0,-1,-2}.
// Calibration text must be text: random bytes or zeros are refused naming the file; real text,
// any language, with tabs and CRLF, passes.
TEST(TextTest, BinaryDataIsNotText) {
  std::mt19937 rng(5);
  std::string random(1 << 16, '\0');
  for (char& c : random) c = static_cast<char>(rng());
  Status s = CheckLooksLikeText("data/x.bin", random);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("data/x.bin: does not look like text"), std::string::npos) << s;
  s = CheckLooksLikeText("zeros", std::string(1 << 20, '\0'));
  EXPECT_NE(s.message().find("zeros: does not look like text: 100.0% of its 1048576 bytes"),
            std::string::npos) << s;
  EXPECT_TRUE(CheckLooksLikeText("t", "Once upon a time,\tthere was\r\na caf\xc3\xa9.\f\n").ok());
  EXPECT_TRUE(CheckLooksLikeText("t", "\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80").ok());
  // One stray byte in a large file is tolerated (1%), many are not.
  std::string mostly(1000, 'a');
  mostly[500] = '\xff';
  EXPECT_TRUE(CheckLooksLikeText("t", mostly).ok());
  for (int i = 0; i < 20; ++i) mostly[i * 7] = '\x01';
  EXPECT_FALSE(CheckLooksLikeText("t", mostly).ok());
}

TEST(Utf8Test, FirstInvalidByteAndItsPlace) {
  EXPECT_EQ(FirstInvalidUtf8("abc"), std::string_view::npos);
  EXPECT_EQ(FirstInvalidUtf8("ab\xc3\xa9\xff"), 4u);
  EXPECT_EQ(FirstInvalidUtf8("\xc0\x80"), 0u);            // overlong NUL
  EXPECT_EQ(FirstInvalidUtf8("x\xed\xa0\x80"), 1u);       // surrogate
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), 0u);   // above U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8("ok\xe2\x82"), 2u);          // cut off
  EXPECT_EQ(DescribeInvalidUtf8("a\nbc\xfe"), "line 2, byte 3 (0xfe)");
  EXPECT_EQ(DescribeInvalidUtf8("fine"), "");
}

TEST(BpeTest, HeapMatchesNaiveWithTiedScores) {
  const uint64_t seed = TestSeed();
  std::mt19937_64 rng(seed);
  auto toks = Llama2cSpecials();
  const std::string alphabet = "ab ";
  std::vector<std::string> pieces = {"a", "b", " ", "c"};
  for (size_t len = 2; len <= 4; ++len) {
    std::vector<std::string> next;
    for (const std::string& p : pieces) {
      if (p.size() != len - 1) continue;
      for (char c : alphabet) next.push_back(p + c);
    }
    pieces.insert(pieces.end(), next.begin(), next.end());
  }
  for (const std::string& p : pieces) {
    if (p.size() > 1 && rng() % 4 == 0) continue;  // holes make merge paths matter
    toks.emplace_back(p, -static_cast<float>(rng() % 3));
  }
  const std::string dir = MakeTempDir("tok");
  const std::string path = dir + "/tied.bin";
  WriteAll(path, Llama2cBytes(0, toks));
  auto tok = LoadLlama2c(path);
  ASSERT_NE(tok, nullptr);
  const NaiveLlama2c naive(*tok);
  auto sp_tok = ConvertAndLoad(path);
  ASSERT_NE(sp_tok, nullptr);

  std::uniform_int_distribution<int> pick(0, 9);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string text;
    const int len = 1 + static_cast<int>(rng() % 60);
    for (int i = 0; i < len; ++i) {
      const int k = pick(rng);
      text += k < 4 ? 'a' : k < 7 ? 'b' : k < 9 ? ' ' : (rng() % 2 ? 'c' : 'd');
    }
    const std::vector<int32_t> fast = tok->Encode(text);
    const std::vector<int32_t> slow = naive.Encode(text);
    ASSERT_EQ(fast, slow) << "seed " << seed << " trial " << trial << " text '" << text
                          << "': " << FirstDifference(fast, slow);
    ASSERT_EQ(sp_tok->Encode(text), fast) << "seed " << seed << " text '" << text << "'";
  }
}

TEST(BpeTest, LeftmostPairWinsTies) {
  // "aa" is the only merge: "aaa" must become [aa, a], not [a, aa].
  auto toks = Llama2cSpecials();
  toks.emplace_back(" ", 0.0f);
  toks.emplace_back("a", 0.0f);
  toks.emplace_back("aa", -1.0f);
  const std::string path = MakeTempDir("tok") + "/t.bin";
  WriteAll(path, Llama2cBytes(0, toks));
  auto tok = LoadLlama2c(path);
  ASSERT_NE(tok, nullptr);
  const int32_t space = 259, a = 260, aa = 261;
  EXPECT_EQ(tok->Encode("aaa"), (std::vector<int32_t>{space, aa, a}));
  EXPECT_EQ(tok->Encode("aaaa"), (std::vector<int32_t>{space, aa, aa}));
  // Characters outside the vocabulary fall back to byte + 3.
  EXPECT_EQ(tok->Encode("x"), (std::vector<int32_t>{space, 'x' + 3}));
  EXPECT_EQ(tok->Encode("\xC3\xA9"), (std::vector<int32_t>{space, 0xC3 + 3, 0xA9 + 3}));
}

TEST(BpeTest, RepeatedPiecesResolveToLowestId) {
  auto toks = Llama2cSpecials();
  toks.emplace_back(" ", 0.0f);
  toks.emplace_back("a", 0.0f);
  toks.emplace_back("a", -5.0f);  // repeat of 260
  toks.emplace_back(" a", -1.0f);
  toks.emplace_back(" a", -0.5f);  // repeat of 262; its score is never used
  const std::string path = MakeTempDir("tok") + "/t.bin";
  WriteAll(path, Llama2cBytes(0, toks));
  auto tok = LoadLlama2c(path);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Encode("a"), (std::vector<int32_t>{262}));
  EXPECT_EQ(tok->Encode("aa"), (std::vector<int32_t>{262, 260}));
}

// -----------------------------------------------------------------------------------------------
// Malformed files.

// Expects `status` to fail with `code` and a message naming `path` and containing `what`.
void ExpectError(const Status& status, absl::StatusCode code, const std::string& path,
                 const std::string& what) {
  EXPECT_EQ(status.code(), code) << status;
  EXPECT_NE(status.message().find(path), std::string_view::npos) << status;
  EXPECT_NE(status.message().find(what), std::string_view::npos)
      << status << " (expected to mention '" << what << "')";
}

TEST(Llama2cTokenizerTest, MalformedFilesGiveClearErrors) {
  const std::string dir = MakeTempDir("tok");
  const std::string good = Llama2cBytes(6, Llama2cSpecials());
  const auto load = [&](const std::string& name, const std::string& bytes, int expected = 0) {
    const std::string path = dir + "/" + name;
    WriteAll(path, bytes);
    return LoadLlama2cTokenizer(path, expected).status();
  };
  const auto i32 = [](int32_t v) { return std::string(reinterpret_cast<const char*>(&v), 4); };

  EXPECT_TRUE(load("good.bin", good).ok()) << load("good.bin", good);
  ExpectError(load("empty.bin", ""), absl::StatusCode::kDataLoss, dir + "/empty.bin", "empty");
  ExpectError(load("short.bin", "ab"), absl::StatusCode::kDataLoss, dir + "/short.bin",
              "truncated header");
  ExpectError(load("header_only.bin", i32(7)), absl::StatusCode::kDataLoss,
              dir + "/header_only.bin", "no tokens");
  ExpectError(load("neg_max.bin", i32(-3) + good.substr(4)), absl::StatusCode::kDataLoss,
              dir + "/neg_max.bin", "max_token_length -3");
  ExpectError(load("trunc_entry.bin", good + "\x01\x02\x03"), absl::StatusCode::kDataLoss,
              dir + "/trunc_entry.bin", "truncated entry for token 259");
  ExpectError(load("trunc_piece.bin", good.substr(0, good.size() - 2)),
              absl::StatusCode::kDataLoss, dir + "/trunc_piece.bin",
              "truncated piece of token 258");
  {
    std::string neg = good;
    const int32_t len = -1;
    std::memcpy(&neg[4 + 4], &len, 4);  // length of token 0
    ExpectError(load("neg_len.bin", neg), absl::StatusCode::kDataLoss, dir + "/neg_len.bin",
                "token 0 has negative length -1");
  }
  ExpectError(load("long_piece.bin", Llama2cBytes(3, Llama2cSpecials())),
              absl::StatusCode::kDataLoss, dir + "/long_piece.bin", "> max_token_length 3");
  {
    std::string huge = good;
    const int32_t len = 1 << 30;
    std::memcpy(&huge[4 + 4], &len, 4);
    const Status st = load("huge_len.bin", huge);
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
    EXPECT_NE(st.message().find("token 0 has length 1073741824"), std::string_view::npos) << st;
  }
  ExpectError(load("count.bin", good, 512), absl::StatusCode::kDataLoss, dir + "/count.bin",
              "259 tokens, expected 512");
  ExpectError(load("few.bin", Llama2cBytes(6, {{"<unk>", 0.0f}, {"a", 0.0f}})),
              absl::StatusCode::kDataLoss, dir + "/few.bin", "too few");
  ExpectError(LoadLlama2cTokenizer(dir + "/missing.bin").status(), absl::StatusCode::kNotFound,
              dir + "/missing.bin", "cannot open");
  // A model checkpoint is not a tokenizer.
  const std::string model_bin = SharedDir() + "/models/stories260K/stories260K.bin";
  if (FileExists(model_bin)) {
    EXPECT_EQ(LoadLlama2cTokenizer(model_bin).status().code(), absl::StatusCode::kDataLoss);
  }
}

// A tiny hand-written sentencepiece model.
sp::ModelProto TinyModel() {
  sp::ModelProto m;
  const auto add = [&m](const std::string& piece, float score, sp::ModelProto::SentencePiece::Type t) {
    auto* p = m.add_pieces();
    p->set_piece(piece);
    p->set_score(score);
    p->set_type(t);
  };
  add("<unk>", 0, sp::ModelProto::SentencePiece::UNKNOWN);
  add("<s>", 0, sp::ModelProto::SentencePiece::CONTROL);
  add("</s>", 0, sp::ModelProto::SentencePiece::CONTROL);
  for (int b = 0; b < 256; ++b) {
    add(bpe::BytePiece(static_cast<uint8_t>(b)), 0, sp::ModelProto::SentencePiece::BYTE);
  }
  add("\xE2\x96\x81", -1, sp::ModelProto::SentencePiece::NORMAL);            // 259
  add("a", -2, sp::ModelProto::SentencePiece::NORMAL);                       // 260
  add("b", -3, sp::ModelProto::SentencePiece::NORMAL);                       // 261
  add("\xE2\x96\x81" "a", -0.5f, sp::ModelProto::SentencePiece::NORMAL);     // 262
  add("ab", -0.25f, sp::ModelProto::SentencePiece::NORMAL);                  // 263
  add("bb", 5.0f, sp::ModelProto::SentencePiece::UNUSED);                    // 264
  m.mutable_trainer_spec()->set_model_type(sp::TrainerSpec::BPE);
  m.mutable_trainer_spec()->set_byte_fallback(true);
  m.mutable_normalizer_spec()->set_name("identity");
  m.mutable_normalizer_spec()->set_remove_extra_whitespaces(false);
  return m;
}

std::unique_ptr<Tokenizer> LoadProto(const sp::ModelProto& m) {
  const std::string dir = MakeTempDir("tok");
  WriteAll(dir + "/tokenizer.model", m.SerializeAsString());
  auto tok = LoadTokenizerFromModelDir(dir);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// A byte flipped inside a piece of the real stories260K tokenizer is refused, naming the token,
// rather than tokenizing differently without a word.
TEST(Llama2cTokenizerTest, FlippedByteInAPieceIsRefused) {
  if (!FileExists(TokPath("stories260K"))) {
    GTEST_SKIP() << "shared data not found under " << SharedDir();
  }
  auto bytes = ReadFile(TokPath("stories260K"));
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  ASSERT_TRUE(LoadLlama2cTokenizer(TokPath("stories260K"), 512).ok());
  std::string damaged = *bytes;
  damaged.back() = static_cast<char>(0xff);  // inside the last piece (token 511)
  const std::string path = MakeTempDir("tok") + "/flipped.bin";
  WriteAll(path, damaged);
  const Status st = LoadLlama2cTokenizer(path, 512).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find(path), std::string_view::npos) << st;
  EXPECT_NE(st.message().find("token 511 is not valid UTF-8"), std::string_view::npos) << st;
}

TEST(SentencePieceTokenizerTest, HandWrittenModel) {
  sp::ModelProto m = TinyModel();
  auto tok = LoadProto(m);
  ASSERT_NE(tok, nullptr);
  // "▁ab": ab (-0.25) beats ▁a (-0.5).
  EXPECT_EQ(tok->Encode("ab"), (std::vector<int32_t>{259, 263}));
  EXPECT_EQ(tok->Encode("a b"), (std::vector<int32_t>{262, 259, 261}));
  // UNUSED "bb" is never produced; unknown characters fall back to bytes.
  EXPECT_EQ(tok->Encode("bb"), (std::vector<int32_t>{259, 261, 261}));
  EXPECT_EQ(tok->Encode("\xC3\xA9"), (std::vector<int32_t>{259, 0xC3 + 3, 0xA9 + 3}));
  EXPECT_EQ(tok->Decode({1, 262, 259, 261, 0xC3 + 3, 0xA9 + 3, 0, 2}),
            " a b\xC3\xA9 \xE2\x81\x87 ");
  EXPECT_EQ(tok->Piece(262), "\xE2\x96\x81" "a");
  EXPECT_FLOAT_EQ(tok->Score(263), -0.25f);

  // Without byte fallback unknown characters become <unk>, one per character.
  m.mutable_trainer_spec()->set_byte_fallback(false);
  tok = LoadProto(m);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Encode("a\xC3\xA9x"), (std::vector<int32_t>{262, 0, 0}));

  // remove_extra_whitespaces folds and trims spaces; no dummy prefix without add_dummy_prefix.
  m.mutable_normalizer_spec()->set_remove_extra_whitespaces(true);
  m.mutable_normalizer_spec()->set_add_dummy_prefix(false);
  tok = LoadProto(m);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->Encode("  a   b  "), (std::vector<int32_t>{260, 259, 261}));
  EXPECT_TRUE(tok->Encode("    ").empty());
}

TEST(SentencePieceTokenizerTest, MalformedModelsGiveClearErrors) {
  const std::string dir = MakeTempDir("tok");
  const auto load_bytes = [&](const std::string& name, const std::string& bytes) {
    const std::string path = dir + "/" + name;
    WriteAll(path, bytes);
    return LoadSentencePieceTokenizer(path).status();
  };
  const auto load = [&](const std::string& name, const sp::ModelProto& m) {
    return load_bytes(name, m.SerializeAsString());
  };

  EXPECT_TRUE(load("good.model", TinyModel()).ok());
  ExpectError(load_bytes("empty.model", ""), absl::StatusCode::kDataLoss, dir + "/empty.model",
              "file is empty");
  ExpectError(load_bytes("garbage.model", "\xFF\xFF\xFF\xFF garbage"), absl::StatusCode::kDataLoss,
              dir + "/garbage.model", "not a valid ModelProto");
  {
    const std::string bytes = TinyModel().SerializeAsString();
    ExpectError(load_bytes("truncated.model", bytes.substr(0, bytes.size() - 3)),
                absl::StatusCode::kDataLoss, dir + "/truncated.model", "not a valid ModelProto");
  }
  if (FileExists(TokPath("stories260K"))) {
    const Status st = LoadSentencePieceTokenizer(TokPath("stories260K")).status();
    EXPECT_FALSE(st.ok()) << "a llama2.c tokenizer.bin must not load as tokenizer.model";
  }
  {
    sp::ModelProto m = TinyModel();
    m.mutable_trainer_spec()->set_model_type(sp::TrainerSpec::UNIGRAM);
    ExpectError(load("unigram.model", m), absl::StatusCode::kUnimplemented,
                dir + "/unigram.model", "model type UNIGRAM is not supported");
    m.clear_trainer_spec();
    ExpectError(load("no_trainer.model", m), absl::StatusCode::kUnimplemented,
                dir + "/no_trainer.model", "no trainer_spec");
  }
  {
    sp::ModelProto m = TinyModel();
    m.mutable_normalizer_spec()->set_name("nmt_nfkc");
    m.mutable_normalizer_spec()->set_precompiled_charsmap(std::string(100, '\x01'));
    ExpectError(load("nfkc.model", m), absl::StatusCode::kUnimplemented, dir + "/nfkc.model",
                "normalizer 'nmt_nfkc' needs a precompiled charsmap");
  }
  {
    sp::ModelProto m = TinyModel();
    m.mutable_pieces(3 + 0x41)->set_type(sp::ModelProto::SentencePiece::NORMAL);
    ExpectError(load("no_byte.model", m), absl::StatusCode::kInvalidArgument,
                dir + "/no_byte.model", "no BYTE piece <0x41>");
  }
  {
    sp::ModelProto m = TinyModel();
    m.mutable_pieces(261)->set_piece("a");
    ExpectError(load("dup.model", m), absl::StatusCode::kInvalidArgument, dir + "/dup.model",
                "piece 261 'a' is repeated");
  }
  {
    // A byte flipped inside a piece: protobuf (proto2 strings) takes it, the loader must not.
    sp::ModelProto m = TinyModel();
    const std::string flipped = m.pieces(261).piece() + "\xff";
    m.mutable_pieces(261)->set_piece(flipped);
    ExpectError(load("flipped.model", m), absl::StatusCode::kInvalidArgument,
                dir + "/flipped.model", "piece 261 is not valid UTF-8 (line 1, byte 2 (0xff))");
  }
  {
    sp::ModelProto m = TinyModel();
    m.mutable_trainer_spec()->set_unk_id(600);
    ExpectError(load("unk.model", m), absl::StatusCode::kInvalidArgument, dir + "/unk.model",
                "unk_id 600");
  }
  {
    sp::ModelProto m;
    m.mutable_trainer_spec()->set_model_type(sp::TrainerSpec::BPE);
    ExpectError(load("nopieces.model", m), absl::StatusCode::kInvalidArgument,
                dir + "/nopieces.model", "no pieces");
  }
  const Status missing = LoadTokenizerFromModelDir(dir + "/nowhere").status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  EXPECT_NE(missing.message().find(dir + "/nowhere/tokenizer.model"), std::string_view::npos)
      << missing;
}

TEST(SentencePieceTokenizerTest, ConvertedModelFields) {
  const std::string src = TokPath("stories260K");
  if (!FileExists(src)) GTEST_SKIP() << "shared data not found under " << SharedDir();
  const std::string out = MakeTempDir("tok") + "/tokenizer.model";
  ASSERT_TRUE(WriteSentencePieceModelFromLlama2c(src, out).ok());
  sp::ModelProto m;
  ASSERT_TRUE(m.ParseFromString(ReadAll(out)));
  ASSERT_EQ(m.pieces_size(), 512);
  EXPECT_EQ(m.pieces(0).piece(), "<unk>");
  EXPECT_EQ(m.pieces(0).type(), sp::ModelProto::SentencePiece::UNKNOWN);
  EXPECT_EQ(m.pieces(1).piece(), "<s>");
  EXPECT_EQ(m.pieces(1).type(), sp::ModelProto::SentencePiece::CONTROL);
  EXPECT_EQ(m.pieces(2).piece(), "</s>");
  EXPECT_EQ(m.pieces(2).type(), sp::ModelProto::SentencePiece::CONTROL);
  EXPECT_EQ(m.pieces(3 + 0x0A).piece(), "<0x0A>");
  EXPECT_EQ(m.pieces(3 + 0x0A).type(), sp::ModelProto::SentencePiece::BYTE);
  EXPECT_EQ(m.pieces(260).piece(), "\xE2\x96\x81t");  // llama2.c " t"
  EXPECT_EQ(m.pieces(260).type(), sp::ModelProto::SentencePiece::NORMAL);
  EXPECT_FLOAT_EQ(m.pieces(260).score(), -1.0f);
  EXPECT_EQ(m.trainer_spec().model_type(), sp::TrainerSpec::BPE);
  EXPECT_EQ(m.trainer_spec().vocab_size(), 512);
  EXPECT_TRUE(m.trainer_spec().byte_fallback());
  EXPECT_EQ(m.trainer_spec().unk_id(), 0);
  EXPECT_EQ(m.trainer_spec().bos_id(), 1);
  EXPECT_EQ(m.trainer_spec().eos_id(), 2);
  EXPECT_EQ(m.trainer_spec().pad_id(), -1);
  EXPECT_EQ(m.normalizer_spec().name(), "identity");
  EXPECT_TRUE(m.normalizer_spec().add_dummy_prefix());
  EXPECT_FALSE(m.normalizer_spec().remove_extra_whitespaces());
  EXPECT_TRUE(m.normalizer_spec().escape_whitespaces());
  EXPECT_TRUE(m.normalizer_spec().precompiled_charsmap().empty());

  // A llama2.c file whose byte pieces are not at 3..258 cannot be expressed.
  auto toks = Llama2cSpecials();
  std::swap(toks[3], toks[4]);
  const std::string bad = MakeTempDir("tok") + "/bad.bin";
  WriteAll(bad, Llama2cBytes(6, toks));
  ExpectError(WriteSentencePieceModelFromLlama2c(bad, out + ".2"),
              absl::StatusCode::kInvalidArgument, bad, "expected the byte piece <0x00>");
}

}  // namespace
}  // namespace qcal
