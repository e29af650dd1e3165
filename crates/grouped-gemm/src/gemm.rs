//! Dense bf16 GEMM: `D = alpha · A · B + beta · D`, the seed of the grouped kernels.

use crate::heuristics::{self, ArchSpec, Device, Problem};
use crate::{GemmError, Operand};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use half::bf16;
use moefuse_kernels::{CompiledVariant, GemmShape, Kernels, Op};
use std::sync::Arc;

/// How B is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BLayout {
    /// `[n, k]` row-major (K contiguous): how `nn.Linear` stores weights. Fastest path.
    Nk,
    /// `[k, n]` row-major (N contiguous).
    Kn,
}

/// A dense GEMM problem: `D[m, n] = alpha · Σ_k A[m, k] · B(k, n) + beta · D[m, n]`.
///
/// A is `[m, k]` row-major, B per [`BLayout`], D `[m, n]` row-major, all bf16 and packed
/// (leading dimension = row length); accumulation is fp32. `k` (and `n` for
/// [`BLayout::Kn`], and for D) must be multiples of 8: TMA moves 16-byte rows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemmDesc {
    /// Rows of A and D (may be 0: nothing to do).
    pub m: usize,
    /// Columns of B and D.
    pub n: usize,
    /// Inner dimension.
    pub k: usize,
    /// Layout of B.
    pub b_layout: BLayout,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of D's previous content (0: D is overwritten and never read).
    pub beta: f32,
}

impl GemmDesc {
    /// `D = A · B` with B stored `[n, k]`.
    ///
    /// ```
    /// let d = moefuse_grouped_gemm::GemmDesc::new(4096, 4096, 4096);
    /// assert_eq!(d.flops(), 2.0 * 4096f64.powi(3));
    /// ```
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        GemmDesc {
            m,
            n,
            k,
            b_layout: BLayout::Nk,
            alpha: 1.0,
            beta: 0.0,
        }
    }

    /// Useful floating-point operations, `2·m·n·k`.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }

    /// Host-side validation of sizes and alignment (buffers are checked at `run`).
    pub fn validate(&self) -> Result<(), GemmError> {
        let (m, n, k) = (self.m, self.n, self.k);
        let shape = |why| GemmError::InvalidShape { m, n, k, why };
        if n == 0 || k == 0 {
            return Err(shape("n and k must be positive (m may be 0)"));
        }
        let max = i32::MAX as usize;
        if m > max || n > max || k > max || m.checked_mul(k).is_none() || m.checked_mul(n).is_none()
        {
            return Err(shape("dimensions must fit 32-bit indexing"));
        }
        let misaligned = |operand, dim, value| GemmError::Misaligned {
            operand,
            dim,
            value,
            required: 8,
        };
        if k % 8 != 0 {
            return Err(misaligned(Operand::A, "k", k));
        }
        if n % 8 != 0 {
            return Err(misaligned(
                if self.b_layout == BLayout::Kn {
                    Operand::B
                } else {
                    Operand::D
                },
                "n",
                n,
            ));
        }
        Ok(())
    }
}

/// The GEMM entry point for one device. Creating it checks the device's architecture
/// against the compiled kernels; planning and running are then cheap.
///
/// ```no_run
/// use moefuse_grouped_gemm::{Gemm, GemmDesc};
/// use half::bf16;
/// let ctx = cudarc::driver::CudaContext::new(0)?;
/// let stream = ctx.default_stream();
/// let (m, n, k) = (1024, 2048, 512);
/// let a = stream.clone_htod(&vec![bf16::from_f32(0.5); m * k])?;   // [m, k]
/// let b = stream.clone_htod(&vec![bf16::from_f32(0.25); n * k])?;  // [n, k]
/// let mut d = stream.alloc_zeros::<bf16>(m * n)?;                  // [m, n]
/// let gemm = Gemm::new(&ctx)?;
/// let plan = gemm.plan(&GemmDesc::new(m, n, k))?;
/// gemm.run(&plan, &stream, &a, &b, &mut d, None)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Gemm {
    ctx: Arc<CudaContext>,
    spec: Box<dyn ArchSpec + Send + Sync>,
    device: Device,
    kernels: Kernels,
}

/// A validated problem with its chosen variant.
#[derive(Debug, Clone)]
pub struct GemmPlan {
    desc: GemmDesc,
    variant: &'static CompiledVariant,
    workspace_bytes: usize,
    ordinal: usize,
}

impl GemmPlan {
    /// The problem.
    pub fn desc(&self) -> &GemmDesc {
        &self.desc
    }

    /// The chosen variant's name.
    pub fn variant(&self) -> String {
        self.variant.name()
    }

    /// Device workspace the run needs (0 for the current dense variants).
    pub fn workspace_bytes(&self) -> usize {
        self.workspace_bytes
    }
}

impl Gemm {
    /// Binds to `ctx`'s device; fails with [`GemmError::Kernel`] holding
    /// `KernelError::UnsupportedArch` or `KernelError::ArchNotBuilt` when no compiled
    /// kernel can run there.
    pub fn new(ctx: &Arc<CudaContext>) -> Result<Self, GemmError> {
        let (spec, device, kernels) = heuristics::for_device(ctx)?;
        Ok(Gemm {
            ctx: ctx.clone(),
            spec,
            device,
            kernels,
        })
    }

    /// Validates `desc` and picks a variant (host only, no allocation, no launch).
    pub fn plan(&self, desc: &GemmDesc) -> Result<GemmPlan, GemmError> {
        self.plan_with(desc, None)
    }

    /// Like [`Gemm::plan`] with the variant named explicitly (for tuning).
    pub fn plan_with(&self, desc: &GemmDesc, variant: Option<&str>) -> Result<GemmPlan, GemmError> {
        desc.validate()?;
        let op = match desc.b_layout {
            BLayout::Nk => Op::GemmBnk,
            BLayout::Kn => Op::GemmBkn,
        };
        let problem = Problem {
            op,
            groups: 1,
            m: desc.m,
            n: desc.n,
            k: desc.k,
        };
        let variant = heuristics::choose(self.spec.as_ref(), &problem, self.device, variant)?;
        let workspace_bytes = self.kernels.gemm_workspace(variant, &shape(desc))?;
        Ok(GemmPlan {
            desc: *desc,
            variant,
            workspace_bytes,
            ordinal: self.ctx.ordinal(),
        })
    }

    /// Runs `plan` on `stream`: `d = alpha · a · b + beta · d`. Checks buffer sizes,
    /// pointer alignment and the workspace before launching; an empty problem (m = 0)
    /// returns without a launch. Captures into a CUDA graph (no host synchronisation).
    pub fn run<A, B, D>(
        &self,
        plan: &GemmPlan,
        stream: &Arc<CudaStream>,
        a: &A,
        b: &B,
        d: &mut D,
        workspace: Option<&mut CudaSlice<u8>>,
    ) -> Result<(), GemmError>
    where
        A: DevicePtr<bf16>,
        B: DevicePtr<bf16>,
        D: DevicePtrMut<bf16>,
    {
        let desc = &plan.desc;
        if plan.ordinal != self.ctx.ordinal() || stream.context().ordinal() != self.ctx.ordinal() {
            return Err(GemmError::PlanMismatch(
                "plan, stream and Gemm must belong to one device",
            ));
        }
        check_len(Operand::A, desc.m * desc.k, a.len())?;
        check_len(Operand::B, desc.n * desc.k, b.len())?;
        check_len(Operand::D, desc.m * desc.n, d.len())?;
        let ws_len = workspace.as_ref().map_or(0, |w| w.len());
        check_len(Operand::Workspace, plan.workspace_bytes, ws_len)?;
        let op = moefuse_kernels::Gemm {
            variant: plan.variant,
            shape: shape(desc),
            a,
            b,
            c: None,
            d,
            workspace: workspace.map(|w| w as &mut dyn DevicePtrMut<u8>),
        };
        self.kernels.launch(stream, op)?;
        Ok(())
    }
}

fn check_len(operand: Operand, needed: usize, got: usize) -> Result<(), GemmError> {
    if got < needed {
        return Err(GemmError::BufferTooSmall {
            operand,
            needed,
            got,
        });
    }
    Ok(())
}

/// The launch layer's shape of a packed problem (B's layout comes with the variant; C is D).
fn shape(desc: &GemmDesc) -> GemmShape {
    GemmShape {
        m: desc.m,
        n: desc.n,
        k: desc.k,
        alpha: desc.alpha,
        beta: desc.beta,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_broken_rule() {
        assert!(
            GemmDesc::new(0, 8, 8).validate().is_ok(),
            "m = 0 is an empty problem, not an error"
        );
        assert!(matches!(
            GemmDesc::new(8, 0, 8).validate(),
            Err(GemmError::InvalidShape { .. })
        ));
        assert!(matches!(
            GemmDesc::new(8, 16, 12).validate(),
            Err(GemmError::Misaligned {
                operand: Operand::A,
                value: 12,
                ..
            })
        ));
        let kn = GemmDesc {
            b_layout: BLayout::Kn,
            ..GemmDesc::new(8, 20, 16)
        };
        assert!(matches!(
            kn.validate(),
            Err(GemmError::Misaligned {
                operand: Operand::B,
                value: 20,
                ..
            })
        ));
        assert!(matches!(
            GemmDesc::new(1 << 31, 8, 8).validate(),
            Err(GemmError::InvalidShape { .. })
        ));
    }

    #[test]
    fn shape_carries_the_scalars() {
        let desc = GemmDesc {
            beta: 1.0,
            ..GemmDesc::new(3, 16, 8)
        };
        let s = shape(&desc);
        assert_eq!((s.m, s.n, s.k, s.beta), (3, 16, 8, 1.0));
    }
}
