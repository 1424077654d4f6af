"""dev/analysis/fp4_decode_bound.py: its search finds no cover shorter than
the kernels' 8 integer instructions per word for the BF16 bit positions the
decode needs, and, so that "no cover" means something, it does find covers
where they exist (contiguous or evenly spaced masks that shifts tile), and
its cover of the kernels' own layout is exact: the kernels' three shifted
outputs (w & M, rotates by 3 and 6) are candidates it knows."""
import os
import subprocess
import sys

src = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
script = os.path.join(src, "dev", "analysis", "fp4_decode_bound.py")
sys.path.insert(0, os.path.join(src, "dev", "analysis"))
import fp4_decode_bound as fb  # noqa: E402

r = subprocess.run([sys.executable, script], capture_output=True, text=True)
assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
assert r.stdout.count("no cover") == 4, r.stdout
assert "shorter than 8 integer instructions per word: no" in r.stdout, r.stdout

# the candidates include what decode8 runs: rotates by 3 and 6 of one word
cands = {frozenset(bits) for bits, _ in fb.candidates(1)}
rot = lambda s: frozenset((p + s) % 32 for p in fb.M)  # noqa: E731
assert rot(3) in cands and rot(6) in cands and rot(0) in cands
# the kernels' fourth output ((w & 0x001B001B) * 0x4108) & M takes the
# bits the three rotates leave, and those are no 2-instruction candidate
rest = frozenset(range(32)) - rot(0) - rot(3) - rot(6)
assert rest == frozenset({0, 1, 3, 4, 16, 17, 19, 20}) and rest not in cands

# where a cover exists the search finds it
try:
    fb.M = (0, 1, 2, 3, 4, 5, 6, 7)
    c = fb.cover(1, (0,))
    assert c is not None and len(c) == 3, c
    fb.M = (0, 1, 2, 3, 16, 17, 18, 19)
    c = fb.cover(1, ())
    assert c is not None and len(c) == 4, c
finally:
    fb.M = (6, 7, 8, 15, 22, 23, 24, 31)
print("fp4_decode_bound: no shorter decode; the search finds covers where they exist")
