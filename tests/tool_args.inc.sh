# Sourced by the tests/sh_*_args.sh scripts: the checks they share for a
# measurement tool's bad arguments. Before sourcing, set BIN (the tool) and,
# optionally, ARGS_PRE (arguments put before each case, e.g. an output file
# that must not be left behind: set LEFT to its path) and ARGS_TIMEOUT.
#   bad 'expected message' ARGS...   exit 2, the message on stderr, nothing
#                                    on stdout, LEFT not created, no
#                                    sanitizer report
#   finish NAME                      the summary line and the exit status
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
