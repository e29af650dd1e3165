//! Expert-parallel dispatch and combine on the GPU (the standalone, non-fused path).
//!
//! [`ExpertParallel`] owns the symmetric and local buffers, sized once from an [`EpConfig`];
//! [`ExpertParallel::dispatch`] sends each routed token once per destination rank and leaves
//! an expert-major receive buffer ready for the grouped GEMM ([`Dispatch::x`] with
//! [`Dispatch::offsets`]); [`Dispatch::combine`] brings the expert outputs back to the source
//! tokens, weighted in fp32. Both are collective (every rank calls them, in the same order),
//! run on the stream given at construction, never synchronise with the host, and can be
//! captured in a CUDA graph. The layouts are the host model's ([`crate::ReceiveLayout`]).
//!
//! Precision: each destination sums its slots' `w · y` in fp32 and sends the partial in
//! bf16; the source sums the partials in fp32 in rank order and writes bf16. Deterministic.
//!
//! Failure: no rank waits forever on another.
//! 1. Construction compares every rank's configuration ([`CommError::ConfigMismatch`]).
//! 2. Every device wait on a peer ends at [`EpConfig::timeout`]; the kernel records a fault
//!    and exits (no trap: the context stays usable).
//! 3. A rank that fails inside a collective on the host (a short buffer, a capacity error,
//!    a [`Dispatch`] dropped without [`Dispatch::combine`]) sends abort signals, so its
//!    peers fail at once ([`CommError::PeerAborted`]) instead of at their deadline.
//! 4. Faults are sticky and reach the host through mapped memory: the next `dispatch`,
//!    `combine`, [`ExpertParallel::synchronize`], [`Dispatch::received_rows`] or
//!    [`ExpertParallel::take_flags`] returns the typed error ([`CommError::PeerTimeout`],
//!    [`CommError::PeerAborted`], [`CommError::Poisoned`]). Drop the instance on every rank
//!    and build a new one: its signal epochs start above any the old one used, so late
//!    signals of the old exchange cannot satisfy the new one's waits.

mod dispatch;
pub(crate) mod guard;
mod memory;
mod params;
mod pulled;
mod setup;

pub use dispatch::Dispatch;
pub use memory::EpMemory;
pub use pulled::{PullBackward, PullDispatch};

use crate::device_module::{self, DeviceModule, HostWords, Kernel};
use crate::{CommError, Placement, Runtime, SymmetricBuffer};
use cudarc::driver::{result, CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use params::{EpParams, FAULT_WORDS};
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a device wait on a peer lasts by default ([`EpConfig::timeout`]).
pub const DEFAULT_EP_TIMEOUT: Duration = Duration::from_secs(10);

/// Sizes of an expert-parallel exchange, the same on every rank (compared at construction),
/// and how long a wait on a peer may last.
///
/// ```
/// use moefuse_comm::EpConfig;
/// let cfg = EpConfig::new(128, 8, 2048, 4096);
/// assert!(cfg.check(8).is_ok());
/// assert!(EpConfig { hidden: 2050, ..cfg }.check(8).is_err());
/// assert_eq!(cfg.timeout, moefuse_comm::DEFAULT_EP_TIMEOUT);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpConfig {
    /// Experts in total (a multiple of the world size, at most 512).
    pub experts: usize,
    /// Slots per token (1..=16, at most `experts`).
    pub top_k: usize,
    /// Row width in bf16 elements (a multiple of 8: rows move in 16-byte vectors).
    pub hidden: usize,
    /// Most tokens a rank dispatches in one call; every buffer is sized from it.
    pub max_tokens: usize,
    /// The deadline of every device wait on a peer (1 ms to 1 h; not compared across
    /// ranks). A wait that reaches it ends the call with [`CommError::PeerTimeout`].
    pub timeout: Duration,
    /// Rows stay home ([`ExpertParallel::dispatch_pull`]): each rank copies its tokens' rows
    /// once into a symmetric buffer and sends only their routing; the receivers read the
    /// rows in place through peer addresses (the fused gate_up's producer). Needs every
    /// peer reachable by load/store (one NVLink domain) and at most
    /// [`MAX_PULL_RANKS`] ranks; no staging or expert-major row buffer is allocated, and
    /// [`ExpertParallel::dispatch`] is refused. `false` (the default): rows are copied to
    /// the receivers ([`ExpertParallel::dispatch`]).
    pub pull_rows: bool,
}

/// Most ranks of a [`EpConfig::pull_rows`] exchange (the fused gate_up reads rows from at
/// most this many ranks: one NVLink domain of 8 GPUs).
pub const MAX_PULL_RANKS: usize = moefuse_kernels::PeerRows::MAX_RANKS;

/// Largest world the count kernel's shared memory is sized for.
pub const MAX_RANKS: usize = 64;
/// Largest expert count (notify's per-expert table): the layer's limit,
/// `moefuse_spec::MAX_EXPERTS`.
pub const MAX_EXPERTS: usize = moefuse_kernels::spec::MAX_EXPERTS;
/// Most slots per token: the layer's limit, `moefuse_spec::MAX_TOP_K`.
const MAX_TOP_K: usize = moefuse_kernels::spec::MAX_TOP_K;

impl EpConfig {
    /// The sizes, with [`DEFAULT_EP_TIMEOUT`].
    ///
    /// ```
    /// let cfg = moefuse_comm::EpConfig::new(16, 4, 1024, 2048);
    /// assert_eq!((cfg.experts, cfg.top_k, cfg.hidden, cfg.max_tokens), (16, 4, 1024, 2048));
    /// ```
    pub const fn new(experts: usize, top_k: usize, hidden: usize, max_tokens: usize) -> Self {
        EpConfig {
            experts,
            top_k,
            hidden,
            max_tokens,
            timeout: DEFAULT_EP_TIMEOUT,
            pull_rows: false,
        }
    }

    /// The same sizes with rows pulled by the receivers ([`EpConfig::pull_rows`]).
    ///
    /// ```
    /// let cfg = moefuse_comm::EpConfig::new(16, 4, 1024, 2048).pulled();
    /// assert!(cfg.pull_rows);
    /// assert!(cfg.check(8).is_ok() && cfg.check(16).is_err());
    /// ```
    pub const fn pulled(self) -> Self {
        EpConfig {
            pull_rows: true,
            ..self
        }
    }

    /// Checks the sizes for a world of `ranks`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let cfg = moefuse_comm::EpConfig::new(16, 4, 1024, 2048);
    /// assert!(moefuse_comm::EpConfig { timeout: Duration::ZERO, ..cfg }.check(2).is_err());
    /// ```
    pub fn check(&self, ranks: usize) -> Result<Placement, CommError> {
        let bad = |what: &'static str, value: usize, rule: &'static str| {
            Err(CommError::Config { what, value, rule })
        };
        if ranks == 0 || ranks > MAX_RANKS {
            // MAX_RANKS is MOEFUSE_EP_MAX_RANKS (the kernels' peer tables).
            return bad("ranks", ranks, "1..=64");
        }
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            return bad("experts", self.experts, "1..=512 (MAX_EXPERTS)");
        }
        if self.top_k == 0 || self.top_k > MAX_TOP_K || self.top_k > self.experts {
            return bad(
                "top_k",
                self.top_k,
                "1..=16 (MAX_TOP_K) and at most experts",
            );
        }
        if self.hidden == 0 || self.hidden % 8 != 0 {
            return bad("hidden", self.hidden, "a positive multiple of 8");
        }
        if self.max_tokens == 0 || self.max_tokens > 1 << 20 {
            return bad("max_tokens", self.max_tokens, "1..=1048576");
        }
        if self.pull_rows && ranks > MAX_PULL_RANKS {
            return bad("ranks (pull_rows)", ranks, "1..=8 (MAX_PULL_RANKS)");
        }
        let ms = self.timeout.as_millis();
        if !(1..=3_600_000).contains(&ms) {
            return bad(
                "timeout (ms)",
                ms.min(usize::MAX as u128) as usize,
                "1..=3600000",
            );
        }
        Placement::new(self.experts, ranks)
    }
}

/// Routing problems the kernels found (slots skipped; nothing written out of bounds).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoutingFlags {
    /// Some `topk_ids` entry was outside `0..experts` (that slot was dropped).
    pub bad_expert_id: bool,
    /// Some token named one expert twice (both slots were kept, in unspecified order).
    pub duplicate_expert: bool,
    /// The expert outputs given to combine had fewer rows than were received.
    pub recv_overflow: bool,
}

struct Symmetric {
    meta: SymmetricBuffer<i32>,
    meta_sig: SymmetricBuffer<u64>,
    stage_x: SymmetricBuffer<u16>,
    stage_info: SymmetricBuffer<i32>,
    stage_w: SymmetricBuffer<f32>,
    /// `[max_tokens, hidden]` with [`EpConfig::pull_rows`] (one element otherwise).
    x_home: SymmetricBuffer<u16>,
    /// `[max_tokens * top_k, hidden]` with [`EpConfig::pull_rows`]: each token's slots.
    y_slots: SymmetricBuffer<u16>,
    /// The pulled backward's dy `[max_tokens, hidden]` and its two signal rows (pull).
    dy_home: SymmetricBuffer<u16>,
    bwd_sig: SymmetricBuffer<u64>,
    bwd_comb_sig: SymmetricBuffer<u64>,
    disp_sig: SymmetricBuffer<u64>,
    comb_x: SymmetricBuffer<u16>,
    comb_sig: SymmetricBuffer<u64>,
    hello: SymmetricBuffer<u64>,
}

struct Local {
    epoch: CudaSlice<u64>,
    done: CudaSlice<u32>,
    chunk_cnt: CudaSlice<i32>,
    pos_local: CudaSlice<i32>,
    tokpos: CudaSlice<i32>,
    counts_all: CudaSlice<i32>,
    dest_row_base: CudaSlice<i32>,
    stage_base: CudaSlice<i32>,
    comb_base: CudaSlice<i32>,
    src_base: CudaSlice<i32>,
    status: CudaSlice<u32>,
    fault: CudaSlice<u64>,
    recv_x: CudaSlice<bf16>,
    recv_offsets: CudaSlice<i32>,
    recv_w: CudaSlice<f32>,
    recv_origin: CudaSlice<i32>,
    /// `source rank * max_tokens + token` per received row ([`EpConfig::pull_rows`]).
    recv_src: CudaSlice<i32>,
    /// The address of each received row's slot at its home ([`EpConfig::pull_rows`]).
    recv_dst: CudaSlice<u64>,
}

/// The pulled exchange's progress through one forward and its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PulledState {
    /// No forward whose backward may run.
    Idle,
    /// A forward of `tokens` tokens combined; its slots and received rows are kept.
    Forward { tokens: usize },
}

struct Kernels {
    /// count, whose last block runs notify.
    count: Kernel,
    dispatch: Kernel,
    expand: Kernel,
    combine_send: Kernel,
    combine_reduce: Kernel,
    slots_signal: Kernel,
    combine_slots: Kernel,
    bwd_publish: Kernel,
    bwd_gather: Kernel,
    abort: Kernel,
}

/// Expert-parallel dispatch/combine for one rank (see the module docs).
///
/// ```no_run
/// # use moefuse_comm::*;
/// # fn demo(rt: &std::sync::Arc<Runtime>, stream: &std::sync::Arc<cudarc::driver::CudaStream>,
/// #         x: &cudarc::driver::CudaSlice<half::bf16>, ids: &cudarc::driver::CudaSlice<i32>,
/// #         w: &cudarc::driver::CudaSlice<f32>, y: &cudarc::driver::CudaSlice<half::bf16>,
/// #         out: &mut cudarc::driver::CudaSlice<half::bf16>) -> Result<(), CommError> {
/// let cfg = EpConfig::new(128, 8, 2048, 4096);
/// let mut ep = ExpertParallel::new(rt, stream, cfg)?;
/// let d = ep.dispatch(x, ids, w, 4096)?;       // collective
/// // ... grouped GEMMs over d.x() with d.offsets(), writing y in the same row order ...
/// d.combine(y, out)?;                            // collective
/// ep.synchronize()?;                             // a peer's failure surfaces here at the latest
/// # Ok(()) }
/// ```
pub struct ExpertParallel {
    cfg: EpConfig,
    place: Placement,
    rank: usize,
    device: usize,
    stream: Arc<CudaStream>,
    grid: u32,
    base: EpParams,
    kernels: Kernels,
    /// Why this rank abandoned a collective (a host-side error), if it did.
    broken: Option<String>,
    local: Local,
    /// Every rank's `x_home` as this device's addresses ([`EpConfig::pull_rows`]).
    peer_rows: Option<moefuse_kernels::PeerRows>,
    /// Where a pulled exchange stands: a backward needs the last forward's slots.
    pulled: PulledState,
    // Freed by Drop, in this order, once the stream is idle (leaked if it never is): the
    // kernels address them through `base`.
    sym: ManuallyDrop<Symmetric>,
    fault_host: ManuallyDrop<HostWords>,
    module: ManuallyDrop<DeviceModule>,
    runtime: Arc<Runtime>,
}

fn cuda(e: result::DriverError) -> CommError {
    CommError::Cuda(e.to_string())
}

fn ptr<T, P: DevicePtr<T>>(buf: &P, stream: &CudaStream) -> u64 {
    // The pointer stays valid while the owner lives; every use is on `stream`.
    let (p, _sync) = buf.device_ptr(stream);
    p
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    len: usize,
) -> Result<CudaSlice<T>, CommError> {
    stream.alloc_zeros::<T>(len.max(1)).map_err(cuda)
}

impl ExpertParallel {
    /// The sizes this exchange was built for.
    pub fn config(&self) -> EpConfig {
        self.cfg
    }

    /// Expert ownership.
    pub fn placement(&self) -> Placement {
        self.place
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The runtime the buffers live on.
    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    /// The last dispatch's expert-major received rows, `[recv_rows_capacity, hidden]`
    /// (what [`Dispatch::x`] gave), kept until the next dispatch on this instance: a layer's
    /// backward reads them after the forward's combine without a copy.
    ///
    /// ```no_run
    /// # fn demo(ep: &moefuse_comm::ExpertParallel) {
    /// let rows = ep.received_x();
    /// # }
    /// ```
    pub fn received_x(&self) -> &CudaSlice<bf16> {
        &self.local.recv_x
    }

    /// The last dispatch's per-local-expert row ends ([`Dispatch::offsets`]), until the next.
    pub fn received_offsets(&self) -> &CudaSlice<i32> {
        &self.local.recv_offsets
    }

    /// The last dispatch's routing weight per received row ([`Dispatch::weights`]).
    pub fn received_weights(&self) -> &CudaSlice<f32> {
        &self.local.recv_w
    }

    /// The last dispatch's `(source rank, token, slot)` per received row ([`Dispatch::origin`]).
    pub fn received_origin(&self) -> &CudaSlice<i32> {
        &self.local.recv_origin
    }

    /// Expert-major rows this rank can receive (the worst case: every token of every rank
    /// with all slots that can land here).
    pub fn recv_rows_capacity(&self) -> usize {
        self.local.recv_w.len()
    }

    /// The typed error of a fault this instance recorded, without waiting for the stream
    /// (the kernels write it to mapped host memory); `Ok` while none is known.
    ///
    /// ```no_run
    /// # fn demo(ep: &moefuse_comm::ExpertParallel) {
    /// if let Err(e) = ep.check() {
    ///     eprintln!("the exchange failed: {e}");
    /// }
    /// # }
    /// ```
    pub fn check(&self) -> Result<(), CommError> {
        let mut words = [0u64; FAULT_WORDS];
        words[0] = self.fault_host.read(0);
        if words[0] != 0 {
            for (i, w) in words.iter_mut().enumerate().skip(1) {
                *w = self.fault_host.read(i);
            }
            if let Some(e) = guard::decode_fault(words) {
                return Err(e);
            }
        }
        match &self.broken {
            Some(cause) => Err(CommError::Poisoned {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Waits for this instance's stream work (at most past every device deadline, then
    /// [`CommError::HostTimeout`]) and returns the fault it recorded, if any: after a
    /// peer's failure every rank returns a typed error here.
    ///
    /// ```no_run
    /// # fn demo(ep: &moefuse_comm::ExpertParallel) -> Result<(), moefuse_comm::CommError> {
    /// ep.synchronize()?;
    /// # Ok(()) }
    /// ```
    pub fn synchronize(&self) -> Result<(), CommError> {
        self.wait_idle("synchronize")?;
        self.check()
    }

    /// The epoch of the last call (synchronises): it starts above every epoch an earlier
    /// instance of the runtime used, on any rank, and grows by one per dispatch.
    ///
    /// ```no_run
    /// # fn demo(ep: &moefuse_comm::ExpertParallel) -> Result<(), moefuse_comm::CommError> {
    /// let before = ep.epoch()?;
    /// # Ok(()) }
    /// ```
    pub fn epoch(&self) -> Result<u64, CommError> {
        self.wait_idle("epoch")?;
        Ok(self.stream.clone_dtoh(&self.local.epoch).map_err(cuda)?[0])
    }

    /// Polls the stream until it is idle, for at most `guard::host_deadline`.
    fn wait_idle(&self, op: &'static str) -> Result<(), CommError> {
        let t0 = Instant::now();
        let limit = guard::host_deadline(self.cfg.timeout);
        let mut nap = Duration::from_micros(20);
        while !device_module::stream_idle(&self.stream)? {
            if t0.elapsed() > limit {
                return Err(CommError::HostTimeout {
                    op,
                    waited: t0.elapsed(),
                });
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
        Ok(())
    }

    /// A caller's device buffer the kernels read or write (`used` elements of it) must be
    /// aligned as they load it and live on the runtime's device (a misaligned or foreign
    /// pointer would kill the context and leave the peers waiting). An unused one (no
    /// tokens) is not looked at.
    fn operand(
        &self,
        what: &'static str,
        addr: u64,
        align: usize,
        used: usize,
    ) -> Result<(), CommError> {
        if used == 0 {
            return Ok(());
        }
        guard::check_operand(
            what,
            addr,
            align,
            device_module::device_of(addr),
            self.device,
        )
    }

    /// This rank gives up the current collective after `cause`: its peers are told (abort
    /// signals for the epoch they wait on) and the instance refuses further calls. One PE
    /// has no peer to tell and stays usable.
    fn abandon(&mut self, stage: i32, cause: &CommError) {
        if self.place.ranks() == 1 {
            return;
        }
        if self.broken.is_none() {
            self.broken = Some(cause.to_string());
        }
        let p = EpParams {
            abort_stage: stage,
            ..self.base
        };
        // SAFETY: `p` mirrors `moefuse_ep_params`; the abort kernel touches only the
        // epoch, fault words and signal buffers, all owned by `self`.
        let launched = unsafe {
            self.module
                .launch(self.kernels.abort, &self.stream, 1, 32, 0, &p)
        };
        if let Err(e) = launched {
            tracing::warn!(%e, "could not tell the peers that this rank abandoned the call");
        }
        tracing::warn!(rank = self.rank, %cause, "expert-parallel call abandoned");
    }

    /// Reads the routing flags the kernels raised since the last call, and clears them
    /// (synchronises the stream; returns the instance's fault, if any, instead).
    ///
    /// ```no_run
    /// # fn demo(ep: &mut moefuse_comm::ExpertParallel) -> Result<(), moefuse_comm::CommError> {
    /// assert!(!ep.take_flags()?.bad_expert_id);
    /// # Ok(()) }
    /// ```
    pub fn take_flags(&mut self) -> Result<RoutingFlags, CommError> {
        self.synchronize()?;
        let status = self.stream.clone_dtoh(&self.local.status).map_err(cuda)?;
        let bits = status[1];
        self.stream
            .memcpy_htod(&[status[0], 0], &mut self.local.status)
            .map_err(cuda)?;
        Ok(RoutingFlags {
            bad_expert_id: bits & params::BAD_EXPERT_ID != 0,
            duplicate_expert: bits & params::DUPLICATE_EXPERT != 0,
            recv_overflow: bits & params::RECV_OVERFLOW != 0,
        })
    }
}

impl Drop for ExpertParallel {
    /// Waits (bounded) for the stream work that reads or writes the buffers, records the
    /// last epoch in the runtime (the next instance starts above it), then frees. If the
    /// stream never becomes idle, the symmetric memory and the module are leaked rather
    /// than freed under running kernels.
    fn drop(&mut self) {
        let idle = self.wait_idle("drop");
        match self.stream.clone_dtoh(&self.local.epoch) {
            Ok(epoch) => self.runtime.raise_epoch_floor(epoch[0]),
            // The abort kernel may have taken one more epoch than the host saw.
            Err(_) => self
                .runtime
                .raise_epoch_floor(self.base.epoch_base + (1 << 32)),
        }
        if let Err(e) = idle {
            tracing::error!(%e, rank = self.rank, "ExpertParallel dropped while its kernels still run: its symmetric memory is leaked");
            return;
        }
        // SAFETY: each field is dropped once, here, and never used again; the stream that
        // used them is idle.
        unsafe {
            ManuallyDrop::drop(&mut self.sym);
            ManuallyDrop::drop(&mut self.fault_host);
            ManuallyDrop::drop(&mut self.module);
        }
    }
}
