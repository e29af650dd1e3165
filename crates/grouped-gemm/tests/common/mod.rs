//! Helpers shared by the GPU test binaries of this crate.

use cudarc::driver::CudaContext;
use std::sync::Arc;

/// Names of the compiled variants for `ctx`'s architecture whose name contains `op` (none
/// on a GPU moefuse has no kernels for).
pub fn variants_for(ctx: &Arc<CudaContext>, op: &str) -> Vec<String> {
    let (major, minor) = ctx.compute_capability().expect("compute capability");
    let Ok(arch) = moefuse_kernels::arch_of(major, minor) else {
        return Vec::new();
    };
    moefuse_kernels::compiled()
        .iter()
        .filter(|v| v.spec.arch == arch)
        .map(|v| v.name())
        .filter(|n| n.contains(op))
        .collect()
}
