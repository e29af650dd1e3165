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
