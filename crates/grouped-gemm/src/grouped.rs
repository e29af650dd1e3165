//! Grouped bf16 GEMM for MoE: forward and dgrad (M-grouped), wgrad (K-grouped), with the
//! group sizes read from device memory (prefix-sum offsets) so that no call synchronises
//! with the host and every call can be captured in a CUDA graph.

use crate::heuristics::{self, ArchSpec, Device, Problem};
use crate::{BLayout, GemmError, Operand};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{CompiledVariant, GroupedShape, Kernels, Op};
use moefuse_spec::{GroupedKind, TileOrder};
use std::sync::Arc;

/// Which grouped product: [`GroupedKind`] (the group-layout enum shared with the kernels)
/// with the weights' layout of an M-grouped one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupedOp {
    /// M-grouped: `D[rows_e] = A[rows_e] · W_e` with `W_e` stored per the layout
    /// (`[n, k]` or `[k, n]`). Forward, and dgrad with the weights' other layout.
    MGrouped(BLayout),
    /// K-grouped: `D_e = A[rows_e]ᵀ · B[rows_e]`, `D_e` `[k, n]` (wgrad).
    KGrouped,
}

/// A grouped problem over `groups` experts whose rows are given at run time by device
/// offsets (`offsets[e]` = end row of group e, prefix-sum form, int32).
///
/// Buffers (row-major, bf16):
/// - M-grouped: A `[rows, k]`, W `[groups, n, k]` ([`BLayout::Nk`]) or `[groups, k, n]`
///   ([`BLayout::Kn`]), D `[rows, n]`;
/// - K-grouped: A `[rows, k]`, B `[rows, n]`, D `[groups, k, n]`.
///
/// `rows` is the capacity of the row-indexed buffers (e.g. tokens × top-k); offsets beyond it
/// are clamped, never followed. `n` and `k` must be multiples of 8.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupedDesc {
    /// The product.
    pub op: GroupedOp,
    /// Number of groups (experts).
    pub groups: usize,
    /// Capacity of the row-indexed buffers.
    pub rows: usize,
    /// M-grouped: output columns; K-grouped: columns of B and of each D_e.
    pub n: usize,
    /// M-grouped: inner dimension; K-grouped: columns of A, rows of each D_e.
    pub k: usize,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of D's previous content (K-grouped with 1.0: gradient accumulation; empty
    /// groups are then left untouched, and zeroed when beta = 0).
    pub beta: f32,
    /// Expected rows per group, for the tile heuristic (default `rows / groups`).
    pub rows_per_group_hint: Option<usize>,
    /// Order in which the persistent kernel walks each group's tiles (tuning; the type and
    /// its word are `moefuse_spec::tile_order`'s).
    pub tile_order: TileOrder,
}

impl GroupedOp {
    /// The grouped kind the kernels implement this product with.
    ///
    /// ```
    /// use moefuse_grouped_gemm::{BLayout, GroupedOp};
    /// use moefuse_spec::GroupedKind;
    /// assert_eq!(GroupedOp::MGrouped(BLayout::Kn).kind(), GroupedKind::MGrouped);
    /// assert_eq!(GroupedOp::KGrouped.kind(), GroupedKind::KGrouped);
    /// ```
    pub const fn kind(self) -> GroupedKind {
        match self {
            GroupedOp::MGrouped(_) => GroupedKind::MGrouped,
            GroupedOp::KGrouped => GroupedKind::KGrouped,
        }
    }
}

impl GroupedDesc {
    /// Forward: `Y[rows_e] = X[rows_e] · W_e`, X `[rows, k]`, W `[groups, n, k]` or
    /// `[groups, k, n]`, Y `[rows, n]`.
    ///
    /// ```
    /// use moefuse_grouped_gemm::{BLayout, GroupedDesc};
    /// let d = GroupedDesc::forward(128, 65536, 1536, 2048, BLayout::Nk);
    /// assert_eq!(d.n, 1536);
    /// ```
    pub fn forward(groups: usize, rows: usize, n: usize, k: usize, weights: BLayout) -> Self {
        GroupedDesc {
            op: GroupedOp::MGrouped(weights),
            groups,
            rows,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            rows_per_group_hint: None,
            tile_order: TileOrder::default(),
        }
    }

    /// dgrad of that forward: `dX[rows_e] = dY[rows_e] · W_eᵀ`, dY `[rows, n]`, dX `[rows, k]`,
    /// the same W. (An M-grouped product over W with its layout read transposed.)
    ///
    /// ```
    /// use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedOp};
    /// let d = GroupedDesc::dgrad(128, 65536, 1536, 2048, BLayout::Nk);
    /// assert_eq!((d.n, d.k, d.op), (2048, 1536, GroupedOp::MGrouped(BLayout::Kn)));
    /// ```
    pub fn dgrad(groups: usize, rows: usize, n: usize, k: usize, weights: BLayout) -> Self {
        let read_as = match weights {
            BLayout::Nk => BLayout::Kn,
            BLayout::Kn => BLayout::Nk,
        };
        Self::forward(groups, rows, k, n, read_as)
    }

    /// wgrad: `dW_e = A[rows_e]ᵀ · B[rows_e]`, `[k, n]` per group. For weights stored
    /// `[groups, k, n]` pass A = X `[rows, k]`, B = dY `[rows, n]`; for `[groups, n, k]` pass
    /// A = dY and B = X with `k` and `n` swapped ([`GroupedDesc::wgrad_for`] does that).
    pub fn wgrad(groups: usize, rows: usize, n: usize, k: usize) -> Self {
        GroupedDesc {
            op: GroupedOp::KGrouped,
            groups,
            rows,
            n,
            k,
            alpha: 1.0,
            beta: 0.0,
            rows_per_group_hint: None,
            tile_order: TileOrder::default(),
        }
    }

    /// The wgrad problem for weights of the forward `(n, k, weights)`, and whether the
    /// operands must be passed swapped (A = dY, B = X).
    ///
    /// ```
    /// use moefuse_grouped_gemm::{BLayout, GroupedDesc};
    /// let (d, swap) = GroupedDesc::wgrad_for(8, 4096, 1536, 2048, BLayout::Nk);
    /// assert!(swap);
    /// assert_eq!((d.k, d.n), (1536, 2048)); // dW_e is [n, k] = dY_eᵀ · X_e
    /// ```
    pub fn wgrad_for(
        groups: usize,
        rows: usize,
        n: usize,
        k: usize,
        weights: BLayout,
    ) -> (Self, bool) {
        match weights {
            BLayout::Kn => (Self::wgrad(groups, rows, n, k), false),
            BLayout::Nk => (Self::wgrad(groups, rows, k, n), true),
        }
    }

    /// Useful FLOPs when the groups hold `total_rows` rows together: `2·total·n·k`.
    pub fn flops(&self, total_rows: usize) -> f64 {
        2.0 * total_rows as f64 * self.n as f64 * self.k as f64
    }

    /// Elements A, B and D must hold.
    pub fn extents(&self) -> [(Operand, usize); 3] {
        let (g, r, n, k) = (self.groups, self.rows, self.n, self.k);
        match self.op.kind() {
            GroupedKind::MGrouped => [
                (Operand::A, r * k),
                (Operand::B, g * n * k),
                (Operand::D, r * n),
            ],
            GroupedKind::KGrouped => [
                (Operand::A, r * k),
                (Operand::B, r * n),
                (Operand::D, g * k * n),
            ],
        }
    }

    /// Host-side validation of sizes and alignment.
    pub fn validate(&self) -> Result<(), GemmError> {
        let (m, n, k) = (self.rows, self.n, self.k);
        let shape = |why| GemmError::InvalidShape { m, n, k, why };
        if n == 0 || k == 0 {
            return Err(shape("n and k must be positive"));
        }
        let max = i32::MAX as usize;
        if self.groups > max || m > max || n > max || k > max {
            return Err(shape("groups, rows, n and k must fit 32-bit indexing"));
        }
        if self.groups.checked_mul(n * k).is_none() || m.checked_mul(n.max(k)).is_none() {
            return Err(shape("buffer extents overflow"));
        }
        // Any variant's rule (a contiguous one reads every field); plan checks the chosen one.
        self.tile_order
            .check(true)
            .map_err(|source| GemmError::InvalidTileOrder {
                order: self.tile_order,
                variant: "any".into(),
                source,
            })?;
        for (dim, value) in [("n", n), ("k", k)] {
            if value % 8 != 0 {
                return Err(GemmError::Misaligned {
                    operand: Operand::B,
                    dim,
                    value,
                    required: 8,
                });
            }
        }
        Ok(())
    }

    /// The launch layer's shape (the kind and B's layout come with the variant).
    ///
    /// ```
    /// use moefuse_grouped_gemm::{BLayout, GroupedDesc};
    /// assert_eq!(GroupedDesc::wgrad(4, 64, 8, 16).shape().k, 16);
    /// ```
    pub fn shape(&self) -> GroupedShape {
        GroupedShape {
            groups: self.groups,
            rows: self.rows,
            n: self.n,
            k: self.k,
            tile_order: self.tile_order.encode(),
            alpha: self.alpha,
            beta: self.beta,
        }
    }

    fn problem(&self) -> Problem {
        let per_group = self
            .rows_per_group_hint
            .unwrap_or(self.rows / self.groups.max(1));
        match self.op {
            GroupedOp::MGrouped(BLayout::Nk) => Problem {
                op: Op::GroupedFwdBnk,
                groups: self.groups,
                m: per_group,
                n: self.n,
                k: self.k,
            },
            GroupedOp::MGrouped(BLayout::Kn) => Problem {
                op: Op::GroupedFwdBkn,
                groups: self.groups,
                m: per_group,
                n: self.n,
                k: self.k,
            },
            GroupedOp::KGrouped => Problem {
                op: Op::GroupedWgrad,
                groups: self.groups,
                m: self.k,
                n: self.n,
                k: per_group,
            },
        }
    }
}

/// Grouped GEMM entry point for one device.
///
/// ```no_run
/// use moefuse_grouped_gemm::{BLayout, GroupedDesc, GroupedGemm};
/// use half::bf16;
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let (experts, rows, n, k) = (8, 4096, 1536, 2048);
/// // 8 experts with 512 rows each: offsets are the running ends.
/// let ends: Vec<i32> = (1..=experts as i32).map(|e| e * 512).collect();
/// let offsets = stream.clone_htod(&ends)?;
/// let x = stream.clone_htod(&vec![bf16::from_f32(0.5); rows * k])?;          // [rows, k]
/// let w = stream.clone_htod(&vec![bf16::from_f32(0.5); experts * n * k])?;   // [E, n, k]
/// let mut y = stream.alloc_zeros::<bf16>(rows * n)?;                         // [rows, n]
/// let gemm = GroupedGemm::new(&ctx)?;
/// let plan = gemm.plan(&GroupedDesc::forward(experts, rows, n, k, BLayout::Nk))?;
/// let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes())?;
/// gemm.run(&plan, &stream, &offsets, &x, &w, &mut y, &mut ws)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GroupedGemm {
    ctx: Arc<CudaContext>,
    spec: Box<dyn ArchSpec + Send + Sync>,
    device: Device,
    pub(crate) kernels: Kernels,
}

/// A validated grouped problem with its chosen variant and workspace size.
#[derive(Debug, Clone)]
pub struct GroupedPlan {
    pub(crate) desc: GroupedDesc,
    pub(crate) variant: &'static CompiledVariant,
    workspace_bytes: usize,
    ordinal: usize,
}

impl GroupedPlan {
    /// The problem.
    pub fn desc(&self) -> &GroupedDesc {
        &self.desc
    }

    /// The chosen variant's name.
    pub fn variant(&self) -> String {
        self.variant.name()
    }

    /// The compiled variant the plan launches.
    pub fn compiled_variant(&self) -> &'static CompiledVariant {
        self.variant
    }

    /// The launch layer's shape of this plan (sizes, scalars and the encoded tile order),
    /// for callers that launch through `moefuse_kernels` themselves (the Python bridge).
    ///
    /// ```
    /// use moefuse_grouped_gemm::{BLayout, GroupedDesc};
    /// let s = GroupedDesc::forward(8, 1024, 256, 512, BLayout::Nk).shape();
    /// assert_eq!((s.groups, s.rows, s.n, s.k), (8, 1024, 256, 512));
    /// ```
    pub fn shape(&self) -> GroupedShape {
        self.desc.shape()
    }

    /// Device workspace `run` needs: CUTLASS's tensor-map slots plus the per-group
    /// shape, pointer and stride arrays (a few hundred bytes per group).
    pub fn workspace_bytes(&self) -> usize {
        self.workspace_bytes
    }
}

impl GroupedGemm {
    /// Binds to `ctx`'s device (see [`crate::Gemm::new`] for the arch checks).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, GemmError> {
        let (spec, device, kernels) = heuristics::for_device(ctx)?;
        Ok(GroupedGemm {
            ctx: ctx.clone(),
            spec,
            device,
            kernels,
        })
    }

    /// The kernel handle the runs launch through.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Validates `desc` and picks a variant (host only, no allocation, no launch).
    pub fn plan(&self, desc: &GroupedDesc) -> Result<GroupedPlan, GemmError> {
        self.plan_with(desc, None)
    }

    /// Like [`GroupedGemm::plan`] with the variant named explicitly (tuning).
    pub fn plan_with(
        &self,
        desc: &GroupedDesc,
        variant: Option<&str>,
    ) -> Result<GroupedPlan, GemmError> {
        desc.validate()?;
        let variant =
            heuristics::choose(self.spec.as_ref(), &desc.problem(), self.device, variant)?;
        let contiguous = variant.spec.schedule == moefuse_kernels::Schedule::Contiguous;
        desc.tile_order
            .check(contiguous)
            .map_err(|source| GemmError::InvalidTileOrder {
                order: desc.tile_order,
                variant: variant.name(),
                source,
            })?;
        // The launch layer's host `can_implement` (limits, int32 row arithmetic, tile
        // order) runs here too, so a plan that exists can launch.
        let workspace_bytes = self.kernels.grouped_workspace(variant, &desc.shape())?;
        Ok(GroupedPlan {
            desc: *desc,
            variant,
            workspace_bytes,
            ordinal: self.ctx.ordinal(),
        })
    }

    /// Runs `plan` on `stream`. `offsets` holds `groups` int32 prefix-sum ends in device
    /// memory; A, B, D as [`GroupedDesc`] describes. Sizes, alignment and workspace are
    /// checked before the launch; zero groups return without one.
    #[allow(clippy::too_many_arguments)]
    pub fn run<O, A, B, D>(
        &self,
        plan: &GroupedPlan,
        stream: &Arc<CudaStream>,
        offsets: &O,
        a: &A,
        b: &B,
        d: &mut D,
        workspace: &mut CudaSlice<u8>,
    ) -> Result<(), GemmError>
    where
        O: DevicePtr<i32>,
        A: DevicePtr<bf16>,
        B: DevicePtr<bf16>,
        D: DevicePtrMut<bf16>,
    {
        let desc = &plan.desc;
        self.check_run(plan, stream, offsets.len(), workspace.len())?;
        self.check_operands(desc, [a.len(), b.len(), d.len()], None)?;
        let op = moefuse_kernels::GroupedGemm {
            variant: plan.variant,
            shape: desc.shape(),
            offsets,
            a,
            a_rows: None,
            b,
            b_rows: None,
            d,
            workspace,
        };
        self.kernels.launch(stream, op)?;
        Ok(())
    }

    /// The checks every run makes first: one device, offsets and workspace large enough.
    pub(crate) fn check_run(
        &self,
        plan: &GroupedPlan,
        stream: &Arc<CudaStream>,
        offsets: usize,
        workspace: usize,
    ) -> Result<(), GemmError> {
        let desc = &plan.desc;
        if plan.ordinal != self.ctx.ordinal() || stream.context().ordinal() != self.ctx.ordinal() {
            return Err(GemmError::PlanMismatch(
                "plan, stream and GroupedGemm must belong to one device",
            ));
        }
        if offsets < desc.groups {
            return Err(GemmError::BufferTooSmall {
                operand: Operand::Offsets,
                needed: desc.groups,
                got: offsets,
            });
        }
        if workspace < plan.workspace_bytes {
            return Err(GemmError::BufferTooSmall {
                operand: Operand::Workspace,
                needed: plan.workspace_bytes,
                got: workspace,
            });
        }
        Ok(())
    }

    /// A, B and D against the problem's extents, with A's or B's replaced by `replace`
    /// (index 0 or 1, elements) where the operand is gathered.
    pub(crate) fn check_operands(
        &self,
        desc: &GroupedDesc,
        got: [usize; 3],
        replace: Option<(usize, usize)>,
    ) -> Result<(), GemmError> {
        let mut needed = desc.extents();
        if let Some((i, elems)) = replace {
            needed[i].1 = elems;
        }
        for ((operand, needed), got) in needed.into_iter().zip(got) {
            if got < needed {
                return Err(GemmError::BufferTooSmall {
                    operand,
                    needed,
                    got,
                });
            }
        }
        Ok(())
    }
}

/// Copies `offsets` to the host (a synchronising call: use it in tests or behind a debug
/// flag) and checks they are non-decreasing, non-negative and end within `rows`.
///
/// ```no_run
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let offsets = stream.clone_htod(&[3i32, 3, 10])?;
/// moefuse_grouped_gemm::check_offsets(&stream, &offsets, 3, 10)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn check_offsets(
    stream: &Arc<CudaStream>,
    offsets: &CudaSlice<i32>,
    groups: usize,
    rows: usize,
) -> Result<(), GemmError> {
    if offsets.len() < groups {
        return Err(GemmError::BufferTooSmall {
            operand: Operand::Offsets,
            needed: groups,
            got: offsets.len(),
        });
    }
    let host = stream.clone_dtoh(offsets)?;
    validate_offsets(&host[..groups], rows)
}

/// The host-side rule behind [`check_offsets`].
///
/// ```
/// use moefuse_grouped_gemm::validate_offsets;
/// assert!(validate_offsets(&[0, 4, 4, 9], 9).is_ok());
/// assert!(validate_offsets(&[4, 2], 9).is_err());
/// assert!(validate_offsets(&[4, 10], 9).is_err());
/// ```
pub fn validate_offsets(ends: &[i32], rows: usize) -> Result<(), GemmError> {
    let mut prev = 0i64;
    for (group, &end) in ends.iter().enumerate() {
        let end = i64::from(end);
        if end < prev || end > rows as i64 {
            return Err(GemmError::InvalidOffsets {
                group,
                end,
                previous: prev,
                rows,
            });
        }
        prev = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use moefuse_spec::{Raster, TileOrderError};

    #[test]
    fn extents_follow_the_op() {
        let f = GroupedDesc::forward(4, 100, 16, 8, BLayout::Nk);
        assert_eq!(f.extents().map(|e| e.1), [800, 512, 1600]);
        let w = GroupedDesc::wgrad(4, 100, 16, 8);
        assert_eq!(w.extents().map(|e| e.1), [800, 1600, 512]);
    }

    #[test]
    fn validation_rejects_misaligned_and_empty_dims() {
        assert!(matches!(
            GroupedDesc::forward(4, 100, 12, 8, BLayout::Nk).validate(),
            Err(GemmError::Misaligned { value: 12, .. })
        ));
        assert!(matches!(
            GroupedDesc::forward(4, 100, 0, 8, BLayout::Nk).validate(),
            Err(GemmError::InvalidShape { .. })
        ));
        assert!(GroupedDesc::forward(0, 0, 8, 8, BLayout::Nk)
            .validate()
            .is_ok());
    }

    #[test]
    fn offsets_rule_names_the_group() {
        match validate_offsets(&[2, 5, 4], 9) {
            Err(GemmError::InvalidOffsets {
                group: 2,
                end: 4,
                previous: 5,
                rows: 9,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert!(validate_offsets(&[-1], 9).is_err());
    }

    #[test]
    fn tile_order_reaches_the_launch_word_and_is_checked() {
        let with = |raster, swizzle| GroupedDesc {
            tile_order: TileOrder {
                raster,
                swizzle,
                ..TileOrder::default()
            },
            ..GroupedDesc::forward(4, 64, 8, 8, BLayout::Nk)
        };
        assert_eq!(with(Raster::Default, 0).shape().tile_order, 0);
        assert_eq!(with(Raster::AlongN, 4).shape().tile_order, 2 | (4 << 8));
        assert_eq!(with(Raster::AlongM, 32).shape().tile_order, 1 | (32 << 8));
        assert!(with(Raster::AlongM, 32).validate().is_ok());
        match with(Raster::AlongM, 3).validate() {
            Err(GemmError::InvalidTileOrder {
                order,
                source: TileOrderError::Width { width: 3, .. },
                ..
            }) => assert_eq!(order.swizzle, 3),
            other => panic!("{other:?}"),
        }
        let mixed = GroupedDesc {
            tile_order: TileOrder {
                prefetch: 255,
                interleave: true,
                ..TileOrder::default()
            },
            ..GroupedDesc::wgrad(4, 64, 8, 8)
        };
        assert_eq!(mixed.shape().tile_order, (255 << 16) | (1 << 24));
    }

    #[test]
    fn problem_maps_wgrad_reduction_to_rows() {
        let p = GroupedDesc::wgrad(8, 800, 16, 32).problem();
        assert_eq!((p.op, p.m, p.n, p.k), (Op::GroupedWgrad, 32, 16, 100));
    }
}
