#!/usr/bin/env bash
# fp4moe trace: the CLI contract (help, CSV columns, diff, -o) and, for every
# kind of malformed input, a clear error naming the file (and the byte
# offset for JSON errors), a non-zero exit, nothing on stdout, no -o file.
set -u
CLI=${FM_CLI:?}
DATA=${FM_TEST_DATA:?}/traces
command -v gzip >/dev/null || { echo "SKIPPED: gzip not found"; exit 77; }
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }

A=$DATA/decode-TP-0.trace.json
B=$DATA/decode-TP-1.trace.json

"$CLI" trace --help >"$T/h" 2>&1 || bad "trace --help exit"
grep -q "summary" "$T/h" && grep -q "diff" "$T/h" && grep -q -- "--steps" "$T/h" || bad "trace --help text"
"$CLI" trace summary --help >"$T/h" 2>&1 || bad "trace summary --help exit"
grep -q "name,category,count,total_us,mean_us,p50_us,p90_us,p99_us,max_us" "$T/h" || bad "summary --help lacks the CSV columns"

"$CLI" trace summary "$A" >"$T/out" 2>"$T/err" || bad "summary exit: $(cat "$T/err")"
grep -q "ProfilerStep#N CPU spans" "$T/out" || bad "summary: step method"
grep -q "^attention " "$T/out" || bad "summary: attention row"
grep -q "uncategorized kernels" "$T/out" || bad "summary: uncategorized list"

"$CLI" trace summary "$A" "$B" --format csv >"$T/csv" || bad "csv exit"
[ "$(head -1 "$T/csv")" = "name,category,count,total_us,mean_us,p50_us,p90_us,p99_us,max_us" ] || bad "csv header: $(head -1 "$T/csv")"
# fused_moe_kernel: 61.25 and 40.5 us per layer, 3 layers x 2 steps x 2 ranks
grep -q '^fused_moe_kernel,moe_gemm,24,1221.000,50.875,50.875,61.250,61.250,61.250$' "$T/csv" || bad "csv fused_moe row: $(grep ^fused "$T/csv")"

"$CLI" trace diff "$A" "$B" --format csv >"$T/d" || bad "diff exit"
[ "$(head -1 "$T/d")" = "category,a_ms_per_step,b_ms_per_step,delta_ms,share_of_delta" ] || bad "diff header"
# attention per step: A (40+45.5+300.25, 42+610+41), B (same, 42+980+41) us;
# everything else is 3 x 126.35 + 3 x 30.5 + 2 = 472.55 us per step in both
grep -q '^attention,0.5394,0.7244,0.1850,1.0000$' "$T/d" || bad "diff attention row: $(grep ^attention "$T/d")"
grep -q '^total,1.0119,1.1969,0.1850,1.0000$' "$T/d" || bad "diff total row: $(tail -1 "$T/d")"
"$CLI" trace diff "$A" >/dev/null 2>&1 && bad "diff with one file accepted"

# gzip input and -o
gzip -c "$A" >"$T/a-TP-0.trace.json.gz"
"$CLI" trace summary "$T/a-TP-0.trace.json.gz" --format json -o "$T/s.json" || bad "gzip + -o"
python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$T/s.json" 2>/dev/null || [ ! -x "$(command -v python3)" ] || bad "-o json not valid"
"$CLI" trace summary "$A" --format html -o "$T/s.html" && grep -q "<svg" "$T/s.html" || bad "html"
"$CLI" trace summary "$A" --bogus >/dev/null 2>&1; [ $? -eq 2 ] || bad "unknown option exit code"
"$CLI" trace summary "$A" --steps marker:fused_moe_kernel >"$T/m" || bad "marker steps"
grep -q "between consecutive kernels matching" "$T/m" || bad "marker method"

# malformed inputs: name, expected message fragment
mk() { printf '%s' "$2" >"$T/$1"; }
head -c 3000 "$A" >"$T/truncated.json"
gzip -c "$A" | head -c 700 >"$T/truncated.json.gz"
sed 's/"dur": 3.1,/"dur": "abc",/' "$A" >"$T/wrongtype.json"
sed '0,/"dur": 9.8,/s/"dur": 9.8,//' "$A" >"$T/missing.json"
sed '0,/"dur": 9.8,/s/"dur": 9.8,/"dur": NaN,/' "$A" >"$T/nan.json"
mk nontrace.json '{"model": "x", "layers": [1, 2]}'
mk empty.json ''
mk array.json '[1, 2, 3]'
printf '\x1f\x8b\x08\x00garbage' >"$T/garbage.json.gz"
for c in "truncated.json:truncated" "truncated.json.gz:gzip" "wrongtype.json:not a finite number" \
         "missing.json:has no \"dur\"" "nan.json:NaN" "nontrace.json:no \"traceEvents\"" \
         "empty.json:empty file" "array.json:not an object" "garbage.json.gz:gzip"; do
  f=${c%%:*}; want=${c#*:}
  rm -f "$T/o.csv"
  "$CLI" trace summary "$T/$f" --format csv -o "$T/o.csv" >"$T/out" 2>"$T/err"
  rc=$?
  [ $rc -ne 0 ] || bad "$f: exit 0"
  [ -s "$T/out" ] && bad "$f: something on stdout"
  [ -e "$T/o.csv" ] && bad "$f: -o file written"
  grep -q "$f" "$T/err" || bad "$f: error does not name the file: $(cat "$T/err")"
  grep -qF "$want" "$T/err" || bad "$f: error lacks '$want': $(cat "$T/err")"
  case $f in *.json) grep -q "byte [0-9]" "$T/err" || [ "$f" = empty.json ] || [ "$f" = nontrace.json ] || bad "$f: no byte offset: $(cat "$T/err")";; esac
  # the same file among good ones: still nothing printed
  "$CLI" trace summary "$A" "$T/$f" >"$T/out" 2>/dev/null && bad "$f: accepted among good files"
  [ -s "$T/out" ] && bad "$f: partial output next to a good file"
done

[ $fail -eq 0 ] && echo "sh_trace_cli: all checks passed"
exit $fail
