// A job's journal (JOB/journal.jsonl, runner/job_dir.h): the record of its finished work, and
// the conversions between task results and journal entries. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "proto/job.pb.h"

namespace qcal {

// ---- Results <-> journal entries

// {"event":"block_done","layer","shard","bytes","checksum","seconds","mse_before_ft",
//  "mse_after_ft","rank","ft_curves":[{"heldout":[...],"train":[...]}] (with fine-tuning),
//  "metrics":[...],"also_wrote":{name: checksum},"phases":[...]} (non-finite numbers as null).
nlohmann::json BlockDoneEntry(const v1::BlockResult& result);
v1::BlockResult BlockResultFromEntry(const nlohmann::json& entry);
// {"event":"e2e_done","checksums":{shard: checksum},"kl_before","kl_after","best_epoch",
//  "head_tuned","seconds"}
nlohmann::json E2eDoneEntry(const v1::FinetuneResult& result);
// {"event":"phase_done","phase","losses":[...],"validation":[[step, loss], ...]}: a global
// phase's training curve (CalibrateResult::curves), which the job report plots by the phase's
// name. PhaseCurveFromEntry: InvalidArgument for anything else.
nlohmann::json PhaseDoneEntry(const v1::PhaseCurve& curve);
StatusOr<v1::PhaseCurve> PhaseCurveFromEntry(const nlohmann::json& entry);
// {"event":"expert_load","layers":[{"layer","routed_tokens":[...],"every_token":[...]}, ...]}:
// a MoE model's calibration routing (CalibrateResult::expert_loads), which the job report plots.
nlohmann::json ExpertLoadEntry(const v1::CalibrateResult& result);
// {"event":"block_part_done", BlockDoneEntry's keys (shard: the part file), "part":{"index",
//  "count","expert_begin","expert_end"}}: an expert group of a MoE block split over tasks.
// BlockResultFromEntry reads either.
nlohmann::json BlockPartDoneEntry(const v1::BlockResult& result);
// Checks a block_part_done entry read from the journal: layer in range, a part with an expert
// range, shard == PartFileName(layer, begin, end), present in out_dir with the entry's checksum.
Status CheckBlockPartDoneEntry(const nlohmann::json& entry, const std::string& out_dir,
                               int64_t num_blocks);
// Every output file a result wrote.
std::vector<v1::WrittenFile> FilesOf(const v1::BlockResult& result);

// Checks a block_done entry read from the journal: an object with event "block_done", layer in
// [0, num_blocks), shard == ShardName(layer + 1, num_blocks), and the shard (and any also_wrote
// file) in out_dir present with the entry's checksum. InvalidArgument / DataLoss naming the file.
Status CheckBlockDoneEntry(const nlohmann::json& entry, const std::string& out_dir,
                           int64_t num_blocks);
// Checks a worker's block result before it is accepted: layer in range, the block's shard name
// (an expert group's: its part file name), plain file names, and staged files present with the
// sizes claimed (CheckStagedFiles).
Status CheckBlockResult(const v1::BlockResult& result, const std::string& out_dir,
                        int64_t num_blocks);

// Append-only journal of finished work; each Append is one JSON line, written and fsynced before
// it returns. A torn last line (crash mid-append) is ignored on Open; other garbage is DataLoss.
// Not thread-safe: one writer per job (the single process, or the coordinator).
class Journal {
 public:
  static StatusOr<Journal> Open(const std::string& path);
  const std::vector<nlohmann::json>& entries() const { return entries_; }
  Status Append(const nlohmann::json& entry);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<nlohmann::json> entries_;
};

}  // namespace qcal
