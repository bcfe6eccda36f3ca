#!/usr/bin/python3
"""The layering check of the build (cmake/QcalHelpers.cmake qcal_layering_check).

Every module (one CMake target) owns files; a file may include, with #include "...", only headers
owned by its own module or by a module it links, directly or through others. An include of a
header another module owns without linking it is an upward (or sideways) dependency and fails
the build; so does an include of a project header no module owns, and a cycle between modules.

The folders are layers, in the order below (docs/architecture.md "Layers"). A module's layer is
its folder's; a module may link, and a file may include, only modules of a lower layer or of its
own folder, so an include or a link that goes up the order, or sideways to another folder of the
same layer, fails the build even when the link that would allow it is added.

  check-layering.py SOURCE_DIR BUILD_DIR/layering.json
"""
import json
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')

# The layers, lowest first; the folders of one layer do not depend on each other.
LAYERS = [
    ("proto",),               # the messages (generated code)
    ("common",),              # formats, recipes, the job layout: torch-free foundations
    ("kernels", "rpc", "report"),  # numeric kernels; the control plane's ends; the job report
    ("engine",),              # the LibTorch layer: comm, model, eval, calib, quant, qsim
    ("methods", "tools"),     # the quantization methods; model tools (`qcal tool`)
    ("runner", "export"),     # job steps and the job runner; exporters of finished checkpoints
    ("worker", "coordinator"),  # the worker process; the service (never links LibTorch)
    ("client", "bench"),      # the `qcal` program; benchmarks
]
RANK = {folder: rank for rank, folder_set in enumerate(LAYERS) for folder in folder_set}


def folder_of(module):
    """The one folder a module's files live in (its layer), or an error message."""
    folders = {f.split("/")[0] for f in module["files"] + module["generated"]}
    if len(folders) != 1:
        return None, f"spans folders {sorted(folders)} (a module lives in one layer)"
    folder = folders.pop()
    if folder not in RANK:
        return None, (f"lives in {folder}/, which is in no layer (add it to LAYERS in "
                      f"scripts/check-layering.py and to docs/architecture.md)")
    return folder, None


def may_use(user, used):
    """Whether a module in folder `user` may depend on one in folder `used`."""
    return user == used or RANK[used] < RANK[user]


def main():
    src, manifest = sys.argv[1], sys.argv[2]
    modules = json.load(open(manifest))
    owner = {}
    for name, m in modules.items():
        for f in m["files"] + m["generated"]:
            if f in owner and owner[f] != name:
                print(f"layering: {f} is owned by both {owner[f]} and {name}")
                return 1
            owner[f] = name

    # Cycles, and each module's transitive closure.
    closure, state = {}, {}

    def visit(name, stack):
        if state.get(name) == "done":
            return True
        if state.get(name) == "active":
            cycle = stack[stack.index(name):] + [name]
            print("layering: modules depend on each other in a cycle: " + " -> ".join(cycle))
            return False
        state[name] = "active"
        reach = {name}
        for d in modules[name]["deps"]:
            if not visit(d, stack + [name]):
                return False
            reach |= closure[d]
        closure[name] = reach
        state[name] = "done"
        return True

    for name in modules:
        if not visit(name, []):
            return 1

    errors = []
    folder = {}
    for name, m in modules.items():
        folder[name], problem = folder_of(m)
        if problem:
            errors.append(f"module {name} {problem}")
    if errors:
        for e in errors:
            print("layering: " + e)
        return 1
    for name, m in modules.items():
        for d in m["deps"]:
            if not may_use(folder[name], folder[d]):
                errors.append(f"module {name} ({folder[name]}/, layer {RANK[folder[name]]}) links "
                              f"{d} ({folder[d]}/, layer {RANK[folder[d]]}): a dependency up or "
                              f"sideways in the layer order")
    for name, m in modules.items():
        for f in m["files"]:
            path = os.path.join(src, f)
            if not os.path.exists(path):
                continue
            with open(path, encoding="utf-8", errors="replace") as fh:
                for lineno, line in enumerate(fh, 1):
                    hit = INCLUDE.match(line)
                    if not hit:
                        continue
                    inc = hit.group(1)
                    if inc.startswith("absl/") or inc.startswith("tests/"):
                        continue
                    target = owner.get(inc)
                    if target is None:
                        if os.path.exists(os.path.join(src, inc)):
                            errors.append(f"{f}:{lineno}: includes {inc}, which no module owns "
                                          f"(add it to a module's SOURCES or HEADERS)")
                        continue
                    if not may_use(folder[name], folder[target]):
                        errors.append(f"{f}:{lineno}: {inc} belongs to {folder[target]}/ (layer "
                                      f"{RANK[folder[target]]}), above or beside {folder[name]}/ "
                                      f"(layer {RANK[folder[name]]}) in the layer order")
                    elif target not in closure[name]:
                        errors.append(f"{f}:{lineno}: module {name} includes {inc} of module "
                                      f"{target}, which it does not link (an upward or sideways "
                                      f"dependency)")
    for e in errors:
        print("layering: " + e)
    if errors:
        print(f"layering: {len(errors)} include(s) against the module layering "
              f"(docs/architecture.md)")
        return 1
    print(f"layering: {len(modules)} modules in {len(LAYERS)} layers, every include and link "
          f"points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
