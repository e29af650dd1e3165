#!/usr/bin/env bash
# moefuse device pack: runs on the GPU machine (written by `cargo xtask device-pack`).
#   run.sh test [S]    every test binary (or those whose name contains S); one line each,
#                      then "N passed, N failed, N skipped"
#   run.sh bench       every benchmark program, then the PyTorch baselines (JSON lines in $OUT)
#   run.sh torch [--filter S]  the PyTorch grouped-GEMM baseline (with lib/ in the pack:
#                      moefuse and dense cuBLAS interleaved beside it, same tensors)
#   run.sh torch_ep    only the PyTorch dispatch/combine baseline
#   run.sh all         test, then bench
#   run.sh NAME ARGS   one program from bin/ (e.g. gemm_demo 8192 8192 8192)
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/moefuse-out}
mkdir -p "$out"
logs=$(mktemp -d)
# cuBLAS (for the baselines) and NVSHMEM come from the machine's python packages.
py_libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, sys
dirs = set()
for pat in ("nvidia/*/lib/libcublas.so*", "nvidia/cu13/lib/libcublas.so*", "nvidia/nvshmem/lib/libnvshmem_host.so*"):
    for p in sys.path:
        for f in glob.glob(os.path.join(p, pat)):
            dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PY
)
export MOEFUSE_COMMIT=$(cat "$here/COMMIT" 2>/dev/null || echo unknown)
export LD_LIBRARY_PATH="${py_libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

run_tests() {
  local passed=0 failed=0 skipped=0 bad=() pat="${1:-}"
  for t in "$here"/tests/*${pat}*; do
    local name log line p f i
    name=$(basename "$t"); log="$logs/$name.log"
    "$t" --test-threads=1 >"$log" 2>&1; rc=$?
    { echo "===== $name (exit $rc)"; cat "$log"; } >>"$out/tests.log"
    line=$(grep -E "^test result:" "$log" | tail -1)
    p=$(sed -nE 's/.* ([0-9]+) passed.*/\1/p' <<<"$line"); f=$(sed -nE 's/.* ([0-9]+) failed.*/\1/p' <<<"$line")
    i=$(sed -nE 's/.* ([0-9]+) ignored.*/\1/p' <<<"$line")
    p=${p:-0}; f=${f:-0}; i=${i:-0}
    if [ $rc -ne 0 ] && [ "$f" = 0 ]; then f=1; fi
    passed=$((passed + p)); failed=$((failed + f)); skipped=$((skipped + i))
    [ "$f" != 0 ] && bad+=("$name")
    printf '%-48s %s passed, %s failed, %s skipped (exit %s)\n' "$name" "$p" "$f" "$i" "$rc"
    grep -h "^SKIPPED" "$log" | sed 's/^/    /'
  done
  echo "TOTAL: $passed passed, $failed failed, $skipped skipped"
  for b in "${bad[@]}"; do echo "--- $b";  grep -E "panicked|FAILED|failed|Error" "$logs/$b.log" | head -20; done
  [ "$failed" = 0 ]
}

run_bench() {
  local rc=0
  for b in "$here"/bin/bench_*; do
    [ -e "$b" ] || continue
    echo "== $(basename "$b")"
    "$b" --out "$out" || rc=1
  done
  run_torch || rc=1
  echo "== torch_dispatch_combine"
  PYTHONUNBUFFERED=1 python3 "$here/py/torch_dispatch_combine.py" --out "$out" || rc=1
  return $rc
}

run_torch() {
  echo "== torch_grouped_mm"
  # With the ctypes bridge in the pack, moefuse and dense cuBLAS are timed in the same
  # process, interleaved with torch on the same tensors (their rows replace bench_grouped's
  # in the report, which shows the latest row per case and backend).
  local lib=()
  [ -e "$here/lib/libmoefuse_bench_capi.so" ] && lib=(--moefuse-lib "$here/lib/libmoefuse_bench_capi.so")
  "$here/bin/bench_grouped" --list-cases "$@" >"$logs/cases.json" &&
    PYTHONUNBUFFERED=1 python3 "$here/py/torch_grouped_mm.py" --cases "$logs/cases.json" --out "$out" "${lib[@]}"
}

case "${1:-all}" in
  test) shift; run_tests "$@" ;;
  bench) run_bench ;;
  torch) shift; run_torch "$@" ;;
  torch_ep) shift; PYTHONUNBUFFERED=1 python3 "$here/py/torch_dispatch_combine.py" --out "$out" "$@" ;;
  all) run_tests; t=$?; run_bench; b=$?; [ $t = 0 ] && [ $b = 0 ] ;;
  *) "$here/bin/$1" "${@:2}" ;;
esac
