//! The typed launch layer: the one door from safe Rust to the kernels (modelled on cudarc's
//! `launch_builder`).
//!
//! 1. [`Kernels::new`] binds a handle to a context: it checks the library's ABI version,
//!    the device's architecture against the compiled targets, and reads the SM count, once.
//! 2. An operation is a typed value ([`Gemm`], [`GroupedGemm`], [`RouterForward`], ...): its
//!    sizes as `usize` and its buffers as cudarc views or slices.
//! 3. [`Kernels::launch`] checks the operation on the host (sizes, limits, alignment: the
//!    kernel's `can_implement`), checks every buffer's length, alignment and context against
//!    the handle's, converts the sizes to the ABI's `i32` once, takes each buffer's
//!    `device_ptr` guard and holds it until after the one `unsafe` call, then turns the
//!    status into a [`KernelError`].
//!
//! ```no_run
//! use moefuse_kernels::{Gemm, GemmShape, Kernels, Op};
//! use half::bf16;
//! let ctx = cudarc::driver::CudaContext::new(0)?;
//! let stream = ctx.default_stream();
//! let kernels = Kernels::new(&ctx)?;
//! let variant = moefuse_kernels::compiled().iter().find(|v| v.spec.op == Op::GemmBnk).unwrap();
//! let (m, n, k) = (256, 256, 256);
//! let a = stream.clone_htod(&vec![bf16::ONE; m * k])?;
//! let b = stream.clone_htod(&vec![bf16::ONE; n * k])?;
//! let mut d = stream.alloc_zeros::<bf16>(m * n)?;
//! let shape = GemmShape::new(m, n, k);
//! kernels.launch(&stream, Gemm { variant, shape, a: &a, b: &b, c: None, d: &mut d, workspace: None })?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::bind::Binder;
use crate::moe_ops::{
    Activation, ActivationBackwardRouted, ColumnsToF32, CombineBackward, CombineForward,
    DecodeForward, DownDgradFused, DownScatter, GateUpFused, GatherRows, Permute, RouterBackward,
    RouterForward, ScatterColumns,
};
use crate::ops::{Gemm, GroupedGemm};
use crate::{KernelError, Kernels};
use cudarc::driver::CudaStream;
use std::ffi::c_void;
use std::sync::Arc;

/// One launch: the operation and its buffers. Built from each operation with `into()`, so
/// [`Kernels::launch`] takes any of them.
///
/// ```
/// use moefuse_kernels::{Activation, ActivationKind, GateUpLayout, Launch};
/// # fn demo(h_pre: &cudarc::driver::CudaSlice<half::bf16>, h: &mut cudarc::driver::CudaSlice<half::bf16>) {
/// let op: Launch<'_> = Activation { kind: ActivationKind::SwiGlu, layout: GateUpLayout::Split,
///     intermediate: 64, max_rows: 16, total_rows: None, h_pre, backward: None, out: h }.into();
/// assert_eq!(op.kernel(), "moefuse_moe_activation_fwd");
/// # }
/// ```
pub enum Launch<'a> {
    /// A dense GEMM variant.
    Gemm(Gemm<'a>),
    /// A grouped GEMM variant.
    GroupedGemm(GroupedGemm<'a>),
    /// `moefuse_moe_router_fwd`.
    RouterForward(RouterForward<'a>),
    /// `moefuse_moe_router_bwd`.
    RouterBackward(RouterBackward<'a>),
    /// `moefuse_moe_activation_fwd` / `_bwd`.
    Activation(Activation<'a>),
    /// `moefuse_moe_permute`.
    Permute(Permute<'a>),
    /// `moefuse_moe_gate_up_fused`.
    GateUpFused(GateUpFused<'a>),
    /// `moefuse_moe_down_scatter`.
    DownScatter(DownScatter<'a>),
    /// `moefuse_moe_down_dgrad_fused`.
    DownDgradFused(DownDgradFused<'a>),
    /// `moefuse_moe_decode_forward`.
    DecodeForward(DecodeForward<'a>),
    /// `moefuse_moe_scatter_columns`.
    ScatterColumns(ScatterColumns<'a>),
    /// `moefuse_moe_columns_to_f32`.
    ColumnsToF32(ColumnsToF32<'a>),
    /// `moefuse_moe_combine`.
    Combine(CombineForward<'a>),
    /// `moefuse_moe_combine_bwd`.
    CombineBackward(CombineBackward<'a>),
    /// `moefuse_moe_combine_bwd` in gather mode.
    GatherRows(GatherRows<'a>),
    /// `moefuse_moe_activation_bwd_routed`.
    ActivationBackwardRouted(ActivationBackwardRouted<'a>),
}

macro_rules! launch_from {
    ($($variant:ident($ty:ident)),*) => {$(
        impl<'a> From<$ty<'a>> for Launch<'a> {
            fn from(op: $ty<'a>) -> Self {
                Launch::$variant(op)
            }
        }
    )*};
}
launch_from!(
    Gemm(Gemm),
    GroupedGemm(GroupedGemm),
    RouterForward(RouterForward),
    RouterBackward(RouterBackward),
    Activation(Activation),
    Permute(Permute),
    GateUpFused(GateUpFused),
    DownScatter(DownScatter),
    DownDgradFused(DownDgradFused),
    DecodeForward(DecodeForward),
    ScatterColumns(ScatterColumns),
    ColumnsToF32(ColumnsToF32),
    Combine(CombineForward),
    CombineBackward(CombineBackward),
    GatherRows(GatherRows),
    ActivationBackwardRouted(ActivationBackwardRouted)
);

impl Launch<'_> {
    /// The kernel's name: the variant name, or the MoE launcher's C symbol.
    pub fn kernel(&self) -> String {
        match self {
            Launch::Gemm(g) => g.variant.name(),
            Launch::GroupedGemm(g) => g.variant.name(),
            Launch::RouterForward(_) => "moefuse_moe_router_fwd".into(),
            Launch::RouterBackward(_) => "moefuse_moe_router_bwd".into(),
            Launch::Activation(a) if a.backward.is_some() => "moefuse_moe_activation_bwd".into(),
            Launch::Activation(_) => "moefuse_moe_activation_fwd".into(),
            Launch::Permute(_) => "moefuse_moe_permute".into(),
            Launch::GateUpFused(_) => "moefuse_moe_gate_up_fused".into(),
            Launch::DownScatter(_) => "moefuse_moe_down_scatter".into(),
            Launch::DownDgradFused(_) => "moefuse_moe_down_dgrad_fused".into(),
            Launch::DecodeForward(_) => "moefuse_moe_decode_forward".into(),
            Launch::ScatterColumns(_) => "moefuse_moe_scatter_columns".into(),
            Launch::ColumnsToF32(_) => "moefuse_moe_columns_to_f32".into(),
            Launch::Combine(_) => "moefuse_moe_combine".into(),
            Launch::CombineBackward(_) => "moefuse_moe_combine_bwd".into(),
            Launch::GatherRows(_) => "moefuse_moe_combine_bwd (gather)".into(),
            Launch::ActivationBackwardRouted(_) => "moefuse_moe_activation_bwd_routed".into(),
        }
    }
}

impl Kernels {
    /// Checks `op` and its buffers on the host, then launches it on `stream`. An empty
    /// problem (no rows, no tokens, no groups) returns `Ok(())` without a launch, after the
    /// same checks.
    ///
    /// ```no_run
    /// # use moefuse_kernels::{Kernels, RouterForward, RouterScoring};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let stream = ctx.default_stream();
    /// let kernels = Kernels::new(&ctx)?;
    /// let (t, e, k) = (4, 8, 2);
    /// let logits = stream.alloc_zeros::<f32>(t * e)?;
    /// let mut ids = stream.alloc_zeros::<i32>(t * k)?;
    /// let mut w = stream.alloc_zeros::<f32>(t * k)?;
    /// kernels.launch(&stream, RouterForward { tokens: t, experts: e, top_k: k,
    ///     scoring: RouterScoring::Softmax, renormalize: true, logits: &logits, bias: None,
    ///     topk_ids: &mut ids, topk_weights: &mut w })?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn launch<'a>(
        &'a self,
        stream: &'a Arc<CudaStream>,
        op: impl Into<Launch<'a>>,
    ) -> Result<(), KernelError> {
        let op = op.into();
        let kernel = op.kernel();
        let mut binder = Binder::new(self, stream, kernel.clone());
        binder.check_context("stream", stream.context())?;
        self.context().bind_to_thread()?;
        let call = match op {
            Launch::Gemm(g) => g.bind(&mut binder)?,
            Launch::GroupedGemm(g) => g.bind(&mut binder)?,
            Launch::RouterForward(r) => r.bind(&mut binder)?,
            Launch::RouterBackward(r) => r.bind(&mut binder)?,
            Launch::Activation(a) => a.bind(&mut binder)?,
            Launch::Permute(p) => p.bind(&mut binder)?,
            Launch::GateUpFused(g) => g.bind(&mut binder)?,
            Launch::DownScatter(d) => d.bind(&mut binder)?,
            Launch::DownDgradFused(d) => d.bind(&mut binder)?,
            Launch::DecodeForward(d) => d.bind(&mut binder)?,
            Launch::ScatterColumns(c) => c.bind(&mut binder)?,
            Launch::ColumnsToF32(c) => c.bind(&mut binder)?,
            Launch::Combine(c) => c.bind(&mut binder)?,
            Launch::CombineBackward(c) => c.bind(&mut binder)?,
            Launch::GatherRows(g) => g.bind(&mut binder)?,
            Launch::ActivationBackwardRouted(a) => a.bind(&mut binder)?,
        };
        let Some(call) = call else {
            return Ok(());
        };
        let result = call.invoke(stream.cu_stream() as *mut c_void);
        // The guards record the buffers' use on `stream` now that the launch is enqueued.
        drop(binder);
        result.map_err(|(status, message)| KernelError::Launch {
            variant: kernel,
            status,
            message,
        })
    }

    /// Launches a grouped GEMM on device addresses and a stream owned outside cudarc (a
    /// foreign framework's tensors). Every host check of [`Kernels::launch`] runs: shape,
    /// limits, alignment, workspace size, and, through the driver, that each address lies in
    /// device memory of this handle's context with room for its extent.
    ///
    /// # Safety
    /// The memory behind every address must stay allocated, and must not be written by
    /// anything else, until the kernel has finished on `stream`; `stream` must be a live
    /// stream of this handle's context (or null, the legacy default stream).
    ///
    /// ```no_run
    /// # use moefuse_kernels::{GroupedShape, Kernels, RawGrouped};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let kernels = Kernels::new(&ctx)?;
    /// let variant = &moefuse_kernels::compiled()[0];
    /// let raw = RawGrouped { offsets: 0x1000, a: 0x2000, b: 0x3000, d: 0x4000,
    ///     workspace: 0x5000, workspace_bytes: 4096, stream: 0 };
    /// // SAFETY: illustration only; a real caller passes addresses it keeps alive.
    /// let r = unsafe { kernels.launch_grouped_raw(variant, &GroupedShape::new(8, 1024, 256, 256), raw) };
    /// # Ok::<(), moefuse_kernels::KernelError>(())
    /// ```
    pub unsafe fn launch_grouped_raw(
        &self,
        variant: &'static crate::CompiledVariant,
        shape: &crate::GroupedShape,
        raw: crate::RawGrouped,
    ) -> Result<(), KernelError> {
        let kernel = variant.name();
        self.context().bind_to_thread()?;
        crate::foreign::check_stream(self, &kernel, raw.stream)?;
        let call = crate::foreign::bind_grouped_raw(self, variant, shape, &raw, &kernel)?;
        let Some(call) = call else {
            return Ok(());
        };
        call.invoke(raw.stream as *mut c_void)
            .map_err(|(status, message)| KernelError::Launch {
                variant: kernel,
                status,
                message,
            })
    }
}

#[cfg(test)]
mod tests;
