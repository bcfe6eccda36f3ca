#!/usr/bin/python3
"""scripts/check-layering.py on small made-up trees: what it lets through and what it refuses.

  check_layering_test.py SOURCE_DIR BUILD_DIR
Also runs the check on the build's own manifest (BUILD_DIR/layering.json), which must pass.
"""
import json
import os
import subprocess
import sys
import tempfile


def run(script, src, modules):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(modules, f)
        manifest = f.name
    try:
        p = subprocess.run([sys.executable, script, src, manifest], capture_output=True, text=True)
        return p.returncode, p.stdout + p.stderr
    finally:
        os.unlink(manifest)


def module(files, deps=()):
    return {"files": list(files), "generated": [], "deps": list(deps)}


def main():
    source_dir, build_dir = sys.argv[1], sys.argv[2]
    script = os.path.join(source_dir, "scripts", "check-layering.py")
    failures = []
    checks = [0]

    def expect(name, modules, files, ok, needle):
        checks[0] += 1
        with tempfile.TemporaryDirectory() as src:
            for path, text in files.items():
                os.makedirs(os.path.dirname(os.path.join(src, path)), exist_ok=True)
                with open(os.path.join(src, path), "w") as fh:
                    fh.write(text)
            code, out = run(script, src, modules)
        if (code == 0) != ok or needle not in out:
            failures.append(f"{name}: exit {code}, expected {'success' if ok else 'failure'} "
                            f"with {needle!r}; output:\n{out}")

    base_files = {
        "common/a.h": "#pragma once\n",
        "engine/model/m.h": '#include "common/a.h"\n',
        "methods/x.h": '#include "engine/model/m.h"\n',
    }
    base = {
        "qcal_common": module(["common/a.h"]),
        "qcal_model": module(["engine/model/m.h"], ["qcal_common"]),
        "qcal_methods": module(["methods/x.h"], ["qcal_model"]),
    }
    expect("includes that point down", base, base_files, True, "every include and link points down")

    # engine/ includes a method header, even with the link added: up the order.
    up_files = dict(base_files, **{"engine/model/m.h": '#include "methods/x.h"\n'})
    up = json.loads(json.dumps(base))
    up["qcal_methods"]["deps"] = []
    up["qcal_model"]["deps"] = ["qcal_common", "qcal_methods"]
    expect("an include up the layers", up, up_files, False,
           "methods/x.h belongs to methods/ (layer 4), above or beside engine/ (layer 3)")
    expect("a link up the layers", up, base_files, False,
           "module qcal_model (engine/, layer 3) links qcal_methods (methods/, layer 4)")

    # worker/ and coordinator/ share a layer: neither may use the other.
    side_files = dict(base_files, **{"worker/w.h": "#pragma once\n",
                                     "coordinator/c.h": '#include "worker/w.h"\n'})
    side = dict(base, qcal_worker=module(["worker/w.h"]),
                qcal_coordinator=module(["coordinator/c.h"], ["qcal_worker"]))
    expect("a sideways link", side, side_files, False,
           "module qcal_coordinator (coordinator/, layer 6) links qcal_worker (worker/, layer 6)")

    # An include of a module not linked, within the order: still refused.
    unlinked = json.loads(json.dumps(base))
    unlinked["qcal_methods"]["deps"] = ["qcal_common"]
    expect("an include without the link", unlinked, base_files, False,
           "module qcal_methods includes engine/model/m.h of module qcal_model, which it does not link")

    # A folder that is in no layer.
    stray = dict(base, qcal_misc=module(["misc/y.h"]))
    expect("a folder in no layer", stray, dict(base_files, **{"misc/y.h": ""}), False,
           "lives in misc/, which is in no layer")

    # The build's own manifest.
    checks[0] += 1
    p = subprocess.run([sys.executable, script, source_dir, os.path.join(build_dir, "layering.json")],
                       capture_output=True, text=True)
    if p.returncode != 0:
        failures.append("the build's own layering.json does not pass:\n" + p.stdout + p.stderr)

    for f in failures:
        print("FAIL " + f)
    print(f"{checks[0] - len(failures)} of {checks[0]} checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
