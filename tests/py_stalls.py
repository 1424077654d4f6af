#!/usr/bin/env python3
"""dev/analysis/stalls.py on Nsight Compute CSV pages written here in ncu's
layout (notes before the header, a units row): the stall reasons largest
first with shares computed here from the same numbers, the instructions with
the most samples first, and the errors for bad input (exit 2, a message
naming the problem, nothing on stdout even when the first file parsed)."""
import csv
import io
import os
import subprocess
import sys
import tempfile

SRC = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
TOOL = os.path.join(SRC, "dev", "analysis", "stalls.py")
PFX, SFX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def run(args):
    r = subprocess.run([sys.executable, TOOL] + args, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def csv_text(rows):
    b = io.StringIO()
    w = csv.writer(b, quoting=csv.QUOTE_ALL)
    for r in rows:
        w.writerow(r)
    return b.getvalue()


def main():
    reasons = {"long_scoreboard": 6.5, "no_instruction": 1.25, "wait": 2.0, "barrier": 0.0, "short_scoreboard": 0.25}
    cols = ["ID", "Kernel Name", "gpu__time_duration.sum", "sm__cycles_elapsed.max", "smsp__inst_executed.sum"]
    cols += [PFX + k + SFX for k in reasons]
    units = ["", "", "usecond", "cycle", "inst"] + ["" for _ in reasons]
    vals = ["0", "fm_route_kernel(fm_route_params)", "11.30", "22,400", "1,300"] + [str(v) for v in reasons.values()]
    raw = "==PROF== Connected to process 1\n" + csv_text([cols, units, vals])
    src_rows = [["# Address", "Source", "Warp Stall Sampling (All Samples)",
                 "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
                 "stall_long_sb", "stall_wait", "stall_long_sb (Not Issued)"]]
    samples = [3, 40, 0, 17, 120]
    for i, s in enumerate(samples):
        src_rows.append(["%04x" % (i * 16), "OP%d R1, R2 ;" % i, str(s), str(s), "1",
                         str(s - s // 4), str(s // 4), str(s)])
    src = "Kernel: fm_route_kernel\n" + csv_text(src_rows)
    tot_r, tot_s = sum(reasons.values()), sum(samples)
    with tempfile.TemporaryDirectory() as d:
        pr, ps = os.path.join(d, "raw.csv"), os.path.join(d, "src.csv")
        with open(pr, "w") as f:
            f.write(raw)
        with open(ps, "w") as f:
            f.write(src)
        rc, out, err = run([pr, ps, "--top", "3"])
        assert rc == 0, (rc, err)
        assert "fm_route_kernel" in out and "cycles (max SM) 22,400" in out, out
        assert "stall cycles per issued instruction: %.2f" % tot_r in out, out
        lines = [l.split() for l in out.splitlines() if l.split() and l.split()[0] in reasons]
        want = sorted((k for k in reasons if reasons[k] > 0), key=lambda k: -reasons[k])
        assert [l[0] for l in lines] == want, (lines, want)
        for l in lines:
            assert abs(float(l[2]) - 100 * reasons[l[0]] / tot_r) < 0.06, l
        assert "barrier" not in out, out
        assert "sampled stalls: %d over 5 instructions" % tot_s in out, out
        top = [l for l in out.splitlines() if "OP" in l]
        assert len(top) == 3, top
        assert [l.split()[3] for l in top] == ["OP4", "OP1", "OP3"], top
        assert abs(float(top[0].split()[0]) - 100 * 120 / tot_s) < 0.06, top
        # an instruction's two largest reasons, the not-issued repeats left out
        assert "(stall_long_sb 90, stall_wait 30)" in top[0], top
        assert "Not Issued" not in out, out

        # --lines: the samples per source range, the page's instructions in
        # address order being the function's (here lines 10, 10, 20, 30, 20)
        lines = [10, 10, 20, 30, 20]
        dump = ["\t.target\tsm_90a", "", "//---- .text.kern_a ----", ".text.kern_a:"]
        for i, ln in enumerate(lines):
            dump.append('\t//## File "/src/cuda/a.cu", line %d' % ln)
            dump.append("        /*%04x*/                   IADD3 R1, R1, 0x1, RZ ;" % (i * 16))
        dump += ["//---- .text.kern_b ----", ".text.kern_b:", '\t//## File "/src/cuda/a.cu", line 40',
                 "        /*0000*/                   EXIT ;"]
        pd = os.path.join(d, "k.sass")
        with open(pd, "w") as f:
            f.write("\n".join(dump) + "\n")
        # the page's rows out of address order: the tool sorts them
        shuffled = [src_rows[0]] + [src_rows[i] for i in (3, 1, 5, 2, 4)]
        for r in shuffled[1:]:
            r[0] = "0x7f00" + r[0]
        ps2 = os.path.join(d, "src2.csv")
        with open(ps2, "w") as f:
            f.write(csv_text(shuffled))
        rc, out, err = run([pr, ps2, "--lines", pd, "--function", "kern_a", "--range", "ten:a.cu:10-10",
                            "--range", "twenty:a.cu:15-25"])
        assert rc == 0, (rc, err)
        by = {l.split()[0]: float(l.split()[1]) for l in out.splitlines()
              if l.split() and l.split()[0] in ("ten", "twenty", "other")}
        want = {"ten": samples[0] + samples[1], "twenty": samples[2] + samples[4], "other": samples[3]}
        for k, v in want.items():
            assert abs(by[k] - 100 * v / tot_s) < 0.06, (k, by, out)

        # errors: exit 2, a message naming the problem, nothing on stdout
        bad = os.path.join(d, "bad.csv")
        with open(bad, "w") as f:
            f.write("no table here\n")
        for args, want in [
            ([os.path.join(d, "missing.csv")], "cannot read"),
            ([bad], "no table with a 'smsp__average_warps_issue_stalled_' column"),
            ([pr, bad], "no table with a 'Warp Stall Sampling (All Samples)' column"),
            ([pr, "--top", "0"], "--top must be at least 1"),
            ([pr, "--lines", pd, "--function", "kern_a"], "--lines needs the source page"),
            ([pr, ps2, "--lines", pd, "--function", "kern"], "2 functions of"),
            ([pr, ps2, "--lines", pd, "--function", "kern_b"], "5 instructions, the function 1"),
            ([pr, ps2, "--lines", pd, "--function", "kern_a", "--range", "x:1-2"], "is not NAME:FILE:LO-HI"),
        ]:
            rc, out, err = run(args)
            assert rc == 2 and want in err and out == "", (args, rc, out, err)
    print("py_stalls: ok")


if __name__ == "__main__":
    main()
