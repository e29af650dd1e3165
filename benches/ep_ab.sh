#!/usr/bin/env bash
# The expert-parallel exchange's kernels against an older pack's, side by side, on the GPU
# machine, from the repository root, with a device pack unpacked at PACK (default
# /tmp/.device-pack) and, optionally, the pack before the change at BASE_PACK:
#
#   [BASE_PACK=DIR] benches/ep_ab.sh OUT_DIR [BUDGET_SECONDS]
#
# 1. the exchange's GPU suites (ep_gpu, ep_faults_gpu, pull_exchange_gpu, ep_layer_gpu: 1, 2
#    and 4 PEs on this GPU);
# 2. bench_ep at one PE (Qwen3-30B-A3B and DeepSeek-V3, 4096 tokens, top-8), arms "base"
#    (when given), "as_built", "base" again and "as_built" again, JSON lines in
#    OUT_DIR/ab/<arm>.jsonl and a side-by-side table in OUT_DIR/summary.txt;
# 3. with time left, ncu of count, dispatch and combine_send at one PE, the base pack's
#    first (OUT_DIR/ncu_<arm>.txt; per-SASS-line stall samples in logs.tgz).
# Every step checks BUDGET_SECONDS (default 400) first. Logs: OUT_DIR/logs.tgz.
set -u
out=${1:?usage: benches/ep_ab.sh OUT_DIR [BUDGET_SECONDS]}
budget=${2:-400}
. "$(dirname "$0")/budget.sh"
mkdir -p "$out/ab"
[ -n "${BASE_PACK:-}" ] && say "base pack $(cat "$BASE_PACK/COMMIT" 2>/dev/null)"
for suite in ep pull_exchange; do
  OUT=$logs/tests_$suite timeout 150 "$pack/run.sh" test $suite >>"$summary" 2>&1
  say "exchange suites *$suite*: exit $?"
done
arms="as_built again"
[ -n "${BASE_PACK:-}" ] && arms="base as_built base_again again"
for arm in $arms; do
  case $arm in base*) p=$BASE_PACK ;; *) p=$pack ;; esac
  if [ "$(left)" -lt 60 ]; then say "bench_ep $arm skipped: out of time"; continue; fi
  mkdir -p "$logs/$arm"
  timeout $(($(left) - 30)) "$p/run.sh" bench_ep --out "$logs/$arm" --samples 30 >"$logs/$arm.log" 2>&1
  say "bench_ep $arm: exit $?"
  cp "$logs/$arm/dispatch_combine.jsonl" "$out/ab/$arm.jsonl" 2>/dev/null
done
python3 - "$out/ab" $arms >>"$summary" <<'PY'
import json, os, sys
d, arms = sys.argv[1], sys.argv[2:]
rows = {}
for a in arms:
    path = os.path.join(d, a + ".jsonl")
    if not os.path.exists(path):
        continue
    for line in open(path):
        r = json.loads(line)
        if r.get("backend") == "moefuse":
            rows.setdefault(r["case"], {})[a] = (r["median_us"], r["iqr_us"])
print("case | " + " | ".join(arms))
for case, v in rows.items():
    print(case + " | " + " | ".join("%.1f [%.1f]" % v[a] if a in v else "-" for a in arms))
PY
# ncu of both packs' kernels (the base first, when given), each while time is left.
ncu_arms="as_built"
[ -n "${BASE_PACK:-}" ] && ncu_arms="base as_built"
for arm in $ncu_arms; do
  case $arm in base) p=$BASE_PACK ;; *) p=$pack ;; esac
  if [ "$(left)" -lt 60 ]; then say "ncu $arm skipped: out of time"; continue; fi
  OUT=$logs/ncu_$arm NCU_SKIP=2 NCU_COUNT=6 \
    NCU_SECTIONS="SpeedOfLight LaunchStats Occupancy WarpStateStats SourceCounters" \
    timeout $(($(left) - 15)) "$p/run.sh" ncu 'moefuse_ep_(count|dispatch|combine_send)' bench_ep --samples 3 \
    --out "$logs/ncu_b_$arm" >"$out/ncu_$arm.txt" 2>&1
  say "ncu $arm: exit $?"
done
tar -czf "$out/logs.tgz" -C "$logs" --exclude='*.ncu-rep' .
cat "$summary"
