#!/usr/bin/env bash
# The multi-GPU issue's runs in one device call, on an nvidia-h200-x2/x4/x8 machine, from the
# repository root after `cargo xtask device-pack`:
#
#   device run (kind nvidia-h200-xN), carry [".device-pack"], command "benches/multi_gpu.sh"
#
# 1. correctness: the comm GPU tests with ranks spread over the GPUs (dispatch -> combine round
#    trips of 7 routings x 3 seeds at 2 and 4 PEs against the host model, teams, stream ops);
# 2. dispatch/combine GB/s per GPU at 2, 4, 8 PEs (NVLink), Qwen3-30B-A3B and DeepSeek-V3
#    shapes, 4096 tokens per rank, written to $OUT/dispatch_combine.jsonl;
# 3. the expert-parallel layer: its GPU test (forward and backward against the CPU reference
#    at 1, 2 and 4 ranks, ranks spread over the GPUs), then its forward and backward at
#    EP = 2, 4, 8, Qwen3-30B-A3B, 8192 tokens per rank, written to $OUT/moe_ep.jsonl
#    (`moefuse_ep` rows; at EP = 1 the single-GPU layer).
# Every JSON line of these suites carries "gpus": the GPUs the run used.
# NVLink multicast stays off in every process (the device README says why).
set -u
out=${OUT:-/tmp/moefuse-out}
gpus=$(nvidia-smi -L | wc -l)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MOEFUSE_LAUNCH_GPUS=$gpus
echo "== $gpus GPUs"
rc=0
.device-pack/run.sh test ep_gpu || rc=1
for n in 2 4 8; do
  [ "$n" -le "$gpus" ] || continue
  echo "== bench_ep, $n PEs"
  .device-pack/run.sh bench_ep --out "$out" --ranks "$n" --samples 30 || rc=1
done
.device-pack/run.sh test ep_layer_gpu || rc=1
for n in 2 4 8; do
  [ "$n" -le "$gpus" ] || continue
  echo "== bench_ep_layer, EP = $n"
  .device-pack/run.sh bench_ep_layer --out "$out" --ranks "$n" --tokens 8192 --samples 20 || rc=1
done
exit $rc
