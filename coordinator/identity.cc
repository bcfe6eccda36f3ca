#include "coordinator/identity.h"

#include <sys/stat.h>

#include <set>

#include <yaml-cpp/yaml.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/log.h"
#include "common/safe_fs.h"
#include "rpc/auth.h"

namespace qcal::coordinator {
namespace {

bool IsUserName(const std::string& s) {
  if (s.empty() || s.size() > 64) return false;
  for (char c : s) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '-' || c == '_' || c == '.';
    if (!ok) return false;
  }
  return true;
}

StatusOr<std::vector<std::string>> Roots(const YAML::Node& node, const std::string& where) {
  std::vector<std::string> out;
  if (!node) return out;
  if (!node.IsSequence()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": must be a list of directories"));
  }
  for (const YAML::Node& item : node) {
    const std::string p = item.as<std::string>("");
    if (p.empty() || p[0] != '/') {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": '", p, "' is not an absolute directory"));
    }
    QCAL_ASSIGN_OR_RETURN(std::string canonical, CanonicalPath(p));
    out.push_back(canonical);
  }
  return out;
}

}  // namespace

StatusOr<TokenTable> TokenTable::Load(const std::string& path) {
  QCAL_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && (st.st_mode & 077) != 0) {
    QCAL_LOG_WARN("{}: the tokens file is readable by other users (chmod 600 it)", path);
  }
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not valid YAML: ", e.what()));
  }
  if (!root.IsMap() || !root["users"] || !root["users"].IsSequence() ||
      root["users"].size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected 'users:' with at least one entry (docs/service.md)"));
  }
  TokenTable table;
  std::set<std::string> names, tokens;
  int index = 0;
  try {
    for (const YAML::Node& u : root["users"]) {
      ++index;
      const std::string name = u["name"] ? u["name"].as<std::string>() : "";
      const std::string where = absl::StrCat(path, ": users[", index, "] '", name, "'");
      if (!IsUserName(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": name must be 1-64 letters, digits, '-', '_' or '.'"));
      }
      if (!names.insert(name).second) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": the name is used twice"));
      }
      for (auto it = u.begin(); it != u.end(); ++it) {
        const std::string key = it->first.as<std::string>();
        if (key != "name" && key != "token" && key != "token_file" && key != "role" &&
            key != "read" && key != "write") {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ": unknown key '", key, "' (name, token, token_file, role, read, write)"));
        }
      }
      Entry e;
      e.who.name = name;
      const std::string role = u["role"] ? u["role"].as<std::string>() : "user";
      if (role != "user" && role != "admin") {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": role must be user or admin (got '", role, "')"));
      }
      e.who.admin = role == "admin";
      if (u["token"] && u["token_file"]) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": give token or token_file"));
      }
      if (u["token_file"]) {
        StatusOr<std::string> t = rpc::ReadTokenFile(u["token_file"].as<std::string>());
        if (!t.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(where, ": ", t.status().message()));
        }
        e.token = *t;
      } else if (u["token"]) {
        e.token = u["token"].as<std::string>();
      }
      if (e.token.size() < 16) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": the token must be at least 16 characters"));
      }
      if (!tokens.insert(e.token).second) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ": the token is the same as another user's"));
      }
      QCAL_ASSIGN_OR_RETURN(e.who.read_roots, Roots(u["read"], where + ": read"));
      QCAL_ASSIGN_OR_RETURN(e.who.write_roots, Roots(u["write"], where + ": write"));
      if (e.who.admin) {
        if (e.who.read_roots.empty()) e.who.read_roots = {"/"};
        if (e.who.write_roots.empty()) e.who.write_roots = {"/"};
      } else if (e.who.read_roots.empty() || e.who.write_roots.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where, ": a user needs 'read' and 'write' roots (the directories it may read models "
            "from and write outputs under)"));
      }
      table.entries_.push_back(std::move(e));
    }
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": users[", index, "]: ", e.what()));
  }
  return table;
}

TokenTable TokenTable::SingleAdmin(std::string token) {
  TokenTable table;
  Entry e;
  e.token = std::move(token);
  e.who.name = "admin";
  e.who.admin = true;
  e.who.read_roots = {"/"};
  e.who.write_roots = {"/"};
  table.entries_.push_back(std::move(e));
  return table;
}

const Principal* TokenTable::Find(const std::string& presented) const {
  const Principal* found = nullptr;
  for (const Entry& e : entries_) {
    if (rpc::ConstantTimeEquals(presented, e.token) && found == nullptr) found = &e.who;
  }
  return found;
}

Status CheckUnderRoots(const Principal& who, const char* field, const std::string& path,
                       bool write) {
  const std::vector<std::string>& roots = write ? who.write_roots : who.read_roots;
  for (const std::string& root : roots) {
    if (PathIsUnder(path, root)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      field, " '", path, "' is outside the directories user '", who.name, "' may ",
      write ? "write" : "read", ": ", absl::StrJoin(roots, ", "),
      " (the coordinator's tokens file grants them)"));
}

}  // namespace qcal::coordinator
