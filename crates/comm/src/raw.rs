//! The only `unsafe` of this crate: thin wrappers over the NVSHMEM host calls the safe types
//! use, each with the invariant it relies on.

use nvshmem_sys::{nvshmemx_init_attr_t, nvshmemx_uniqueid_t, NvshmemHost};
use std::ffi::c_void;

/// `NVSHMEMX_UNIQUEID_INITIALIZER`: version field set, payload zero.
pub(crate) fn uniqueid_initializer() -> nvshmemx_uniqueid_t {
    nvshmemx_uniqueid_t {
        version: (1 << 16) + std::mem::size_of::<nvshmemx_uniqueid_t>() as i32,
        internal: [0; 124],
    }
}

/// `NVSHMEMX_INIT_ATTR_INITIALIZER`, field by field (the header's macro, which bindgen
/// cannot translate): every nested struct carries `(1 << 16) + sizeof` as its version.
pub(crate) fn init_attr_initializer() -> nvshmemx_init_attr_t {
    use nvshmem_sys::{nvshmemx_init_args_t, nvshmemx_uniqueid_args_t};
    let v = |size: usize| (1 << 16) + size as i32;
    nvshmemx_init_attr_t {
        version: v(std::mem::size_of::<nvshmemx_init_attr_t>()),
        mpi_comm: std::ptr::null_mut(),
        args: nvshmemx_init_args_t {
            version: v(std::mem::size_of::<nvshmemx_init_args_t>()),
            uid_args: nvshmemx_uniqueid_args_t {
                version: v(std::mem::size_of::<nvshmemx_uniqueid_args_t>()),
                id: std::ptr::null_mut(),
                myrank: -1,
                nranks: -1,
            },
            content: [0; 96],
        },
    }
}

pub(crate) fn get_uniqueid(lib: &NvshmemHost, id: &mut nvshmemx_uniqueid_t) -> i32 {
    // SAFETY: `id` is a valid, initialised (versioned) uniqueid struct the call fills.
    unsafe { lib.nvshmemx_get_uniqueid(id) }
}

pub(crate) fn vendor_version(lib: &NvshmemHost) -> (i32, i32, i32) {
    let (mut a, mut b, mut c) = (0, 0, 0);
    // SAFETY: writes three ints; needs no initialised NVSHMEM.
    unsafe { lib.nvshmemx_vendor_get_version_info(&mut a, &mut b, &mut c) };
    (a, b, c)
}

/// Bootstraps this process as `rank` of `ranks` from `id` (collective over all ranks).
pub(crate) fn init_with_uniqueid(
    lib: &NvshmemHost,
    id: &mut nvshmemx_uniqueid_t,
    rank: i32,
    ranks: i32,
) -> i32 {
    let mut attr = init_attr_initializer();
    // SAFETY: `id` and `attr` are valid, versioned structs that live across both calls;
    // the attr stores a pointer to `id` that init reads before returning.
    unsafe {
        let st = lib.nvshmemx_set_attr_uniqueid_args(rank, ranks, id, &mut attr);
        if st != 0 {
            return st;
        }
        lib.nvshmemx_hostlib_init_attr(
            nvshmem_sys::flags_NVSHMEMX_INIT_WITH_UNIQUEID as u32,
            &mut attr,
        )
    }
}

pub(crate) fn finalize(lib: &NvshmemHost) {
    // SAFETY: called once, by the Runtime's Drop, after every SymmetricBuffer (each holds an
    // Arc of the Runtime) has been freed.
    unsafe { lib.nvshmemx_hostlib_finalize() }
}

pub(crate) fn my_pe(lib: &NvshmemHost) -> i32 {
    // SAFETY: valid after init; the Runtime exists only after a successful init.
    unsafe { lib.nvshmem_my_pe() }
}

pub(crate) fn n_pes(lib: &NvshmemHost) -> i32 {
    // SAFETY: as for my_pe.
    unsafe { lib.nvshmem_n_pes() }
}

pub(crate) fn malloc(lib: &NvshmemHost, bytes: usize) -> *mut c_void {
    // SAFETY: collective symmetric allocation after init; a null return is handled by the caller.
    unsafe { lib.nvshmem_malloc(bytes) }
}

pub(crate) fn free(lib: &NvshmemHost, ptr: *mut c_void) {
    // SAFETY: `ptr` came from nvshmem_malloc of this runtime and is freed once (Drop).
    unsafe { lib.nvshmem_free(ptr) }
}

pub(crate) fn peer_ptr(lib: &NvshmemHost, ptr: *const c_void, pe: i32) -> *mut c_void {
    // SAFETY: `ptr` is a symmetric address of this runtime and `pe` a valid PE (checked).
    unsafe { lib.nvshmem_ptr(ptr, pe) }
}

pub(crate) fn barrier_all_on_stream(lib: &NvshmemHost, stream: *mut c_void) {
    // SAFETY: `stream` is a live CUDA stream of the context NVSHMEM was initialised on.
    unsafe { lib.nvshmemx_barrier_all_on_stream(stream) }
}

pub(crate) fn cumodule_init(lib: &NvshmemHost, module: *mut c_void) -> i32 {
    // SAFETY: `module` is a live CUmodule loaded from an NVSHMEM-linked fatbin on the
    // context NVSHMEM was initialised on; the runtime is alive (the caller holds it).
    unsafe { lib.nvshmemx_cumodule_init(module as nvshmem_sys::CUmodule) }
}

pub(crate) fn cumodule_finalize(lib: &NvshmemHost, module: *mut c_void) -> i32 {
    // SAFETY: `module` was bound by cumodule_init and is finalised once, before unload.
    unsafe { lib.nvshmemx_cumodule_finalize(module as nvshmem_sys::CUmodule) }
}

pub(crate) fn team_split_strided(
    lib: &NvshmemHost,
    parent: i32,
    start: i32,
    stride: i32,
    size: i32,
    new_team: &mut i32,
) -> i32 {
    // SAFETY: collective over `parent` after init; a null config with mask 0 asks for the
    // defaults; `new_team` is a valid out-pointer (NVSHMEM_TEAM_INVALID for non-members).
    unsafe {
        lib.nvshmem_team_split_strided(parent, start, stride, size, std::ptr::null(), 0, new_team)
    }
}

pub(crate) fn team_destroy(lib: &NvshmemHost, team: i32) {
    // SAFETY: `team` came from team_split_strided of this runtime and is destroyed once.
    unsafe { lib.nvshmem_team_destroy(team) }
}

pub(crate) fn team_my_pe(lib: &NvshmemHost, team: i32) -> i32 {
    // SAFETY: `team` is a valid team handle of this runtime.
    unsafe { lib.nvshmem_team_my_pe(team) }
}

pub(crate) fn team_n_pes(lib: &NvshmemHost, team: i32) -> i32 {
    // SAFETY: as for team_my_pe.
    unsafe { lib.nvshmem_team_n_pes(team) }
}

pub(crate) fn team_translate_pe(lib: &NvshmemHost, team: i32, pe: i32, dest: i32) -> i32 {
    // SAFETY: both handles are valid teams of this runtime.
    unsafe { lib.nvshmem_team_translate_pe(team, pe, dest) }
}

pub(crate) fn team_sync_on_stream(lib: &NvshmemHost, team: i32, stream: *mut c_void) -> i32 {
    // SAFETY: `team` is valid and `stream` is a live stream of NVSHMEM's context.
    unsafe { lib.nvshmemx_team_sync_on_stream(team, stream as _) }
}

/// NVSHMEM's own bootstrap (NVSHMEM_BOOTSTRAP: PMI by default; PMI-2, PMIx or the MPI
/// plugin by setting), for processes started by mpirun or srun.
pub(crate) fn init_with_default_bootstrap(lib: &NvshmemHost) -> i32 {
    let mut attr = init_attr_initializer();
    // SAFETY: flags 0 selects the environment's bootstrap; `attr` is a valid, versioned
    // struct that lives across the call.
    unsafe { lib.nvshmemx_hostlib_init_attr(0, &mut attr) }
}

/// `NVSHMEM_SIGNAL_SET` / `NVSHMEM_SIGNAL_ADD` (nvshmem_common_transport.h).
pub(crate) const SIGNAL_SET: i32 = 9;
pub(crate) const SIGNAL_ADD: i32 = 10;
/// `NVSHMEM_CMP_GE` (nvshmem_constants.h).
pub(crate) const CMP_GE: i32 = 5;

/// Stream-ordered put of `bytes` from local `src` to symmetric `dst` on `pe`, then (when
/// `sig` is non-null) `sig` on `pe` updated by `op` with `value` after the data.
///
/// # Safety
/// `dst` (symmetric) and `src` (device memory) hold `bytes`; `sig` is null or a symmetric
/// u64; `pe` is a valid PE; `stream` is a live stream of NVSHMEM's context; all stay valid
/// until the stream passes this operation.
#[allow(clippy::too_many_arguments)] // the NVSHMEM call's own arguments
pub(crate) unsafe fn put_signal_on_stream(
    lib: &NvshmemHost,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    sig: *mut u64,
    value: u64,
    op: i32,
    pe: i32,
    stream: *mut c_void,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        if sig.is_null() {
            lib.nvshmemx_putmem_on_stream(dst, src, bytes, pe, stream as _)
        } else {
            lib.nvshmemx_putmem_signal_on_stream(dst, src, bytes, sig, value, op, pe, stream as _)
        }
    }
}

/// Stream-ordered get of `bytes` from symmetric `src` on `pe` into local `dst`.
///
/// # Safety
/// As for [`put_signal_on_stream`], with the roles of the buffers swapped.
pub(crate) unsafe fn get_on_stream(
    lib: &NvshmemHost,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    pe: i32,
    stream: *mut c_void,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { lib.nvshmemx_getmem_on_stream(dst, src, bytes, pe, stream as _) }
}

/// The stream waits until the local symmetric `sig` is >= `value`.
///
/// # Safety
/// `sig` is a symmetric u64 of this runtime; `stream` a live stream of its context.
pub(crate) unsafe fn wait_ge_on_stream(
    lib: &NvshmemHost,
    sig: *mut u64,
    value: u64,
    stream: *mut c_void,
) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { lib.nvshmemx_signal_wait_until_on_stream(sig, CMP_GE, value, stream as _) }
}

/// Completes this PE's outstanding stream-ordered puts (ordered on `stream`).
///
/// # Safety
/// `stream` is a live stream of NVSHMEM's context.
pub(crate) unsafe fn quiet_on_stream(lib: &NvshmemHost, stream: *mut c_void) {
    // SAFETY: forwarded from the caller's contract.
    unsafe { lib.nvshmemx_quiet_on_stream(stream as _) }
}

/// Zeroes `bytes` at device address `ptr` on `stream`.
pub(crate) fn memset_zero(
    ptr: u64,
    bytes: usize,
    stream: &cudarc::driver::CudaStream,
) -> Result<(), crate::CommError> {
    if bytes == 0 {
        return Ok(());
    }
    // SAFETY: callers pass a live allocation of at least `bytes` bytes (a symmetric buffer
    // they own); the memset is ordered on `stream`.
    unsafe {
        cudarc::driver::result::memset_d8_async(
            ptr as cudarc::driver::sys::CUdeviceptr,
            0,
            bytes,
            stream.cu_stream(),
        )
    }
    .map_err(|e| crate::CommError::Cuda(e.to_string()))
}
