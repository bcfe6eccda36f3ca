#!/usr/bin/python3
"""The layering check of the build (cmake/QcalHelpers.cmake qcal_layering_check).

Every module (one CMake target) owns files; a file may include, with #include "...", only headers
owned by its own module or by a module it links, directly or through others. An include of a
header another module owns without linking it is an upward (or sideways) dependency and fails
the build; so does an include of a project header no module owns, and a cycle between modules.

  check-layering.py SOURCE_DIR BUILD_DIR/layering.json
"""
import json
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


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
                    if target not in closure[name]:
                        errors.append(f"{f}:{lineno}: module {name} includes {inc} of module "
                                      f"{target}, which it does not link (an upward or sideways "
                                      f"dependency)")
    for e in errors:
        print("layering: " + e)
    if errors:
        print(f"layering: {len(errors)} include(s) against the module layering "
              f"(docs/architecture.md)")
        return 1
    print(f"layering: {len(modules)} modules, every include points down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
