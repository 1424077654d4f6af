"""dev/analysis/power_plateaus.py (the plateaus of a dev/gpu/power.sh run) on
a synthetic run whose powers are known: the settled part of each phase (from
one second after its start), the line fitted to the unthrottled pure reads,
a layer's watts beyond a pure read at its rate; and on broken input, which
must give exit 2 and a message, not a traceback."""
import datetime
import os
import re
import subprocess
import sys
import tempfile

src = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
script = os.path.join(src, "dev", "analysis", "power_plateaus.py")
T0 = datetime.datetime(2026, 11, 30, 8, 0, 0)


def at(s, nano=False):
    t = T0 + datetime.timedelta(seconds=s)
    return t.strftime("%Y/%m/%d %H:%M:%S.%f") + ("000" if nano else "")


def run(d, env=None):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, script, d], capture_output=True, text=True, env=e)


# phases (start s, end s, watts, SM MHz, throttle bits): the reads draw
# 140 W + 120 W per TB/s; nvidia-smi's one-second average is modelled by a
# linear ramp over the first second of each phase, which the script skips
READS = [(2480.0, 3.0, 7.0), (3480.0, 7.0, 11.0), (4090.0, 11.0, 15.0)]
PHASES = [(0.0, 3.0, 80.0, 345, 1)]
for gbs, a, b in READS:
    PHASES.append((a, b, 140.0 + 0.12 * gbs, 1980, 0))
PHASES += [(15.0, 19.0, 700.0, 1900, 4), (19.0, 25.0, 695.0, 1650, 4)]


def watts(t):
    prev = 80.0
    for a, b, w, _, _ in PHASES:
        if a <= t < b:
            return prev + (w - prev) * min(1.0, t - a)  # a one-second ramp
        prev = w
    return 80.0


with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "power_smi.csv"), "w") as f:
        t = 0.0
        while t < 26.0:
            ph = [p for p in PHASES if p[0] <= t < p[1]]
            mhz, thr = (ph[0][3], ph[0][4]) if ph else (345, 1)
            f.write(f"{at(t)[:-3]}, {watts(t):.2f} W, 700.00 W, {mhz} MHz, 3201 MHz, 0x{thr:016x}\n")
            t += 0.05
        f.write("garbage line\n")
    with open(os.path.join(d, "power_marks.txt"), "w") as f:
        for s, n in [(0.5, "idle start"), (2.9, "idle end"), (15.0, "probe start"), (19.0, "probe end"),
                     (19.0, "layer 16 start"), (25.0, "layer 16 end")]:
            f.write(f"{at(s, True)} {n}\n")
    with open(os.path.join(d, "power_readpat1.txt"), "w") as f:
        f.write(f"{at(3.0, True)} variant                grid   us/layer     GB/s     % bw  check\n")
        for i, (gbs, a, b) in enumerate(READS):
            f.write(f"{at(b, True)} rg 4w d{i + 1}                192      22.83     {gbs:.0f}     53.9     ok\n")
    with open(os.path.join(d, "power_probe.txt"), "w") as f:
        f.write(f"{at(15.0, True)} kernel       blocks  threads       GB/s   vs gs4 xor\n")
        for s, k in [(16.3, "gs4"), (17.6, "gs8"), (19.0, "gs4_1w")]:
            f.write(f"{at(s, True)} {k}            1056      512     4546.0    1.000 ok\n")
    with open(os.path.join(d, "power_bench_16.txt"), "w") as f:
        f.write(" batch    us/layer          (min .. max)    tokens/s   active   MB/layer     GB/s     %bw\n")
        f.write("    16       334.3      (330.1 .. 340.0)       47860     81.2    1162.54  3478.00   76.6%\n")
    r = run(d)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    m = re.search(r"pure reads without a power cap: (\d+) W \+ (\d+) W per TB/s \((\d+) points\)", out)
    assert m, out
    assert abs(int(m.group(1)) - 140) <= 2 and abs(int(m.group(2)) - 120) <= 2 and m.group(3) == "3", out
    # each read plateau is its level, unaffected by the ramp it follows
    for gbs, _, _ in READS:
        row = [l for l in out.splitlines() if l.startswith("read rg") and f" {gbs:.0f} " in l]
        assert row and abs(float(row[0].split()[6]) - (140 + 0.12 * gbs)) < 1.5, (gbs, row)
    probe = [l for l in out.splitlines() if l.startswith("read: bandwidth probe")]
    assert probe and " 700 " in probe[0] and "100 %" in probe[0], probe
    layer = [l for l in out.splitlines() if l.strip().startswith("16 ")]
    assert layer, out
    f = layer[0].split()
    # 695 W at 3478 GB/s: a pure read there draws 140 + 417 = 557 W, the rest 138 W
    assert f[4] == "695" and abs(float(f[8]) - 557) <= 2 and abs(float(f[10]) - 138) <= 2, layer

    # broken input: a message and exit 2, no traceback
    for env, what in [({"POWER_SUSTAIN_MS": "soon"}, "POWER_SUSTAIN_MS")]:
        r = run(d, env)
        assert r.returncode == 2 and what in r.stderr and "Traceback" not in r.stderr, r.stderr
    os.remove(os.path.join(d, "power_marks.txt"))
    r = run(d)
    assert r.returncode == 2 and "power_marks.txt" in r.stderr and "Traceback" not in r.stderr, r.stderr
    with open(os.path.join(d, "power_smi.csv"), "w") as f:
        f.write("not, a, csv\n")
    r = run(d)
    assert r.returncode == 2 and "no samples" in r.stderr and "Traceback" not in r.stderr, r.stderr
r = run("/nonexistent/dir")
assert r.returncode == 2 and "not a directory" in r.stderr, r.stderr
print("power_plateaus: plateaus, the fitted line, the layer's rest and the bad inputs as expected")
