//! Driver checks of device addresses that come from outside cudarc (the raw launch entry,
//! [`crate::Kernels::launch_grouped_raw`]): the address is device memory of the handle's
//! device, and its allocation holds the operand's extent; and the binding of a grouped GEMM
//! on such addresses ([`bind_grouped_raw`]).

use crate::bind::{check_align, check_len, Call};
use crate::ops::{
    grouped_args, grouped_entry, grouped_extents, GROUPED_WORKSPACE_ALIGN, OPERAND_ALIGN,
};
use crate::{CompiledVariant, GroupedShape, KernelError, Kernels, RawGrouped};
use cudarc::driver::sys;
use std::ffi::c_void;

/// One pointer attribute of `ptr`, of type `T`.
fn attribute<T: Default>(
    attr: sys::CUpointer_attribute,
    ptr: u64,
) -> Result<T, cudarc::driver::DriverError> {
    let mut value = T::default();
    // SAFETY: cuPointerGetAttribute writes one value of the attribute's type (int for the
    // ordinal, CUdeviceptr for the range start, size_t for its size: `T` at each call site)
    // into `value`, which lives for the call; `ptr` is only looked up, never dereferenced.
    unsafe { sys::cuPointerGetAttribute(&mut value as *mut T as *mut c_void, attr, ptr) }
        .result()?;
    Ok(value)
}

/// Checks that `[ptr, ptr + elems * size)` lies in one device allocation of `kernels`'s device.
pub(crate) fn check_range_of(
    kernels: &Kernels,
    kernel: &str,
    operand: &'static str,
    ptr: u64,
    elems: usize,
    size: usize,
) -> Result<(), KernelError> {
    use sys::CUpointer_attribute::*;
    let not_device = |source| KernelError::NotDeviceMemory {
        kernel: kernel.to_string(),
        operand,
        address: ptr,
        source,
    };
    let ordinal: i32 = attribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr).map_err(not_device)?;
    let ours = kernels.context();
    if usize::try_from(ordinal).ok() != Some(ours.ordinal()) {
        return Err(KernelError::WrongDevice {
            kernel: kernel.to_string(),
            operand,
            expected: ours.ordinal(),
            found: usize::try_from(ordinal).unwrap_or(usize::MAX),
            expected_ctx: ours.cu_ctx() as usize,
            found_ctx: 0,
        });
    }
    let start: u64 = attribute(CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr).map_err(not_device)?;
    let bytes: usize = attribute(CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr).map_err(not_device)?;
    let needed = elems.saturating_mul(size);
    let end = start.saturating_add(bytes as u64);
    if ptr.saturating_add(needed as u64) <= end {
        return Ok(());
    }
    Err(KernelError::OutsideAllocation {
        kernel: kernel.to_string(),
        operand,
        address: ptr,
        needed,
        start,
        size: bytes,
    })
}

/// Checks that the foreign `stream` (0: the legacy default stream) belongs to the handle's
/// context.
pub(crate) fn check_stream(
    kernels: &Kernels,
    kernel: &str,
    stream: u64,
) -> Result<(), KernelError> {
    if stream == 0 {
        return Ok(());
    }
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: cuStreamGetCtx writes one CUcontext into `ctx`, which lives for the call; the
    // stream handle is only looked up (the raw entry's caller guarantees it is live).
    unsafe { sys::cuStreamGetCtx(stream as sys::CUstream, &mut ctx) }.result()?;
    let ours = kernels.context();
    if ctx == ours.cu_ctx() {
        return Ok(());
    }
    Err(KernelError::WrongDevice {
        kernel: kernel.to_string(),
        operand: "stream",
        expected: ours.ordinal(),
        found: usize::MAX,
        expected_ctx: ours.cu_ctx() as usize,
        found_ctx: ctx as usize,
    })
}

/// The checks of [`GroupedGemm::bind`] on foreign addresses: the same host rules, and the
/// driver's word that each address is device memory of the handle's context with room for
/// its extent.
pub(crate) fn bind_grouped_raw(
    kernels: &Kernels,
    variant: &'static CompiledVariant,
    s: &GroupedShape,
    raw: &RawGrouped,
    kernel: &str,
) -> Result<Option<Call>, KernelError> {
    let (run, _) = grouped_entry(kernels, variant, kernel)?;
    let need = kernels.grouped_workspace(variant, s)?;
    let [ea, eb, ed] = grouped_extents(kernel, variant.spec.op, s)?;
    check_len(kernel, "workspace", need, raw.workspace_bytes)?;
    if s.groups == 0 {
        return Ok(None);
    }
    for (operand, ptr, elems, size, align) in [
        ("offsets", raw.offsets, s.groups, 4, 4),
        ("a", raw.a, ea, 2, OPERAND_ALIGN),
        ("b", raw.b, eb, 2, OPERAND_ALIGN),
        ("d", raw.d, ed, 2, OPERAND_ALIGN),
        ("workspace", raw.workspace, need, 1, GROUPED_WORKSPACE_ALIGN),
    ] {
        check_align(kernel, operand, ptr, align)?;
        check_range_of(kernels, kernel, operand, ptr, elems, size)?;
    }
    let args = grouped_args(
        variant.spec.op,
        s,
        kernel,
        raw.offsets,
        [raw.a, raw.b, raw.d],
    )?;
    Ok(Some(Call::Grouped {
        run,
        args,
        workspace: raw.workspace,
        workspace_bytes: raw.workspace_bytes,
    }))
}
