#!/usr/bin/env python3
"""dev/analysis/sass_lines.py on an nvdisasm -g dump written here: the
instruction counts per function and per source-line range (counted
independently below from the same layout), a line in two ranges, the
function filter, and the errors for bad input (exit 2, a message naming the
problem); a cubin with no nvdisasm to read it is refused by name."""
import os
import subprocess
import sys
import tempfile

SRC = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
TOOL = os.path.join(SRC, "dev", "analysis", "sass_lines.py")


def dump(funcs):
    """funcs: [(name, [(line, n_instructions)])] -> nvdisasm -g -c text."""
    out = ["\t.target\tsm_90a", ""]
    for name, blocks in funcs:
        out += ["//--------------------- .text.%s --------------------------" % name,
                "\t.section\t.text.%s,\"ax\",@progbits" % name, "%s:" % name, ".text.%s:" % name]
        a = 0
        for line, n in blocks:
            if line:
                out.append('\t//## File "/src/cuda/%s", line %d' % (line[0], line[1]))
            for _ in range(n):
                out.append("        /*%04x*/                   IADD3 R1, R1, 0x1, RZ ;" % a)
                a += 0x10
        out.append("        /*%04x*/                   EXIT ;" % a)
        out.append(".L_x_%s:" % name)
    return "\n".join(out) + "\n"


def run(args):
    r = subprocess.run([sys.executable, TOOL] + args, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def counts(out):
    """{function or range name: count} from the tool's output."""
    res = {}
    for line in out.splitlines():
        w = line.split()
        if len(w) >= 3 and w[2] == "instructions":
            res[w[0]] = int(w[1])
        elif len(w) == 2 and line.startswith("  "):
            res[w[0]] = int(w[1])
    return res


def main():
    # kern_a: 5 instructions before any line, then a.cu 10 (3), a.cu 20 (4),
    # b.cu 15 (6), a.cu 30 (2), the EXIT after it (a.cu 30 too); kern_b: a.cu 10 (7) + EXIT
    fa = [(None, 5), (("a.cu", 10), 3), (("a.cu", 20), 4), (("b.cu", 15), 6), (("a.cu", 30), 2)]
    fb = [(("a.cu", 10), 7)]
    text = dump([("kern_a", fa), ("kern_b", fb)])
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.sass")
        with open(p, "w") as f:
            f.write(text)
        rc, out, err = run([p])
        assert rc == 0, (rc, err)
        c = counts(out)
        assert c == {"kern_a": 5 + 3 + 4 + 6 + 2 + 1, "kern_b": 7 + 1}, c
        assert "%d bytes" % (16 * 21) in out, out

        # ranges over both functions: lines 10..20 of a.cu (kern_a 3 + 4,
        # kern_b 7 + its EXIT), b.cu 15 alone; a.cu 20 is in two ranges and
        # counts in the first named
        rc, out, err = run([p, "--range", "front:a.cu:10-20", "--range", "mid:a.cu:20-30", "--range", "b:b.cu:1-99"])
        assert rc == 0, (rc, err)
        c = counts(out)
        assert c["front"] == 3 + 4 + 7 + 1, c
        assert c["mid"] == 2 + 1, c
        assert c["b"] == 6, c
        assert c["other"] == 5, c

        # the function filter
        rc, out, err = run([p, "--function", "kern_b", "--range", "x:a.cu:10-10"])
        assert rc == 0, (rc, err)
        c = counts(out)
        assert "kern_a" not in c and c["kern_b"] == 8 and c["x"] == 8 and c["other"] == 0, c

        # errors: exit 2 and a message naming the problem
        for args, want in [
            ([os.path.join(d, "missing.sass")], "cannot read"),
            ([p, "--range", "nofile:10-20"], "is not NAME:FILE:LO-HI"),
            ([p, "--range", "x:a.cu:30-10"], "is not NAME:FILE:LO-HI"),
            ([p, "--function", "kern_zz"], "no function name holds 'kern_zz'"),
        ]:
            rc, out, err = run(args)
            assert rc == 2 and want in err and out == "", (args, rc, out, err)
        empty = os.path.join(d, "empty.sass")
        with open(empty, "w") as f:
            f.write("not a dump\n")
        rc, out, err = run([empty])
        assert rc == 2 and "no functions" in err, (rc, err)
        noline = os.path.join(d, "noline.sass")
        with open(noline, "w") as f:
            f.write(dump([("kern_c", [(None, 4)])]))
        rc, out, err = run([noline, "--range", "x:a.cu:1-2"])
        assert rc == 2 and "no line information" in err and out == "", (rc, out, err)
        cub = os.path.join(d, "k.cubin")
        with open(cub, "wb") as f:
            f.write(b"\x7fELF" + b"\0" * 60)
        rc, out, err = run([cub, "--nvdisasm", os.path.join(d, "no-nvdisasm")])
        assert rc == 2 and "nvdisasm was not found" in err, (rc, err)
    print("py_sass_lines: ok")


if __name__ == "__main__":
    main()
