# Sourced by the tests/sh_*_args.sh scripts: the checks they share for a
# measurement tool's bad arguments. Before sourcing, set BIN (the tool) and,
# optionally, ARGS_PRE (arguments put before each case, e.g. an output file
# that must not be left behind: set LEFT to its path) and ARGS_TIMEOUT.
#   bad 'expected message' ARGS...   exit 2, the message on stderr, nothing
#                                    on stdout, LEFT not created, no
#                                    sanitizer report
#   finish NAME                      the summary line and the exit status
# A CUDA tool's script sources this with CUDA_TOOL=NAME set instead of BIN:
# BIN becomes that dev tool, and the script is skipped (exit 77) where the
# CUDA backend is not built (FM_CUDA off or no nvcc).
if [ -n "${CUDA_TOOL:-}" ]; then
    BIN="${FM_DEV_TOOLS_DIR:-}/$CUDA_TOOL"
    if [ "${FM_HAVE_CUDA:-}" = 0 ]; then echo "SKIPPED: $CUDA_TOOL: the CUDA backend is not built (FM_CUDA off or no nvcc)"; exit 77; fi
    if [ ! -x "$BIN" ]; then echo "FAIL: $BIN not built (run through ctest after a full build)"; exit 1; fi
fi
T=$(mktemp -d /tmp/fm_sh_args.XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

bad() {
    local want=$1; shift
    # shellcheck disable=SC2086  # ARGS_PRE is split into words on purpose
    timeout "${ARGS_TIMEOUT:-20}" "$BIN" ${ARGS_PRE:-} "$@" >"$T/out" 2>"$T/err"
    local rc=$?
    [ "$rc" = 2 ] || fail "$*: exit $rc, expected 2"
    grep -qF -- "$want" "$T/err" || fail "$*: expected '$want' on stderr, got: $(cat "$T/err")"
    [ -z "${LEFT:-}" ] || [ ! -e "$LEFT" ] || fail "$*: left $LEFT behind"
    [ ! -s "$T/out" ] || fail "$*: wrote to stdout: $(cat "$T/out")"
    ! grep -q "AddressSanitizer\|runtime error" "$T/err" || fail "$*: sanitizer report"
}

finish() {
    if [ "$fails" -gt 0 ]; then echo "$fails failure(s)"; exit 1; fi
    echo "$1 argument checks: all passed"
    exit 0
}
