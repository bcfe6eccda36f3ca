// tokenizer.json (common/hf_tokenizer.h), issue 12:
//  * the real Llama 3 tokenizer (../shared/models/llama3-tokenizer) against the independent npm
//    package llama3-tokenizer-js 1.2.0: its own test cases and whole files (WikiText-2 test
//    joined, PTB valid, the TinyStories sample), as recorded by scripts/llama3-reference-ids.mjs
//    in tests/data/llama3_reference.json; decode(encode(x)) == x on those files;
//  * a Llama-2-style file (Metaspace or Prepend/Replace normalizers, byte fallback, merges by
//    rank) made from stories260K's sentencepiece vocabulary the way `transformers` converts one,
//    against qcal's sentencepiece tokenizer on the same files;
//  * special tokens parsed only when asked; BOS/EOS from tokenizer_config.json and config.json;
//  * malformed files: errors naming the file and the field.
#include "common/hf_tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/hash.h"
#include "common/tokenizer.h"
#include "tests/test_util.h"

namespace qcal {
namespace {

using json = nlohmann::json;
using ::qcal::testing::MakeTempDir;
using ::qcal::testing::SharedDir;
using ::qcal::testing::SourceDir;

std::string Llama3Dir() { return SharedDir() + "/models/llama3-tokenizer"; }

std::string Read(const std::string& path) {
  auto s = ReadFile(path);
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *s : std::string();
}

std::unique_ptr<Tokenizer> Llama3(bool parse_special) {
  HfTokenizerOptions o;
  o.parse_special = parse_special;
  o.tokenizer_config_path = Llama3Dir() + "/tokenizer_config.json";
  auto tok = LoadHfTokenizer(Llama3Dir() + "/tokenizer.json", o);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

// The standard FNV-1a 64 (offset basis 14695981039346656037) over the ids as little-endian
// int32, as scripts/llama3-reference-ids.mjs computes it. (common/hash.h's Fnv1a has another
// offset basis, so it is not used here.)
std::string IdsHash(const std::vector<int32_t>& ids) {
  uint64_t h = 14695981039346656037ull;
  for (int32_t id : ids) {
    const uint32_t u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  return Hex64(h);
}

std::string Show(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size() && i < 48; ++i) s += std::to_string(ids[i]) + " ";
  if (ids.size() > 48) s += "...";
  return s;
}

const json& Reference() {
  static const json ref = json::parse(Read(SourceDir() + "/tests/data/llama3_reference.json"));
  return ref;
}

// The shared tokenizer.json names its special tokens as Llama 3.0 does; Llama 3.1 (and the JS
// package) renamed three reserved ones (<|finetune_right_pad_id|> = 128004, <|eom_id|> = 128008,
// <|python_tag|> = 128010) and renumbered the remaining <|reserved_special_token_N|> (N >= 3 at
// 128008 + N). The 3.1 file is the 3.0 one with those added tokens renamed; nothing else differs.
std::unique_ptr<Tokenizer> Llama31(bool parse_special) {
  json t = json::parse(Read(Llama3Dir() + "/tokenizer.json"));
  for (json& a : t["added_tokens"]) {
    const int id = a["id"].get<int>();
    std::string name;
    switch (id) {
      case 128002: name = "<|reserved_special_token_0|>"; break;
      case 128003: name = "<|reserved_special_token_1|>"; break;
      case 128004: name = "<|finetune_right_pad_id|>"; break;
      case 128005: name = "<|reserved_special_token_2|>"; break;
      case 128008: name = "<|eom_id|>"; break;
      case 128010: name = "<|python_tag|>"; break;
      default:
        if (id >= 128011) name = absl::StrFormat("<|reserved_special_token_%d|>", id - 128008);
    }
    if (!name.empty()) a["content"] = name;
  }
  HfTokenizerOptions o;
  o.parse_special = parse_special;
  o.tokenizer_config_path = Llama3Dir() + "/tokenizer_config.json";
  auto tok = ParseHfTokenizer(t.dump(), "llama3.1 tokenizer.json", o);
  EXPECT_TRUE(tok.ok()) << tok.status();
  return tok.ok() ? *std::move(tok) : nullptr;
}

TEST(HfTokenizerLlama3, MatchesLlama3TokenizerJsOnItsOwnTestCases) {
  auto tok = Llama31(/*parse_special=*/true);  // the JS package always parses special tokens
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 128256);
  EXPECT_EQ(tok->bos_id(), 128000);
  EXPECT_EQ(tok->eos_id(), 128001);
  auto llama30 = Llama3(true);
  ASSERT_NE(llama30, nullptr);
  int encodes = 0, decodes = 0;
  for (const json& c : Reference()["cases"]) {
    const std::vector<int32_t> want = c["ids"].get<std::vector<int32_t>>();
    if (c["kind"] == "encode") {
      const std::string input = c["input"].get<std::string>();
      std::vector<int32_t> got;
      if (c["bos"].get<bool>()) got.push_back(tok->bos_id());
      const auto body = tok->Encode(input);
      got.insert(got.end(), body.begin(), body.end());
      if (c["eos"].get<bool>()) got.push_back(tok->eos_id());
      EXPECT_EQ(got, want) << "encode(" << input.substr(0, 80) << ")\n got  " << Show(got)
                           << "\n want " << Show(want);
      // The shared (3.0-named) file gives the same ids wherever no 3.1-only name occurs.
      if (input.find("<|") == std::string::npos) EXPECT_EQ(llama30->Encode(input), body);
      ++encodes;
    } else {
      EXPECT_EQ(tok->Decode(want), c["text"].get<std::string>()) << "decode(" << Show(want) << ")";
      ++decodes;
    }
  }
  EXPECT_GE(encodes, 15);
  EXPECT_GE(decodes, 15);
}

TEST(HfTokenizerLlama3, MatchesLlama3TokenizerJsOnWholeFilesAndRoundTrips) {
  auto tok = Llama3(/*parse_special=*/false);
  ASSERT_NE(tok, nullptr);
  ASSERT_EQ(Reference()["files"].size(), 3u);
  for (const json& f : Reference()["files"]) {
    const std::string path = f["path"].get<std::string>();
    const std::string text = Read(SharedDir() + "/" + path);
    ASSERT_FALSE(text.empty()) << path;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> ids = tok->Encode(text);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%s: %zu bytes -> %zu tokens in %.0f ms\n", path.c_str(), text.size(), ids.size(),
                ms);
    EXPECT_EQ(static_cast<int64_t>(ids.size()), f["tokens"].get<int64_t>()) << path;
    EXPECT_EQ(IdsHash(ids), f["fnv1a64"].get<std::string>()) << path;
    const auto first = f["first_ids"].get<std::vector<int32_t>>();
    EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + std::min(ids.size(), first.size())),
              first)
        << path;
    EXPECT_TRUE(tok->Decode(ids) == text) << path << ": decode(encode(x)) != x";
  }
}

TEST(HfTokenizerLlama3, SpecialTokensAreTextUnlessAsked) {
  const std::string text = "a<|begin_of_text|>b<|eot_id|>";
  auto plain = Llama3(false);
  auto special = Llama3(true);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(special, nullptr);
  const auto p = plain->Encode(text);
  const auto s = special->Encode(text);
  EXPECT_EQ(std::count(p.begin(), p.end(), 128000), 0) << Show(p);
  EXPECT_EQ(std::count(p.begin(), p.end(), 128009), 0) << Show(p);
  EXPECT_GT(p.size(), 6u);
  EXPECT_EQ(s, (std::vector<int32_t>{64, 128000, 65, 128009})) << Show(s);
  EXPECT_EQ(plain->Decode(p), text);
  EXPECT_EQ(special->Decode(s), text);
}

TEST(HfTokenizerLlama3, MalformedTextIsReadWithReplacementCharacters) {
  auto tok = Llama3(false);
  ASSERT_NE(tok, nullptr);
  const auto ids = tok->Encode(std::string("ok \xff\xfe end", 9));
  EXPECT_EQ(tok->Decode(ids), "ok \xEF\xBF\xBD\xEF\xBF\xBD end");
  EXPECT_TRUE(tok->Encode("").empty());
}

TEST(HfTokenizerLlama3, ModelDirectoryUsesTokenizerJsonAndConfigIds) {
  const std::string dir = MakeTempDir("l3dir");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"}) {
    ASSERT_EQ(::symlink((Llama3Dir() + "/" + f).c_str(), (dir + "/" + f).c_str()), 0) << f;
  }
  ASSERT_TRUE(WriteFileAtomic(dir + "/config.json",
                              R"({"bos_token_id": 128000, "eos_token_id": [128009, 128001]})")
                  .ok());
  auto tok = LoadTokenizerFromModelDir(dir);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->bos_id(), 128000);
  EXPECT_EQ((*tok)->eos_id(), 128009);  // the first of config.json's list
  EXPECT_EQ((*tok)->Encode("This is a test sentence."),
            (std::vector<int32_t>{2028, 374, 264, 1296, 11914, 13}));
  // Calibration and evaluation text: special tokens stay text.
  const auto eot = (*tok)->Encode("<|eot_id|>");
  EXPECT_EQ(std::count(eot.begin(), eot.end(), 128009), 0) << Show(eot);
}

// --- a Llama-2-style tokenizer.json from stories260K's vocabulary -----------------------------

// tokenizer.json for a sentencepiece BPE vocabulary as `transformers`' LlamaConverter writes it:
// merges are every split of every piece into two pieces, by the merged piece's score (highest
// first), then by the ids of the two halves; byte fallback; <unk> <s> </s> added, special.
std::string Llama2StyleJson(const Tokenizer& sp, bool metaspace) {
  json vocab = json::object();
  std::map<std::string, int32_t> ids;
  for (int32_t id = 0; id < sp.vocab_size(); ++id) {
    vocab[sp.Piece(id)] = id;
    ids[sp.Piece(id)] = id;
  }
  struct M {
    float score;
    int32_t merged, l, r;
    std::string a, b;
  };
  std::vector<M> merges;
  for (int32_t id = 3; id < sp.vocab_size(); ++id) {
    const std::string p = sp.Piece(id);
    if (p.size() == 6 && p.rfind("<0x", 0) == 0) continue;
    std::vector<M> local;
    for (size_t k = 1; k < p.size(); ++k) {
      const std::string a = p.substr(0, k), b = p.substr(k);
      if (ids.count(a) && ids.count(b) && ids[a] >= 3 && ids[b] >= 3) {
        local.push_back(M{sp.Score(id), id, ids[a], ids[b], a, b});
      }
    }
    std::sort(local.begin(), local.end(),
              [](const M& x, const M& y) { return std::tie(x.l, x.r) < std::tie(y.l, y.r); });
    merges.insert(merges.end(), local.begin(), local.end());
  }
  std::stable_sort(merges.begin(), merges.end(),
                   [](const M& x, const M& y) { return x.score > y.score; });
  json jm = json::array();
  for (const M& m : merges) jm.push_back(m.a + " " + m.b);
  json added = json::array();
  for (int32_t id = 0; id < 3; ++id) {
    added.push_back({{"id", id}, {"content", sp.Piece(id)}, {"single_word", false},
                     {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                     {"special", true}});
  }
  json t = {{"version", "1.0"}, {"added_tokens", added}};
  if (metaspace) {
    t["normalizer"] = nullptr;
    t["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"},
                          {"prepend_scheme", "first"}, {"split", false}};
  } else {
    t["normalizer"] = {{"type", "Sequence"},
                       {"normalizers",
                        {{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
                         {{"type", "Replace"}, {"pattern", {{"String", " "}}},
                          {"content", "\xE2\x96\x81"}}}}};
    t["pre_tokenizer"] = nullptr;
  }
  t["post_processor"] = {{"type", "TemplateProcessing"},
                         {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                                     {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}}};
  t["decoder"] = {{"type", "Sequence"},
                  {"decoders",
                   {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}},
                     {"content", " "}},
                    {{"type", "ByteFallback"}},
                    {{"type", "Fuse"}},
                    {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}};
  t["model"] = {{"type", "BPE"},         {"dropout", nullptr},   {"unk_token", "<unk>"},
                {"fuse_unk", true},      {"byte_fallback", true}, {"ignore_merges", false},
                {"vocab", vocab},        {"merges", jm}};
  return t.dump();
}

TEST(HfTokenizerLlama2Style, MatchesSentencepieceOnStories260KVocabulary) {
  const std::string dir = MakeTempDir("sp");
  ASSERT_TRUE(WriteSentencePieceModelFromLlama2c(SharedDir() + "/models/stories260K/tok512.bin",
                                                 dir + "/tokenizer.model")
                  .ok());
  auto sp = LoadSentencePieceTokenizer(dir + "/tokenizer.model");
  ASSERT_TRUE(sp.ok()) << sp.status();
  for (bool metaspace : {true, false}) {
    SCOPED_TRACE(metaspace ? "Metaspace pre-tokenizer" : "Prepend + Replace normalizers");
    // `tokenizers`' Metaspace adds no "▁" to text that already starts with a space (it would
    // start with "▁" after the replacement), where sentencepiece's dummy prefix is always added:
    // that pre-tokenizer is compared on text that does not start with a space.
    auto hf = ParseHfTokenizer(Llama2StyleJson(**sp, metaspace), "llama2-style tokenizer.json");
    ASSERT_TRUE(hf.ok()) << hf.status();
    EXPECT_EQ((*hf)->bos_id(), 1);  // from the TemplateProcessing post-processor
    for (const char* path : {"data/tinystories/TinyStories-valid.sample30k.txt",
                             "data/ptb/ptb.valid.txt", "data/wikitext2/wiki.test.joined.txt"}) {
      std::string text = Read(SharedDir() + "/" + path);
      if (metaspace) text.erase(0, text.find_first_not_of(' '));
      const auto want = (*sp)->Encode(text);
      const auto got = (*hf)->Encode(text);
      EXPECT_EQ(got.size(), want.size()) << path;
      EXPECT_TRUE(got == want) << path << "\n got  " << Show(got) << "\n want " << Show(want);
      EXPECT_TRUE((*hf)->Decode(got) == text) << path << ": decode(encode(x)) != x";
    }
    // Characters outside the 512-piece vocabulary fall back to bytes.
    const std::string odd = "caf\xC3\xA9 \xE9\x95\x87 \xF0\x9F\xA6\x99";
    EXPECT_EQ((*hf)->Encode(odd), (*sp)->Encode(odd));
    EXPECT_EQ((*hf)->Decode((*hf)->Encode(odd)), odd);
  }
}

// --- malformed files ----------------------------------------------------------------------------

struct Bad {
  const char* what;
  std::string text;
  std::vector<std::string> expect;  // substrings of the message
};

TEST(HfTokenizerErrors, MalformedFilesNameTheFileAndField) {
  const json good = json::parse(R"({
    "added_tokens": [],
    "normalizer": null,
    "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\p{L}+"}, "behavior": "Isolated",
                      "invert": false},
    "decoder": null,
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}})");
  ASSERT_TRUE(ParseHfTokenizer(good.dump(), "good.json").ok());
  auto with = [&](const std::function<void(json&)>& f) {
    json j = good;
    f(j);
    return j.dump();
  };
  const std::string full = good.dump();
  const std::vector<Bad> cases = {
      {"no model", with([](json& j) { j.erase("model"); }), {"bad.json", "model", "missing"}},
      {"unknown model type", with([](json& j) { j["model"]["type"] = "Unigram"; }),
       {"bad.json", "model", "Unigram", "BPE"}},
      {"unknown pre-tokenizer",
       with([](json& j) { j["pre_tokenizer"] = {{"type", "Whitespace"}}; }),
       {"bad.json", "pre_tokenizer", "Whitespace", "Split"}},
      {"unknown normalizer", with([](json& j) { j["normalizer"] = {{"type", "NFKC"}}; }),
       {"bad.json", "normalizer", "NFKC"}},
      {"unknown decoder", with([](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }),
       {"bad.json", "decoder", "WordPiece"}},
      {"merge naming an unknown token",
       with([](json& j) { j["model"]["merges"].push_back("a c"); }),
       {"bad.json", "model.merges[1]", "'c'", "not in model.vocab"}},
      {"merge without a space", with([](json& j) { j["model"]["merges"][0] = "ab"; }),
       {"bad.json", "model.merges[0]"}},
      {"bad regex",
       with([](json& j) { j["pre_tokenizer"]["pattern"]["Regex"] = "(\\p{L}+"; }),
       {"bad.json", "pre_tokenizer.pattern.Regex", "does not compile"}},
      {"bad split behaviour",
       with([](json& j) { j["pre_tokenizer"]["behavior"] = "Sideways"; }),
       {"bad.json", "pre_tokenizer.behavior", "Sideways"}},
      {"vocab id not an integer", with([](json& j) { j["model"]["vocab"]["a"] = "zero"; }),
       {"bad.json", "model.vocab[\"a\"]"}},
      {"repeated id", with([](json& j) { j["model"]["vocab"]["c"] = 1; }),
       {"bad.json", "model.vocab", "id 1"}},
      {"added token without content",
       with([](json& j) { j["added_tokens"].push_back({{"id", 3}}); }),
       {"bad.json", "added_tokens[0]", "content"}},
      {"unk token not in vocab", with([](json& j) { j["model"]["unk_token"] = "<unk>"; }),
       {"bad.json", "model.unk_token", "<unk>"}},
      {"truncated file", full.substr(0, full.size() / 2), {"bad.json", "not valid JSON"}},
      {"empty file", "", {"bad.json", "empty"}},
      {"not an object", "[1, 2]", {"bad.json", "not a JSON object"}},
  };
  for (const Bad& c : cases) {
    auto r = ParseHfTokenizer(c.text, "bad.json");
    ASSERT_FALSE(r.ok()) << c.what;
    const std::string msg(r.status().message());
    for (const auto& e : c.expect) {
      EXPECT_NE(msg.find(e), std::string::npos) << c.what << ": '" << e << "' not in: " << msg;
    }
  }
  // Post-processors are only read for a BOS of last resort: a malformed one is no error (and no
  // abort: hf_tokenizer_fuzz found "post_processor": {"type": [...]} throwing from json::value).
  for (const char* pp : {R"({"type": [1, 2]})", R"({"type": "Sequence", "processors": [{"type": 3}]})",
                         R"({"type": "TemplateProcessing", "single": [{"SpecialToken": 7}]})",
                         R"("TemplateProcessing")"}) {
    json j = good;
    j["post_processor"] = json::parse(pp);
    auto r = ParseHfTokenizer(j.dump(), "pp.json");
    EXPECT_TRUE(r.ok()) << pp << ": " << r.status();
  }
  // A missing file names the path.
  auto missing = LoadHfTokenizer("/nonexistent/tokenizer.json");
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("/nonexistent/tokenizer.json"), std::string::npos);
}

}  // namespace
}  // namespace qcal
