// Where qcal writes, it never follows a symbolic link. A job's directories belong to whoever
// submitted it, and the process writing them (a coordinator running as root, or another user's
// service) must not be steered by a link that person planted into writing, truncating, appending
// to or copying a file outside those directories.
//
// The rule: every path qcal writes under is made canonical once, where it enters the program
// (CanonicalPath: the command line, a submitted job spec), and from then on no component of a
// path qcal creates, opens for writing, renames into or copies from may be a symbolic link. Each
// opening walks the path from "/" (or the working directory, for a relative path), opening every
// directory with O_NOFOLLOW|O_DIRECTORY below its parent's descriptor and the file itself with
// O_NOFOLLOW, so no component can be swapped for a link between a check and the use. A link
// anywhere is refused with FailedPrecondition naming the path and the component (kLinkRefusal).
//
// Every write of the job layout goes through here: AtomicFileWriter (common/atomic_file.h) and
// the few files opened in place (the job directory's lock, the journal, the activation spill,
// the calibration cache's partial files, the workers' log). tests/common/safe_fs_test.cc checks
// that no other source file opens a file for writing, and tests/coordinator/job_links_test.sh
// plants a link at every path a job writes (found with QCAL_TRACE_WRITES, below).
//
// QCAL_TRACE_WRITES=FILE: every path created or opened for writing through this module is
// appended to FILE, one per line (for the tests that find what a job writes).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "common/status.h"

namespace qcal {

// What every refusal says after "PATH: COMPONENT is a symbolic link".
inline constexpr char kLinkRefusal[] =
    "qcal does not write or copy through symbolic links in a job's directories; remove the link, "
    "or give the directory it points to";

// `path` made absolute (against the working directory) and canonical: the longest prefix that
// exists is resolved (realpath: links followed, "." and ".." removed), the rest appended
// lexically. An empty path is InvalidArgument; an unreadable prefix names it.
StatusOr<std::string> CanonicalPath(const std::string& path);

// Opens `path` (flags as for open(2); O_CLOEXEC and O_NOFOLLOW are added) without following a
// link at any component. Returns the descriptor (the caller closes it). A link: FailedPrecondition
// (kLinkRefusal); other errors as io::ErrnoError ("PATH: WHAT: strerror"). When `flags` create or
// write, a file that exists must be a regular file (a FIFO or device is refused too).
StatusOr<int> OpenNoFollow(const std::string& path, int flags, mode_t mode, const char* what);

// The directory holding `path` opened as above (O_RDONLY|O_DIRECTORY), and the last component.
struct ParentDir {
  int fd = -1;       // the caller closes it
  std::string name;  // the last component of the path
};
StatusOr<ParentDir> OpenParentNoFollow(const std::string& path);

// mkdir -p without following links: every existing component must be a directory (not a link to
// one); missing ones are created with `mode`.
Status MakeDirs(const std::string& path, mode_t mode = 0755);

// Renames `from` over `to` (both without links in any component); refuses when `to` exists as a
// link (rename(2) would replace the link silently; a planted link is refused instead).
Status RenameNoFollow(const std::string& from, const std::string& to);

// FailedPrecondition (kLinkRefusal) when any component of `path` that exists is a link; OK when
// none is (a missing tail is fine). For paths handed to another program (mpirun's log).
Status CheckNoLinks(const std::string& path);

// Whether `path` lies at or below `root` (both canonical; compared by components).
bool PathIsUnder(const std::string& path, const std::string& root);

// Where `path` resolves, when it may be copied into an output: a regular file at or below one of
// `allowed` (canonical directories). FailedPrecondition naming the file and where it points
// otherwise; a missing file is NotFound. Reads nothing (the check before a job runs).
StatusOr<std::string> ResolveForCopy(const std::string& path,
                                     const std::vector<std::string>& allowed);

// The contents of `path` for copying it into an output (ResolveForCopy, then read): the file's
// resolved location must be a regular file at or below one of `allowed` (canonical directories),
// opened without links (so a swap after the check is refused). FailedPrecondition naming the
// file and where it points otherwise; a missing file is NotFound.
StatusOr<std::string> ReadFileForCopy(const std::string& path,
                                      const std::vector<std::string>& allowed);

// Appends `path` to QCAL_TRACE_WRITES (see above); no-op when the variable is unset.
void TraceWrite(const std::string& path);

}  // namespace qcal
