//! The per-context handle of the launch layer: which device, which arch, how many SMs,
//! checked once ([`Kernels::new`]). Launching lives in `launch.rs`, the host checks and the
//! one `unsafe` call in `bind.rs`.

use crate::{built_archs, check_abi, KernelError, VariantArch};
use cudarc::driver::CudaContext;
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

pub(crate) fn require_built(arch: VariantArch, built: &[&str]) -> Result<(), KernelError> {
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
}
