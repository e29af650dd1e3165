//! NVSHMEM device modules on the GPU: an embedded fatbin (see [`crate::embedded_modules`])
//! loaded with the driver API, bound to the running NVSHMEM with `nvshmemx_cumodule_init`,
//! and its kernels launched on a caller's stream.
//!
//! The only `unsafe` of the comm crate outside `raw`: driver calls on handles this type owns,
//! and launches whose argument struct the kernel's C declaration fixes.

use crate::{module, raw, CommError, Runtime};
use cudarc::driver::{result, sys, CudaStream};
use std::ffi::{c_void, CString};
use std::sync::Arc;

fn cuda(e: result::DriverError) -> CommError {
    CommError::Cuda(e.to_string())
}

/// The embedded-module arch name for the device of `rt`, or a typed error.
pub(crate) fn device_arch(rt: &Runtime) -> Result<&'static str, CommError> {
    let (major, minor) = rt.context().compute_capability().map_err(cuda)?;
    moefuse_kernels::arch_of(major, minor)
        .map(|arch| arch.name())
        .map_err(|_| CommError::UnsupportedDevice { major, minor })
}

/// A loaded, NVSHMEM-bound module. Unloaded (after `nvshmemx_cumodule_finalize`) on drop.
pub(crate) struct DeviceModule {
    rt: Arc<Runtime>,
    module: sys::CUmodule,
}

// SAFETY: a CUmodule handle may be used from any thread of its context; the runtime it needs
// is kept alive by the Arc.
unsafe impl Send for DeviceModule {}
// SAFETY: as above; launches only read the handle.
unsafe impl Sync for DeviceModule {}

/// A 1-D launch's grid and block sizes and its dynamic shared memory bytes.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LaunchShape {
    pub grid: u32,
    pub block: u32,
    pub smem: u32,
}

/// One kernel of a [`DeviceModule`], valid while the module lives.
#[derive(Clone, Copy)]
pub(crate) struct Kernel(sys::CUfunction);

impl DeviceModule {
    /// Loads the embedded module `name` for this device and binds it to NVSHMEM.
    pub(crate) fn load(rt: &Arc<Runtime>, name: &str) -> Result<Self, CommError> {
        let arch = device_arch(rt)?;
        let image = module(name, arch).ok_or_else(|| CommError::ModuleNotBuilt {
            name: name.to_string(),
            arch,
            built: env!("MOEFUSE_COMM_BUILT_ARCHS"),
        })?;
        rt.context().bind_to_thread().map_err(cuda)?;
        // The driver wants the image 8-byte aligned and NUL-safe: copy into a u64 buffer.
        let mut aligned = vec![0u64; image.fatbin.len().div_ceil(8)];
        // SAFETY: `aligned` has at least `fatbin.len()` bytes; the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                image.fatbin.as_ptr(),
                aligned.as_mut_ptr() as *mut u8,
                image.fatbin.len(),
            )
        };
        // SAFETY: `aligned` holds a complete fatbin (checked for its magic by the build and
        // a test); the driver copies what it needs before returning.
        let module = unsafe { result::module::load_data(aligned.as_ptr() as *const c_void) }
            .map_err(cuda)?;
        let status = raw::cumodule_init(rt.host(), module as *mut c_void);
        if status != 0 {
            // SAFETY: the module was loaded above and is not used afterwards.
            let _ = unsafe { result::module::unload(module) };
            return Err(CommError::ModuleInit {
                name: name.to_string(),
                status,
                built_with: {
                    let (a, b, c) = nvshmem_sys::bound_version();
                    format!("{a}.{b}.{c}")
                },
            });
        }
        tracing::debug!(name, arch, "nvshmem device module loaded");
        Ok(DeviceModule {
            rt: rt.clone(),
            module,
        })
    }

    /// The kernel `name` (an `extern "C"` symbol of the module).
    pub(crate) fn kernel(&self, name: &str) -> Result<Kernel, CommError> {
        let c =
            CString::new(name).map_err(|_| CommError::Cuda(format!("bad kernel name {name}")))?;
        // SAFETY: `self.module` is loaded until drop.
        let f = unsafe { result::module::get_function(self.module, c) }
            .map_err(|e| CommError::Cuda(format!("{name}: {e}")))?;
        Ok(Kernel(f))
    }

    /// Launches `kernel` with one by-value argument `args`.
    ///
    /// # Safety
    /// `A` must be exactly the kernel's single parameter type (a `#[repr(C)]` mirror of its
    /// C struct), and every pointer in it must be valid for what the kernel does with it
    /// until the stream reaches the launch's end.
    pub(crate) unsafe fn launch<A>(
        &self,
        kernel: Kernel,
        stream: &CudaStream,
        grid: u32,
        block: u32,
        smem: u32,
        args: &A,
    ) -> Result<(), CommError> {
        let mut params = [args as *const A as *mut c_void];
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.launch_params(kernel, stream, grid, block, smem, &mut params) }
    }

    /// Launches `kernel` with one by-value argument `args`, programmatically dependent on
    /// the kernel before it on `stream` (programmatic stream serialization): its blocks may
    /// become resident once every block of that kernel ran `griddepcontrol.launch_dependents`
    /// (or exited), and must run `griddepcontrol.wait` before reading anything it writes.
    ///
    /// # Safety
    /// As [`DeviceModule::launch`], and the kernel must wait (`griddepcontrol.wait`) before
    /// it touches any memory the previous kernel writes or reads.
    pub(crate) unsafe fn launch_dependent<A>(
        &self,
        kernel: Kernel,
        stream: &CudaStream,
        shape: LaunchShape,
        args: &A,
    ) -> Result<(), CommError> {
        let LaunchShape { grid, block, smem } = shape;
        let mut params = [args as *const A as *mut c_void];
        // SAFETY: an all-zero CUlaunchAttribute is a valid value of the C union; the id and
        // the one field it selects are set below.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: forwarded from the caller's contract; `config` and `attr` live across the
        // call, and the driver copies the arguments before returning.
        unsafe {
            sys::cuLaunchKernelEx(&config, kernel.0, params.as_mut_ptr(), std::ptr::null_mut())
        }
        .result()
        .map_err(cuda)
    }

    /// Launches `kernel` with `params`, one pointer per kernel parameter.
    ///
    /// # Safety
    /// `params[i]` must point to a value of the kernel's i-th parameter type, and every
    /// device pointer among them must be valid for the kernel's use until it finishes.
    pub(crate) unsafe fn launch_params(
        &self,
        kernel: Kernel,
        stream: &CudaStream,
        grid: u32,
        block: u32,
        smem: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CommError> {
        // SAFETY: forwarded from the caller's contract; the driver copies the arguments
        // before returning, so they need not outlive the call.
        unsafe {
            result::launch_kernel(
                kernel.0,
                (grid, 1, 1),
                (block, 1, 1),
                smem,
                stream.cu_stream(),
                params,
            )
        }
        .map_err(cuda)
    }
}

impl Drop for DeviceModule {
    fn drop(&mut self) {
        let _ = self.rt.context().bind_to_thread();
        let status = raw::cumodule_finalize(self.rt.host(), self.module as *mut c_void);
        if status != 0 {
            tracing::warn!(status, "nvshmemx_cumodule_finalize failed");
        }
        // SAFETY: loaded by `load`, unloaded once here; no kernel handle outlives the module
        // in this crate (they live in the same owner).
        if let Err(e) = unsafe { result::module::unload(self.module) } {
            tracing::warn!(%e, "cuModuleUnload failed");
        }
    }
}

/// A few `u64` words of pinned host memory mapped into the device's address space: the
/// kernels write them, the host reads them at any time without synchronising a stream.
pub(crate) struct HostWords {
    host: *mut u64,
    device: u64,
    len: usize,
}

// SAFETY: the words are plain pinned host memory owned by this value; reads and writes go
// through volatile accesses, and the allocation is freed once, by Drop.
unsafe impl Send for HostWords {}
// SAFETY: as above; `&self` methods only read.
unsafe impl Sync for HostWords {}

impl HostWords {
    /// `len` zeroed words, mapped for the device of `rt`'s context.
    pub(crate) fn new(rt: &Runtime, len: usize) -> Result<Self, CommError> {
        rt.context().bind_to_thread().map_err(cuda)?;
        let bytes = len.max(1) * std::mem::size_of::<u64>();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a fresh allocation of `bytes`; zeroed below before anyone reads it.
        let host = unsafe { result::malloc_host(bytes, flags) }.map_err(cuda)? as *mut u64;
        // NOTES: built before the device pointer is known so that an early return frees the
        // allocation; completed in place below (a struct update `..words` would copy the
        // fields and then drop `words`, freeing the memory the result still points to).
        let mut words = HostWords {
            host,
            device: 0,
            len,
        };
        // SAFETY: `host` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: `host` came from cuMemHostAlloc with DEVICEMAP on the bound context.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) }
            .result()
            .map_err(cuda)?;
        words.device = device as u64;
        Ok(words)
    }

    /// The device address of word 0.
    pub(crate) fn device_ptr(&self) -> u64 {
        self.device
    }

    /// Word `i`, as the device last wrote it.
    pub(crate) fn read(&self, i: usize) -> u64 {
        assert!(i < self.len, "word {i} of {}", self.len);
        // SAFETY: `i` is inside the live allocation; volatile because the device writes it.
        unsafe { std::ptr::read_volatile(self.host.add(i)) }
    }
}

impl Drop for HostWords {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once; its users (kernels of
        // the owner) have finished: the owner synchronises its stream before dropping this.
        if let Err(e) = unsafe { result::free_host(self.host as *mut c_void) } {
            tracing::warn!(%e, "cuMemFreeHost failed");
        }
    }
}

/// The ordinal of the device whose memory holds `addr`, or `None` when the driver does not
/// know `addr` as device memory.
pub(crate) fn device_of(addr: u64) -> Option<usize> {
    let mut ordinal: i32 = -1;
    // SAFETY: the attribute is an int written to `ordinal`; an unknown address is reported
    // as an error, never dereferenced.
    let status = unsafe {
        sys::cuPointerGetAttribute(
            &mut ordinal as *mut i32 as *mut c_void,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            addr as sys::CUdeviceptr,
        )
    };
    (status == sys::CUresult::CUDA_SUCCESS && ordinal >= 0).then_some(ordinal as usize)
}

/// True once every piece of work queued on `stream` has finished.
pub(crate) fn stream_idle(stream: &CudaStream) -> Result<bool, CommError> {
    stream.context().bind_to_thread().map_err(cuda)?;
    // SAFETY: `stream` is a live stream of a live context (the Arc keeps both).
    match unsafe { sys::cuStreamQuery(stream.cu_stream()) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        other => Err(cuda(result::DriverError(other))),
    }
}
