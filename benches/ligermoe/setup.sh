#!/usr/bin/env bash
# Unpack the LigerMoE carry folder on the GPU machine and check that it imports.
# Run from the repository root (the device tool's working directory), with `.ligermoe/` carried:
#
#   benches/ligermoe/setup.sh            # unpacks .ligermoe/*.tar.xz into $LIGERMOE_ROOT
#   source /tmp/ligermoe/env.sh          # optional: the environment for your own python3
#
# $LIGERMOE_ROOT (default /tmp/ligermoe) gets:
#   site/   liger_cute_kernels (sm90a core + non-RDC MoE cubin), liger_kernel, tvm_ffi
#   lib/    libcudart.so.12, NVSHMEM 3.6.5 libnvshmem_host.so.3 + nvshmem_bootstrap_uid.so.3
#           (also linked into site/liger_cute_kernels/, where liger looks first, so that it
#           does not pick up torch's NVSHMEM 3.4.5 from site-packages/nvidia/nvshmem)
#   extra/  packaging, typing_extensions (added to PYTHONPATH only if python3 lacks them)
#   env.sh  PYTHONPATH, LD_LIBRARY_PATH, LD_PRELOAD (the two NVSHMEM libraries, so they own the
#           libnvshmem_host.so.3 soname before torch loads its own), NVSHMEM_REMOTE_TRANSPORT=none,
#           NVSHMEM_DISABLE_NVLS=1
# Unpacking is skipped when $LIGERMOE_ROOT already holds this MANIFEST. Then it checks, in a
# fresh python3 with env.sh: torch + CUDA, `import liger_cute_kernels`, loading the native core
# through TVM FFI, `liger_kernel.ops.cute.ops.moe.moe_fused`, and prints versions and which
# libnvshmem_host.so.3 the process mapped. Exit 0: ready; 2: no carry folder; 1: check failed.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
CARRY="$REPO/.ligermoe"
DEST="${LIGERMOE_ROOT:-/tmp/ligermoe}"

if [ ! -f "$CARRY/MANIFEST" ]; then
  echo "SKIP ligermoe: $CARRY is absent (build it with benches/ligermoe/fetch.sh on a machine with PyPI access, then carry .ligermoe)" >&2
  exit 2
fi

extract() {  # archive dest
  if command -v xz >/dev/null && command -v tar >/dev/null; then
    xz -dc "$1" | tar -C "$2" -xf -
  else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(sys.argv[2])' "$1" "$2"
  fi
}

if [ -f "$DEST/MANIFEST" ] && cmp -s "$CARRY/MANIFEST" "$DEST/MANIFEST"; then
  echo "# $DEST is up to date"
else
  t0=$(date +%s)
  rm -rf "$DEST"
  mkdir -p "$DEST/site" "$DEST/lib"
  for a in liger_cute_kernels liger_kernel tvm_ffi; do extract "$CARRY/$a.tar.xz" "$DEST/site"; done
  extract "$CARRY/lib.tar.xz" "$DEST/lib"
  if [ -f "$CARRY/extra.tar.xz" ]; then mkdir -p "$DEST/extra"; extract "$CARRY/extra.tar.xz" "$DEST/extra"; fi
  for f in libnvshmem_host.so.3 nvshmem_bootstrap_uid.so.3; do
    ln -sf "$DEST/lib/$f" "$DEST/site/liger_cute_kernels/$f"
  done
  cp "$CARRY/MANIFEST" "$DEST/MANIFEST"
  echo "# unpacked $CARRY into $DEST in $(( $(date +%s) - t0 )) s ($(du -sh "$DEST" | cut -f1))"
fi

# packaging / typing_extensions >= 4.13 from the carry only where python3 lacks them.
PYPATH="$DEST/site"
if [ -d "$DEST/extra" ] && ! python3 -c 'import packaging.version; from typing_extensions import get_annotations' 2>/dev/null; then
  PYPATH="$DEST/site:$DEST/extra"
  echo "# python3 lacks packaging or typing_extensions>=4.13: using the carried ones"
fi
cat > "$DEST/env.sh" <<EOF
export LIGERMOE_ROOT="$DEST"
export PYTHONPATH="$PYPATH\${PYTHONPATH:+:\$PYTHONPATH}"
export LD_LIBRARY_PATH="$DEST/lib:$DEST/site/tvm_ffi/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LD_PRELOAD="$DEST/lib/libnvshmem_host.so.3:$DEST/lib/nvshmem_bootstrap_uid.so.3\${LD_PRELOAD:+:\$LD_PRELOAD}"
export NVSHMEM_REMOTE_TRANSPORT="\${NVSHMEM_REMOTE_TRANSPORT:-none}"
export NVSHMEM_DISABLE_NVLS="\${NVSHMEM_DISABLE_NVLS:-1}"
export TVM_FFI_CACHE_DIR="\${TVM_FFI_CACHE_DIR:-$DEST/tvm-ffi-cache}"
export LIGERMOE_ENV_OK=1
EOF

# The check runs in a child shell so that LD_PRELOAD does not leak into this one.
bash -c "source '$DEST/env.sh' && python3 -" <<'EOF'
import ctypes, importlib.metadata as md, sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPU {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
for d in ("liger-cute-kernels", "liger-kernel", "apache-tvm-ffi"):
    print(f"{d} {md.version(d)}")
import liger_cute_kernels
print(f"liger_cute_kernels from {liger_cute_kernels.__file__}")
from liger_cute_kernels import tvm_ffi
tvm_ffi._load_module()
print(f"native core loaded: {tvm_ffi._select_core_module(__import__('pathlib').Path(tvm_ffi.__file__).parent).name}")
try:
    from liger_kernel.ops.cute.ops.moe import moe_fused  # noqa: F401
    print("liger_kernel.ops.cute.ops.moe.moe_fused: ok")
except ImportError as exc:
    print(f"liger_kernel.ops.cute.ops.moe import failed ({exc}); ligermoe_moe.py loads the op module directly")
try:
    lib = ctypes.CDLL(None)
    maj, mnr, pat = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    lib.nvshmemx_vendor_get_version_info(ctypes.byref(maj), ctypes.byref(mnr), ctypes.byref(pat))
    print(f"NVSHMEM host library {maj.value}.{mnr.value}.{pat.value}")
except Exception as exc:  # noqa: BLE001
    print(f"NVSHMEM version query failed: {exc}")
maps = sorted({l.split()[-1] for l in open("/proc/self/maps") if "nvshmem" in l or "libcudart" in l})
print("mapped: " + ", ".join(maps))
if sum("libnvshmem_host" in m for m in maps) != 1:
    print("WARNING: more than one libnvshmem_host is mapped")
EOF
echo "# ligermoe ready: source $DEST/env.sh (benches/ligermoe_moe.py does this by itself)"
