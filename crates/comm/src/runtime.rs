//! The NVSHMEM runtime: bootstrap by unique id, symmetric buffers, stream barriers.
//!
//! Lifetimes make use-after-finalize impossible in safe code: a [`SymmetricBuffer`] holds an
//! `Arc` of its [`Runtime`], which finalises NVSHMEM only when the last buffer is gone.
//! NOTES: this layer has run on the build machine only (library loading, unique ids,
//! argument checks); its first GPU run is the comm issue's next device call.

use crate::{raw, CommError};
use cudarc::driver::{CudaContext, CudaStream};
use nvshmem_sys::{nvshmemx_uniqueid_t, NvshmemHost};
use std::marker::PhantomData;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

static INITIALISED: AtomicBool = AtomicBool::new(false);

/// The loaded NVSHMEM host library, version-checked against the bindings.
#[derive(Clone)]
pub struct Library(Arc<NvshmemHost>);

impl Library {
    /// Loads the host library (see [`nvshmem_sys::library_candidates`] for where it looks)
    /// and checks its version is the one the bindings were generated from.
    ///
    /// ```no_run
    /// let lib = moefuse_comm::Library::load(None)?;
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn load(explicit: Option<&Path>) -> Result<Self, CommError> {
        let lib = nvshmem_sys::load(explicit).map_err(|e| CommError::Library(e.to_string()))?;
        check_version(raw::vendor_version(&lib), nvshmem_sys::bound_version())?;
        Ok(Library(Arc::new(lib)))
    }
}

/// The loaded library must be exactly the bound version, patch included: the device
/// modules are linked against that release's device library, and NVSHMEM's host/device
/// contract is only promised within one release.
fn check_version(found: (i32, i32, i32), bound: (u32, u32, u32)) -> Result<(), CommError> {
    let (a, b, c) = bound;
    if (found.0 as i64, found.1 as i64, found.2 as i64) != (a as i64, b as i64, c as i64) {
        return Err(CommError::Version {
            found: format!("{}.{}.{}", found.0, found.1, found.2),
            bound: format!("{a}.{b}.{c}"),
        });
    }
    Ok(())
}

/// The bootstrap secret every rank passes to [`Runtime::init`]: created by one rank, sent
/// to the others by the caller's launcher (hex text fits an environment variable).
#[derive(Clone, Copy)]
pub struct UniqueId(nvshmemx_uniqueid_t);

impl UniqueId {
    /// A new id (on the rank that coordinates the bootstrap).
    pub fn create(lib: &Library) -> Result<Self, CommError> {
        let mut id = raw::uniqueid_initializer();
        match raw::get_uniqueid(&lib.0, &mut id) {
            0 => Ok(UniqueId(id)),
            status => Err(CommError::Nvshmem {
                call: "nvshmemx_get_uniqueid",
                status,
            }),
        }
    }

    /// The id as 256 hex digits.
    pub fn to_hex(&self) -> String {
        let mut s = format!("{:08x}", self.0.version as u32);
        for &c in &self.0.internal {
            s.push_str(&format!("{:02x}", c as u8));
        }
        s
    }

    /// Parses [`UniqueId::to_hex`]'s text.
    ///
    /// ```
    /// assert!(moefuse_comm::UniqueId::from_hex("zz").is_err());
    /// ```
    pub fn from_hex(text: &str) -> Result<Self, CommError> {
        let bad = || CommError::UniqueIdText(text.chars().take(16).collect());
        if text.len() != 8 + 2 * 124 || !text.is_ascii() {
            return Err(bad());
        }
        let version = u32::from_str_radix(&text[..8], 16).map_err(|_| bad())? as i32;
        let mut internal = [0 as std::os::raw::c_char; 124];
        for (i, byte) in internal.iter_mut().enumerate() {
            let at = 8 + 2 * i;
            *byte = u8::from_str_radix(&text[at..at + 2], 16).map_err(|_| bad())?
                as std::os::raw::c_char;
        }
        Ok(UniqueId(nvshmemx_uniqueid_t { version, internal }))
    }
}

/// An initialised NVSHMEM runtime (one per process).
pub struct Runtime {
    lib: Library,
    ctx: Arc<CudaContext>,
    rank: usize,
    ranks: usize,
    /// The largest signal epoch any expert-parallel instance of this runtime used: the next
    /// instance proposes it as its base, so epochs never restart (see `ExpertParallel::new`).
    epoch_floor: AtomicU64,
}

impl Runtime {
    /// Joins the job as `rank` of `ranks` on `ctx`'s device (collective: every rank calls it
    /// with the same id). Fails if NVSHMEM is already initialised in this process.
    pub fn init(
        lib: &Library,
        ctx: &Arc<CudaContext>,
        id: &UniqueId,
        rank: usize,
        ranks: usize,
    ) -> Result<Arc<Self>, CommError> {
        check_rank(rank, ranks)?;
        let mut id = id.0;
        Self::init_by(
            lib,
            ctx,
            Some((rank, ranks)),
            "nvshmemx_hostlib_init_attr",
            |host| raw::init_with_uniqueid(host, &mut id, rank as i32, ranks as i32),
        )
    }

    /// Joins the job `moefuse-launch` started (`cargo xtask launch`, `launch`): rank 0
    /// creates the unique id, every rank gets it through the launcher's rendezvous
    /// ([`exchange_unique_id`](crate::exchange_unique_id)), then [`Runtime::init`] as
    /// `env.rank` of `env.world_size`.
    ///
    /// ```no_run
    /// use moefuse_comm::{LaunchEnv, Library, Runtime};
    /// let env = LaunchEnv::from_env()?.expect("run me under cargo xtask launch");
    /// let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let rt = Runtime::join_launched(&Library::load(None)?, &ctx, &env)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn join_launched(
        lib: &Library,
        ctx: &Arc<CudaContext>,
        env: &crate::LaunchEnv,
    ) -> Result<Arc<Self>, CommError> {
        let hex = crate::exchange_unique_id(env, || Ok(UniqueId::create(lib)?.to_hex()))?;
        Self::init(
            lib,
            ctx,
            &UniqueId::from_hex(&hex)?,
            env.rank,
            env.world_size,
        )
    }

    /// Joins a job started by `mpirun` or `srun` through NVSHMEM's own bootstrap
    /// (`NVSHMEM_BOOTSTRAP`: PMI by default; PMI-2, PMIx, or the MPI plugin by setting);
    /// rank and size come from the launcher. NOTES: not exercised here (no PMI on the
    /// machines this project can reach); the unique-id path is the tested one.
    ///
    /// ```no_run
    /// # let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    /// let lib = moefuse_comm::Library::load(None)?;
    /// let rt = moefuse_comm::Runtime::init_with_bootstrap(&lib, &ctx)?;
    /// println!("rank {} of {}", rt.rank(), rt.ranks());
    /// # Ok::<(), moefuse_comm::CommError>(())
    /// ```
    pub fn init_with_bootstrap(
        lib: &Library,
        ctx: &Arc<CudaContext>,
    ) -> Result<Arc<Self>, CommError> {
        Self::init_by(
            lib,
            ctx,
            None,
            "nvshmemx_hostlib_init_attr (NVSHMEM_BOOTSTRAP)",
            raw::init_with_default_bootstrap,
        )
    }

    /// The common part of every init: one runtime per process, the device bound, the
    /// reported rank and size checked against `expected`.
    fn init_by(
        lib: &Library,
        ctx: &Arc<CudaContext>,
        expected: Option<(usize, usize)>,
        call: &'static str,
        init: impl FnOnce(&NvshmemHost) -> i32,
    ) -> Result<Arc<Self>, CommError> {
        if INITIALISED.swap(true, Ordering::SeqCst) {
            return Err(CommError::AlreadyInitialised);
        }
        let result = (|| {
            ctx.bind_to_thread()
                .map_err(|e| CommError::Cuda(e.to_string()))?;
            let status = init(&lib.0);
            if status != 0 {
                return Err(CommError::Nvshmem { call, status });
            }
            let (me, n) = (raw::my_pe(&lib.0) as usize, raw::n_pes(&lib.0) as usize);
            if let Some(expected) = expected.filter(|&e| e != (me, n)) {
                raw::finalize(&lib.0);
                return Err(CommError::RankMismatch {
                    expected,
                    found: (me, n),
                });
            }
            tracing::debug!(rank = me, ranks = n, "nvshmem initialised");
            Ok(Arc::new(Runtime {
                lib: lib.clone(),
                ctx: ctx.clone(),
                rank: me,
                ranks: n,
                epoch_floor: AtomicU64::new(0),
            }))
        })();
        if result.is_err() {
            INITIALISED.store(false, Ordering::SeqCst);
        }
        result
    }

    /// This process's rank (PE).
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// World size.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The CUDA context NVSHMEM was initialised on.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub(crate) fn host(&self) -> &NvshmemHost {
        &self.lib.0
    }

    /// The largest epoch an expert-parallel instance of this runtime has used.
    pub(crate) fn epoch_floor(&self) -> u64 {
        self.epoch_floor.load(Ordering::SeqCst)
    }

    /// Records that epochs up to `epoch` were used (never lowers the floor).
    pub(crate) fn raise_epoch_floor(&self, epoch: u64) {
        self.epoch_floor.fetch_max(epoch, Ordering::SeqCst);
    }

    /// PEs sharing this PE's GPU (NVSHMEM's `NVSHMEMI_TEAM_SAME_GPU`): more than one means
    /// NVSHMEM's "limited MPG" mode, where it aborts the process on team splits and on
    /// host-initiated stream operations; the calls that would abort return
    /// [`CommError::Unsupported`] instead. Device-initiated communication (our kernels)
    /// works there.
    pub fn pes_sharing_gpu(&self) -> usize {
        const TEAM_SAME_GPU: i32 = 4;
        raw::team_n_pes(&self.lib.0, TEAM_SAME_GPU).max(1) as usize
    }

    pub(crate) fn refuse_in_mpg(&self, what: &str) -> Result<(), CommError> {
        let sharing = self.pes_sharing_gpu();
        if sharing > 1 {
            return Err(CommError::Unsupported(format!(
                "{what} with {sharing} PEs on one GPU: NVSHMEM supports it only with one PE per GPU (or MPS)"
            )));
        }
        Ok(())
    }

    /// Collectively allocates `len` elements of `T` on the symmetric heap (every rank must
    /// call it with the same `len`, in the same order).
    pub fn alloc<T: Copy>(self: &Arc<Self>, len: usize) -> Result<SymmetricBuffer<T>, CommError> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(CommError::Alloc { bytes: usize::MAX })?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| CommError::Cuda(e.to_string()))?;
        let ptr = raw::malloc(&self.lib.0, bytes.max(1));
        if ptr.is_null() {
            return Err(CommError::Alloc { bytes });
        }
        Ok(SymmetricBuffer {
            runtime: self.clone(),
            ptr,
            len,
            marker: PhantomData,
        })
    }

    /// [`Runtime::alloc`], then zero-filled on `stream` and followed by a barrier on it, so
    /// no peer can write into the buffer before it is zeroed everywhere (collective).
    pub fn alloc_zeroed<T: Copy>(
        self: &Arc<Self>,
        len: usize,
        stream: &CudaStream,
    ) -> Result<SymmetricBuffer<T>, CommError> {
        let buf = self.alloc::<T>(len)?;
        raw::memset_zero(buf.device_ptr(), len * std::mem::size_of::<T>(), stream)?;
        self.barrier_on_stream(stream);
        Ok(buf)
    }

    /// A barrier over all ranks, ordered on `stream`.
    pub fn barrier_on_stream(&self, stream: &CudaStream) {
        raw::barrier_all_on_stream(&self.lib.0, stream.cu_stream() as *mut std::ffi::c_void);
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        raw::finalize(&self.lib.0);
        INITIALISED.store(false, Ordering::SeqCst);
    }
}

/// The rule `Runtime::init` checks first, before any CUDA or NVSHMEM call.
fn check_rank(rank: usize, ranks: usize) -> Result<(), CommError> {
    if ranks == 0 || rank >= ranks {
        return Err(CommError::Rank { rank, ranks });
    }
    Ok(())
}

/// `len` elements of `T` at the same symmetric address on every rank.
pub struct SymmetricBuffer<T> {
    runtime: Arc<Runtime>,
    ptr: *mut std::ffi::c_void,
    len: usize,
    marker: PhantomData<T>,
}

// SAFETY: the buffer is device memory owned by the runtime; the handle carries no host
// references, and frees happen through the runtime's library, which is thread-safe.
unsafe impl<T: Send> Send for SymmetricBuffer<T> {}

impl<T> SymmetricBuffer<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The runtime the buffer lives on.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// This rank's device address of the buffer.
    pub fn device_ptr(&self) -> u64 {
        self.ptr as u64
    }

    /// The buffer of `pe` as a load/store address on this device, when `pe` is reachable
    /// over NVLink (or is this rank); `None` for peers reached only through NVSHMEM puts.
    pub fn peer_ptr(&self, pe: usize) -> Result<Option<u64>, CommError> {
        if pe >= self.runtime.ranks {
            return Err(CommError::Rank {
                rank: pe,
                ranks: self.runtime.ranks,
            });
        }
        let p = raw::peer_ptr(&self.runtime.lib.0, self.ptr, pe as i32);
        Ok((!p.is_null()).then_some(p as u64))
    }
}

impl<T> Drop for SymmetricBuffer<T> {
    fn drop(&mut self) {
        raw::free(&self.runtime.lib.0, self.ptr);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The host library is part of the pinned toolchain (`cargo xtask setup`): these tests
    // need no GPU, only the library, and fail with its search list when it is missing.
    fn lib() -> Library {
        Library::load(None).unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn unique_ids_are_fresh_and_survive_hex() {
        let lib = lib();
        let (a, b) = (
            UniqueId::create(&lib).unwrap(),
            UniqueId::create(&lib).unwrap(),
        );
        assert_ne!(a.to_hex(), b.to_hex(), "two ids must differ");
        let text = a.to_hex();
        assert_eq!(text.len(), 256);
        assert_eq!(UniqueId::from_hex(&text).unwrap().to_hex(), text);
        assert!(matches!(
            UniqueId::from_hex(&text[..200]),
            Err(CommError::UniqueIdText(_))
        ));
    }

    #[test]
    fn the_version_check_compares_the_patch_too() {
        assert!(check_version((3, 4, 5), (3, 4, 5)).is_ok());
        for found in [(3, 4, 6), (3, 4, 0), (3, 5, 5), (2, 4, 5)] {
            assert_eq!(
                check_version(found, (3, 4, 5)),
                Err(CommError::Version {
                    found: format!("{}.{}.{}", found.0, found.1, found.2),
                    bound: "3.4.5".into()
                }),
                "{found:?}"
            );
        }
    }

    #[test]
    fn init_rejects_a_rank_outside_the_world() {
        assert!(matches!(
            check_rank(2, 2),
            Err(CommError::Rank { rank: 2, ranks: 2 })
        ));
        assert!(matches!(
            check_rank(0, 0),
            Err(CommError::Rank { rank: 0, ranks: 0 })
        ));
        assert!(check_rank(1, 2).is_ok());
    }

    #[test]
    fn init_attr_initializer_versions_match_the_header_macro() {
        let attr = raw::init_attr_initializer();
        assert_eq!(attr.version, (1 << 16) + 144);
        assert_eq!(attr.args.version, (1 << 16) + 128);
        assert_eq!(attr.args.uid_args.version, (1 << 16) + 24);
        assert_eq!(
            (attr.args.uid_args.myrank, attr.args.uid_args.nranks),
            (-1, -1)
        );
        assert_eq!(raw::uniqueid_initializer().version, (1 << 16) + 128);
    }
}
