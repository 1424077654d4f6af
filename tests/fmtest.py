"""Shared pieces of the Python tests (tests/py_*.py, run by ctest): the skip
convention (exit 77, which ctest reports as skipped), the paths ctest passes
in through the environment, and checks that collect failures and report
them all at the end."""
import os
import subprocess
import sys

SKIP = 77


def skip(why):
    print(f"SKIPPED: {why}")
    sys.exit(SKIP)


def env_path(var, name=None):
    """$var (a directory, or with name a file in it); skips when unset (the
    test was not started by ctest) and fails when the path does not exist
    (ctest sets it to what the build makes)."""
    d = os.environ.get(var)
    if not d:
        skip(f"{var} not set (run through ctest)")
    p = os.path.join(d, name) if name else d
    if not os.path.exists(p):
        print(f"FAIL: {p} ({var}) does not exist: build everything first")
        sys.exit(1)
    return p


def fmt_dump_quant(tool, fmt, w):
    """The library's quantization of w (float32 [R, K], a NumPy array) by
    tests/tools/fmt_dump: its status, packed, scales and scale2 lines as
    strings ("" where one is absent)."""
    words = w.astype("float32").ravel().view("uint32").tolist()
    r = subprocess.run([tool, "quant", fmt, str(w.shape[0]), str(w.shape[1])],
                       input="\n".join(f"{u:08x}" for u in words) + "\n",
                       check=True, capture_output=True, text=True).stdout
    out = dict(line.split(" ", 1) for line in r.splitlines() if " " in line)
    for k in ("status", "packed", "scales", "scale2"):
        out.setdefault(k, "")
    return out


class Checks:
    """check(cond, msg) records msg when cond is false; finish(ok) prints
    every failure and exits 1, or prints ok."""

    def __init__(self):
        self.failures = []

    def __call__(self, cond, msg):
        if not cond:
            self.failures.append(msg)
        return bool(cond)

    def finish(self, ok):
        if self.failures:
            for msg in self.failures:
                print("FAIL:", msg)
            print(f"{len(self.failures)} failure(s)")
            sys.exit(1)
        print(ok)
