#!/usr/bin/env bash
# moefuse device pack: runs on the GPU machine (written by `cargo xtask device-pack`).
#   run.sh test [S]    every test binary (or those whose name contains S); one line each,
#                      then "N passed, N failed, N skipped"
#   run.sh bench       every benchmark program, then the PyTorch baselines (JSON lines in $OUT)
#   run.sh torch [--filter S]  the PyTorch grouped-GEMM baseline (with lib/ in the pack:
#                      moefuse and dense cuBLAS interleaved beside it, same tensors)
#   run.sh torch_ep    only the PyTorch dispatch/combine baseline
#   run.sh sanitize [S]  every GPU test binary (or those whose name contains S) under
#                      compute-sanitizer: memcheck, then racecheck and synccheck (the
#                      kernels use shared memory); one line per binary and tool, then
#                      "SANITIZE: N runs, N clean, N with errors" (SANITIZE_TOOLS,
#                      SANITIZE_TIMEOUT seconds per run, default 900; the tests' own
#                      deadlines are stretched SANITIZE_TIME_SCALE times, default 10;
#                      SANITIZE_ARGS go to each test binary, e.g. "--skip NAME")
#   run.sh ncu R P A   Nsight Compute on the kernels matching regex R while program or test
#                      P runs with arguments A (NCU_SKIP, NCU_COUNT), report under $OUT
#   run.sh all         test, then bench
#   run.sh NAME ARGS   one program from bin/ (e.g. gemm_demo 8192 8192 8192)
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/moefuse-out}
mkdir -p "$out"
logs=$(mktemp -d)
# cuBLAS (for the baselines) and NVSHMEM come from the machine's python packages.
# -I: neither the current folder nor PYTHON* variables decide what is imported or searched;
# the user site (pip install --user) is searched explicitly.
py_libs=$(python3 -I - <<'PY' 2>/dev/null
import glob, os, site, sys
dirs = set()
roots = [p for p in sys.path if os.path.isabs(p)] + [site.getusersitepackages()]
for pat in ("nvidia/*/lib/libcublas.so*", "nvidia/cu13/lib/libcublas.so*", "nvidia/nvshmem/lib/libnvshmem_host.so*",
            "nvidia/*/lib/libcurand.so*", "nvidia/*/lib/libnvrtc.so*", "nvidia/*/lib/libcudart.so*"):
    for p in roots:
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
    "$t" --test-threads=1 ${SANITIZE_ARGS:-} >"$log" 2>&1; rc=$?
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

# NOTES: NVSHMEM builds its teams on NCCL when it finds libnccl (torch's, on the H200), and
# NCCL's init fails under the sanitizer (cudaErrorNoKernelImageForDevice in
# cudaFuncGetAttributes, 24 errors in NCCL's frames, none in ours: measured 2026-12-03 with a
# 1-PE probe). The suites that bootstrap NVSHMEM run with NVSHMEM_DISABLE_NCCL=1, which
# makes NVSHMEM use its own collectives; the probe is then clean under memcheck and racecheck.
run_sanitize() {
  local pat="${1:-}" cs tools runs=0 clean=0 dirty=0 bad=()
  cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  tools=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
  echo "sanitizer: $("$cs" --version 2>&1 | tail -1)"
  # Only the binaries that run GPU work (version-test makes no CUDA call: the sanitizer
  # reports "terminated before first instrumented API call" and exits 255).
  for t in "$here"/tests/*${pat}*; do
    [ -x "$t" ] || continue
    local name extra=() env_extra=(MOEFUSE_TEST_TIME_SCALE=${SANITIZE_TIME_SCALE:-10} MOEFUSE_UNDER_SANITIZER=1)
    name=$(basename "$t")
    case "$name" in *_gpu-test) ;; *) continue ;; esac
    case "$name" in ep_*|pull_*) env_extra+=(NVSHMEM_DISABLE_NCCL=1) ;; esac
    for tool in $tools; do
      local log="$logs/$name.$tool.log" rc errs summary
      case "$tool" in
        memcheck) extra=(--leak-check no) ;;
        racecheck) extra=(--racecheck-report hazard) ;;
        *) extra=() ;;
      esac
      env "${env_extra[@]}" timeout "${SANITIZE_TIMEOUT:-900}" "$cs" --tool "$tool" \
        --error-exitcode 99 --print-limit 20 "${extra[@]}" "$t" --test-threads=1 ${SANITIZE_ARGS:-} >"$log" 2>&1
      rc=$?
      { echo "===== $name [$tool] (exit $rc)"; cat "$log"; } >>"$out/sanitize.log"
      summary=$(grep -E "(ERROR|RACECHECK) SUMMARY" "$log" | tail -1)
      errs=$(sed -nE 's/.*SUMMARY: ([0-9]+) .*/\1/p' <<<"$summary")
      runs=$((runs + 1))
      if [ "$rc" = 0 ] && [ "${errs:-0}" = 0 ] && [ -n "$summary" ]; then
        clean=$((clean + 1))
      else
        dirty=$((dirty + 1)); bad+=("$name [$tool]")
      fi
      printf '%-40s %-10s exit %-4s %s\n' "$name" "$tool" "$rc" "${summary:-no sanitizer summary (timed out or crashed)}"
      grep -h "^test result:" "$log" | tail -1 | sed 's/^/    /'
    done
  done
  echo "SANITIZE: $runs runs, $clean clean, $dirty with errors or no summary"
  for b in "${bad[@]}"; do echo "--- $b"; done
  [ "$dirty" = 0 ]
}

# Nsight Compute on one pack binary: `run.sh ncu KERNEL_REGEX PROGRAM [ARGS]` profiles the
# first NCU_COUNT (default 2) launches of kernels whose name matches the regex (after
# NCU_SKIP, default 1, warm-up launches) with the sections that say where a kernel's time
# goes (speed of light, memory workload, warp-state stalls, scheduler, source counters; or
# the NCU_SECTIONS list), writes $OUT/ncu.ncu-rep (open it in the Nsight Compute GUI) and
# $OUT/ncu.source.csv (the SASS with its counters and stall samples), prints the details page.
# PROGRAM is a test binary (tests/NAME-test, with its own arguments, e.g. --exact TEST) or a
# program of bin/.
run_ncu() {
  local regex="$1" prog="$2"; shift 2
  local ncu bin
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  if [ -x "$here/tests/$prog-test" ]; then bin="$here/tests/$prog-test"; else bin="$here/bin/$prog"; fi
  local sections=() s
  for s in ${NCU_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis WarpStateStats SchedulerStats SourceCounters \
    LaunchStats Occupancy}; do sections+=(--section "$s"); done
  # NOTES: the clocks stay as the machine runs them (the device notes ask it); NCU_FLAGS adds
  # more, e.g. "--cache-control none" for latency-bound kernels, whose cold-cache durations
  # (ncu flushes caches before each profiled launch by default) overstate their real ones.
  # shellcheck disable=SC2086
  "$ncu" --clock-control none ${NCU_FLAGS:-} --kernel-name "regex:$regex" --launch-skip "${NCU_SKIP:-1}" --launch-count "${NCU_COUNT:-2}" \
    "${sections[@]}" --export "$out/ncu" --force-overwrite "$bin" "$@" > "$out/ncu.log" 2>&1
  local rc=$?
  "$ncu" --import "$out/ncu.ncu-rep" --page details 2>/dev/null | head -400
  # Per-SASS-instruction counters (warp stall samples by reason among them), for a text-only look.
  "$ncu" --import "$out/ncu.ncu-rep" --page source --csv --print-source sass > "$out/ncu.source.csv" 2>/dev/null
  echo "ncu: exit $rc; log in \$OUT/ncu.log, report in \$OUT/ncu.ncu-rep"
  return $rc
}

case "${1:-all}" in
  test) shift; run_tests "$@" ;;
  sanitize) shift; run_sanitize "$@" ;;
  ncu) shift; run_ncu "$@" ;;
  bench) run_bench ;;
  torch) shift; run_torch "$@" ;;
  torch_ep) shift; PYTHONUNBUFFERED=1 python3 "$here/py/torch_dispatch_combine.py" --out "$out" "$@" ;;
  all) run_tests; t=$?; run_bench; b=$?; [ $t = 0 ] && [ $b = 0 ] ;;
  *) "$here/bin/$1" "${@:2}" ;;
esac
