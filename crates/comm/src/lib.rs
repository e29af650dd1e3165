//! Expert-parallel communication for moefuse.
//!
//! This first part is the host-side model of dispatch and combine, the contract the
//! device kernels implement and the CPU reference their tests compare against:
//!
//! 1. [`Placement`] says which rank owns which expert (contiguous blocks of `E / ranks`).
//! 2. [`SendPlan::build`] turns one rank's `topk_ids` into what it sends: each routed token
//!    once per destination rank (not once per expert), with the local experts it feeds there.
//! 3. [`ReceiveLayout::build`] turns every rank's send plan into one rank's expert-major
//!    receive buffer: rows grouped by local expert, stable in (source rank, token) order,
//!    with prefix-sum offsets ready for the grouped GEMM.
//! 4. [`combine`] reduces expert outputs back to each source token with fp32 routing weights.
//! 5. [`Capacity`] sizes every buffer once from a token capacity and rejects larger requests.
//!
//! The runtime side ([`Library`], [`UniqueId`], [`Runtime`], [`SymmetricBuffer`]) wraps
//! NVSHMEM through `nvshmem-sys`: bootstrap by unique id, symmetric allocation with
//! lifetimes tied to the runtime, peer pointers, stream-ordered barriers. Process launch and
//! the rendezvous that hands every rank the unique id are `moefuse-launch`'s, re-exported
//! here ([`launch`], [`LaunchEnv`], [`exchange_unique_id`]).
//!
//! [`ExpertParallel`] runs dispatch and combine on the GPU. No rank can hang another:
//! every device wait on a peer has a deadline ([`EpConfig::timeout`]), a rank that fails
//! inside a collective tells its peers, and every rank then gets a typed error
//! ([`CommError::PeerTimeout`], [`CommError::PeerAborted`]); the ranks' configurations are
//! compared at construction ([`CommError::ConfigMismatch`]).
//!
//! ```
//! use moefuse_comm::{Placement, SendPlan, ReceiveLayout};
//! let place = Placement::new(8, 2)?;               // 8 experts over 2 ranks
//! let ids = [0, 5, 1, 2];                           // 2 tokens, top-2
//! let plans = [SendPlan::build(&place, 0, &ids, 2)?, SendPlan::build(&place, 1, &ids, 2)?];
//! let recv = ReceiveLayout::build(&place, 1, &plans)?;
//! assert_eq!(recv.offsets, vec![0, 2, 2, 2]);      // local expert 5-4=1 gets 2 rows
//! # Ok::<(), moefuse_comm::CommError>(())
//! ```

mod bootstrap;
mod device_module;
mod ep;
mod modules;
mod plan;
mod raw;
mod runtime;
mod selftest;
mod stream_ops;
mod team;

pub use bootstrap::{
    broadcast_from_rank0, exchange_unique_id, launch, LaunchEnv, LaunchError, LaunchEvent,
    LaunchSpec, OutputStream, Rendezvous, RendezvousServer, ServerLimits, Token,
    DEFAULT_LAUNCH_TIMEOUT,
};
pub use ep::{
    Dispatch, EpConfig, EpMemory, ExpertParallel, PullBackward, PullDispatch, RoutingFlags,
    DEFAULT_EP_TIMEOUT, MAX_EXPERTS, MAX_PULL_RANKS, MAX_RANKS,
};
pub use modules::{embedded_modules, module, EmbeddedModule};
pub use plan::{combine, Capacity, Placement, ReceiveLayout, RecvRow, Send, SendPlan};
pub use runtime::{Library, Runtime, SymmetricBuffer, UniqueId};
pub use stream_ops::{quiet_on_stream, Signal, SignalOp};
pub use team::Team;

/// Everything the communication layer rejects, with the offending values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// Experts do not divide evenly over ranks, or a count is zero.
    #[error("cannot place {experts} experts on {ranks} ranks: experts must be a positive multiple of ranks")]
    Placement {
        /// Experts.
        experts: usize,
        /// Ranks.
        ranks: usize,
    },
    /// A rank index outside the world.
    #[error("rank {rank} outside a world of {ranks}")]
    Rank {
        /// The rank.
        rank: usize,
        /// World size.
        ranks: usize,
    },
    /// A routed expert id outside `0..experts`.
    #[error("token {token} slot {slot}: expert id {id} outside 0..{experts}")]
    ExpertId {
        /// Token.
        token: usize,
        /// Top-k slot.
        slot: usize,
        /// The id.
        id: i64,
        /// Experts.
        experts: usize,
    },
    /// `topk_ids` is not `tokens × top_k` long, or top_k is 0.
    #[error("topk_ids has {len} entries, not a multiple of top_k = {top_k}")]
    Shape {
        /// Entries.
        len: usize,
        /// Top-k.
        top_k: usize,
    },
    /// The NVSHMEM host library could not be loaded (the message lists where it looked).
    #[error("{0}")]
    Library(String),
    /// The loaded library is not the version the bindings describe.
    #[error("NVSHMEM host library {found} differs from the bound {bound}; device code built against one cannot run on the other")]
    Version {
        /// Loaded.
        found: String,
        /// Bound.
        bound: String,
    },
    /// An NVSHMEM call returned an error status.
    #[error("{call} returned {status}")]
    Nvshmem {
        /// The call.
        call: &'static str,
        /// Its status.
        status: i32,
    },
    /// `Runtime::init` was called while a runtime is alive in this process.
    #[error("NVSHMEM is already initialised in this process")]
    AlreadyInitialised,
    /// NVSHMEM came up with another rank or size than asked for.
    #[error("NVSHMEM reports rank/size {found:?}, expected {expected:?}")]
    RankMismatch {
        /// (rank, ranks) asked for.
        expected: (usize, usize),
        /// (rank, ranks) reported.
        found: (usize, usize),
    },
    /// A symmetric allocation failed.
    #[error("symmetric allocation of {bytes} bytes failed")]
    Alloc {
        /// Bytes requested.
        bytes: usize,
    },
    /// A unique id's text form is malformed.
    #[error("unique id text `{0}…` is not 256 hex digits")]
    UniqueIdText(String),
    /// A CUDA driver call failed.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// The device is not one the NVSHMEM modules are built for (sm_90a, sm_100a).
    #[error("compute capability {major}.{minor} is not supported: the comm kernels target sm_90a and sm_100a")]
    UnsupportedDevice {
        /// Major.
        major: i32,
        /// Minor.
        minor: i32,
    },
    /// The device's arch was not in MOEFUSE_CUDA_ARCHS when this crate was built.
    #[error("NVSHMEM module `{name}` was not built for {arch} (built: `{built}`); rebuild with MOEFUSE_CUDA_ARCHS including it")]
    ModuleNotBuilt {
        /// Module.
        name: String,
        /// The device's arch.
        arch: &'static str,
        /// What the build embedded.
        built: &'static str,
    },
    /// An expert-parallel configuration outside what the kernels support.
    #[error("{what} = {value} is not supported: must be {rule}")]
    Config {
        /// The field.
        what: &'static str,
        /// Its value.
        value: usize,
        /// The rule.
        rule: &'static str,
    },
    /// A caller's device buffer is shorter than the call needs.
    #[error("{what} holds {got} elements; the call needs {needed}")]
    BufferTooSmall {
        /// Which buffer.
        what: &'static str,
        /// Needed elements.
        needed: usize,
        /// Its length.
        got: usize,
    },
    /// `nvshmemx_cumodule_init` refused a module: most often the device library it was
    /// linked against and the loaded host library differ in version.
    #[error("nvshmemx_cumodule_init({name}) returned {status}: the module was device-linked against NVSHMEM {built_with}; the host library must be the same version")]
    ModuleInit {
        /// Module.
        name: String,
        /// Status.
        status: i32,
        /// The NVSHMEM the module was built with.
        built_with: String,
    },
    /// An operation NVSHMEM does not support in this configuration (the message says why).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The ring check found a wrong element (the message names it).
    #[error("NVSHMEM ring check failed: {0}")]
    SelfTest(String),
    /// A request beyond the capacity the buffers were sized for.
    #[error("{what}: {needed} exceeds the capacity {capacity} (sized from max_tokens={max_tokens}, top_k={top_k})")]
    Capacity {
        /// Which buffer.
        what: &'static str,
        /// Requested.
        needed: usize,
        /// Available.
        capacity: usize,
        /// The sizing inputs.
        max_tokens: usize,
        /// The sizing inputs.
        top_k: usize,
    },
    /// Launching processes or the rendezvous failed (moefuse-launch's error).
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// A peer built its `ExpertParallel` with other sizes: its writes would land past this
    /// rank's buffers, so no rank goes on (every rank reports the first peer that differs).
    #[error("rank {rank}: rank {peer}'s EpConfig differs (hash {theirs:#018x}, ours {ours:#018x}); every rank must pass the same experts, top_k, hidden, max_tokens and pull_rows")]
    ConfigMismatch {
        /// This rank.
        rank: usize,
        /// The first rank whose configuration differs.
        peer: usize,
        /// This rank's configuration hash.
        ours: u64,
        /// The peer's.
        theirs: u64,
    },
    /// A peer's handshake record never reached this rank during `ExpertParallel::new`.
    #[error("rank {rank}: rank {peer} sent no handshake during ExpertParallel::new")]
    HandshakeMissing {
        /// This rank.
        rank: usize,
        /// The silent peer.
        peer: usize,
    },
    /// A device wait on a peer passed its deadline (`EpConfig::timeout`): the peer is dead,
    /// slow, or did not make the same call. The instance is unusable afterwards.
    #[error("{op}: rank {peer} did not answer within {waited:?}; build a new ExpertParallel on every rank to go on")]
    PeerTimeout {
        /// The wait.
        op: &'static str,
        /// The peer waited on.
        peer: usize,
        /// How long the kernel waited.
        waited: std::time::Duration,
    },
    /// A peer abandoned the call after an error of its own (its error says which). The
    /// instance is unusable afterwards.
    #[error("{op}: rank {peer} abandoned the call after an error on its side; build a new ExpertParallel on every rank to go on")]
    PeerAborted {
        /// The wait.
        op: &'static str,
        /// The peer that aborted.
        peer: usize,
    },
    /// The instance failed earlier (a timeout, an abort, or a local error inside a
    /// collective) and refuses further collectives.
    #[error(
        "this ExpertParallel failed earlier ({cause}); drop it and build a new one on every rank"
    )]
    Poisoned {
        /// What failed first.
        cause: String,
    },
    /// The host waited longer than any device deadline allows for the stream to finish.
    #[error("{op}: the stream did not finish within {waited:?}")]
    HostTimeout {
        /// What waited.
        op: &'static str,
        /// How long.
        waited: std::time::Duration,
    },
    /// A caller buffer's address is not aligned as the kernels load it.
    #[error("{what} at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// Which buffer.
        what: &'static str,
        /// Its device address.
        addr: u64,
        /// The alignment the kernels need.
        align: usize,
    },
    /// A caller buffer lives on another device than the runtime's.
    #[error("{what} lives on device {found}; the runtime runs on device {expected}")]
    WrongDevice {
        /// Which buffer.
        what: &'static str,
        /// The runtime's device ordinal.
        expected: usize,
        /// The buffer's.
        found: usize,
    },
    /// A caller buffer's address is not device memory the driver knows.
    #[error("{what} at {addr:#x} is not CUDA device memory")]
    NotDeviceMemory {
        /// Which buffer.
        what: &'static str,
        /// Its address.
        addr: u64,
    },
}
