#!/usr/bin/env bash
# Build the LigerMoE carry folder `.ligermoe/` (git-ignored) on a machine WITH access to
# PyPI, for the GPU machine that has none.  Run from anywhere; paths are repo-relative.
#
#   benches/ligermoe/fetch.sh            # -> .ligermoe/ (< 40 MiB), prints its size
#
# What it does:
#   1. `pip download --no-deps` the exact wheels for CPython 3.12 / manylinux x86_64 into
#      .ligermoe-wheels/ (git-ignored cache; reused when present):
#        liger-cute-kernels==0.8.5   native MoE core (sm90a .so, non-RDC MoE cubin)
#        liger-kernel==0.8.5         the autograd front end (liger_kernel.ops.cute.ops.moe)
#        apache-tvm-ffi==0.1.15.post2 the FFI the native core is loaded through
#        nvidia-cuda-runtime-cu12==12.9.79  libcudart.so.12 (the core is built with CUDA 12.9)
#        nvidia-nvshmem-cu12==3.6.5  NVSHMEM host library + UID bootstrap plugin
#          (LIGERMOE_NVSHMEM=cu13 takes nvidia-nvshmem-cu13==3.6.5 instead: the variant
#          measured on the H200, but its host library is 32.6 MiB after xz -- its fatbins are
#          already compressed -- which puts .ligermoe/ at ~43.5 MiB, over the 40 MiB budget;
#          the cu12 build, 24 MiB after xz, matches the CUDA 12.9 build of the Liger core)
#      plus packaging==26.4 and typing-extensions==4.16.0 (pure Python; liger_kernel imports
#      packaging, tvm_ffi needs typing_extensions >= 4.13; setup.sh puts them on PYTHONPATH
#      only if the GPU machine's python3 lacks them),
#   2. unpack them, keep only what an H200 run needs (the sm100f core, NVSHMEM device
#      bitcode/static libs/transports, CUDA headers and static libs are dropped),
#   3. pack each as a .tar.xz into .ligermoe/ with MANIFEST (files, sizes, sha256 of the
#      wheels) -- benches/ligermoe/setup.sh unpacks them on the GPU machine into /tmp.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
WHL="$ROOT/.ligermoe-wheels"
OUT="$ROOT/.ligermoe"
NVSHMEM_FLAVOR="${LIGERMOE_NVSHMEM:-cu12}"
case "$NVSHMEM_FLAVOR" in cu12|cu13) ;; *) echo "LIGERMOE_NVSHMEM must be cu12 or cu13" >&2; exit 2;; esac
STAGE="$(mktemp -d /tmp/ligermoe-stage.XXXXXX)"
trap 'rm -rf "$STAGE"' EXIT

PKGS=(
  "liger-cute-kernels==0.8.5"
  "liger-kernel==0.8.5"
  "apache-tvm-ffi==0.1.15.post2"
  "nvidia-cuda-runtime-cu12==12.9.79"
  "nvidia-nvshmem-${NVSHMEM_FLAVOR}==3.6.5"
  "packaging==26.4"
  "typing-extensions==4.16.0"
)
PLAT=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 linux_x86_64 any; do
  PLAT+=(--platform "$p")
done

mkdir -p "$WHL"
for pkg in "${PKGS[@]}"; do
  # PIP_FIND_LINKS may point at a local wheel folder; look at PyPI as well.
  pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --abi cp312 --abi abi3 --abi none "${PLAT[@]}" -d "$WHL" "$pkg" >/dev/null
done
ls -l "$WHL"

unpack() { mkdir -p "$STAGE/$2" && (cd "$STAGE/$2" && python3 -m zipfile -e "$WHL"/$1 . ); }
unpack "liger_cute_kernels-0.8.5-*.whl"   lck
unpack "liger_kernel-0.8.5-*.whl"         lk
unpack "apache_tvm_ffi-0.1.15.post2-cp312-*.whl" tvm
unpack "nvidia_cuda_runtime_cu12-12.9.79-*.whl"  cudart
unpack "nvidia_nvshmem_${NVSHMEM_FLAVOR}-3.6.5-*.whl"  nvshmem
unpack "packaging-26.4-*.whl"              extra
unpack "typing_extensions-4.16.0-*.whl"    extra

# site/ = what goes on PYTHONPATH; lib/ = shared libraries for LD_LIBRARY_PATH / LD_PRELOAD.
mkdir -p "$STAGE/site" "$STAGE/lib"
cp -a "$STAGE/lck/liger_cute_kernels" "$STAGE/site/"
rm -f "$STAGE/site/liger_cute_kernels/libliger_cute_kernels_sm100f.so"   # Blackwell core: not for H200
cp -a "$STAGE/lck/"liger_cute_kernels-*.dist-info "$STAGE/site/"
cp -a "$STAGE/lk/liger_kernel" "$STAGE/lk/"liger_kernel-*.dist-info "$STAGE/site/"
cp -a "$STAGE/tvm/tvm_ffi" "$STAGE/tvm/"apache_tvm_ffi-*.dist-info "$STAGE/site/"
cp -a "$STAGE/cudart/nvidia/cuda_runtime/lib/libcudart.so.12" "$STAGE/lib/"
cp -a "$STAGE/nvshmem/nvidia/nvshmem/lib/libnvshmem_host.so.3" \
      "$STAGE/nvshmem/nvidia/nvshmem/lib/nvshmem_bootstrap_uid.so.3" "$STAGE/lib/"
find "$STAGE/site" "$STAGE/extra" -name __pycache__ -prune -exec rm -rf {} +

rm -rf "$OUT"; mkdir -p "$OUT"
# The three big binaries get their own archives (xz -9e shrinks them ~15-40x).
tar -C "$STAGE/site" -cf - liger_cute_kernels liger_cute_kernels-0.8.5.dist-info \
  | xz -T0 -9e > "$OUT/liger_cute_kernels.tar.xz"
tar -C "$STAGE/site" -cf - liger_kernel liger_kernel-0.8.5.dist-info | xz -T0 -9 > "$OUT/liger_kernel.tar.xz"
tar -C "$STAGE/site" -cf - tvm_ffi apache_tvm_ffi-0.1.15.post2.dist-info | xz -T0 -9 > "$OUT/tvm_ffi.tar.xz"
tar -C "$STAGE/lib" -cf - . | xz -T0 -9e > "$OUT/lib.tar.xz"
tar -C "$STAGE/extra" -cf - . | xz -T0 -9 > "$OUT/extra.tar.xz"

{
  echo "# LigerMoE carry folder, built by benches/ligermoe/fetch.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# unpack on the GPU machine with benches/ligermoe/setup.sh"
  echo "[wheels] sha256"
  (cd "$WHL" && for p in "${PKGS[@]}"; do
     n="${p%%==*}"; n="${n//-/_}"; f=$(ls ${n}-${p##*==}-*.whl); sha256sum "$f"; done)
  echo "[archives] sha256"
  (cd "$OUT" && sha256sum *.tar.xz)
  echo "[contents] bytes path (uncompressed)"
  (cd "$STAGE" && find site lib -type f -size +256k -printf '%s %p\n' | sort -k2)
  echo "[versions]"
  for p in "${PKGS[@]}"; do echo "$p"; done
  echo "nvshmem_flavor=$NVSHMEM_FLAVOR"
} > "$OUT/MANIFEST"

du -b "$OUT"/* | awk '{printf "%10.2f MiB  %s\n", $1/1048576, $2}'
total=$(du -sb "$OUT" | cut -f1)
printf 'total %s: %.2f MiB\n' "$OUT" "$(echo "$total/1048576" | bc -l)"
if [ "$total" -ge $((64 * 1048576)) ]; then echo "ERROR: .ligermoe/ is over the 64 MiB carry limit" >&2; exit 1; fi
if [ "$total" -ge $((40 * 1048576)) ]; then
  echo "WARNING: .ligermoe/ is over 40 MiB: carry it alone (no room for the device pack in the same run)" >&2
fi
