//! The host side of one launch: [`Binder`] checks each buffer (context, length, alignment)
//! and holds its `device_ptr` guard; the size checks and conversions every operation uses;
//! and [`Call`], the ABI arguments of one launch with the one `unsafe` call of the layer.

use crate::{ffi, last_error, KernelError, Kernels, Status};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use std::ffi::c_void;

/// Checks buffers against a launch and holds their `device_ptr` guards until the launch is
/// enqueued (dropped after [`Call::invoke`]).
pub(crate) struct Binder<'a> {
    pub(crate) kernels: &'a Kernels,
    stream: &'a CudaStream,
    pub(crate) kernel: String,
    guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> Binder<'a> {
    /// A binder for one launch of `kernel` on `stream`, holding no guard yet.
    pub(crate) fn new(kernels: &'a Kernels, stream: &'a CudaStream, kernel: String) -> Self {
        Binder {
            kernels,
            stream,
            kernel,
            guards: Vec::new(),
        }
    }

    pub(crate) fn check_context(
        &self,
        operand: &'static str,
        owner: &CudaContext,
    ) -> Result<(), KernelError> {
        let ours = self.kernels.context();
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
    ActivationBackwardRouted(ffi::MoefuseActivationRoutedArgs),
    Permute(ffi::MoefusePermuteArgs),
    GateUpFused(ffi::MoefuseGateUpArgs),
    DownScatter(ffi::MoefuseDownScatterArgs),
    DownDgradFused(ffi::MoefuseDownDgradArgs),
    DecodeForward(ffi::MoefuseDecodeArgs),
    ScatterColumns(ffi::MoefuseScatterColumnsArgs),
    ColumnsToF32(ffi::MoefuseColumnsToF32Args),
    Combine(ffi::MoefuseCombineArgs),
    CombineBackward(ffi::MoefuseCombineBwdArgs),
}

impl Call {
    /// Enqueues the call on `stream`: `Ok` or the status with the library's message.
    pub(crate) fn invoke(&self, stream: *mut c_void) -> Result<(), (Status, String)> {
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
                Call::ActivationBackwardRouted(a) => {
                    ffi::moefuse_moe_activation_bwd_routed(a, stream)
                }
                #[cfg(moefuse_moe_linked)]
                Call::Permute(a) => ffi::moefuse_moe_permute(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::GateUpFused(a) => ffi::moefuse_moe_gate_up_fused(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::DownScatter(a) => ffi::moefuse_moe_down_scatter(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::DownDgradFused(a) => ffi::moefuse_moe_down_dgrad_fused(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::DecodeForward(a) => ffi::moefuse_moe_decode_forward(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::ScatterColumns(a) => ffi::moefuse_moe_scatter_columns(a, stream),
                #[cfg(moefuse_moe_linked)]
                Call::ColumnsToF32(a) => ffi::moefuse_moe_columns_to_f32(a, stream),
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
