#!/usr/bin/env bash
# The MoE layer's tables of docs/benchmarks.md in one device call, on the GPU machine, from
# the repository root, with a device pack unpacked at PACK (default /tmp/.device-pack):
#
#   benches/moe_tables.sh OUT_DIR [BUDGET_SECONDS] [TEST_FILTER...]
#
# 1. the pack's test binaries whose names hold each TEST_FILTER (none by default; e.g.
#    `layer moe_kernels fused`), logs in OUT_DIR/logs.tgz;
# 2. the T = 8192 table: bench_moe on Qwen3-30B-A3B, GPT-OSS-120B, Mixtral-8x7B and
#    DeepSeek-V3 with --profile (the stage profiles go to OUT_DIR/profile.txt), then
#    benches/torch_moe.py (forward and backward) on the same models;
# 3. with time left, the decode table: bench_moe at T = 1..128 on Qwen3-30B-A3B,
#    Mixtral-8x7B and DeepSeek-V3, then torch_moe.py (forward).
# Both benches append to OUT_DIR/moe.jsonl; copy its rows into benches/results/moe.jsonl
# and run `cargo xtask bench-report`. Every step checks BUDGET_SECONDS (default 540) first.
set -u
out=${1:?usage: benches/moe_tables.sh OUT_DIR [BUDGET_SECONDS] [TEST_FILTER...]}
budget=${2:-540}
shift $(($# >= 2 ? 2 : 1))
. "$(dirname "$0")/budget.sh"
mkdir -p "$logs/b"
for filter in "$@"; do
  if [ "$(left)" -lt 200 ]; then say "tests $filter skipped: out of time"; continue; fi
  OUT=$logs/t_$filter timeout 150 "$pack/run.sh" test "$filter" >>"$summary" 2>&1
  say "tests $filter done"
done
# (a timeout of 0 would be none: each step runs only with its margin left)
step() { # MARGIN NAME COMMAND...
  local margin=$1 name=$2
  shift 2
  if [ "$(left)" -le $((margin + 20)) ]; then say "$name skipped: out of time"; return; fi
  timeout $(($(left) - margin)) "$@" >"$logs/$name.log" 2>&1
  say "$name: exit $?"
}
big=qwen3-30b-a3b,gpt-oss-120b,mixtral-8x7b,deepseek-v3
step 120 bench_8192 "$pack/run.sh" bench_moe --models $big --tokens 8192 --samples 10 --profile --out "$logs/b"
step 90 torch_8192 python3 benches/torch_moe.py --models $big --tokens 8192 --passes fwd,bwd --samples 20 --out "$logs/b"
small=qwen3-30b-a3b,mixtral-8x7b,deepseek-v3
tokens=1,2,4,8,16,32,64,128
step 40 bench_decode "$pack/run.sh" bench_moe --models $small --tokens $tokens --samples 20 --out "$logs/b"
step 5 torch_decode python3 benches/torch_moe.py --models $small --tokens $tokens --passes fwd --samples 20 --out "$logs/b"
cp "$logs/b/moe.jsonl" "$out/moe.jsonl" 2>/dev/null
cp "$logs/bench_8192.log" "$out/profile.txt" 2>/dev/null
tar -czf "$out/logs.tgz" -C "$logs" .
cat "$summary"
