//! Helpers shared by the GPU test binaries of this crate.

use cudarc::driver::CudaContext;
use moefuse_grouped_gemm::{reference, GroupedDesc, GroupedOp};
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

/// Which elements of D a grouped call over `ends` may write (M-grouped: the groups' rows;
/// K-grouped: every expert's D_e, except an empty expert's with beta != 0).
#[allow(dead_code)] // not every test binary compares whole outputs
pub fn touched_mask(desc: &GroupedDesc, ends: &[i32]) -> Vec<bool> {
    let [_, _, (_, d_len)] = desc.extents();
    let mut mask = vec![false; d_len];
    for (e, r) in reference::group_ranges(ends, desc.rows)
        .into_iter()
        .enumerate()
    {
        let span = match desc.op {
            GroupedOp::MGrouped(_) => r.start * desc.n..r.end * desc.n,
            GroupedOp::KGrouped if !r.is_empty() || desc.beta == 0.0 => {
                e * desc.k * desc.n..(e + 1) * desc.k * desc.n
            }
            GroupedOp::KGrouped => continue,
        };
        mask[span].iter_mut().for_each(|m| *m = true);
    }
    mask
}
