//! The fused gate_up of the launch layer (moe_abi.h `moefuse_gate_up_args`): the token rows
//! of x gathered by the GEMM's producer (or read in order from an already gathered x), the
//! activation in its epilogue.

use super::{check_routed_gemm, tile_order_word, ActivationKind, GateUpLayout};
use crate::bind::{check_align, check_multiple, check_range, extent, to_i32, Binder, Call};
use crate::{ffi, KernelError};
use cudarc::driver::{CudaContext, DevicePtr, DevicePtrMut};
use half::bf16;
use std::ffi::c_void;
use std::sync::Arc;

/// TMA rows and 16-byte stores: every bf16 matrix starts 16-byte aligned.
const ROW_ALIGN: u64 = 16;

/// The x of every rank of an expert-parallel group as addresses this device loads from (its
/// own memory, or a peer's mapped over NVLink, as NVSHMEM's `nvshmem_ptr` gives them): the
/// rows a [`GateUpRows::Peers`] gate_up reads in place, `[rows, hidden]` bf16 per rank.
/// Built by the communication layer, which owns the buffers (hence `unsafe`).
///
/// ```no_run
/// # fn demo(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, bases: &[u64]) -> Result<(), moefuse_kernels::KernelError> {
/// // SAFETY: each base is a live [4096, 2048] bf16 buffer this device reads (see `new`).
/// let peers = unsafe { moefuse_kernels::PeerRows::new(ctx, bases, 4096, 2048)? };
/// assert_eq!(peers.ranks(), bases.len());
/// # Ok(()) }
/// ```
/// Not `Clone`: a launch can only borrow it from its owner, who keeps the buffers alive.
#[derive(Debug)]
pub struct PeerRows {
    context: Arc<CudaContext>,
    x: [u64; ffi::MOEFUSE_GATE_UP_MAX_PEERS],
    ranks: usize,
    rows: usize,
    hidden: usize,
}

impl PeerRows {
    /// Most ranks one gate_up reads rows from (`MOEFUSE_GATE_UP_MAX_PEERS`: one NVLink
    /// domain of 8 GPUs).
    pub const MAX_RANKS: usize = ffi::MOEFUSE_GATE_UP_MAX_PEERS;

    /// The x of `x.len()` ranks (`1..=`[`PeerRows::MAX_RANKS`]), each `[rows, hidden]` bf16
    /// at a 16-byte aligned address, for kernels on `context`'s device. Errors on a count,
    /// size or alignment the kernel cannot take.
    ///
    /// # Safety
    /// For every launch that uses the value, each `x[s]` must be the address (on `context`'s
    /// device, possibly a peer mapping) of `rows * hidden` bf16 elements that stay
    /// allocated and are not written while the launch reads them.
    ///
    /// ```no_run
    /// # fn demo(ctx: &std::sync::Arc<cudarc::driver::CudaContext>, x: u64) -> Result<(), moefuse_kernels::KernelError> {
    /// // SAFETY: `x` is a live [128, 1024] bf16 buffer on ctx's device.
    /// let one = unsafe { moefuse_kernels::PeerRows::new(ctx, &[x], 128, 1024)? };
    /// # Ok(()) }
    /// ```
    pub unsafe fn new(
        context: &Arc<CudaContext>,
        x: &[u64],
        rows: usize,
        hidden: usize,
    ) -> Result<Self, KernelError> {
        let kernel = "PeerRows".to_string();
        check_range(
            &kernel,
            "ranks",
            x.len() as i128,
            1,
            Self::MAX_RANKS as i128,
        )?;
        check_range(&kernel, "rows", rows as i128, 1, i32::MAX as i128)?;
        check_range(&kernel, "hidden", hidden as i128, 8, i32::MAX as i128)?;
        check_multiple(&kernel, "hidden", hidden, 8)?;
        for &base in x {
            check_align(&kernel, "x[rank]", base, ROW_ALIGN)?;
        }
        let mut table = [0u64; ffi::MOEFUSE_GATE_UP_MAX_PEERS];
        table[..x.len()].copy_from_slice(x);
        Ok(PeerRows {
            context: context.clone(),
            x: table,
            ranks: x.len(),
            rows,
            hidden,
        })
    }

    /// Ranks.
    ///
    /// ```no_run
    /// # fn demo(p: &moefuse_kernels::PeerRows) { assert!(p.ranks() >= 1); }
    /// ```
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// Rows of each rank's x (`source_of = rank * rows + t`).
    ///
    /// ```no_run
    /// # fn demo(p: &moefuse_kernels::PeerRows) { assert!(p.rows() >= 1); }
    /// ```
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Where a [`GateUpFused`]'s rows of A come from.
///
/// ```no_run
/// # fn demo(x: &cudarc::driver::CudaSlice<half::bf16>, src: &cudarc::driver::CudaSlice<i32>) {
/// let rows = moefuse_kernels::GateUpRows::Gather { x, source_of: src };
/// # }
/// ```
pub enum GateUpRows<'a> {
    /// Row `r` reads token `source_of[r] / top_k` of `x [tokens, hidden]` (the permutation's
    /// `source_of [tokens * top_k]`, device data the kernel bounds).
    Gather {
        /// `[tokens, hidden]`.
        x: &'a dyn DevicePtr<bf16>,
        /// `[tokens * top_k]`: `t * top_k + j` of each row.
        source_of: &'a dyn DevicePtr<i32>,
    },
    /// `x [tokens * top_k, hidden]` holds the rows in expert-major order already (the
    /// unfused path's `x_perm`): row `r` reads row `r`, and only the activation is fused.
    InOrder {
        /// `[tokens * top_k, hidden]`.
        x: &'a dyn DevicePtr<bf16>,
    },
    /// Row `r` reads row `t` of rank `s`'s x in place, `source_of[r] = s * peers.rows() + t`
    /// (the expert-parallel pull dispatch: only routing metadata moved).
    Peers {
        /// The ranks' x.
        peers: &'a PeerRows,
        /// `[tokens * top_k]`: `s * rows + t` of each row.
        source_of: &'a dyn DevicePtr<i32>,
    },
}

/// `h[r] = act(x[source_of[r] / top_k] · W_eᵀ)` for the expert-major rows `r` of each expert
/// `e` (rows `offsets[e-1]..offsets[e]`), and `h_pre[r]` (the pre-activation) when given:
/// the permutation's gather, the gate_up GEMM and the activation in one kernel. The rows
/// may also come in order ([`GateUpRows::InOrder`], the unfused path's `x_perm`: only the
/// activation is fused) or from the ranks of an expert-parallel group
/// ([`GateUpRows::Peers`]). Hopper only
/// (`sm_90a`); elsewhere it returns [`KernelError::Launch`] with
/// [`Status::ArchMismatch`](crate::Status::ArchMismatch), and the caller runs the unfused
/// stages. `hidden` and `intermediate` are multiples of 8.
///
/// ```no_run
/// # use moefuse_kernels::{ActivationKind, GateUpFused, GateUpLayout, GateUpRows, Kernels};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let (t, k, d, i, e) = (16, 2, 128, 64, 4);
/// let (x, w) = (stream.alloc_zeros::<bf16>(t * d)?, stream.alloc_zeros::<bf16>(e * 2 * i * d)?);
/// let (offsets, source_of) = (stream.alloc_zeros::<i32>(e)?, stream.alloc_zeros::<i32>(t * k)?);
/// let mut h = stream.alloc_zeros::<bf16>(t * k * i)?;
/// kernels.launch(&stream, GateUpFused { tokens: t, top_k: k, hidden: d, intermediate: i,
///     experts: e, kind: ActivationKind::SwiGlu, layout: GateUpLayout::Split, tile_order: 0,
///     offsets: &offsets, rows: GateUpRows::Gather { x: &x, source_of: &source_of }, w: &w,
///     h: &mut h, h_pre: None, errors: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GateUpFused<'a> {
    /// Tokens (rows of x).
    pub tokens: usize,
    /// Slots per token, `1..=`[`MAX_TOP_K`](moefuse_spec::MAX_TOP_K).
    pub top_k: usize,
    /// `D`, a multiple of 8.
    pub hidden: usize,
    /// `I`, a multiple of 8.
    pub intermediate: usize,
    /// Experts, `1..=`[`MAX_EXPERTS`](moefuse_spec::MAX_EXPERTS).
    pub experts: usize,
    /// The activation.
    pub kind: ActivationKind,
    /// Gate/up rows of `W_e` (ignored by `Relu2`).
    pub layout: GateUpLayout,
    /// 0 (default), or the contiguous grouped GEMM's raster, band and interleave fields.
    pub tile_order: u32,
    /// `[experts]` prefix-sum ends (device data, clamped by the kernel).
    pub offsets: &'a dyn DevicePtr<i32>,
    /// Where the rows of A come from.
    pub rows: GateUpRows<'a>,
    /// `[experts, W, hidden]`, `W = 2I` gated, `I` for `Relu2`.
    pub w: &'a dyn DevicePtr<bf16>,
    /// `[tokens * top_k, intermediate]` out.
    pub h: &'a mut dyn DevicePtrMut<bf16>,
    /// `[tokens * top_k, W]` out (the backward's input), or `None`.
    pub h_pre: Option<&'a mut dyn DevicePtrMut<bf16>>,
    /// `[1]` error bits (`ffi::MOEFUSE_MOE_ERROR_SOURCE`), or `None`.
    pub errors: Option<&'a mut dyn DevicePtrMut<u32>>,
}

impl<'a> GateUpFused<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (t, k, d, i, e) = (
            self.tokens,
            self.top_k,
            self.hidden,
            self.intermediate,
            self.experts,
        );
        let tk = check_routed_gemm(kernel, (t, k, d, i, e))?;
        let width = if self.kind.is_gated() { 2 * i } else { i };
        let (activation, alpha, limit) = self.kind.raw(kernel)?;
        let tile_order = tile_order_word(
            kernel,
            self.tile_order,
            0x100_ff03,
            "tile_order: raster 0-2, band bits 8-15, interleave bit 24",
        )?;
        let offsets = b.read("offsets", self.offsets, e, 4)?;
        let (mut source_of, mut x) = (0, 0);
        let (mut peers, mut peer_rows) = (0, 0);
        let mut peer_x = [std::ptr::null::<c_void>(); ffi::MOEFUSE_GATE_UP_MAX_PEERS];
        match self.rows {
            GateUpRows::Gather {
                x: xs,
                source_of: src,
            } => {
                source_of = b.read("source_of", src, tk, 4)?;
                x = b.read("x", xs, extent(kernel, "x", &[t, d])?, ROW_ALIGN)?;
            }
            GateUpRows::InOrder { x: xs } => {
                x = b.read("x", xs, extent(kernel, "x", &[tk, d])?, ROW_ALIGN)?;
            }
            GateUpRows::Peers {
                peers: pr,
                source_of: src,
            } => {
                source_of = b.read("source_of", src, tk, 4)?;
                b.check_context("peer x", &pr.context)?;
                if pr.hidden != d {
                    return Err(KernelError::Inconsistent {
                        kernel: kernel.clone(),
                        why: "the peers' x rows are not `hidden` wide",
                    });
                }
                peers = to_i32(kernel, "peers", pr.ranks)?;
                peer_rows = to_i32(kernel, "peer rows", pr.rows)?;
                for (slot, &base) in peer_x.iter_mut().zip(&pr.x[..pr.ranks]) {
                    *slot = base as *const c_void;
                }
            }
        }
        let w = b.read("w", self.w, extent(kernel, "w", &[e, width, d])?, ROW_ALIGN)?;
        let h = b.write("h", self.h, extent(kernel, "h", &[tk, i])?, ROW_ALIGN)?;
        let h_pre = b.write_opt(
            "h_pre",
            self.h_pre,
            extent(kernel, "h_pre", &[tk, width])?,
            ROW_ALIGN,
        )?;
        let errors = b.write_opt("errors", self.errors, 1, 4)?;
        if t == 0 {
            return Ok(None);
        }
        Ok(Some(Call::GateUpFused(ffi::MoefuseGateUpArgs {
            tokens: to_i32(kernel, "tokens", t)?,
            top_k: to_i32(kernel, "top_k", k)?,
            hidden: to_i32(kernel, "hidden", d)?,
            intermediate: to_i32(kernel, "intermediate", i)?,
            experts: to_i32(kernel, "experts", e)?,
            activation,
            layout: self.layout.raw(),
            tile_order,
            alpha,
            limit,
            offsets: offsets as *const i32,
            source_of: source_of as *const i32,
            x: x as *const _,
            w: w as *const _,
            h: h as *mut _,
            h_pre: h_pre as *mut _,
            errors: errors as *mut u32,
            peers,
            peer_rows,
            peer_x,
        })))
    }
}
