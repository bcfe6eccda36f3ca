// Who is calling: the coordinator's tokens file maps each bearer token to a user, a role and the
// directory roots that user may read models from and write outputs under (docs/service.md,
// "Security"). Jobs record their owner; a user sees and acts on its own jobs only, an admin on
// all. Workers never use these tokens: each job's group gets a credential of its own
// (JobManager), valid only for that job's worker RPCs.
//
// The tokens file (YAML, readable by the coordinator alone):
//   users:
//     - name: alice
//       token_file: /etc/qcal/alice.token   # or `token: "<at least 16 characters>"`
//       role: user                          # user (default) or admin
//       read: [/data/models, /home/alice]   # model and calibration directories (user: required)
//       write: [/scratch/alice]             # out_dir and job_dir (user: required)
// An admin's roots default to "/" (everything the coordinator's own uid may touch). The single
// --auth-token-file of earlier versions is one admin ("admin") and the coordinator warns so.
#pragma once

#include <string>
#include <vector>

#include "common/status.h"

namespace qcal::coordinator {

struct Principal {
  std::string name;
  bool admin = false;
  std::vector<std::string> read_roots;   // canonical directories
  std::vector<std::string> write_roots;  // canonical directories
};

class TokenTable {
 public:
  // Parses a tokens file; every error names the file, the user entry and the field.
  static StatusOr<TokenTable> Load(const std::string& path);
  // One admin with roots "/" (the single --auth-token-file).
  static TokenTable SingleAdmin(std::string token);

  // The principal whose token is `presented` (compared in constant time against every entry,
  // so the time says nothing about which one matched); nullptr when none.
  const Principal* Find(const std::string& presented) const;
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    std::string token;
    Principal who;
  };
  std::vector<Entry> entries_;
};

// InvalidArgument naming `field` when the canonical `path` lies under none of `roots`
// ("out_dir '/x' is outside the directories user 'bob' may write: /scratch/bob").
Status CheckUnderRoots(const Principal& who, const char* field, const std::string& path,
                       bool write);

}  // namespace qcal::coordinator
