#!/usr/bin/env python3
"""Where a kernel's register spills sit: inside its wgmma K loops or in per-tile code (CPU tool).

ptxas reports a kernel's spill bytes (--warn-on-spills) but not where they are. Spills in the
per-tile code (epilogues, task hand-out, the producer at its 40 registers) cost a few local
loads and stores per tile; one in the loop that issues the wgmma batches costs at every K step.
This disassembles the named objects (cuobjdump -sass) and prints, for every kernel with wgmma,
the local loads and stores (LDL, STL) within the address range of the innermost loop (backward
branch) around each HGMMA or QGMMA (FP8), and the others. The range is an upper bound: it also holds code that
the K loop runs once per tile behind a branch (the standalone dgrad kinds look their next tile
up there), so a spill listed "in" a K loop is to be read in the listing before it is believed.
--strict: exit 1 when any is listed there.

The objects are the build's own (compile_commands.json: the -o of each source). cuobjdump: the
CUDA toolkit's, or $CUOBJDUMP (a toolkit without it: NVIDIA's nvidia-cuda-cuobjdump wheel has one).

usage: scripts/sass_spills.py [--strict] BUILD_DIR SOURCE_SUFFIX...
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

INS = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
SPILL = re.compile(r"^(@!?U?P\w+\s+)?(STL|LDL)\b")


def cuobjdump():
    for cand in (os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")):
        if cand and os.access(cand, os.X_OK):
            return cand
    sys.exit("sass_spills: cuobjdump not found (the CUDA toolkit's bin/, or set CUOBJDUMP)")


def object_of(build, db, suffix):
    entries = [e for e in db if e["file"].endswith(suffix)]
    if not entries:
        sys.exit(f"sass_spills: no compile command for {suffix}")
    e = entries[0]
    args = e["arguments"] if "arguments" in e else shlex.split(e["command"])
    if "-o" not in args:
        sys.exit(f"sass_spills: no -o in the compile command of {suffix}")
    obj = args[args.index("-o") + 1]
    obj = obj if os.path.isabs(obj) else os.path.join(e["directory"], obj)
    if not os.path.exists(obj):
        sys.exit(f"sass_spills: {obj} missing (build {suffix} first)")
    return obj


def kernels(sass):
    """(name, [(address, instruction)]) for each function of a cuobjdump -sass listing."""
    name, body = None, []
    for line in sass.splitlines():
        if "Function :" in line:
            if name:
                yield name, body
            name, body = line.split("Function :", 1)[1].strip(), []
            continue
        m = INS.match(line)
        if m and name:
            body.append((int(m.group(1), 16), m.group(2)))
    if name:
        yield name, body


def check(name, body):
    """(spills in K loops, spills elsewhere, number of K loops)."""
    loops = []
    for addr, text in body:
        m = BRANCH.search(text)
        if m and int(m.group(1), 16) <= addr:
            loops.append((int(m.group(1), 16), addr))
    inner = set()
    for addr, text in body:
        if "HGMMA" in text or "QGMMA" in text:  # bf16 and FP8 (e4m3) wgmma
            around = [lp for lp in loops if lp[0] <= addr <= lp[1]]
            if around:
                inner.add(min(around, key=lambda lp: lp[1] - lp[0]))
    spills = [(a, t) for a, t in body if SPILL.match(t)]
    in_loop = [(a, t) for a, t in spills if any(lo <= a <= hi for lo, hi in inner)]
    return in_loop, len(spills) - len(in_loop), len(inner)


def main():
    argv = sys.argv[1:]
    strict = "--strict" in argv
    argv = [a for a in argv if a != "--strict"]
    if len(argv) < 2:
        sys.exit(__doc__)
    build, suffixes = argv[0], argv[1:]
    db_path = os.path.join(build, "compile_commands.json")
    if not os.path.exists(db_path):
        sys.exit(f"sass_spills: {db_path} missing (CMAKE_EXPORT_COMPILE_COMMANDS)")
    with open(db_path) as f:
        db = json.load(f)
    tool = cuobjdump()
    failed, checked = False, 0
    for suffix in suffixes:
        obj = object_of(build, db, suffix)
        r = subprocess.run([tool, "-sass", obj], capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"sass_spills: {tool} -sass {obj} failed:\n{r.stderr}")
        for name, body in kernels(r.stdout):
            in_loop, elsewhere, n_loops = check(name, body)
            if n_loops == 0:
                continue  # no wgmma in this function
            checked += 1
            short = name if len(name) < 110 else name[:107] + "..."
            print(f"{suffix}: {short}: {n_loops} K loop(s), LDL/STL within their range {len(in_loop)}, elsewhere {elsewhere}")
            for a, t in in_loop[:8]:
                print(f"    {a:#x}: {t}")
            failed |= bool(in_loop)
    if checked == 0:
        sys.exit("sass_spills: no kernel with wgmma found in " + " ".join(suffixes))
    if failed:
        print("sass_spills: spill instructions within a K loop's range (above)")
        if strict:
            sys.exit(1)
    else:
        print(f"sass_spills: {checked} kernels, no spill instruction within a K loop's range")


if __name__ == "__main__":
    main()
