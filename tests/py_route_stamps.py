"""dev/analysis/route_stamps.py (the routing's stamps printed by a build of
dev/gpu/patches/route-stamps.patch) on a log whose medians are known, and on
broken input, which must give exit 2 and a message, not a traceback; and every
development patch of dev/gpu/patches still applies to the tree."""
import os
import subprocess
import sys
import tempfile

src = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
script = os.path.join(src, "dev", "analysis", "route_stamps.py")
sys.path.insert(0, os.path.join(src, "dev", "analysis"))
import route_stamps as rs  # noqa: E402


def stamp(T, lgwait, grouped):
    return ("STAMP T=%d k=8 lgwait %.2f lgend 7.00 selstart 3.60 selwait0 7.00 selwait1 7.40 selected 11.90 "
            "elect 12.00 grouped %.2f\n" % (T, lgwait, grouped))


def gst(T, pass1):
    return "GST T=%d wait 10 select 20 elect 30 zero 40 pass1 %d scans 60 act 70 pass2 80 end 90\n" % (T, pass1)


def sst(T, group):
    return "SST T=%d path 1 wait 100 scores 2000 pick 1500 select 3600 sync 40 group %d\n" % (T, group)


def exp(T, dnend):
    return "EXP T=%d guwait 13.50 guend 20.10 dnwait 21.00 dnend %.2f nextlg 32.00\n" % (T, dnend)


def fus(T, gusums):
    return "FUS T=%d waitmax 18.00 gusums %.2f hwaitmax 29.70 dnland 30.10\n" % (T, gusums)


def fsel(T, hdone):
    return ("FSEL T=%d routed0 11.00 routed 11.40 gusums 20.00 hdone %.2f hwait0 21.20 hwait 21.60 dnland 20.50 "
            "sumend 24.00 end 24.30 entry0 -3.00 entry 2.00 waited0 8.00 waited 8.40 scored 9.90\n" % (T, hdone))


def run(text):
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        p = subprocess.run([sys.executable, script, path], capture_output=True, text=True)
    finally:
        os.unlink(path)
    return p


def layer(T, lg_done):
    return ("LAYER T=%d lg_in0 -4.10 lg_in 0.90 lg_waited0 1.20 lg_waited 1.60 lg_done %.2f fu_in0 1.50 fu_in 4.80 "
            "fu_waited0 6.00 fu_waited 6.40 scored 7.50 routed0 9.00 routed 11.00 gusums 14.60 hdone 15.00 "
            "hwait 16.50 dnland 16.90 sumend 21.00 end 21.40\n" % (T, lg_done))


# medians per batch size, each field alone; other lines of the log ignored
log = ("timing: median of 50 graph replays\n" + stamp(1, 3.0, 13.0) + stamp(1, 5.0, 11.0) + stamp(1, 4.0, 30.0) +
       stamp(256, 13.7, 60.8) + gst(256, 500) + gst(256, 700) + sst(1, 300) + sst(1, 500) + sst(1, 100) +
       exp(1, 28.0) + exp(1, 30.0) + fus(1, 27.0) + fus(1, 28.0) + fus(1, 29.5) + fsel(1, 21.0) + fsel(1, 20.0) +
       layer(1, 5.0) + layer(1, 3.0) + layer(1, 4.0) +
       "     1        29.0   (28.8 .. 29.4)\n")
p = run(log)
assert p.returncode == 0, p.stderr
out = p.stdout
assert "STAMP T=1    n=3" in out and "lgwait 4.00" in out and "grouped 13.00" in out, out
assert "STAMP T=256  n=1" in out and "grouped 60.80" in out, out
assert "GST   T=256  n=2" in out and "pass1 600.00" in out and "end 90.00" in out, out
assert "SST   T=1    n=3" in out and "group 300.00" in out and "scores 2000.00" in out, out
assert "EXP   T=1    n=2" in out and "dnend 29.00" in out and "nextlg 32.00" in out, out
assert "FUS   T=1    n=3" in out and "gusums 28.00" in out and "dnland 30.10" in out, out
assert "FSEL  T=1    n=2" in out and "hdone 20.50" in out and "end 24.30" in out, out
assert "LAYER T=1    n=3" in out and "lg_done 4.00" in out and "lg_in0 -4.10" in out and "end 21.40" in out, out
with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
    f.write(stamp(16, 2.0, 9.0) + gst(16, 7))
try:
    rows = rs.parse(f.name)
finally:
    os.unlink(f.name)
assert sorted(rows) == [("GST", 16), ("STAMP", 16)] and rows[("STAMP", 16)][0]["lgwait"] == 2.0, rows
assert rows[("GST", 16)][0]["pass1"] == 7.0

# broken input: a message naming the problem, exit 2, no traceback
for bad, why in (("no stamps here\n", "no STAMP, GST, SST, EXP, FUS, FSEL or LAYER lines"),
                 (layer(1, 3.0).replace(" hwait 16.50", ""), "not a LAYER line"),
                 (layer(1, 3.0).replace("lg_in0", "lg_inO"), "not a LAYER line"),
                 (fsel(1, 3.0).replace(" end 24.30", ""), "not a FSEL line"),
                 (fus(1, 3.0).replace("gusums", "gusum"), "not a FUS line"),
                 (sst(1, 5).replace("pick", "pik"), "not a SST line"),
                 (exp(4, 9.0).replace(" nextlg 32.00", ""), "not a EXP line"),
                 ("STAMP T=4 k=8 lgwait 1.0\n", "not a STAMP line"),
                 ("STAMP T=x k=8 " + stamp(4, 1, 2)[14:], "not a STAMP line"),
                 (gst(64, 5).replace("pass1", "passX"), "not a GST line"),
                 (stamp(4, 1.0, 2.0).replace("12.00", "twelve"), "not a STAMP line")):
    p = run(bad)
    assert p.returncode == 2, (bad, p.returncode, p.stdout)
    assert why in p.stderr and "Traceback" not in p.stderr, (bad, p.stderr)
p = subprocess.run([sys.executable, script], capture_output=True, text=True)
assert p.returncode == 2 and "usage" in p.stderr
p = subprocess.run([sys.executable, script, "/nonexistent/route.log"], capture_output=True, text=True)
assert p.returncode == 2 and "route_stamps:" in p.stderr and "Traceback" not in p.stderr

# every development patch applies to this tree, each alone (a source change
# that breaks one shows here, not on the GPU machine)
git = subprocess.run(["git", "-C", src, "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
if git.returncode == 0 and git.stdout.strip() == "true":
    pdir = os.path.join(src, "dev", "gpu", "patches")
    patches = sorted(f for f in os.listdir(pdir) if f.endswith(".patch"))
    assert "route-stamps.patch" in patches, patches
    for name in patches:
        p = subprocess.run(["git", "-C", src, "apply", "--check", os.path.join(pdir, name)], capture_output=True,
                           text=True)
        assert p.returncode == 0, (name, p.stderr)
else:
    print("patch check skipped: the source is not a git work tree")
print("py_route_stamps: OK")
