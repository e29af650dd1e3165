#!/usr/bin/env bash
# The decode forward's two kernel pairs side by side, on the GPU machine, from the repository
# root, with a device pack unpacked at PACK (default /tmp/.device-pack):
#
#   benches/decode_ab.sh OUT_DIR [BUDGET_SECONDS]
#
# 1. the decode_gpu suite (every case on the tensor-core pair and, up to 512 slots, the
#    row-dot pair);
# 2. bench_moe with MOEFUSE_DECODE_KERNELS=row_dot, then tensor_core (with
#    MOEFUSE_DECODE_PREFETCH=1: the gate_up's next-unit L2 prefetch), then on Qwen3 only (the
#    one model whose units are small enough to prefetch) tensor_core with
#    MOEFUSE_DECODE_PREFETCH=0 (no prefetch) and =3 (also the down weights into L2 in the
#    gate_up's tail, "tail"), model by model
#    (Qwen3-30B-A3B at T = 1..16, Mixtral-8x7B at T = 1..8, DeepSeek-V3 at T = 1..4 when
#    time is left; the row-dot pair lost at every T up to 64 on 2026-12-07), JSON lines in OUT_DIR/ab_<arm>.jsonl, and a side-by-side table in
#    OUT_DIR/summary.txt;
# 3. with time left, the decode table with the layer's own choice (DecodeKernels::Auto) at
#    T = 1..128 beside torch_moe (benches/torch_moe.py) in OUT_DIR/moe.jsonl.
# 4. with time left, ncu of both pairs at Qwen3 T = 1 (OUT_DIR/ncu_<pair>/).
# Each step runs only while BUDGET_SECONDS (default 500) last, so a device call's limit is
# never hit mid-write. Logs: OUT_DIR/logs.tgz.
set -u
out=${1:?usage: benches/decode_ab.sh OUT_DIR [BUDGET_SECONDS]}
budget=${2:-500}
pack=${PACK:-/tmp/.device-pack}
cd "$(dirname "$0")/.."
t0=$(date +%s)
logs=$(mktemp -d)
summary=$out/summary.txt
mkdir -p "$out"
left() { echo $((budget - ($(date +%s) - t0))); }
say() { echo "[t+$(($(date +%s) - t0))s] $*" >>"$summary"; }
say "pack $(cat "$pack/COMMIT" 2>/dev/null) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
OUT=$logs/tests timeout 120 "$pack/run.sh" test decode >>"$summary" 2>&1
say "decode_gpu done"
arms="row_dot tensor_core tensor_core_no_prefetch tensor_core_tail"
ab() { # MODELS TOKENS [ARMS]
  local arm pair prefetch
  for arm in ${3:-row_dot tensor_core}; do
    # MOEFUSE_DECODE_PREFETCH: 1 the gate_up's next unit, 2 the down weights in its tail
    case $arm in
      *_no_prefetch) pair=${arm%_no_prefetch}; prefetch=0 ;;
      *_tail) pair=${arm%_tail}; prefetch=3 ;;
      *) pair=$arm; prefetch=1 ;;
    esac
    mkdir -p "$logs/ab_$arm"
    if [ "$(left)" -lt 40 ]; then say "skipped $1 $arm: out of time"; continue; fi
    MOEFUSE_DECODE_KERNELS=$pair MOEFUSE_DECODE_PREFETCH=$prefetch timeout $(($(left) - 10)) "$pack/run.sh" bench_moe \
      --out "$logs/ab_$arm" --models "$1" --tokens "$2" --samples 15 >>"$logs/ab_$arm.log" 2>&1
    say "bench_moe $1 T=$2 $arm: exit $?"
  done
}
ab qwen3-30b-a3b 1,2,4,8,16 "$arms"
ab mixtral-8x7b 1,2,4,8
ab deepseek-v3 1,2,4
python3 - "$logs" $arms >>"$summary" <<'PY'
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
for arm in $arms; do cp "$logs/ab_$arm/moe.jsonl" "$out/ab_$arm.jsonl" 2>/dev/null; done
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
# 4. with time left, Nsight Compute on both pairs at Qwen3-30B-A3B T = 1 (stall reasons and
#    SASS counters in OUT_DIR/ncu_<pair>/: details.txt, ncu.source.csv.xz).
for pair in tensor_core row_dot; do
  if [ "$(left)" -lt 50 ]; then say "ncu $pair skipped: out of time"; continue; fi
  mkdir -p "$out/ncu_$pair"
  OUT=$out/ncu_$pair MOEFUSE_DECODE_KERNELS=$pair MOEFUSE_DECODE_PREFETCH=1 NCU_SKIP=4 NCU_COUNT=2 \
    timeout $(($(left) - 10)) "$pack/run.sh" ncu 'decode_' bench_moe --models qwen3-30b-a3b --tokens 1 --samples 3 \
    --out "$logs/ncu_bench" >"$out/ncu_$pair/details.txt" 2>&1
  say "ncu $pair: exit $?"
  rm -f "$out/ncu_$pair/ncu.ncu-rep"
  [ -f "$out/ncu_$pair/ncu.source.csv" ] && xz -9 "$out/ncu_$pair/ncu.source.csv"
done
cp "$logs/tests/tests.log" "$logs/" 2>/dev/null
tar -czf "$out/logs.tgz" -C "$logs" .
cat "$summary"
