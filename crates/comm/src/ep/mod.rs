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

mod params;

use crate::device_module::{DeviceModule, Kernel};
use crate::{Capacity, CommError, Placement, Runtime, SymmetricBuffer};
use cudarc::driver::{
    result, sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits,
};
use half::bf16;
use params::EpParams;
use std::sync::Arc;

/// Sizes of an expert-parallel exchange, the same on every rank.
///
/// ```
/// let cfg = moefuse_comm::EpConfig { experts: 128, top_k: 8, hidden: 2048, max_tokens: 4096 };
/// assert!(cfg.check(8).is_ok());
/// assert!(moefuse_comm::EpConfig { hidden: 2050, ..cfg }.check(8).is_err());
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
}

/// Largest world the count kernel's shared memory is sized for.
pub const MAX_RANKS: usize = 64;
/// Largest expert count (the notify kernel's per-expert table).
pub const MAX_EXPERTS: usize = 512;

impl EpConfig {
    /// Checks the sizes for a world of `ranks`.
    pub fn check(&self, ranks: usize) -> Result<Placement, CommError> {
        let bad = |what: &'static str, value: usize, rule: &'static str| {
            Err(CommError::Config { what, value, rule })
        };
        if ranks == 0 || ranks > MAX_RANKS {
            // MAX_RANKS is MOEFUSE_EP_MAX_RANKS (the kernels' peer tables).
            return bad("ranks", ranks, "1..=64");
        }
        if self.experts == 0 || self.experts > MAX_EXPERTS {
            return bad("experts", self.experts, "1..=512");
        }
        if self.top_k == 0 || self.top_k > 16 || self.top_k > self.experts {
            return bad("top_k", self.top_k, "1..=16 and at most experts");
        }
        if self.hidden == 0 || self.hidden % 8 != 0 {
            return bad("hidden", self.hidden, "a positive multiple of 8");
        }
        if self.max_tokens == 0 || self.max_tokens > 1 << 20 {
            return bad("max_tokens", self.max_tokens, "1..=1048576");
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
    disp_sig: SymmetricBuffer<u64>,
    comb_x: SymmetricBuffer<u16>,
    comb_sig: SymmetricBuffer<u64>,
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
    recv_x: CudaSlice<bf16>,
    recv_offsets: CudaSlice<i32>,
    recv_w: CudaSlice<f32>,
    recv_origin: CudaSlice<i32>,
}

struct Kernels {
    count: Kernel,
    notify: Kernel,
    dispatch: Kernel,
    expand: Kernel,
    combine_send: Kernel,
    combine_reduce: Kernel,
}

/// Expert-parallel dispatch/combine for one rank (see the module docs).
///
/// ```no_run
/// # use moefuse_comm::*;
/// # fn demo(rt: &std::sync::Arc<Runtime>, stream: &std::sync::Arc<cudarc::driver::CudaStream>,
/// #         x: &cudarc::driver::CudaSlice<half::bf16>, ids: &cudarc::driver::CudaSlice<i32>,
/// #         w: &cudarc::driver::CudaSlice<f32>, y: &cudarc::driver::CudaSlice<half::bf16>,
/// #         out: &mut cudarc::driver::CudaSlice<half::bf16>) -> Result<(), CommError> {
/// let cfg = EpConfig { experts: 128, top_k: 8, hidden: 2048, max_tokens: 4096 };
/// let mut ep = ExpertParallel::new(rt, stream, cfg)?;
/// let d = ep.dispatch(x, ids, w, 4096)?;       // collective
/// // ... grouped GEMMs over d.x() with d.offsets(), writing y in the same row order ...
/// d.combine(y, out)?;                            // collective
/// # Ok(()) }
/// ```
pub struct ExpertParallel {
    cfg: EpConfig,
    place: Placement,
    rank: usize,
    stream: Arc<CudaStream>,
    grid: u32,
    base: EpParams,
    kernels: Kernels,
    // Field order is drop order: buffers before the module, the module before the runtime.
    local: Local,
    #[allow(dead_code)] // held for its lifetime: the kernels address it through `base`
    sym: Symmetric,
    module: DeviceModule,
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
    /// Allocates every buffer (collective: all ranks call it with the same `cfg`) and loads
    /// the kernels. All later calls run on `stream`.
    pub fn new(
        runtime: &Arc<Runtime>,
        stream: &Arc<CudaStream>,
        cfg: EpConfig,
    ) -> Result<Self, CommError> {
        let (ranks, rank) = (runtime.ranks(), runtime.rank());
        let place = cfg.check(ranks)?;
        let module = DeviceModule::load(runtime, "ep")?;
        let kernels = Kernels {
            count: module.kernel("moefuse_ep_count")?,
            notify: module.kernel("moefuse_ep_notify")?,
            dispatch: module.kernel("moefuse_ep_dispatch")?,
            expand: module.kernel("moefuse_ep_expand")?,
            combine_send: module.kernel("moefuse_ep_combine_send")?,
            combine_reduce: module.kernel("moefuse_ep_combine_reduce")?,
        };
        let (e, k, d, t) = (cfg.experts, cfg.top_k, cfg.hidden, cfg.max_tokens);
        let c = e + ranks;
        let cap = Capacity {
            max_tokens: t,
            top_k: k,
            place,
        };
        let staged = cap.staging_rows();
        let rows = cap.expert_rows();
        let comb_rows = t * k.min(ranks);
        let sym = Symmetric {
            meta: runtime.alloc(ranks * c)?,
            meta_sig: runtime.alloc(ranks)?,
            stage_x: runtime.alloc(staged * d)?,
            stage_info: runtime.alloc(staged * (k + 1))?,
            stage_w: runtime.alloc(staged * k)?,
            disp_sig: runtime.alloc(ranks)?,
            comb_x: runtime.alloc(comb_rows * d)?,
            comb_sig: runtime.alloc(ranks)?,
        };
        // Signals must start at zero on every rank before any peer can raise one.
        for (p, bytes) in [
            (sym.meta_sig.device_ptr(), ranks * 8),
            (sym.disp_sig.device_ptr(), ranks * 8),
            (sym.comb_sig.device_ptr(), ranks * 8),
        ] {
            // SAFETY: `p` is a live symmetric allocation of at least `bytes` bytes.
            unsafe { result::memset_d8_async(p as sys::CUdeviceptr, 0, bytes, stream.cu_stream()) }
                .map_err(cuda)?;
        }
        let local = Local {
            epoch: zeros(stream, 1)?,
            done: zeros(stream, 2)?,
            chunk_cnt: zeros(stream, t.div_ceil(params::CHUNK) * c)?,
            pos_local: zeros(stream, t * k)?,
            tokpos: zeros(stream, t * ranks)?,
            counts_all: zeros(stream, ranks * c)?,
            dest_row_base: zeros(stream, e)?,
            stage_base: zeros(stream, ranks)?,
            comb_base: zeros(stream, ranks)?,
            src_base: zeros(stream, ranks + 1)?,
            status: zeros(stream, 2)?,
            recv_x: zeros(stream, rows * d)?,
            recv_offsets: zeros(stream, place.per_rank())?,
            recv_w: zeros(stream, rows)?,
            recv_origin: zeros(stream, rows * 3)?,
        };
        runtime.barrier_on_stream(stream);
        stream.synchronize().map_err(cuda)?;
        let s = stream.as_ref();
        let base = EpParams {
            ranks: ranks as i32,
            rank: rank as i32,
            experts: e as i32,
            local_experts: place.per_rank() as i32,
            top_k: k as i32,
            hidden: d as i32,
            tokens: 0,
            max_tokens: t as i32,
            recv_rows_cap: rows as i64,
            meta: sym.meta.device_ptr(),
            meta_sig: sym.meta_sig.device_ptr(),
            stage_x: sym.stage_x.device_ptr(),
            stage_info: sym.stage_info.device_ptr(),
            stage_w: sym.stage_w.device_ptr(),
            disp_sig: sym.disp_sig.device_ptr(),
            comb_x: sym.comb_x.device_ptr(),
            comb_sig: sym.comb_sig.device_ptr(),
            epoch: ptr(&local.epoch, s),
            done: ptr(&local.done, s),
            chunk_cnt: ptr(&local.chunk_cnt, s),
            pos_local: ptr(&local.pos_local, s),
            tokpos: ptr(&local.tokpos, s),
            counts_all: ptr(&local.counts_all, s),
            dest_row_base: ptr(&local.dest_row_base, s),
            stage_base: ptr(&local.stage_base, s),
            comb_base: ptr(&local.comb_base, s),
            src_base: ptr(&local.src_base, s),
            status: ptr(&local.status, s),
            recv_x: ptr(&local.recv_x, s),
            recv_offsets: ptr(&local.recv_offsets, s),
            recv_w: ptr(&local.recv_w, s),
            recv_origin: ptr(&local.recv_origin, s),
            ..EpParams::default()
        };
        // Two 256-thread blocks per SM: 16 warps, each with 4 row loads per lane in flight.
        let grid = 2 * runtime
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda)? as u32;
        tracing::debug!(
            rank,
            ranks,
            ?cfg,
            staged,
            rows,
            "expert-parallel buffers ready"
        );
        Ok(ExpertParallel {
            cfg,
            place,
            rank,
            stream: stream.clone(),
            grid,
            base,
            kernels,
            local,
            sym,
            module,
            runtime: runtime.clone(),
        })
    }

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

    /// Rows the expert-major receive buffer holds (the worst case: every token of every
    /// rank with all slots that can land here).
    pub fn recv_rows_capacity(&self) -> usize {
        self.local.recv_w.len()
    }

    /// Sends `tokens` rows of `x` (`[tokens, hidden]` bf16) to the owners of their experts
    /// (`topk_ids`, `topk_weights`: `[tokens, top_k]`). Collective. Errors before any launch
    /// when a buffer is short or `tokens` exceeds the capacity.
    pub fn dispatch<X, I, W>(
        &mut self,
        x: &X,
        topk_ids: &I,
        topk_weights: &W,
        tokens: usize,
    ) -> Result<Dispatch<'_>, CommError>
    where
        X: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        W: DevicePtr<f32>,
    {
        let cap = Capacity {
            max_tokens: self.cfg.max_tokens,
            top_k: self.cfg.top_k,
            place: self.place,
        };
        cap.check_dispatch(tokens, self.cfg.top_k)?;
        let (k, d) = (self.cfg.top_k, self.cfg.hidden);
        check_len("x", x.len(), tokens * d)?;
        check_len("topk_ids", topk_ids.len(), tokens * k)?;
        check_len("topk_weights", topk_weights.len(), tokens * k)?;
        let s = self.stream.clone();
        let (xp, _xs) = x.device_ptr(&s);
        let (ip, _is) = topk_ids.device_ptr(&s);
        let (wp, _ws) = topk_weights.device_ptr(&s);
        let p = EpParams {
            tokens: tokens as i32,
            x: xp,
            topk_ids: ip,
            topk_weights: wp,
            ..self.base
        };
        let chunks = tokens.div_ceil(params::CHUNK).max(1) as u32;
        let count_smem = (8 * (self.cfg.experts + self.place.ranks() + 32 * k) * 4) as u32;
        let kn = &self.kernels;
        // SAFETY: `p` mirrors `moefuse_ep_params` (layout test); its buffers are owned by
        // `self` and sized from the config, the caller's were checked above and are kept
        // alive by their guards until the launches are queued (stream order does the rest).
        unsafe {
            self.module
                .launch(kn.count, &s, chunks, 256, count_smem, &p)?;
            self.module.launch(kn.notify, &s, 1, 1024, 0, &p)?;
            self.module.launch(kn.dispatch, &s, self.grid, 256, 0, &p)?;
            self.module.launch(kn.expand, &s, self.grid, 256, 0, &p)?;
        }
        Ok(Dispatch { ep: self, tokens })
    }

    /// Reads the routing flags the kernels raised since the last call, and clears them
    /// (synchronises the stream).
    pub fn take_flags(&mut self) -> Result<RoutingFlags, CommError> {
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

fn check_len(what: &'static str, got: usize, needed: usize) -> Result<(), CommError> {
    if got < needed {
        return Err(CommError::BufferTooSmall { what, needed, got });
    }
    Ok(())
}

/// The received rows of one [`ExpertParallel::dispatch`], to be given back to
/// [`Dispatch::combine`] (every rank must combine before it dispatches again).
pub struct Dispatch<'a> {
    ep: &'a mut ExpertParallel,
    tokens: usize,
}

impl Dispatch<'_> {
    /// Expert-major received rows, `[recv_rows_capacity, hidden]` bf16; the first
    /// `offsets[local_experts - 1]` are valid, grouped by local expert.
    pub fn x(&self) -> &CudaSlice<bf16> {
        &self.ep.local.recv_x
    }

    /// Prefix-sum ends of each local expert's rows (the grouped GEMM's offsets), on the device.
    pub fn offsets(&self) -> &CudaSlice<i32> {
        &self.ep.local.recv_offsets
    }

    /// Routing weight of each received row.
    pub fn weights(&self) -> &CudaSlice<f32> {
        &self.ep.local.recv_w
    }

    /// `(source rank, token, slot)` of each received row, `[rows, 3]`.
    pub fn origin(&self) -> &CudaSlice<i32> {
        &self.ep.local.recv_origin
    }

    /// Rows received (synchronises the stream; for tests and tools).
    pub fn received_rows(&self) -> Result<usize, CommError> {
        let status = self
            .ep
            .stream
            .clone_dtoh(&self.ep.local.status)
            .map_err(cuda)?;
        Ok(status[0] as usize)
    }

    /// Reduces the expert outputs `y` (`[rows, hidden]` bf16, in [`Dispatch::x`]'s row order)
    /// back to this rank's tokens: `out[t] = Σ_slot w[t, slot] · y(t, slot)`, `[tokens,
    /// hidden]` bf16. Collective.
    pub fn combine<Y, O>(self, y: &Y, out: &mut O) -> Result<(), CommError>
    where
        Y: DevicePtr<bf16>,
        O: DevicePtrMut<bf16>,
    {
        let ep = self.ep;
        let d = ep.cfg.hidden;
        check_len("out", out.len(), self.tokens * d)?;
        let s = ep.stream.clone();
        let (yp, _ys) = y.device_ptr(&s);
        let (op, _os) = out.device_ptr_mut(&s);
        let p = EpParams {
            tokens: self.tokens as i32,
            // Rows past the end of `y` are skipped and flagged (recv_overflow).
            recv_rows_cap: ep.base.recv_rows_cap.min((y.len() / d) as i64),
            y: yp,
            out: op,
            ..ep.base
        };
        // SAFETY: as in dispatch; `y` and `out` were checked and are kept alive by their guards.
        unsafe {
            ep.module
                .launch(ep.kernels.combine_send, &s, ep.grid, 256, 0, &p)?;
            ep.module
                .launch(ep.kernels.combine_reduce, &s, ep.grid, 256, 0, &p)?;
        }
        Ok(())
    }
}
