#!/usr/bin/env python3
"""Instruction counts of SASS by function and by source-line range: the code
that a kernel fetches when it runs once per step, cold in the SM's
instruction caches. Reads a dump of `nvdisasm -g -c CUBIN` (line numbers
need the build's --generate-line-info, which the Release build has) or the
cubin itself (then runs nvdisasm: --nvdisasm, $NVDISASM or PATH; PyPI's
nvidia-cuda-nvdisasm has one). A cubin comes out of a binary with
`cuobjdump -xelf route_select.sm_90a.cubin build/fp4moe`.

  python3 dev/analysis/sass_lines.py route_select.sm_90a.cubin --function fm_route_kernelILi1 \\
      --range pick:route_select.cu:248-398 --range grouping:route_select.cu:467-710

Prints, per function whose mangled name holds --function (every function
by default), its instructions and bytes (16 per instruction); then, summed
over those functions, the instructions whose source line lies in LO..HI of
a file whose path ends with FILE for each --range NAME:FILE:LO-HI (a line
in two ranges counts in the first), and the rest as "other". Exit 2 with a
message on a missing or unreadable input, a dump with no function or no
line information, or a range that is not NAME:FILE:LO-HI.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

SECTION = re.compile(r"^\.text\.(\S+):\s*$")
LINE = re.compile(r'//## File "([^"]*)", line (\d+)')
INSN = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+\S")


def fail(msg):
    print("sass_lines: " + msg, file=sys.stderr)
    sys.exit(2)


def parse(text):
    """{function: [(file or None, line or 0)]}, one entry per instruction."""
    funcs, cur, where = {}, None, (None, 0)
    for raw in text.splitlines():
        m = SECTION.match(raw.strip())
        if m:
            cur, where = m.group(1), (None, 0)
            funcs.setdefault(cur, [])
            continue
        m = LINE.search(raw)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        if cur is not None and INSN.match(raw):
            funcs[cur].append(where)
    return funcs


def parse_range(s):
    m = re.fullmatch(r"([^:]+):([^:]+):(\d+)-(\d+)", s)
    if not m or int(m.group(3)) > int(m.group(4)):
        fail("range '%s' is not NAME:FILE:LO-HI (LO <= HI)" % s)
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


def read_input(path, nvdisasm):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail("cannot read %s: %s" % (path, e.strerror))
    if not data.startswith(b"\x7fELF"):
        return data.decode("utf-8", errors="replace")
    tool = nvdisasm or os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not tool or not os.path.exists(tool):
        fail("%s is a cubin and nvdisasm was not found (--nvdisasm PATH)" % path)
    r = subprocess.run([tool, "-g", "-c", path], capture_output=True, text=True)
    if r.returncode != 0:
        fail("nvdisasm failed on %s: %s" % (path, r.stderr.strip()[:300]))
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", help="a dump of nvdisasm -g -c, or a cubin")
    ap.add_argument("--function", default="", help="only functions whose mangled name holds this")
    ap.add_argument("--range", action="append", default=[], help="NAME:FILE:LO-HI")
    ap.add_argument("--nvdisasm", default=None, help="nvdisasm to run on a cubin")
    a = ap.parse_args()
    ranges = [parse_range(r) for r in a.range]
    funcs = parse(read_input(a.input, a.nvdisasm))
    if not funcs:
        fail("no functions in %s (not an nvdisasm -c dump?)" % a.input)
    chosen = {f: v for f, v in funcs.items() if a.function in f}
    if not chosen:
        fail("no function name holds '%s'" % a.function)
    if ranges and not any(fl for v in chosen.values() for fl, _ in v):
        fail("no line information in %s (build with --generate-line-info, disassemble with -g)" % a.input)
    for f, v in chosen.items():
        print("%-60s %6d instructions %7d bytes" % (f, len(v), 16 * len(v)))
    if ranges:
        counts = {name: 0 for name, _, _, _ in ranges}
        other = 0
        for v in chosen.values():
            for fl, ln in v:
                for name, suffix, lo, hi in ranges:
                    if fl and fl.endswith(suffix) and lo <= ln <= hi:
                        counts[name] += 1
                        break
                else:
                    other += 1
        for name, _, _, _ in ranges:
            print("  %-20s %6d" % (name, counts[name]))
        print("  %-20s %6d" % ("other", other))


if __name__ == "__main__":
    main()
