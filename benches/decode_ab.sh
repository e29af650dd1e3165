#!/usr/bin/env bash
# The decode forward's kernels against an older pack's, side by side, on the GPU machine, from
# the repository root, with a device pack unpacked at PACK (default /tmp/.device-pack):
#
#   [BASE_PACK=DIR] benches/decode_ab.sh OUT_DIR [BUDGET_SECONDS]
#
# 1. the decode_gpu suite;
# 2. bench_moe on the decode kernels, arms (below): "base" (BASE_PACK's kernels, when given),
#    "as_built" and "as_built" again last; Qwen3-30B-A3B at T = 1..64, Mixtral-8x7B at
#    T = 1..8 and DeepSeek-V3 at T = 1..4, JSON lines in OUT_DIR/ab/<arm>.jsonl, a
#    side-by-side table in OUT_DIR/summary.txt;
# 3. with time left, the decode table with the layer's own choice (DecodePath::Auto) at
#    T = 1..128 beside torch_moe (benches/torch_moe.py) in OUT_DIR/moe.jsonl;
# 4. with time left, ncu of the kernels at Qwen3 T = 1 (OUT_DIR/ncu.tar);
# 5. with time left, racecheck of decode_gpu.
# A variant under test is measured by building the pack twice (the base pack before the
# change) rather than by switches in the kernels.
# Each step runs only while BUDGET_SECONDS (default 500) last, so a device call's limit is
# never hit mid-write. Logs: OUT_DIR/logs.tgz.
set -u
out=${1:?usage: benches/decode_ab.sh OUT_DIR [BUDGET_SECONDS]}
budget=${2:-500}
. "$(dirname "$0")/budget.sh"
OUT=$logs/tests timeout 120 "$pack/run.sh" test decode >>"$summary" 2>&1
say "decode_gpu done"
# The arms: "base" (BASE_PACK's kernels, when given), this pack's, and this pack's again last
# on Qwen3, so drift between arms shows.
arm_list="as_built again"
two_arms="as_built"
if [ -n "${BASE_PACK:-}" ]; then
  arm_list="base $arm_list"
  two_arms="base $two_arms"
  say "base pack $(cat "$BASE_PACK/COMMIT" 2>/dev/null)"
fi
arm_pack() { case $1 in base) echo "$BASE_PACK" ;; *) echo "$pack" ;; esac; }
ab() { # MODELS TOKENS ARM...
  local models=$1 tokens=$2 name
  shift 2
  for name in "$@"; do
    mkdir -p "$logs/ab_$name"
    if [ "$(left)" -lt 40 ]; then say "skipped $models $name: out of time"; continue; fi
    timeout $(($(left) - 10)) \
      "$(arm_pack "$name")/run.sh" bench_moe --out "$logs/ab_$name" --models "$models" --tokens "$tokens" --samples 15 \
      >>"$logs/ab_$name.log" 2>&1
    say "bench_moe $models T=$tokens $name: exit $?"
  done
}
ab qwen3-30b-a3b 1,2,4,8,16,32,64 $arm_list
ab mixtral-8x7b 1,2,4,8 $two_arms
ab deepseek-v3 1,2,4 $two_arms
python3 - "$logs" $arm_list >>"$summary" <<'PY'
import json, os, sys
rows, arms = {}, sys.argv[2:]
for arm in arms:
    path = os.path.join(sys.argv[1], f"ab_{arm}", "moe.jsonl")
    if not os.path.exists(path):
        continue
    for line in open(path):
        r = json.loads(line)
        if r.get("backend") == "moefuse":
            rows.setdefault(r["case"], {})[arm] = r
cell = lambda r: "%.1f [%.1f] %.0f GB/s" % (r["median_us"], r.get("iqr_us") or 0, r.get("gbps") or 0) if r else "-"
print(("%-36s" + " %28s" * len(arms)) % ("case", *arms))
for case, v in rows.items():
    print(("%-36s" + " %28s" * len(arms)) % (case, *(cell(v.get(a)) for a in arms)))
PY
mkdir -p "$out/ab"
for arm in $arm_list; do cp "$logs/ab_$arm/moe.jsonl" "$out/ab/$arm.jsonl" 2>/dev/null; done
tokens=1,2,4,8,16,32,64,128
models=qwen3-30b-a3b,mixtral-8x7b,deepseek-v3
if [ "$(left)" -gt 150 ]; then
  mkdir -p "$logs/table"
  timeout $(($(left) - 60)) "$pack/run.sh" bench_moe --models $models --tokens $tokens --samples 20 \
    --out "$logs/table" >"$logs/table.log" 2>&1
  say "decode table: exit $?"
  # (timeout 0 would mean no limit: torch_moe runs only with 20 s or more left)
  if [ "$(left)" -gt 25 ]; then
    timeout $(($(left) - 5)) python3 benches/torch_moe.py --models $models --tokens $tokens --passes fwd \
      --samples 20 --out "$logs/table" >"$logs/torch.log" 2>&1
    say "torch_moe: exit $?"
  else
    say "torch_moe skipped: out of time"
  fi
  cp "$logs/table/moe.jsonl" "$out/moe.jsonl" 2>/dev/null
fi
# 4. with time left, Nsight Compute on the decode kernels at Qwen3-30B-A3B T = 1 (stall
#    reasons and SASS counters in OUT_DIR/ncu/<arm>/: details.txt, ncu.source.csv.xz).
if [ "$(left)" -lt 50 ]; then
  say "ncu skipped: out of time"
else
  n=$out/ncu/as_built
  mkdir -p "$n"
  OUT=$n NCU_SKIP=4 NCU_COUNT=2 \
    timeout $(($(left) - 10)) "$pack/run.sh" ncu 'decode_' bench_moe --models qwen3-30b-a3b --tokens 1 --samples 3 \
    --out "$logs/ncu_bench" >"$n/details.txt" 2>&1
  say "ncu: exit $?"
  rm -f "$n/ncu.ncu-rep"
  [ -f "$n/ncu.source.csv" ] && xz -9 "$n/ncu.source.csv"
fi
tar -cf "$out/ncu.tar" -C "$out" ncu 2>/dev/null && rm -rf "$out/ncu"
# 5. with time left, racecheck of decode_gpu (the pipelined gate_up's partials alternate
#    between two shared buffers with one barrier per unit).
if [ "$(left)" -gt 60 ]; then
  OUT=$logs/race SANITIZE_TOOLS=racecheck SANITIZE_TIMEOUT=$(($(left) - 20)) \
    "$pack/run.sh" sanitize decode >>"$summary" 2>&1
  say "racecheck: exit $?"
else
  say "racecheck skipped: out of time"
fi
cp "$logs/tests/tests.log" "$logs/tests.log" 2>/dev/null
tar -czf "$out/logs.tgz" -C "$logs" .
cat "$summary"
