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

use crate::moe_ops::{
    Activation, CombineBackward, CombineForward, Permute, RouterBackward, RouterForward,
};
use crate::ops::{Gemm, GroupedGemm};
use crate::{built_archs, check_abi, ffi, last_error, KernelError, Status, VariantArch};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::ffi::c_void;
use std::sync::Arc;

/// A per-context handle on the kernel library: ABI and architecture checked once.
///
/// ```no_run
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let kernels = moefuse_kernels::Kernels::new(&ctx)?;
/// assert!(kernels.sms() > 0);
/// # Ok::<(), moefuse_kernels::KernelError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Kernels {
    ctx: Arc<CudaContext>,
    arch: VariantArch,
    sms: usize,
}

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
    /// `moefuse_moe_combine`.
    Combine(CombineForward<'a>),
    /// `moefuse_moe_combine_bwd`.
    CombineBackward(CombineBackward<'a>),
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
    Combine(CombineForward),
    CombineBackward(CombineBackward)
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
            Launch::Combine(_) => "moefuse_moe_combine".into(),
            Launch::CombineBackward(_) => "moefuse_moe_combine_bwd".into(),
        }
    }
}

/// The architecture of compute capability `major.minor`, if moefuse has kernels for it.
///
/// ```
/// use moefuse_kernels::{arch_of, VariantArch};
/// assert_eq!(arch_of(9, 0).unwrap(), VariantArch::Sm90a);
/// assert!(arch_of(8, 9).is_err());
/// ```
pub fn arch_of(major: i32, minor: i32) -> Result<VariantArch, KernelError> {
    let found = match (u32::try_from(major), u32::try_from(minor)) {
        (Ok(major), Ok(minor)) => VariantArch::from_capability(major, minor),
        _ => None,
    };
    found.ok_or(KernelError::UnsupportedArch { major, minor })
}

fn require_built(arch: VariantArch, built: &[&str]) -> Result<(), KernelError> {
    if built.contains(&arch.name()) {
        return Ok(());
    }
    Err(KernelError::ArchNotBuilt {
        arch: arch.name(),
        built: built.join(","),
    })
}

impl Kernels {
    /// Binds to `ctx`: checks the ABI, the architecture and that this build compiled it.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, KernelError> {
        check_abi()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = arch_of(major, minor)?;
        require_built(arch, &built_archs())?;
        let sms = ctx.attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )?;
        Ok(Kernels {
            ctx: ctx.clone(),
            arch,
            sms: usize::try_from(sms).unwrap_or(0),
        })
    }

    /// The context every buffer and stream of a launch must belong to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device's architecture.
    pub fn arch(&self) -> VariantArch {
        self.arch
    }

    /// The device's streaming multiprocessors.
    pub fn sms(&self) -> usize {
        self.sms
    }

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
        let mut binder = Binder {
            kernels: self,
            stream,
            kernel: kernel.clone(),
            guards: Vec::new(),
        };
        binder.check_context("stream", stream.context())?;
        self.ctx.bind_to_thread()?;
        let call = match op {
            Launch::Gemm(g) => g.bind(&mut binder)?,
            Launch::GroupedGemm(g) => g.bind(&mut binder)?,
            Launch::RouterForward(r) => r.bind(&mut binder)?,
            Launch::RouterBackward(r) => r.bind(&mut binder)?,
            Launch::Activation(a) => a.bind(&mut binder)?,
            Launch::Permute(p) => p.bind(&mut binder)?,
            Launch::Combine(c) => c.bind(&mut binder)?,
            Launch::CombineBackward(c) => c.bind(&mut binder)?,
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
        self.ctx.bind_to_thread()?;
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

/// Checks buffers against a launch and holds their `device_ptr` guards until the launch is
/// enqueued (dropped after [`Call::invoke`]).
pub(crate) struct Binder<'a> {
    pub(crate) kernels: &'a Kernels,
    stream: &'a CudaStream,
    pub(crate) kernel: String,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Binder<'a> {
    pub(crate) fn check_context(
        &self,
        operand: &'static str,
        owner: &CudaContext,
    ) -> Result<(), KernelError> {
        let ours = &self.kernels.ctx;
        if owner.cu_ctx() == ours.cu_ctx() {
            return Ok(());
        }
        Err(KernelError::WrongDevice {
            kernel: self.kernel.to_string(),
            operand,
            expected: ours.ordinal(),
            found: owner.ordinal(),
            expected_ctx: ours.cu_ctx() as usize,
            found_ctx: owner.cu_ctx() as usize,
        })
    }

    fn check(
        &self,
        operand: &'static str,
        owner: &CudaContext,
        len: usize,
        needed: usize,
    ) -> Result<(), KernelError> {
        self.check_context(operand, owner)?;
        check_len(&self.kernel, operand, needed, len)
    }

    fn aligned(&self, operand: &'static str, ptr: u64, align: u64) -> Result<u64, KernelError> {
        check_align(&self.kernel, operand, ptr, align)?;
        Ok(ptr)
    }

    /// The address of `buf`, read by the kernel: `needed` elements, `align`-byte aligned.
    pub(crate) fn read<T>(
        &mut self,
        operand: &'static str,
        buf: &'a dyn DevicePtr<T>,
        needed: usize,
        align: u64,
    ) -> Result<u64, KernelError> {
        self.check(operand, buf.stream().context(), buf.len(), needed)?;
        let (ptr, guard) = buf.device_ptr(self.stream);
        self.guards.push(guard);
        self.aligned(operand, ptr, align)
    }

    /// The address of `buf`, written by the kernel: `needed` elements, `align`-byte aligned.
    pub(crate) fn write<T>(
        &mut self,
        operand: &'static str,
        buf: &'a mut dyn DevicePtrMut<T>,
        needed: usize,
        align: u64,
    ) -> Result<u64, KernelError> {
        self.check(operand, buf.stream().context(), buf.len(), needed)?;
        let (ptr, guard) = buf.device_ptr_mut(self.stream);
        self.guards.push(guard);
        self.aligned(operand, ptr, align)
    }

    /// [`Binder::read`] of an optional buffer; null when absent.
    pub(crate) fn read_opt<T>(
        &mut self,
        operand: &'static str,
        buf: Option<&'a dyn DevicePtr<T>>,
        needed: usize,
        align: u64,
    ) -> Result<u64, KernelError> {
        buf.map_or(Ok(0), |b| self.read(operand, b, needed, align))
    }

    /// [`Binder::write`] of an optional buffer; null when absent.
    pub(crate) fn write_opt<T>(
        &mut self,
        operand: &'static str,
        buf: Option<&'a mut dyn DevicePtrMut<T>>,
        needed: usize,
        align: u64,
    ) -> Result<u64, KernelError> {
        buf.map_or(Ok(0), |b| self.write(operand, b, needed, align))
    }
}

/// `got >= needed` elements, or [`KernelError::BufferTooSmall`].
pub(crate) fn check_len(
    kernel: &str,
    operand: &'static str,
    needed: usize,
    got: usize,
) -> Result<(), KernelError> {
    if got >= needed {
        return Ok(());
    }
    Err(KernelError::BufferTooSmall {
        kernel: kernel.to_string(),
        operand,
        needed,
        got,
    })
}

/// `ptr % align == 0`, or [`KernelError::Misaligned`].
pub(crate) fn check_align(
    kernel: &str,
    operand: &'static str,
    ptr: u64,
    align: u64,
) -> Result<(), KernelError> {
    if ptr % align == 0 {
        return Ok(());
    }
    Err(KernelError::Misaligned {
        kernel: kernel.to_string(),
        operand,
        address: ptr,
        required: align,
    })
}

/// `min <= value <= max`, or [`KernelError::OutOfRange`].
pub(crate) fn check_range(
    kernel: &str,
    what: &'static str,
    value: i128,
    min: i128,
    max: i128,
) -> Result<(), KernelError> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(KernelError::OutOfRange {
        kernel: kernel.to_string(),
        what,
        value,
        min,
        max,
    })
}

/// `value` as the ABI's `int32_t`: the one size conversion of a launch.
pub(crate) fn to_i32(kernel: &str, what: &'static str, value: usize) -> Result<i32, KernelError> {
    i32::try_from(value).map_err(|_| KernelError::OutOfRange {
        kernel: kernel.to_string(),
        what,
        value: value as i128,
        min: 0,
        max: i32::MAX as i128,
    })
}

/// The product of `dims` as an element count, or [`KernelError::OutOfRange`] on overflow.
pub(crate) fn extent(
    kernel: &str,
    what: &'static str,
    dims: &[usize],
) -> Result<usize, KernelError> {
    let product = dims
        .iter()
        .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128));
    match product.and_then(|p| usize::try_from(p).ok()) {
        Some(p) => Ok(p),
        None => Err(KernelError::OutOfRange {
            kernel: kernel.to_string(),
            what,
            value: i128::MAX,
            min: 0,
            max: usize::MAX as i128,
        }),
    }
}

/// `value % multiple == 0`, or [`KernelError::NotMultiple`].
pub(crate) fn check_multiple(
    kernel: &str,
    what: &'static str,
    value: usize,
    multiple: usize,
) -> Result<(), KernelError> {
    if value % multiple == 0 {
        return Ok(());
    }
    Err(KernelError::NotMultiple {
        kernel: kernel.to_string(),
        what,
        value,
        multiple,
    })
}

/// A checked C call, ready to go: the argument struct holds only addresses the binder
/// checked (or null where the ABI allows it) and sizes converted from checked values.
#[derive(Debug)]
#[cfg_attr(not(moefuse_moe_linked), allow(dead_code))]
pub(crate) enum Call {
    Gemm {
        run: ffi::GemmLaunchFn,
        args: ffi::MoefuseGemmArgs,
        workspace: u64,
        workspace_bytes: usize,
    },
    Grouped {
        run: ffi::GroupedLaunchFn,
        args: ffi::MoefuseGroupedGemmArgs,
        workspace: u64,
        workspace_bytes: usize,
    },
    RouterForward(ffi::MoefuseRouterArgs),
    RouterBackward(ffi::MoefuseRouterBwdArgs),
    ActivationForward(ffi::MoefuseActivationArgs),
    ActivationBackward(ffi::MoefuseActivationArgs),
    Permute(ffi::MoefusePermuteArgs),
    Combine(ffi::MoefuseCombineArgs),
    CombineBackward(ffi::MoefuseCombineBwdArgs),
}

impl Call {
    /// Enqueues the call on `stream`: `Ok` or the status with the library's message.
    fn invoke(&self, stream: *mut c_void) -> Result<(), (Status, String)> {
        #[cfg(not(moefuse_moe_linked))]
        if !matches!(self, Call::Gemm { .. } | Call::Grouped { .. }) {
            let _ = stream;
            return Err((
                Status::ArchMismatch,
                "built without MoE kernels (MOEFUSE_CUDA_ARCHS=none or feature `moe` off)".into(),
            ));
        }
        // SAFETY: every `Call` is built by a `bind` of this crate: its device addresses come
        // from buffers of the launch's context whose lengths cover the extents abi.h gives
        // for its sizes and whose alignment was checked (or from `launch_grouped_raw`, whose
        // caller guarantees the same); device-side indices (offsets, total_rows, ids,
        // row_of) are clamped or skipped by the kernels, whatever they hold; the
        // buffers' guards live in the binder until after this call; the context is bound to
        // this thread and `stream` belongs to it. Each launcher only reads its argument
        // struct, which outlives the call.
        let raw = unsafe {
            match self {
                Call::Gemm {
                    run,
                    args,
                    workspace,
                    workspace_bytes,
                } => run(args, *workspace as *mut c_void, *workspace_bytes, stream),
                Call::Grouped {
                    run,
                    args,
                    workspace,
                    workspace_bytes,
                } => run(args, *workspace as *mut c_void, *workspace_bytes, stream),
                #[cfg(moefuse_moe_linked)]
                Call::RouterForward(a) => ffi::moefuse_moe_router_fwd(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::RouterBackward(a) => ffi::moefuse_moe_router_bwd(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::ActivationForward(a) => ffi::moefuse_moe_activation_fwd(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::ActivationBackward(a) => ffi::moefuse_moe_activation_bwd(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::Permute(a) => ffi::moefuse_moe_permute(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::Combine(a) => ffi::moefuse_moe_combine(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::CombineBackward(a) => ffi::moefuse_moe_combine_bwd(a, stream),
                #[cfg(not(moefuse_moe_linked))]
                _ => ffi::MOEFUSE_STATUS_ARCH_MISMATCH,
            }
        };
        if raw == ffi::MOEFUSE_STATUS_OK {
            return Ok(());
        }
        Err((Status::from_raw(raw), last_error()))
    }
}

#[cfg(test)]
mod tests;
