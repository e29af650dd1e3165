//! The scattered down GEMM of the launch layer (moe_abi.h `moefuse_down_scatter_args`): the
//! contiguous grouped GEMM whose epilogue stores each row at an address of a device table
//! (the expert-parallel combine: each expert output row straight into its token's slot on
//! the token's home rank).

use crate::bind::{check_multiple, check_range, extent, to_i32, Binder, Call};
use crate::{ffi, KernelError};
use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use half::bf16;
use moefuse_spec::MAX_EXPERTS;
use std::sync::Arc;

/// TMA rows: bf16 matrices start 16-byte aligned.
const ROW_ALIGN: u64 = 16;

/// A device table of row addresses, `[rows]` u64, each the start of `hidden` bf16 values a
/// [`DownScatter`] may write (this device's memory or a peer's mapped over NVLink), built by
/// the communication layer that fills the table and owns what it points to (hence
/// `unsafe`). Not `Clone`: a launch only borrows it from its owner.
///
/// ```no_run
/// # fn demo(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, table: &cudarc::driver::CudaSlice<u64>)
/// #         -> Result<(), moefuse_kernels::KernelError> {
/// // SAFETY: (see `new`) every entry the launch reads addresses 2048 writable bf16.
/// let rows = unsafe { moefuse_kernels::ScatterRows::new(ctx, table, 2048) };
/// assert_eq!(rows.hidden(), 2048);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct ScatterRows<'a> {
    context: Arc<CudaContext>,
    table: &'a CudaSlice<u64>,
    hidden: usize,
}

impl<'a> ScatterRows<'a> {
    /// The table `table` of rows `hidden` bf16 wide, for launches on `context`'s device.
    ///
    /// # Safety
    /// When a launch that uses the value runs, every entry of `table` it reads (the rows
    /// below the launch's last offset) must be a 16-byte aligned address, on `context`'s
    /// device or a peer mapping of it, of `hidden` bf16 values that nothing else reads or
    /// writes during the launch; no two such entries may overlap.
    ///
    /// ```no_run
    /// # fn demo(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, table: &cudarc::driver::CudaSlice<u64>) {
    /// // SAFETY: the table's entries address disjoint 1024-wide bf16 rows (see `new`).
    /// let rows = unsafe { moefuse_kernels::ScatterRows::new(ctx, table, 1024) };
    /// # }
    /// ```
    pub unsafe fn new(
        context: &Arc<CudaContext>,
        table: &'a CudaSlice<u64>,
        hidden: usize,
    ) -> Self {
        ScatterRows {
            context: context.clone(),
            table,
            hidden,
        }
    }

    /// Row width in bf16 elements.
    ///
    /// ```no_run
    /// # fn demo(r: &moefuse_kernels::ScatterRows<'_>) { assert!(r.hidden() > 0); }
    /// ```
    pub fn hidden(&self) -> usize {
        self.hidden
    }
}

/// How a [`DownScatter`]'s expert weights are stored.
///
/// ```
/// assert_ne!(moefuse_kernels::ScatterWeights::OutByIn, moefuse_kernels::ScatterWeights::InByOut);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScatterWeights {
    /// `[experts, hidden, intermediate]`: `out_r = h[r] · W_eᵀ` (the down projection).
    OutByIn,
    /// `[experts, intermediate, hidden]`: `out_r = h[r] · W_e` (the gate_up projection's
    /// dgrad, `dx = d_h_pre · W_gate_up`).
    InByOut,
}

/// `out_r = h[r] · W_eᵀ` (or `· W_e`, [`ScatterWeights`]) for the expert-major rows `r` of each expert `e` (rows
/// `offsets[e-1]..offsets[e]`, device data the kernel clamps to `rows`), each stored at
/// its address in `dst` (bf16, `hidden` wide): the expert-parallel layer's down GEMM with
/// the combine's transfer in its epilogue. Hopper only (`sm_90a`); elsewhere
/// [`KernelError::Launch`] with [`Status::ArchMismatch`](crate::Status::ArchMismatch).
///
/// ```no_run
/// # use moefuse_kernels::{DownScatter, Kernels, ScatterRows, ScatterWeights};
/// # fn demo(kernels: &Kernels, stream: &std::sync::Arc<cudarc::driver::CudaStream>,
/// #         offsets: &cudarc::driver::CudaSlice<i32>, h: &cudarc::driver::CudaSlice<half::bf16>,
/// #         w: &cudarc::driver::CudaSlice<half::bf16>, dst: &ScatterRows<'_>)
/// #         -> Result<(), moefuse_kernels::KernelError> {
/// kernels.launch(stream, DownScatter { rows: 4096, experts: 16, hidden: 2048,
///     intermediate: 768, weights: ScatterWeights::OutByIn, offsets, h, w, dst })?;
/// # Ok(()) }
/// ```
pub struct DownScatter<'a> {
    /// Expert-major rows (`h`'s rows, `dst`'s entries).
    pub rows: usize,
    /// Experts, `1..=`[`MAX_EXPERTS`].
    pub experts: usize,
    /// `D` (N), a multiple of 8.
    pub hidden: usize,
    /// `I` (K), a multiple of 8.
    pub intermediate: usize,
    /// How `w` is stored.
    pub weights: ScatterWeights,
    /// `[experts]` prefix-sum ends.
    pub offsets: &'a dyn DevicePtr<i32>,
    /// `[rows, intermediate]`.
    pub h: &'a dyn DevicePtr<bf16>,
    /// `[experts, hidden, intermediate]` or `[experts, intermediate, hidden]`.
    pub w: &'a dyn DevicePtr<bf16>,
    /// Where each row goes.
    pub dst: &'a ScatterRows<'a>,
}

impl<'a> DownScatter<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (r, e, d, i) = (self.rows, self.experts, self.hidden, self.intermediate);
        check_range(kernel, "experts", e as i128, 1, MAX_EXPERTS as i128)?;
        check_range(kernel, "rows", r as i128, 0, i32::MAX as i128)?;
        check_range(kernel, "hidden", d as i128, 8, i32::MAX as i128)?;
        check_range(kernel, "intermediate", i as i128, 8, i32::MAX as i128)?;
        check_multiple(kernel, "hidden", d, 8)?;
        check_multiple(kernel, "intermediate", i, 8)?;
        if self.dst.hidden != d {
            return Err(KernelError::Inconsistent {
                kernel: kernel.clone(),
                why: "the destination rows are not `hidden` wide",
            });
        }
        b.check_context("dst", &self.dst.context)?;
        let offsets = b.read("offsets", self.offsets, e, 4)?;
        let h = b.read("h", self.h, extent(kernel, "h", &[r, i])?, ROW_ALIGN)?;
        let w = b.read("w", self.w, extent(kernel, "w", &[e, d, i])?, ROW_ALIGN)?;
        let row_dst = b.read("dst", self.dst.table, r, 8)?;
        if r == 0 {
            return Ok(None);
        }
        Ok(Some(Call::DownScatter(ffi::MoefuseDownScatterArgs {
            rows: to_i32(kernel, "rows", r)?,
            experts: to_i32(kernel, "experts", e)?,
            hidden: to_i32(kernel, "hidden", d)?,
            intermediate: to_i32(kernel, "intermediate", i)?,
            tile_order: 0,
            b_layout: match self.weights {
                ScatterWeights::OutByIn => ffi::MOEFUSE_B_LAYOUT_NK,
                ScatterWeights::InByOut => ffi::MOEFUSE_B_LAYOUT_KN,
            },
            offsets: offsets as *const i32,
            h: h as *const _,
            w: w as *const _,
            row_dst: row_dst as *const u64,
        })))
    }
}
