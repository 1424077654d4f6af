#!/usr/bin/env python3
"""dev/gpu/logits_peer.py's argument checks, which run before torch is
imported: a batch size out of range, a list that is not integers and a
non-positive shape are exit 2 with a message naming the argument; good
arguments without torch or a GPU are a SKIPPED line and exit 77."""
import os
import subprocess
import sys

SRC = os.environ.get("FM_SOURCE_DIR", os.path.join(os.path.dirname(__file__), ".."))
TOOL = os.path.join(SRC, "dev", "gpu", "logits_peer.py")


def run(args):
    r = subprocess.run([sys.executable, TOOL] + args, capture_output=True, text=True)
    return r.returncode, r.stdout, r.stderr


def main():
    for args, want in [(["--batch", "0"], "--batch '0': sizes are 1 .. 65536"),
                       (["--batch", "1,x"], "--batch '1,x': not a list of integers"),
                       (["--batch", ""], "not a list of integers"),
                       (["--E", "-1"], "argument --E: -1 is not a positive integer"),
                       (["--layers", "0"], "argument --layers: 0 is not a positive integer")]:
        rc, out, err = run(args)
        assert rc == 2, (args, rc, out, err)
        assert want in err, (args, err)
        assert out == "", (args, out)
    rc, out, err = run(["--E", "16", "--H", "64", "--batch", "1,2", "--layers", "1", "--reps", "1"])
    if rc == 77:
        assert out.startswith("SKIPPED: "), out
    else:  # torch and a GPU here: a row per batch size
        assert rc == 0, (rc, out, err)
        rows = [l.split() for l in out.splitlines() if l.split() and l.split()[0].isdigit()]
        assert [r[0] for r in rows] == ["1", "2"], out
    print("py_logits_peer: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
