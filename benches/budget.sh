# Sourced by the device-call scripts (decode_ab.sh, ep_ab.sh, moe_tables.sh) once they have
# set `out` (the output folder) and `budget` (seconds): sets `pack` (PACK, default
# /tmp/.device-pack), moves to the repository root, and defines the call's clock, a scratch
# folder `logs`, the summary file, `left` (seconds of the budget left) and `say` (a
# timestamped summary line); the summary's first line names the pack's commit and the card.
# The torch rows the scripts write carry the pack's commit (MOEFUSE_COMMIT), as the pack's
# own benches do.
pack=${PACK:-/tmp/.device-pack}
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
t0=$(date +%s)
logs=$(mktemp -d)
summary=$out/summary.txt
mkdir -p "$out"
left() { echo $((budget - ($(date +%s) - t0))); }
say() { echo "[t+$(($(date +%s) - t0))s] $*" >>"$summary"; }
export MOEFUSE_COMMIT=${MOEFUSE_COMMIT:-$(cat "$pack/COMMIT" 2>/dev/null || echo unknown)}
say "pack $(cat "$pack/COMMIT" 2>/dev/null) on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)"
