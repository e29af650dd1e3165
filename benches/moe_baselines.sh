#!/usr/bin/env bash
# Both MoE-layer baselines in one go, on the GPU machine, from the repository root:
#
#   benches/moe_baselines.sh --out DIR [--models a,b] [--tokens 1,32,128,8192,16384]
#                            [--passes fwd,bwd,fwdbwd] [--routing-seed 0] [--seed 0] [--samples 30]
#
# 1. benches/torch_moe.py     (backend torch_moe)  -> DIR/moe.jsonl
# 2. benches/ligermoe/setup.sh, then benches/ligermoe_moe.py (backend ligermoe, one process per
#    model) -> DIR/moe.jsonl; skipped with a message when .ligermoe/ was not carried.
# All arguments go to both scripts unchanged. MOEFUSE_COMMIT defaults to `git rev-parse` (or
# "unknown" without .git). Exit status: 0 when every part that ran succeeded.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! printf '%s\n' "$@" | grep -qE '^--out(=|$)'; then
  echo "usage: benches/moe_baselines.sh --out DIR [--models ...] [--tokens ...] [...]" >&2
  exit 2
fi
export MOEFUSE_COMMIT="${MOEFUSE_COMMIT:-$(git rev-parse --short=10 HEAD 2>/dev/null || echo unknown)}"
rc=0

echo "=== torch_moe ==="
python3 benches/torch_moe.py "$@" || { echo "torch_moe.py failed (exit $?)"; rc=1; }

echo "=== ligermoe ==="
if [ ! -d .ligermoe ]; then
  echo "SKIP ligermoe: .ligermoe/ is absent (run benches/ligermoe/fetch.sh where PyPI is reachable and carry .ligermoe)"
elif ! benches/ligermoe/setup.sh; then
  echo "SKIP ligermoe: benches/ligermoe/setup.sh failed"; rc=1
else
  python3 benches/ligermoe_moe.py "$@" || { echo "ligermoe_moe.py failed (exit $?)"; rc=1; }
fi
exit $rc
