//! Helpers shared by the GPU test binaries of this crate.

use cudarc::driver::CudaContext;
use std::sync::Arc;

/// Names of the compiled variants for `ctx`'s architecture whose name contains `op`.
pub fn variants_for(ctx: &Arc<CudaContext>, op: &str) -> Vec<String> {
    let (major, _) = ctx.compute_capability().expect("compute capability");
    let arch = if major == 9 { "sm90a" } else { "sm100a" };
    moefuse_kernels::compiled()
        .iter()
        .map(|v| v.name())
        .filter(|n| n.starts_with(arch) && n.contains(op))
        .collect()
}
