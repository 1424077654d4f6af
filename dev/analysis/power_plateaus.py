#!/usr/bin/env python3
"""Power plateaus of a dev/gpu/power.sh run.

    python3 dev/analysis/power_plateaus.py OUT_DIR

Reads OUT_DIR/power_smi.csv (nvidia-smi every 50 ms: timestamp, power.draw,
power.limit, clocks.sm, clocks.mem, throttle reasons), power_marks.txt (the
script's phase marks), the stamped output lines of cuda_readpat and
cuda_bwprobe (a line's stamp ends its variant's window) and the layer's
`fp4moe bench` outputs, and prints one row per phase:

  - nvidia-smi's power.draw is an average over the last second, so a phase
    is averaged over its samples from 1 s after its start to 0.1 s before
    its end (phases shorter than 1.5 s are left out);
  - the pure reads (cuda_readpat's variants, the bandwidth probe's first
    three kernels) that ran unthrottled give a least-squares line of power
    against bandwidth; each layer row then shows what a pure read at the
    layer's bandwidth would draw by that line, and the rest: what the
    decode, the MMAs and the routing add on top of moving the bytes.
"""
import datetime
import glob
import os
import re
import sys

LAG_S = 1.0  # power.draw averages the last second
MIN_S = 1.5


def ts(text):
    """Seconds since the epoch of 'YYYY/MM/DD HH:MM:SS.fff...' (local time)."""
    text = text.strip()
    day, clock = text.split()[:2]
    whole, _, frac = clock.partition(".")
    t = datetime.datetime.strptime(day + " " + whole, "%Y/%m/%d %H:%M:%S").timestamp()
    return t + (float("0." + frac) if frac else 0.0)


def fail(msg):
    print(f"power_plateaus: {msg}", file=sys.stderr)
    sys.exit(2)


def opened(path):
    try:
        return open(path, errors="replace")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")


def read_samples(path):
    rows = []
    with opened(path) as f:
        for line in f:
            parts = [p.strip() for p in line.split(",")]
            if len(parts) < 6:
                continue
            try:
                t = ts(parts[0])
                watts = float(parts[1].split()[0])
                limit = float(parts[2].split()[0])
                sm = float(parts[3].split()[0])
                thr = int(parts[5], 16)
            except (ValueError, IndexError):
                continue
            rows.append((t, watts, limit, sm, thr))
    if not rows:
        fail(f"no samples in {path} (nvidia-smi's csv: timestamp, power.draw, power.limit, clocks.sm, "
             "clocks.mem, throttle reasons)")
    return rows


def stamped_lines(path):
    out = []
    if not os.path.exists(path):
        return out
    with opened(path) as f:
        for line in f:
            m = re.match(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) (.*)$", line.rstrip("\n"))
            if m:
                try:
                    out.append((ts(m.group(1)), m.group(2)))
                except ValueError:
                    continue
    return out


def plateau(samples, t0, t1):
    """Mean power, max power, mean SM clock and the share of samples with a
    power throttle reason, over [t0 + LAG_S, t1]; None if too short."""
    if t1 - t0 < MIN_S:
        return None
    sel = [s for s in samples if t0 + LAG_S <= s[0] <= t1 - 0.1]
    if not sel:
        return None
    n = len(sel)
    capped = sum(1 for s in sel if s[4] & 0x84) / n  # sw power cap | hw power brake
    return (sum(s[1] for s in sel) / n, max(s[1] for s in sel), sum(s[3] for s in sel) / n, capped, sel[0][2])


def main():
    if len(sys.argv) != 2:
        print("usage: power_plateaus.py OUT_DIR", file=sys.stderr)
        return 2
    out = sys.argv[1]
    if not os.path.isdir(out):
        fail(f"{out} is not a directory")
    samples = read_samples(os.path.join(out, "power_smi.csv"))
    marks = {}
    with opened(os.path.join(out, "power_marks.txt")) as f:
        for line in f:
            parts = line.split(None, 2)
            if len(parts) == 3:
                try:
                    marks[parts[2].strip()] = ts(parts[0] + " " + parts[1])
                except ValueError:
                    continue

    rows = []  # (name, GB/s or None, plateau)
    if "idle start" in marks and "idle end" in marks:
        p = plateau(samples, marks["idle start"] - LAG_S, marks["idle end"])
        rows.append(("clocks idle", None, p))

    # cuda_readpat: a variant's window runs from the previous line's stamp
    # (the table header for the first) to its own
    for name in sorted(glob.glob(os.path.join(out, "power_readpat*.txt"))):
        prev = None
        for t, line in stamped_lines(name):
            if line.startswith("variant"):
                prev = t
                continue
            f = line.split()
            if prev is not None and len(f) >= 6 and f[-1] in ("ok", "BAD"):
                try:
                    gbs = float(f[-3])
                except ValueError:
                    continue
                label = "read " + " ".join(f[:-5]) + f" ({os.path.basename(name)[6:-4]})"
                rows.append((label, gbs, plateau(samples, prev, t)))
                prev = t

    # the bandwidth probe: its first three kernels read at the full rate
    lines = stamped_lines(os.path.join(out, "power_probe.txt"))
    start = next((t for t, l in lines if l.startswith("kernel")), None)
    full = [(t, l.split()) for t, l in lines if re.match(r"^(gs4|gs8|gs4_1w) ", l)]
    if start is not None and len(full) == 3:
        gbs = min(float(f[3]) for _, f in full)
        rows.append(("read: bandwidth probe (gs4, gs8, gs4_1w)", gbs, plateau(samples, start, full[-1][0])))

    reads = [(g, p) for n, g, p in rows if g is not None and p is not None and p[3] < 0.05]
    fit = None
    if len(reads) >= 3:
        n = len(reads)
        mx = sum(g for g, _ in reads) / n
        my = sum(p[0] for _, p in reads) / n
        sxx = sum((g - mx) ** 2 for g, _ in reads)
        if sxx > 0:
            b = sum((g - mx) * (p[0] - my) for g, p in reads) / sxx
            fit = (my - b * mx, b)  # watts, watts per GB/s

    try:
        sustain_s = float(os.environ.get("POWER_SUSTAIN_MS", "4000")) / 1000.0
    except ValueError:
        fail("POWER_SUSTAIN_MS is not a number")
    benches = []
    for name in glob.glob(os.path.join(out, "power_bench_*.txt")):
        m = re.match(r"^power_bench_(\d+)\.txt$", os.path.basename(name))
        if m:
            benches.append((int(m.group(1)), name))
    layers = []
    for b, name in sorted(benches):
        us = gbs = pct = None
        with opened(name) as f:
            for line in f:
                f_ = line.split()
                if len(f_) > 6 and f_[0] == str(b) and re.match(r"^[0-9.]+$", f_[1]):
                    us = float(f_[1])
                    nums = [x for x in f_ if re.match(r"^[0-9.]+%$", x)]
                    pct = float(nums[0][:-1]) if nums else None
                    flt = [x for x in f_[2:] if re.match(r"^[0-9.]+$", x)]
                    gbs = float(flt[-1]) if flt else None
        t1 = marks.get(f"layer {b} end")
        p = plateau(samples, t1 - sustain_s, t1) if t1 else None
        layers.append((b, us, gbs, pct, p))

    print("phase                                      GB/s   power W (max)   SM MHz   power-capped")
    for name, gbs, p in rows:
        g = f"{gbs:6.0f}" if gbs is not None else "     -"
        if p is None:
            print(f"{name:40s} {g}   (shorter than {MIN_S} s)")
        else:
            print(f"{name:40s} {g}   {p[0]:5.0f} ({p[1]:4.0f})    {p[2]:5.0f}   {100 * p[3]:4.0f} %")
    lim = samples[-1][2]
    if fit:
        print(f"\npure reads without a power cap: {fit[0]:.0f} W + {1000 * fit[1]:.0f} W per TB/s "
              f"({len(reads)} points); the limit is {lim:.0f} W")
    if layers:
        print("\n    B       us     GB/s   % bw   power W   SM MHz   capped   a pure read at that rate   the rest")
        for b, us, gbs, pct, p in layers:
            if p is None or gbs is None:
                print(f"{b:5d}   no settled window")
                continue
            pr = fit[0] + fit[1] * gbs if fit else float("nan")
            print(f"{b:5d} {us:8.1f} {gbs:8.0f} {pct if pct is not None else float('nan'):6.1f}   {p[0]:7.0f}  "
                  f"{p[2]:7.0f}   {100 * p[3]:4.0f} %   {pr:22.0f} W   {p[0] - pr:6.0f} W")


if __name__ == "__main__":
    sys.exit(main())
