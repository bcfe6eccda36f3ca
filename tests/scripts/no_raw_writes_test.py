#!/usr/bin/env python3
"""Every file qcal creates, truncates, appends to or renames goes through common/safe_fs.h, which
never follows a symbolic link (issue 51). This scans the sources outside tests/ and bench/ for a
write that does not: open(2) with a writing flag and neither O_NOFOLLOW nor O_EXCL (both refuse
a link at the leaf), rename(2), std::filesystem's rename/copy/create_directories, mkdir(2),
std::ofstream and fopen for writing. A line may opt out with a reason: `// raw-write: WHY` on it or the line above.
Usage: no_raw_writes_test.py SOURCE_DIR"""
import pathlib
import re
import sys

root = pathlib.Path(sys.argv[1])
OWNER = "common/safe_fs.cc"
WRITE_FLAGS = re.compile(r"O_(CREAT|WRONLY|RDWR|TRUNC|APPEND)\b")
OPEN = re.compile(r"(::open\(|\bopenat\(|\baddopen\(|\bopen64\()")
FORBIDDEN = [
    (re.compile(r"(::|std::|\b)rename(at)?\("), "rename(2)"),
    (re.compile(r"fs::rename|filesystem::rename"), "std::filesystem::rename"),
    (re.compile(r"fs::copy|filesystem::copy"), "std::filesystem::copy"),
    (re.compile(r"create_director(y|ies)\("), "std::filesystem::create_directories"),
    (re.compile(r"(::|\b)mkdir(at)?\("), "mkdir(2)"),
    (re.compile(r"std::ofstream|std::fstream"), "std::ofstream"),
    (re.compile(r"fopen\([^)]*\"[wa]"), "fopen for writing"),
]

problems = []
files = 0
for path in sorted(root.rglob("*")):
    rel = path.relative_to(root).as_posix()
    if path.suffix not in (".cc", ".h", ".cu", ".cuh") or not path.is_file():
        continue
    if rel.split("/")[0] in ("tests", "bench", "build") or rel.startswith("build") or rel == OWNER:
        continue
    files += 1
    # Joined statements: an open(...) call may span lines.
    text = path.read_text(errors="replace")
    lines = text.split("\n")
    for i, line in enumerate(lines):
        code = line.split("//")[0]
        if "raw-write:" in line or (i > 0 and "raw-write:" in lines[i - 1]):
            continue
        if OPEN.search(code):
            stmt = " ".join(l.split("//")[0] for l in lines[i:i + 3])
            stmt = stmt.split(";")[0]
            if WRITE_FLAGS.search(stmt) and "O_NOFOLLOW" not in stmt and "O_EXCL" not in stmt:
                problems.append(f"{rel}:{i + 1}: opens for writing without O_NOFOLLOW "
                                f"(use OpenNoFollow, common/safe_fs.h): {line.strip()}")
        for pattern, what in FORBIDDEN:
            if pattern.search(code) and "NoFollow" not in code:
                problems.append(f"{rel}:{i + 1}: {what} outside common/safe_fs.cc "
                                f"(use RenameNoFollow / MakeDirs / AtomicFileWriter): "
                                f"{line.strip()}")

if problems:
    print("\n".join(problems))
    print(f"{len(problems)} write(s) that may follow a symbolic link, in {files} files")
    sys.exit(1)
print(f"no raw writes: {files} source files write only through common/safe_fs.h")
