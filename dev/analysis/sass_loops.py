#!/usr/bin/env python3
"""Instructions per loop iteration of the expert kernels, from their SASS.

The wgmma kernels spend their time in one loop per pass width (one 128-wide K
segment per iteration), so the number of SASS instructions in that loop is
the figure to compare between builds (where the decode is issue-bound, fewer
instructions per segment are time).

    dev/analysis/sass_loops.py FILE [FUNCTION ...] [--ops] [--arch sm_90a]
    dev/analysis/sass_loops.py --sass DUMP.txt [FUNCTION ...] [--ops]

FILE is anything `cuobjdump -sass` reads (an executable, a library, an
object file or a cubin); cuobjdump needs nvdisasm for sm_90a (both come with
the CUDA toolkit; NVDISASM_PATH, or --cuobjdump, when they are elsewhere).
--sass reads a dump saved before. FUNCTION is a mangled kernel name; without
one, the wgmma kernels that the shipped DeepSeek-V4-Flash configs run. A loop
is a backward branch whose body holds tensor-core instructions (HGMMA or
HMMA); for each, the body's instructions, its MMAs and its local-memory
accesses (spills) are printed, and with --ops its opcode histogram.
"""
import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys

# The wgmma kernels of DeepSeek-V4-Flash's shipped configs: gate/up and the
# 128-row down with passes of up to 8 and 16 tokens (B = 1 - 256), and the
# two-warpgroup pair with passes of up to 32 (B = 512).
DEFAULT_FUNCS = [
    "_Z19fm_expert_wg_kernelILi2ELb0ELi1ELb0ELi1EEv16fm_expert_paramsii",
    "_Z19fm_expert_wg_kernelILi2ELb0ELi2ELb0ELi1EEv16fm_expert_paramsii",
    "_Z19fm_expert_wg_kernelILi2ELb0ELi2ELb1ELi1EEv16fm_expert_paramsii",
    "_Z19fm_expert_wg_kernelILi2ELb0ELi4ELb0ELi2EEv16fm_expert_paramsii",
    "_Z19fm_expert_wg_kernelILi2ELb0ELi4ELb1ELi2EEv16fm_expert_paramsii",
]

INS = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)")
BRA = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(0x[0-9a-f]+)")
MMA = re.compile(r"\b(HGMMA|HMMA)\b")
LOCAL = re.compile(r"^(?:@!?U?P[0-9T]\s+)?(LDL|STL)\b")


def fail(msg):
    print("sass_loops: error: " + msg, file=sys.stderr)
    sys.exit(2)


def parse(text):
    """{function: [(address, instruction text)]} of a cuobjdump -sass dump."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = INS.match(line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2)))
    return funcs


def opcode(ins):
    ins = re.sub(r"^@!?U?P[0-9T]\s+", "", ins)
    return ins.split()[0].split(".")[0] if ins.split() else "?"


def loops(ins):
    """(start, end, body) of every backward branch whose body holds MMAs."""
    out = []
    for addr, text in ins:
        m = BRA.search(text)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [t for a, t in ins if target <= a <= addr]
        if any(MMA.search(t) for t in body):
            out.append((target, addr, body))
    return out


def report(funcs, names, ops, out=sys.stdout):
    missing = 0
    for name in names:
        ins = funcs.get(name)
        if not ins:
            print("%s: not in the dump" % name, file=out)
            missing += 1
            continue
        print("%s: %d instructions" % (name, len(ins)), file=out)
        found = loops(ins)
        for start, end, body in found:
            n_mma = sum(1 for t in body if MMA.search(t))
            n_local = sum(1 for t in body if LOCAL.match(t))
            inner = sum(1 for s0, e0, _ in found if (s0, e0) != (start, end) and start <= s0 and e0 <= end)
            print("  loop %#x..%#x: %d instructions, %d MMA, %d local%s" %
                  (start, end, len(body), n_mma, n_local, ", holds %d of these loops" % inner if inner else ""),
                  file=out)
            if ops:
                hist = collections.Counter(opcode(t) for t in body)
                print("    " + " ".join("%s %d" % kv for kv in hist.most_common()), file=out)
    return missing


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", help="executable, library, object or cubin")
    ap.add_argument("functions", nargs="*", help="mangled kernel names")
    ap.add_argument("--sass", help="a saved `cuobjdump -sass` dump instead of FILE")
    ap.add_argument("--arch", default="sm_90a", help="the architecture to disassemble (default sm_90a)")
    ap.add_argument("--cuobjdump", default=None, help="cuobjdump to run (default: from PATH or CUDA_HOME)")
    ap.add_argument("--ops", action="store_true", help="print each loop's opcode histogram")
    a = ap.parse_args(argv)
    names = list(a.functions)
    if a.sass:
        if a.file:
            names.insert(0, a.file)
        try:
            with open(a.sass, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            fail("cannot read %s: %s" % (a.sass, e.strerror))
    else:
        if not a.file:
            fail("give FILE or --sass DUMP")
        if not os.path.isfile(a.file):
            fail("no such file: %s" % a.file)
        tool = a.cuobjdump or shutil.which("cuobjdump") or os.path.join(
            os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")
        if not os.path.isfile(tool):
            fail("cuobjdump not found (--cuobjdump PATH)")
        cmd = [tool, "-sass", "-arch", a.arch]
        for n in names or DEFAULT_FUNCS:
            cmd += ["-fun", n]
        r = subprocess.run(cmd + [a.file], capture_output=True, text=True)
        if r.returncode != 0:
            fail("%s failed: %s" % (" ".join(cmd[:3]), (r.stderr or r.stdout).strip().splitlines()[-1:]))
        text = r.stdout
    funcs = parse(text)
    if not funcs:
        fail("no SASS functions in the dump (cuobjdump needs nvdisasm for %s: NVDISASM_PATH)" % a.arch)
    missing = report(funcs, names or DEFAULT_FUNCS, a.ops)
    return 1 if missing == len(names or DEFAULT_FUNCS) else 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    sys.exit(main(sys.argv[1:]))
