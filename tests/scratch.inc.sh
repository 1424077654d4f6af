# Sourced by the shell tests that run development scripts in a scratch tree
# (tests/sh_gpu_*.sh): SRC (the source tree), T (a scratch directory named
# after SCRATCH_NAME, removed on exit), fail MESSAGE (counts a failure) and
# done_checks NAME (the summary line and the exit status).
SRC=${FM_SOURCE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
T=$(mktemp -d "/tmp/fm_${SCRATCH_NAME:-scratch}.XXXXXX")
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
done_checks() {
    if [ "$fails" -gt 0 ]; then echo "$fails failure(s)"; exit 1; fi
    echo "$1: all checks passed"
    exit 0
}
