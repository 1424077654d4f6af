#!/usr/bin/env python3
"""dev/analysis/sass_loops.py on a SASS dump written here: the loops that hold
MMAs, their instruction, MMA and spill counts (counted independently below
from the same lines), nesting, a function missing from the dump, and the
errors for bad input (exit 2, a message naming the problem)."""
import os
import subprocess
import sys
import tempfile

SRC = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
TOOL = os.path.join(SRC, "dev", "analysis", "sass_loops.py")


def ins(addr, text):
    return "        /*%04x*/                   %s ;                /* 0x000000000000794d */" % (addr, text)


def dump():
    # one function: a prologue, an outer loop (0x40 .. 0x200) holding an
    # inner one (0x80 .. 0x140) with 4 HGMMA and a spill, and a backward
    # branch without MMAs (0x220 -> 0x210) that is not a loop of interest
    lines = ["\tcode for sm_90a", "\t\tFunction : kern_a", "\t.headerflags @\"EF_CUDA_SM90\""]
    body = {0x00: "MOV R1, c[0x0][0x28]", 0x10: "S2R R0, SR_TID.X", 0x40: "IMAD R2, R0, 0x4, RZ"}
    a = 0x50
    while a < 0x80:
        body[a] = "IADD3 R3, R3, 0x1, RZ"
        a += 0x10
    inner = ["LDS.128 R4, [R2]", "HGMMA.64x8x16.F32.BF16 R8, R4, gdesc[UR4], R8", "STL [R1+0x4], R3",
             "HGMMA.64x8x16.F32.BF16 R8, R4, gdesc[UR8], R8", "@!PT LDS RZ, [RZ]",
             "HGMMA.64x8x16.F32.BF16 R12, R4, gdesc[UR4], R12", "LDL R3, [R1+0x4]",
             "HGMMA.64x8x16.F32.BF16 R12, R4, gdesc[UR8], R12, gsb0", "WARPGROUP.DEPBAR.LE gsb0, 0x0",
             "ISETP.GE.AND P0, PT, R3, 0x20, PT", "HMUL2 R5, R5, R6", "LOP3.LUT R7, R7, 0x81c081c0, RZ, 0xc0, !PT",
             "@!P0 BRA 0x80"]
    for i, t in enumerate(inner):
        body[0x80 + 0x10 * i] = t
    a = 0x80 + 0x10 * len(inner)
    while a < 0x200:
        body[a] = "FADD R9, R9, R10"
        a += 0x10
    body[0x200] = "@P1 BRA 0x40"
    body[0x210] = "NOP"
    body[0x220] = "@P2 BRA 0x210"
    body[0x230] = "EXIT"
    for k in sorted(body):
        lines.append(ins(k, body[k]))
    lines += ["\t\t..........", "", "\t\tFunction : kern_b", ins(0x0, "EXIT")]
    return "\n".join(lines) + "\n", body


def run(args):
    r = subprocess.run([sys.executable, TOOL] + args, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def main():
    text, body = dump()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.sass")
        with open(p, "w") as f:
            f.write(text)
        rc, out, err = run(["--sass", p, "kern_a", "kern_b", "kern_c", "--ops"])
        assert rc == 0, (rc, err)
        # independent counts of the two loops
        inner = [t for a, t in body.items() if 0x80 <= a <= 0x80 + 0x10 * 12]
        outer = [t for a, t in body.items() if 0x40 <= a <= 0x200]
        want_inner = "loop 0x80..0x140: %d instructions, 4 MMA, 2 local" % len(inner)
        want_outer = "loop 0x40..0x200: %d instructions, 4 MMA, 2 local, holds 1 of these loops" % len(outer)
        assert "kern_a: %d instructions" % len(body) in out, out
        assert want_inner in out, (want_inner, out)
        assert want_outer in out, (want_outer, out)
        assert "0x210" not in out, out  # no MMA in that loop
        assert "HGMMA 4" in out and "LDS 2" in out, out
        assert "kern_b: 1 instructions" in out and "loop" not in out.split("kern_b")[1], out
        assert "kern_c: not in the dump" in out, out
        # every function missing: exit 1
        rc, out, err = run(["--sass", p, "kern_x"])
        assert rc == 1 and "kern_x: not in the dump" in out, (rc, out)
        # bad input: exit 2 with the problem named
        rc, out, err = run(["--sass", os.path.join(d, "none.sass")])
        assert rc == 2 and "cannot read" in err and "none.sass" in err, (rc, err)
        empty = os.path.join(d, "empty.sass")
        open(empty, "w").close()
        rc, out, err = run(["--sass", empty])
        assert rc == 2 and "no SASS functions" in err, (rc, err)
        rc, out, err = run([os.path.join(d, "missing.bin")])
        assert rc == 2 and "no such file" in err, (rc, err)
        rc, out, err = run([p, "--cuobjdump", os.path.join(d, "no-cuobjdump")])
        assert rc == 2 and "cuobjdump not found" in err, (rc, err)
    print("py_sass_loops: all passed")


if __name__ == "__main__":
    main()
