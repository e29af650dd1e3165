//! Grouped GEMMs that read one operand's rows through an index ([`GroupedGemm::run_gathered`]):
//! row `r` of the problem reads row `index[r] / div` of a smaller buffer, so a caller never
//! writes the permuted copy (the MoE layer's backward reads `x` and `dy` by `source_of`).

use crate::error::{GemmError, Operand};
use crate::grouped::{GroupedGemm, GroupedPlan};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{GatheredRows, Op, Schedule};
use std::sync::Arc;

/// Which operand of a grouped problem is gathered, and from what.
///
/// ```
/// use moefuse_grouped_gemm::{Gather, GatheredOperand};
/// let g = Gather { operand: GatheredOperand::B, div: 8, source_rows: 8192 };
/// assert_eq!(g.source_rows, 8192);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gather {
    /// A (`[source_rows, k]`; M-grouped and K-grouped contiguous variants) or B
    /// (`[source_rows, n]`; K-grouped contiguous variants only: an M-grouped B is the
    /// weights).
    pub operand: GatheredOperand,
    /// Each index entry is divided by this (>= 1): the MoE layer's `source_of` holds
    /// `token · top_k + slot`, so `div = top_k` names the token.
    pub div: usize,
    /// Rows of the gathered buffer (>= 1); an entry naming a row at or past it, or a negative
    /// one, reads zeros.
    pub source_rows: usize,
}

/// The gathered operand of a [`Gather`].
///
/// ```
/// assert_ne!(moefuse_grouped_gemm::GatheredOperand::A, moefuse_grouped_gemm::GatheredOperand::B);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatheredOperand {
    /// The left operand.
    A,
    /// The right operand of a K-grouped (wgrad) problem.
    B,
}

impl GroupedGemm {
    /// Runs `plan` with one operand's rows read through `index` (`[rows]` int32 in device
    /// memory, never trusted: bad entries read zeros). The gathered operand is
    /// `[gather.source_rows, width]`; everything else as [`GroupedGemm::run`]. Needs a plan of
    /// a contiguous (`..._contig`) variant, and for a gathered B a K-grouped one, else
    /// [`GemmError::PlanMismatch`] before any launch.
    ///
    /// ```no_run
    /// use moefuse_grouped_gemm::{Gather, GatheredOperand, GroupedDesc, GroupedGemm};
    /// # let ctx = cudarc::driver::CudaContext::new(0)?;
    /// # let stream = ctx.default_stream();
    /// let gg = GroupedGemm::new(&ctx)?;
    /// // 2 experts, 4 routed rows (2 tokens, top-2): dW_e = dY_e^T · x[source_of / 2]
    /// let plan = gg.plan(&GroupedDesc::wgrad(2, 4, 128, 64))?;
    /// let offsets = stream.clone_htod(&[2i32, 4])?;
    /// let source_of = stream.clone_htod(&[0i32, 2, 1, 3])?;
    /// let dy = stream.alloc_zeros::<half::bf16>(4 * 64)?;
    /// let x = stream.alloc_zeros::<half::bf16>(2 * 128)?;
    /// let mut dw = stream.alloc_zeros::<half::bf16>(2 * 64 * 128)?;
    /// let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes().max(1))?;
    /// let gather = Gather { operand: GatheredOperand::B, div: 2, source_rows: 2 };
    /// gg.run_gathered(&plan, &stream, &offsets, &dy, &x, &source_of, gather, &mut dw, &mut ws)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[allow(clippy::too_many_arguments)]
    pub fn run_gathered<O, A, B, I, D>(
        &self,
        plan: &GroupedPlan,
        stream: &Arc<CudaStream>,
        offsets: &O,
        a: &A,
        b: &B,
        index: &I,
        gather: Gather,
        d: &mut D,
        workspace: &mut CudaSlice<u8>,
    ) -> Result<(), GemmError>
    where
        O: DevicePtr<i32>,
        A: DevicePtr<bf16>,
        B: DevicePtr<bf16>,
        I: DevicePtr<i32>,
        D: DevicePtrMut<bf16>,
    {
        let desc = &plan.desc;
        let spec = plan.variant.spec;
        let is_b = gather.operand == GatheredOperand::B;
        if spec.schedule != Schedule::Contiguous {
            return Err(GemmError::PlanMismatch(
                "a gathered operand needs a plan of a contiguous (`_contig`) variant",
            ));
        }
        if is_b && spec.op != Op::GroupedWgrad {
            return Err(GemmError::PlanMismatch(
                "a gathered B needs a K-grouped (wgrad) plan: an M-grouped B is the weights",
            ));
        }
        if gather.div == 0 || gather.source_rows == 0 {
            return Err(GemmError::InvalidShape {
                m: desc.rows,
                n: desc.n,
                k: desc.k,
                why: "a gathered operand needs div >= 1 and source_rows >= 1",
            });
        }
        self.check_run(plan, stream, offsets.len(), workspace.len())?;
        if index.len() < desc.rows {
            return Err(GemmError::BufferTooSmall {
                operand: Operand::RowIndex,
                needed: desc.rows,
                got: index.len(),
            });
        }
        let (slot, width) = if is_b { (1, desc.n) } else { (0, desc.k) };
        let elems = gather.source_rows.saturating_mul(width);
        self.check_operands(desc, [a.len(), b.len(), d.len()], Some((slot, elems)))?;
        let rows = GatheredRows {
            index,
            div: gather.div,
            source_rows: gather.source_rows,
        };
        let op = moefuse_kernels::GroupedGemm {
            variant: plan.variant,
            shape: desc.shape(),
            offsets,
            a,
            a_rows: (!is_b).then_some(rows),
            b,
            b_rows: is_b.then_some(rows),
            d,
            workspace,
        };
        self.kernels.launch(stream, op)?;
        Ok(())
    }
}
