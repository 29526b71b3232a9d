#!/usr/bin/env python3
"""Fails when ptxas serialises the wgmma pipeline of a kernel (CPU check, run by ctest).

ptxas does not fail a build whose wgmma instructions it had to serialise; it prints an info
line (C7510 a call crosses the pipeline, C7511 too few registers, C7514 non-wgmma code reads
accumulator registers, C7515 non-wgmma code defines them, C7518 divergent path) and the kernel
silently loses 5-30 %: a task loop without a bound cost the fused forward 5-10 % this way
(docs/megakernel.md), a branch around the wgmma issue 5-7 % (C7514, which this
check missed until 2026-12-02, 8073c7d). So besides the known codes, any line saying that
wgmma instructions "are serialized" fails the check.
This recompiles the named sources with the build's own command (compile_commands.json) plus
-Xptxas -v and fails on any of those lines.

usage: scripts/check_wgmma_pipeline.py BUILD_DIR SOURCE_SUFFIX...
"""
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

SERIALISED = ("C7510", "C7511", "C7514", "C7515", "C7518", "are serialized")


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    build, suffixes = sys.argv[1], sys.argv[2:]
    db_path = os.path.join(build, "compile_commands.json")
    if not os.path.exists(db_path):
        sys.exit(f"check_wgmma_pipeline: {db_path} missing (CMAKE_EXPORT_COMPILE_COMMANDS)")
    with open(db_path) as f:
        db = json.load(f)
    failed = False
    for suffix in suffixes:
        entries = [e for e in db if e["file"].endswith(suffix)]
        if not entries:
            sys.exit(f"check_wgmma_pipeline: no compile command for {suffix}")
        e = entries[0]
        args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
        out = []
        skip = 0
        for a in args:  # drop the object and the dependency-file outputs
            if skip:
                skip -= 1
                continue
            if a in ("-o", "-MF", "-MT"):
                skip = 1
                continue
            if a == "-MD":
                continue
            out.append(a)
        with tempfile.TemporaryDirectory() as tmp:
            cmd = out + ["-o", os.path.join(tmp, "x.o"), "-Xptxas", "-v"]
            r = subprocess.run(cmd, cwd=e["directory"], capture_output=True, text=True)
        log = r.stdout + r.stderr
        if r.returncode != 0:
            print(log)
            sys.exit(f"check_wgmma_pipeline: compiling {suffix} failed")
        hits = [line for line in log.splitlines() if any(c in line for c in SERIALISED)]
        kernels = len(re.findall(r"Used \d+ registers", log))
        if hits:
            failed = True
            print(f"FAIL {suffix}: ptxas serialised wgmma:")
            for line in hits:
                print("  " + line)
        else:
            print(f"ok   {suffix}: {kernels} kernels, wgmma pipelines intact")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
