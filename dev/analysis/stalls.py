#!/usr/bin/env python3
"""Stall reasons of one kernel from Nsight Compute's CSV pages (written by
dev/gpu/stalls.sh):

  python3 dev/analysis/stalls.py RAW.csv [SOURCE.csv] [--top N]
      [--lines CUBIN_OR_DUMP --function F --range NAME:FILE:LO-HI ...]

RAW.csv is `ncu -i REP --page raw --csv` of a report holding
smsp__average_warps_issue_stalled_*_per_issue_active.ratio: prints the
kernel's duration, cycles and instructions, then each stall reason in
cycles per issued instruction and its share of the total, largest first.
SOURCE.csv is `ncu -i REP --page source --print-source sass --csv`: prints
the sampled stalls' total and the N instructions (default 20) with the most
samples, with their share and any per-reason columns the page has. With
--lines (the kernel's cubin or its `nvdisasm -g -c` dump, read as
sass_lines.py reads it) and --function (a substring of the one mangled name
profiled), the samples are also summed per source-line range, as
sass_lines.py counts instructions: the page's instructions, in address order,
are the function's. Exit 2 with a message on a missing file, a page without
the columns it needs, or a page and function of different lengths.
"""
import argparse
import csv
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sass_lines  # noqa: E402  (the dump parser and range syntax)

PFX = "smsp__average_warps_issue_stalled_"
SFX = "_per_issue_active.ratio"
ALL = "Warp Stall Sampling (All Samples)"


def fail(msg):
    print("stalls: " + msg, file=sys.stderr)
    sys.exit(2)


def read(path):
    try:
        with open(path, newline="", encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")


def num(s):
    s = (s or "").strip().replace(",", "")
    try:
        return float(s)
    except ValueError:
        return None


def table(text, need, path):
    """Rows (dicts) of the CSV whose header row holds the column `need`;
    ncu prints notes before the header."""
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        if need in ln:
            rows = list(csv.DictReader(io.StringIO("\n".join(lines[i:]))))
            if rows:
                return rows
            break
    fail(f"{path}: no table with a '{need}' column")


OUT = []


def say(line):
    """Printed only once every input has parsed: no partial output."""
    OUT.append(line)


def raw_page(path):
    rows = table(read(path), PFX, path)
    # the row after the header gives units when its first cell is empty or a unit
    data = [r for r in rows if any(num(v) is not None for k, v in r.items() if k and k.startswith(PFX))]
    if not data:
        fail(f"{path}: no kernel row with stall metrics")
    r = data[0]
    name = r.get("Kernel Name") or r.get("Function Name") or "?"
    say(f"kernel {name[:100]}")
    info = [("gpu__time_duration.sum", "duration"), ("sm__cycles_elapsed.max", "cycles (max SM)"),
            ("smsp__inst_executed.sum", "instructions (warp)")]
    say("  " + ", ".join(f"{lab} {r[k]}" for k, lab in info if k in r and num(r[k]) is not None))
    st = [(k[len(PFX):-len(SFX)], num(v)) for k, v in r.items()
          if k and k.startswith(PFX) and k.endswith(SFX) and num(v) is not None]
    tot = sum(v for _, v in st)
    say(f"  stall cycles per issued instruction: {tot:.2f}")
    for reason, v in sorted(st, key=lambda x: -x[1]):
        if v > 0:
            say(f"  {reason:<24} {v:8.2f}  {100 * v / tot if tot else 0:5.1f} %")


def source_page(path, top, lines=None, ranges=()):
    rows = table(read(path), ALL, path)
    addr = next((k for k in rows[0] if k and k.strip() in ("Address", "# Address")), None)
    src = next((k for k in rows[0] if k and k.strip() == "Source"), None)
    if src is None:
        fail(f"{path}: no 'Source' column")
    # per-reason columns of all samples; ncu repeats each for the not-issued ones
    extra = [k for k in rows[0] if k and "stall" in k.lower() and k != ALL
             and "not-issued" not in k.lower() and "not issued" not in k.lower()]
    ins = [(num(r[ALL]) or 0.0, r) for r in rows]
    tot = sum(s for s, _ in ins)
    say(f"  sampled stalls: {tot:.0f} over {len(ins)} instructions")
    if tot <= 0:
        return
    for s, r in sorted(ins, key=lambda x: -x[0])[:top]:
        why = ""
        if extra:
            parts = sorted(((num(r[k]) or 0.0, k) for k in extra), reverse=True)[:2]
            why = "  (" + ", ".join(f"{k} {v:.0f}" for v, k in parts if v > 0) + ")"
        a = (r.get(addr) or "").strip() if addr else ""
        say(f"  {100 * s / tot:5.1f} %  {a:>8}  {r[src].strip()[:70]}{why}")
    if lines is not None:
        if addr is None:
            fail(f"{path}: no 'Address' column to place the samples")
        try:
            at = sorted((int(r[addr].strip(), 16), num(r[ALL]) or 0.0) for r in rows)
        except ValueError:
            fail(f"{path}: an address that is not hexadecimal")
        if len(at) != len(lines):
            fail(f"{path}: {len(at)} instructions, the function {len(lines)}")
        sums = {name: 0.0 for name, _, _, _ in ranges}
        other = 0.0
        for (_, smp), (fl, ln) in zip(at, lines):
            for name, suffix, lo, hi in ranges:
                if fl and fl.endswith(suffix) and lo <= ln <= hi:
                    sums[name] += smp
                    break
            else:
                other += smp
        say("  samples by source range:")
        for name, _, _, _ in ranges:
            say(f"  {name:<20} {100 * sums[name] / tot:5.1f} %")
        say(f"  {'other':<20} {100 * other / tot:5.1f} %")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw")
    ap.add_argument("source", nargs="?")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--lines", help="the kernel's cubin or nvdisasm -g -c dump")
    ap.add_argument("--function", default="", help="substring of the profiled function's mangled name")
    ap.add_argument("--range", action="append", default=[], help="NAME:FILE:LO-HI")
    ap.add_argument("--nvdisasm", default=None, help="nvdisasm to run on a cubin")
    a = ap.parse_args()
    if a.top < 1:
        fail("--top must be at least 1")
    if a.lines and not a.source:
        fail("--lines needs the source page")
    ranges = [sass_lines.parse_range(r) for r in a.range]
    lines = None
    if a.lines:
        funcs = {f: v for f, v in sass_lines.parse(sass_lines.read_input(a.lines, a.nvdisasm)).items()
                 if a.function in f}
        if len(funcs) != 1:
            fail(f"{len(funcs)} functions of {a.lines} hold '{a.function}' (one is needed)")
        lines = next(iter(funcs.values()))
        if not any(fl for fl, _ in lines):
            fail(f"no line information in {a.lines}")
    raw_page(a.raw)
    if a.source:
        source_page(a.source, a.top, lines, ranges)
    print("\n".join(OUT))


if __name__ == "__main__":
    main()
