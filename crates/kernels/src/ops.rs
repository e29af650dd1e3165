//! The GEMM operations of the launch layer: dense and grouped, each a shape (sizes and
//! scalars, checked on the host as the kernel's `can_implement`) and its buffers.

use crate::bind::{check_len, check_multiple, check_range, extent, to_i32, Binder, Call};
use crate::{ffi, CompiledVariant, Entry, KernelError, Kernels, Op, Schedule, VariantSpec};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_spec::{GroupedKind, TileOrder, CONTIGUOUS_MAX_GROUPS, ZERO_EMPTY_GROUPS_MAX};

/// TMA moves 16-byte rows: bf16 operands start 16-byte aligned.
pub(crate) const OPERAND_ALIGN: u64 = 16;
/// The grouped launchers carve their per-group arrays from a 256-byte aligned workspace.
pub(crate) const GROUPED_WORKSPACE_ALIGN: u64 = 256;

/// A dense problem: `D[m, n] = alpha · A[m, k] · B + beta · C`, all packed row-major bf16,
/// B `[n, k]` or `[k, n]` as the variant's [`Op`] says.
///
/// ```
/// let s = moefuse_kernels::GemmShape::new(128, 256, 64);
/// assert_eq!((s.alpha, s.beta), (1.0, 0.0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmShape {
    /// Rows of A, C, D (0: nothing is launched).
    pub m: usize,
    /// Columns of B, C, D (multiple of 8).
    pub n: usize,
    /// Inner dimension (multiple of 8).
    pub k: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C (0: C is never read).
    pub beta: f32,
}

impl GemmShape {
    /// `D = A · B`.
    ///
    /// ```
    /// assert_eq!(moefuse_kernels::GemmShape::new(1, 8, 8).k, 8);
    /// ```
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        GemmShape {
            m,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
        }
    }
}

/// A dense GEMM launch.
///
/// ```no_run
/// # use moefuse_kernels::{Gemm, GemmShape, Kernels, Op};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let variant = moefuse_kernels::compiled().iter().find(|v| v.spec.op == Op::GemmBnk).unwrap();
/// let a = stream.alloc_zeros::<bf16>(64 * 64)?;
/// let b = stream.alloc_zeros::<bf16>(64 * 64)?;
/// let mut d = stream.alloc_zeros::<bf16>(64 * 64)?;
/// let shape = GemmShape { beta: 1.0, ..GemmShape::new(64, 64, 64) }; // C is D
/// kernels.launch(&stream, Gemm { variant, shape, a: &a, b: &b, c: None, d: &mut d, workspace: None })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Gemm<'a> {
    /// A dense variant ([`Op::GemmBnk`] or [`Op::GemmBkn`]) of the handle's architecture.
    pub variant: &'static CompiledVariant,
    /// Sizes and scalars.
    pub shape: GemmShape,
    /// `[m, k]`.
    pub a: &'a dyn DevicePtr<bf16>,
    /// `[n, k]` or `[k, n]`.
    pub b: &'a dyn DevicePtr<bf16>,
    /// `[m, n]`, read when `beta != 0`; `None` reads D itself.
    pub c: Option<&'a dyn DevicePtr<bf16>>,
    /// `[m, n]`.
    pub d: &'a mut dyn DevicePtrMut<bf16>,
    /// At least [`Kernels::gemm_workspace`] bytes, 16-byte aligned (`None`: 0 bytes).
    pub workspace: Option<&'a mut dyn DevicePtrMut<u8>>,
}

/// A grouped problem over prefix-sum offsets (abi.h `moefuse_grouped_gemm_args`); the kind
/// (M- or K-grouped) and B's layout come from the variant's [`Op`].
///
/// ```
/// let s = moefuse_kernels::GroupedShape::new(8, 4096, 256, 512);
/// assert_eq!(s.tile_order, 0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupedShape {
    /// Groups (experts); 0 launches nothing.
    pub groups: usize,
    /// Rows the row-indexed buffers hold; device ends are clamped to it.
    pub rows: usize,
    /// M-grouped: columns of D. K-grouped: columns of B and of each D_e.
    pub n: usize,
    /// M-grouped: inner dimension. K-grouped: columns of A, rows of each D_e.
    pub k: usize,
    /// abi.h's tile-order word (raster, swizzle or band, prefetch, interleave):
    /// [`TileOrder::encode`](moefuse_spec::TileOrder::encode) of the order wanted.
    pub tile_order: i32,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of D's previous content.
    pub beta: f32,
}

impl GroupedShape {
    /// `groups` groups over `rows` rows, `alpha = 1`, `beta = 0`, the default tile order.
    ///
    /// ```
    /// assert_eq!(moefuse_kernels::GroupedShape::new(2, 16, 8, 8).rows, 16);
    /// ```
    pub fn new(groups: usize, rows: usize, n: usize, k: usize) -> Self {
        GroupedShape {
            groups,
            rows,
            n,
            k,
            tile_order: 0,
            alpha: 1.0,
            beta: 0.0,
        }
    }
}

/// A grouped GEMM launch. Buffers per kind: M-grouped A `[rows, k]`, B `[groups, n, k]` or
/// `[groups, k, n]`, D `[rows, n]`; K-grouped A `[rows, k]`, B `[rows, n]`, D
/// `[groups, k, n]`.
///
/// ```no_run
/// # use moefuse_kernels::{GroupedGemm, GroupedShape, Kernels, Op};
/// # use half::bf16;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// # let kernels = Kernels::new(&ctx)?;
/// let variant = moefuse_kernels::compiled().iter().find(|v| v.spec.op == Op::GroupedFwdBnk).unwrap();
/// let shape = GroupedShape::new(2, 256, 128, 64);
/// let offsets = stream.clone_htod(&[100i32, 256])?;
/// let a = stream.alloc_zeros::<bf16>(256 * 64)?;
/// let b = stream.alloc_zeros::<bf16>(2 * 128 * 64)?;
/// let mut d = stream.alloc_zeros::<bf16>(256 * 128)?;
/// let mut ws = stream.alloc_zeros::<u8>(kernels.grouped_workspace(variant, &shape)?)?;
/// kernels.launch(&stream, GroupedGemm { variant, shape, offsets: &offsets, a: &a, b: &b,
///     a_rows: None, b_rows: None, d: &mut d, workspace: &mut ws })?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GroupedGemm<'a> {
    /// A grouped variant of the handle's architecture.
    pub variant: &'static CompiledVariant,
    /// Sizes and scalars.
    pub shape: GroupedShape,
    /// `[groups]` int32 prefix-sum row ends.
    pub offsets: &'a dyn DevicePtr<i32>,
    /// See the struct docs; with `a_rows`, `[a_rows.source_rows, k]`.
    pub a: &'a dyn DevicePtr<bf16>,
    /// Contiguous (`_contig`) variants only: read A's rows through an index instead of a
    /// permuted copy (the other variants refuse it before the launch).
    pub a_rows: Option<GatheredRows<'a>>,
    /// See the struct docs; with `b_rows`, `[b_rows.source_rows, n]`.
    pub b: &'a dyn DevicePtr<bf16>,
    /// K-grouped contiguous (`_contig` wgrad) variants only: read B's rows through an index
    /// instead of a permuted copy (the other variants refuse it before the launch).
    pub b_rows: Option<GatheredRows<'a>>,
    /// See the struct docs.
    pub d: &'a mut dyn DevicePtrMut<bf16>,
    /// At least [`Kernels::grouped_workspace`] bytes, 256-byte aligned.
    pub workspace: &'a mut dyn DevicePtrMut<u8>,
}

/// An operand's rows read through an index: row `r` of the grouped problem reads row
/// `index[r] / div` of a `[source_rows, width]` buffer; an entry that is negative or names a
/// row at or past `source_rows` reads zeros (the device never trusts the index). The MoE
/// layer's backward reads the token rows of `x` and `dy` this way (`index` = `source_of`,
/// `div` = top-k), so their permuted copies are never written.
///
/// ```no_run
/// # use moefuse_kernels::GatheredRows;
/// # let ctx = cudarc::driver::CudaContext::new(0)?;
/// # let stream = ctx.default_stream();
/// let source_of = stream.clone_htod(&[3i32, 0, 1, 2])?; // 2 tokens, top-2: slot -> row
/// let rows = GatheredRows { index: &source_of, div: 2, source_rows: 2 };
/// assert_eq!(rows.div, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy)]
pub struct GatheredRows<'a> {
    /// `[rows]` int32 entries (the shape's `rows`).
    pub index: &'a dyn DevicePtr<i32>,
    /// Divisor applied to each entry (>= 1).
    pub div: usize,
    /// Rows of the gathered operand (>= 1).
    pub source_rows: usize,
}

impl std::fmt::Debug for GatheredRows<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatheredRows")
            .field("index_len", &self.index.len())
            .field("div", &self.div)
            .field("source_rows", &self.source_rows)
            .finish()
    }
}

/// Device addresses and a stream from outside cudarc, for [`Kernels::launch_grouped_raw`].
///
/// ```
/// let r = moefuse_kernels::RawGrouped { offsets: 0, a: 0, b: 0, d: 0, workspace: 0,
///     workspace_bytes: 0, stream: 0 };
/// assert_eq!(r.workspace_bytes, 0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawGrouped {
    /// `[groups]` int32 prefix-sum row ends.
    pub offsets: u64,
    /// A.
    pub a: u64,
    /// B.
    pub b: u64,
    /// D.
    pub d: u64,
    /// The workspace.
    pub workspace: u64,
    /// Its size in bytes.
    pub workspace_bytes: usize,
    /// A `CUstream` of the handle's context (0: the legacy default stream).
    pub stream: u64,
}

fn dense_entry(
    kernels: &Kernels,
    variant: &CompiledVariant,
    kernel: &str,
) -> Result<(ffi::GemmLaunchFn, ffi::GemmWorkspaceFn), KernelError> {
    check_variant_arch(kernels, variant)?;
    match variant.entry {
        Entry::Gemm { run, workspace } => Ok((run, workspace)),
        Entry::Grouped { .. } => Err(KernelError::WrongEntry {
            variant: kernel.to_string(),
            expected: "dense",
        }),
    }
}

pub(crate) fn grouped_entry(
    kernels: &Kernels,
    variant: &CompiledVariant,
    kernel: &str,
) -> Result<(ffi::GroupedLaunchFn, ffi::GroupedWorkspaceFn), KernelError> {
    check_variant_arch(kernels, variant)?;
    match variant.entry {
        Entry::Grouped { run, workspace } => Ok((run, workspace)),
        Entry::Gemm { .. } => Err(KernelError::WrongEntry {
            variant: kernel.to_string(),
            expected: "grouped",
        }),
    }
}

fn check_variant_arch(kernels: &Kernels, variant: &CompiledVariant) -> Result<(), KernelError> {
    if variant.spec.arch == kernels.arch() {
        return Ok(());
    }
    Err(KernelError::VariantArch {
        variant: variant.name(),
        variant_arch: variant.spec.arch.name(),
        device_arch: kernels.arch().name(),
    })
}

/// Host-side `can_implement` of a dense problem on `spec`.
pub(crate) fn check_gemm(
    kernel: &str,
    spec: &VariantSpec,
    s: &GemmShape,
) -> Result<(), KernelError> {
    let max = i32::MAX as i128;
    check_range(kernel, "m", s.m as i128, 0, max)?;
    check_range(kernel, "n", s.n as i128, 1, max)?;
    check_range(kernel, "k", s.k as i128, 1, max)?;
    check_multiple(kernel, "k", s.k, 8)?;
    check_multiple(kernel, "n", s.n, 8)?;
    let [tm, tn, _] = spec.tile.map(|t| t as i128);
    let cm = spec.cluster[0] as i128;
    // Row and tile indices are int32 in the kernels' schedulers.
    check_range(
        kernel,
        "m + 2 * cluster tile rows",
        s.m as i128 + 2 * tm * cm,
        0,
        max,
    )?;
    let tiles = cdiv(s.m as i128, tm) * cdiv(s.n as i128, tn);
    check_range(kernel, "output tiles", tiles, 0, max)
}

/// Host-side `can_implement` of a grouped problem on `spec` for a device of `sms` SMs:
/// everything the launchers and kernels assume about sizes, limits and the tile order.
pub(crate) fn check_grouped(
    kernel: &str,
    spec: &VariantSpec,
    s: &GroupedShape,
    sms: usize,
) -> Result<(), KernelError> {
    let max = i32::MAX as i128;
    check_range(kernel, "groups", s.groups as i128, 0, max)?;
    check_range(kernel, "rows", s.rows as i128, 0, max)?;
    check_range(kernel, "n", s.n as i128, 1, max)?;
    check_range(kernel, "k", s.k as i128, 1, max)?;
    check_multiple(kernel, "n", s.n, 8)?;
    check_multiple(kernel, "k", s.k, 8)?;
    check_tile_order(kernel, spec.schedule, s.tile_order)?;
    let contiguous = spec.schedule == Schedule::Contiguous;
    if contiguous {
        check_range(
            kernel,
            "groups (contiguous kernel's table)",
            s.groups as i128,
            0,
            CONTIGUOUS_MAX_GROUPS as i128,
        )?;
    }
    let k_grouped = spec.op.grouped_kind() == Some(GroupedKind::KGrouped);
    if k_grouped && s.beta == 0.0 {
        check_range(
            kernel,
            "groups (zero_empty_groups grid.y)",
            s.groups as i128,
            0,
            ZERO_EMPTY_GROUPS_MAX as i128,
        )?;
    }
    // Row arithmetic is int32 on the device (the contiguous scheduler's `row0` runs up to one
    // cluster tile past a group's end): keep two cluster tiles of headroom below i32::MAX.
    let [tm, tn, tk] = spec.tile.map(|t| t as i128);
    let cm = spec.cluster[0] as i128;
    let unit = if k_grouped { tk } else { tm * cm };
    check_range(
        kernel,
        "rows + 2 * cluster tile rows",
        s.rows as i128 + 2 * unit,
        0,
        max,
    )?;
    // Tile numbers are int32 too: every group adds at most one partial unit, and a
    // persistent CTA steps one grid (<= SMs) past the last tile.
    let (groups, rows, n, k) = (s.groups as i128, s.rows as i128, s.n as i128, s.k as i128);
    let tiles = if k_grouped {
        groups * cdiv(k, tm) * cdiv(n, tn)
    } else {
        (cdiv(rows, unit) + groups) * cdiv(n, tn)
    };
    check_range(kernel, "tiles + SMs", tiles + sms as i128, 0, max)
}

/// `ceil(a / b)` of non-negative values.
fn cdiv(a: i128, b: i128) -> i128 {
    (a + b - 1) / b
}

/// The tile-order word as the launchers decode it (`moefuse_spec::tile_order`).
fn check_tile_order(kernel: &str, schedule: Schedule, word: i32) -> Result<(), KernelError> {
    TileOrder::decode(word, schedule == Schedule::Contiguous)
        .map(|_| ())
        .map_err(|source| KernelError::InvalidTileOrder {
            kernel: kernel.to_string(),
            word,
            source,
        })
}

fn b_layout(op: Op) -> i32 {
    match op {
        Op::GemmBkn | Op::GroupedFwdBkn => ffi::MOEFUSE_B_LAYOUT_KN,
        _ => ffi::MOEFUSE_B_LAYOUT_NK,
    }
}

/// Elements of (A, B, D) a grouped problem of `op` reads and writes.
pub(crate) fn grouped_extents(
    kernel: &str,
    op: Op,
    s: &GroupedShape,
) -> Result<[usize; 3], KernelError> {
    let (g, r, n, k) = (s.groups, s.rows, s.n, s.k);
    Ok(if op == Op::GroupedWgrad {
        [
            extent(kernel, "a extent", &[r, k])?,
            extent(kernel, "b extent", &[r, n])?,
            extent(kernel, "d extent", &[g, k, n])?,
        ]
    } else {
        [
            extent(kernel, "a extent", &[r, k])?,
            extent(kernel, "b extent", &[g, n, k])?,
            extent(kernel, "d extent", &[r, n])?,
        ]
    })
}

fn dense_args(
    op: Op,
    s: &GemmShape,
    kernel: &str,
    ptrs: [u64; 4],
) -> Result<ffi::MoefuseGemmArgs, KernelError> {
    let [a, b, c, d] = ptrs;
    let ldb = if b_layout(op) == ffi::MOEFUSE_B_LAYOUT_KN {
        s.n
    } else {
        s.k
    };
    Ok(ffi::MoefuseGemmArgs {
        m: to_i32(kernel, "m", s.m)?,
        n: to_i32(kernel, "n", s.n)?,
        k: to_i32(kernel, "k", s.k)?,
        b_layout: b_layout(op),
        a: a as *const _,
        b: b as *const _,
        c: c as *const _,
        d: d as *mut _,
        lda: s.k as i64,
        ldb: ldb as i64,
        ldc: s.n as i64,
        ldd: s.n as i64,
        alpha: s.alpha,
        beta: s.beta,
    })
}

/// The gathered-rows fields of one operand: index address (0: none), div, source rows.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct GatherArgs {
    pub(crate) index: u64,
    pub(crate) div: usize,
    pub(crate) source_rows: usize,
}

pub(crate) fn grouped_args(
    op: Op,
    s: &GroupedShape,
    kernel: &str,
    offsets: u64,
    [a, b, d]: [u64; 3],
) -> Result<ffi::MoefuseGroupedGemmArgs, KernelError> {
    grouped_args_gathered(
        op,
        s,
        kernel,
        offsets,
        [a, b, d],
        [GatherArgs::default(); 2],
    )
}

pub(crate) fn grouped_args_gathered(
    op: Op,
    s: &GroupedShape,
    kernel: &str,
    offsets: u64,
    [a, b, d]: [u64; 3],
    [gather_a, gather_b]: [GatherArgs; 2],
) -> Result<ffi::MoefuseGroupedGemmArgs, KernelError> {
    let div = |g: GatherArgs, what| {
        if g.index == 0 {
            Ok(1)
        } else {
            to_i32(kernel, what, g.div)
        }
    };
    Ok(ffi::MoefuseGroupedGemmArgs {
        num_groups: to_i32(kernel, "groups", s.groups)?,
        total_rows: to_i32(kernel, "rows", s.rows)?,
        n: to_i32(kernel, "n", s.n)?,
        k: to_i32(kernel, "k", s.k)?,
        b_layout: b_layout(op),
        tile_order: s.tile_order,
        offsets: offsets as *const i32,
        a: a as *const _,
        b: b as *const _,
        d: d as *mut _,
        alpha: s.alpha,
        beta: s.beta,
        b_rows: gather_b.index as *const i32,
        b_rows_div: div(gather_b, "b_rows div")?,
        b_source_rows: to_i32(kernel, "b_rows source rows", gather_b.source_rows)?,
        a_rows: gather_a.index as *const i32,
        a_rows_div: div(gather_a, "a_rows div")?,
        a_source_rows: to_i32(kernel, "a_rows source rows", gather_a.source_rows)?,
    })
}

/// The host rules of gathered rows: a contiguous (`_contig`) variant, and for B a K-grouped
/// one; `div >= 1`, `source_rows >= 1`, and the gathered operand under 2^32 16-byte chunks
/// (the producers address it in 32 bits). `width`: the operand's row length in elements.
fn check_gathered(
    kernel: &str,
    spec: &VariantSpec,
    rows: &GatheredRows<'_>,
    operand_b: bool,
    width: usize,
) -> Result<(), KernelError> {
    let inconsistent = |why| KernelError::Inconsistent {
        kernel: kernel.to_string(),
        why,
    };
    if spec.schedule != Schedule::Contiguous {
        return Err(inconsistent(
            "gathered rows (a_rows, b_rows) need a contiguous (`_contig`) variant",
        ));
    }
    if operand_b && spec.op != Op::GroupedWgrad {
        return Err(inconsistent(
            "b_rows (gathered B) needs a K-grouped (wgrad) variant: an M-grouped B is the weights",
        ));
    }
    check_range(kernel, "rows div", rows.div as i128, 1, i32::MAX as i128)?;
    check_range(
        kernel,
        "source rows",
        rows.source_rows as i128,
        1,
        i32::MAX as i128,
    )?;
    check_range(
        kernel,
        "gathered operand's 16-byte chunks (source rows * width / 8)",
        rows.source_rows as i128 * (width / 8) as i128,
        0,
        (1i128 << 32) - 1,
    )
}

impl Kernels {
    /// Bytes of workspace the dense `variant` needs for `shape` (after the host checks).
    ///
    /// ```no_run
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let kernels = moefuse_kernels::Kernels::new(&ctx)?;
    /// let v = &moefuse_kernels::compiled()[0];
    /// let bytes = kernels.gemm_workspace(v, &moefuse_kernels::GemmShape::new(64, 64, 64))?;
    /// # Ok::<(), moefuse_kernels::KernelError>(())
    /// ```
    pub fn gemm_workspace(
        &self,
        variant: &CompiledVariant,
        shape: &GemmShape,
    ) -> Result<usize, KernelError> {
        let kernel = variant.name();
        let (_, query) = dense_entry(self, variant, &kernel)?;
        check_gemm(&kernel, variant.spec, shape)?;
        // NOTES: null operands, as the query has always been made: the launcher's argument
        // check then answers 0, which every dense variant compiled today needs.
        let probe = dense_args(variant.spec.op, shape, &kernel, [0; 4])?;
        self.context().bind_to_thread()?;
        // SAFETY: the query reads `probe` (a valid reference for the call) and the current
        // device's attributes; it dereferences none of the (null) pointers inside it.
        Ok(unsafe { query(&probe) })
    }

    /// Bytes of workspace the grouped `variant` needs for `shape` (after the host checks).
    ///
    /// ```no_run
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// let kernels = moefuse_kernels::Kernels::new(&ctx)?;
    /// let v = moefuse_kernels::compiled().iter().find(|v| v.spec.op.is_grouped()).unwrap();
    /// let bytes = kernels.grouped_workspace(v, &moefuse_kernels::GroupedShape::new(8, 1024, 256, 256))?;
    /// # Ok::<(), moefuse_kernels::KernelError>(())
    /// ```
    pub fn grouped_workspace(
        &self,
        variant: &CompiledVariant,
        shape: &GroupedShape,
    ) -> Result<usize, KernelError> {
        let kernel = variant.name();
        let (_, query) = grouped_entry(self, variant, &kernel)?;
        check_grouped(&kernel, variant.spec, shape, self.sms())?;
        let probe = grouped_args(variant.spec.op, shape, &kernel, 0, [0; 3])?;
        self.context().bind_to_thread()?;
        // SAFETY: sizes and device attributes only; the query dereferences no pointer.
        let bytes = unsafe { query(&probe) };
        // Any grouped problem needs its per-group arrays: 0 means the query refused.
        if bytes == 0 && shape.groups > 0 {
            return Err(KernelError::WorkspaceQuery {
                variant: kernel,
                message: crate::last_error(),
            });
        }
        Ok(bytes)
    }
}

impl<'a> Gemm<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (run, _) = dense_entry(b.kernels, self.variant, kernel)?;
        let s = self.shape;
        check_gemm(kernel, self.variant.spec, &s)?;
        let need = b.kernels.gemm_workspace(self.variant, &s)?;
        let mn = extent(kernel, "d extent", &[s.m, s.n])?;
        let a = b.read(
            "a",
            self.a,
            extent(kernel, "a extent", &[s.m, s.k])?,
            OPERAND_ALIGN,
        )?;
        let bb = b.read(
            "b",
            self.b,
            extent(kernel, "b extent", &[s.n, s.k])?,
            OPERAND_ALIGN,
        )?;
        let c = b.read_opt("c", self.c, mn, OPERAND_ALIGN)?;
        let d = b.write("d", self.d, mn, OPERAND_ALIGN)?;
        let ws_len = self.workspace.as_ref().map_or(0, |w| w.len());
        check_len(kernel, "workspace", need, ws_len)?;
        let ws = b.write_opt("workspace", self.workspace, need, OPERAND_ALIGN)?;
        if s.m == 0 {
            return Ok(None);
        }
        let c = match (s.beta == 0.0, c) {
            (true, _) => 0,
            (false, 0) => d,
            (false, c) => c,
        };
        let args = dense_args(self.variant.spec.op, &s, kernel, [a, bb, c, d])?;
        Ok(Some(Call::Gemm {
            run,
            args,
            workspace: ws,
            workspace_bytes: ws_len,
        }))
    }
}

impl<'a> GroupedGemm<'a> {
    pub(crate) fn bind(self, b: &mut Binder<'a>) -> Result<Option<Call>, KernelError> {
        let kernel = &b.kernel.clone();
        let (run, _) = grouped_entry(b.kernels, self.variant, kernel)?;
        let s = self.shape;
        let need = b.kernels.grouped_workspace(self.variant, &s)?;
        let [mut ea, mut eb, ed] = grouped_extents(kernel, self.variant.spec.op, &s)?;
        let mut gather = [GatherArgs::default(); 2];
        if self.a_rows.is_some() && self.b_rows.is_some() {
            return Err(KernelError::Inconsistent {
                kernel: kernel.to_string(),
                why: "a_rows and b_rows: one gathered operand per launch",
            });
        }
        for (i, rows) in [self.a_rows, self.b_rows].into_iter().enumerate() {
            let Some(rows) = rows else { continue };
            let (width, name) = if i == 1 {
                (s.n, "b_rows")
            } else {
                (s.k, "a_rows")
            };
            check_gathered(kernel, self.variant.spec, &rows, i == 1, width)?;
            let extent = extent(
                kernel,
                "gathered operand extent",
                &[rows.source_rows, width],
            )?;
            *(if i == 1 { &mut eb } else { &mut ea }) = extent;
            gather[i] = GatherArgs {
                index: b.read(name, rows.index, s.rows, 4)?,
                div: rows.div,
                source_rows: rows.source_rows,
            };
        }
        let offsets = b.read("offsets", self.offsets, s.groups, 4)?;
        let a = b.read("a", self.a, ea, OPERAND_ALIGN)?;
        let bb = b.read("b", self.b, eb, OPERAND_ALIGN)?;
        let d = b.write("d", self.d, ed, OPERAND_ALIGN)?;
        let ws_len = self.workspace.len();
        let ws = b.write("workspace", self.workspace, need, GROUPED_WORKSPACE_ALIGN)?;
        if s.groups == 0 {
            return Ok(None);
        }
        let op = self.variant.spec.op;
        let args = grouped_args_gathered(op, &s, kernel, offsets, [a, bb, d], gather)?;
        Ok(Some(Call::Grouped {
            run,
            args,
            workspace: ws,
            workspace_bytes: ws_len,
        }))
    }
}

#[cfg(test)]
mod tests;
