//! GPU tests of the dense GEMM against the CPU reference (run on the H200 through
//! `cargo xtask device-pack`; reported as ignored, with a SKIPPED line, without a GPU).

#![forbid(unsafe_code)]

mod common;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse_grouped_gemm::{reference, BLayout, Gemm, GemmDesc, GemmError, Operand};
use moefuse_kernels::{GemmShape, KernelError, Kernels, VariantArch};
use moefuse_testkit::{check_close, to_f32, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

/// Shapes with M, N, K off every tile multiple, tiny and larger ones.
const SHAPES: &[(usize, usize, usize)] = &[
    (128, 256, 64),
    (1000, 1528, 776),
    (1, 8, 8),
    (77, 4104, 1032),
    (2048, 2048, 2048),
    (3001, 264, 136),
];

struct Case {
    desc: GemmDesc,
    a: Vec<bf16>,
    b: Vec<bf16>,
    d0: Vec<bf16>,
    seed: u64,
}

impl Case {
    fn new(desc: GemmDesc) -> Self {
        let seed = Rng::fresh_seed();
        let mut rng = Rng::new(seed);
        let d0 = if desc.beta != 0.0 {
            rng.bf16_vec(desc.m * desc.n)
        } else {
            vec![POISON_BF16; desc.m * desc.n]
        };
        Case {
            a: rng.bf16_vec(desc.m * desc.k),
            b: rng.bf16_vec(desc.n * desc.k),
            d0,
            desc,
            seed,
        }
    }

    /// Runs `variant` (or the heuristic's choice) and compares every element.
    fn check(
        &self,
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        variant: Option<&str>,
    ) -> Result<f64, String> {
        let what = format!("{:?} variant={variant:?} seed={}", self.desc, self.seed);
        let gemm = Gemm::new(ctx).map_err(|e| format!("{what}: {e}"))?;
        let plan = gemm
            .plan_with(&self.desc, variant)
            .map_err(|e| format!("{what}: {e}"))?;
        let up = |v: &[bf16]| stream.clone_htod(v).map_err(|e| e.to_string());
        let (a, b, mut d) = (up(&self.a)?, up(&self.b)?, up(&self.d0)?);
        let mut ws = alloc_workspace(stream, plan.workspace_bytes())?;
        gemm.run(&plan, stream, &a, &b, &mut d, ws.as_mut())
            .map_err(|e| format!("{what}: {e}"))?;
        let got = to_f32(&stream.clone_dtoh(&d).map_err(|e| e.to_string())?);
        let want = reference::gemm_all(&self.desc, &self.a, &self.b, Some(&self.d0));
        check_close(
            &got,
            &want,
            BF16_REL_ERR,
            &format!("{what} ({})", plan.variant()),
        )
    }
}

fn alloc_workspace(
    stream: &Arc<CudaStream>,
    bytes: usize,
) -> Result<Option<CudaSlice<u8>>, String> {
    if bytes == 0 {
        return Ok(None);
    }
    stream
        .alloc_zeros::<u8>(bytes)
        .map(Some)
        .map_err(|e| e.to_string())
}

fn every_variant_matches_reference(ctx: &Arc<CudaContext>, layout: BLayout) -> Result<(), String> {
    let stream = ctx.default_stream();
    let variants = common::variants_for(
        ctx,
        if layout == BLayout::Nk {
            "gemm_bnk"
        } else {
            "gemm_bkn"
        },
    );
    if variants.is_empty() {
        return Err(format!("no compiled {layout:?} variant for this GPU"));
    }
    for &(m, n, k) in SHAPES {
        let case = Case::new(GemmDesc {
            b_layout: layout,
            ..GemmDesc::new(m, n, k)
        });
        for v in &variants {
            let err = case.check(ctx, &stream, Some(v))?;
            println!("{v} m={m} n={n} k={k}: rel err {err:.2e}");
        }
        case.check(ctx, &stream, None)?;
    }
    Ok(())
}

fn main() {
    let suite = GpuSuite::new()
        .test("gemm_bnk_every_variant_matches_reference", |ctx| {
            every_variant_matches_reference(ctx, BLayout::Nk)
        })
        .test("gemm_bkn_every_variant_matches_reference", |ctx| {
            every_variant_matches_reference(ctx, BLayout::Kn)
        })
        .test("gemm_alpha_beta_accumulate", |ctx| {
            let stream = ctx.default_stream();
            for layout in [BLayout::Nk, BLayout::Kn] {
                let desc = GemmDesc {
                    b_layout: layout,
                    alpha: 0.5,
                    beta: -1.5,
                    ..GemmDesc::new(517, 392, 264)
                };
                Case::new(desc).check(ctx, &stream, None)?;
            }
            Ok(())
        })
        .test("gemm_empty_problem_launches_nothing", |ctx| {
            let stream = ctx.default_stream();
            let gemm = Gemm::new(ctx).map_err(|e| e.to_string())?;
            let plan = gemm
                .plan(&GemmDesc::new(0, 64, 64))
                .map_err(|e| e.to_string())?;
            let a = stream.alloc_zeros::<bf16>(8).map_err(|e| e.to_string())?;
            let b = stream
                .clone_htod(&vec![bf16::ONE; 64 * 64])
                .map_err(|e| e.to_string())?;
            let mut d = stream
                .clone_htod(&[POISON_BF16; 8])
                .map_err(|e| e.to_string())?;
            gemm.run(&plan, &stream, &a, &b, &mut d, None)
                .map_err(|e| e.to_string())?;
            let after = stream.clone_dtoh(&d).map_err(|e| e.to_string())?;
            if after.iter().any(|x| x.to_bits() != POISON_BF16.to_bits()) {
                return Err("m = 0 wrote to D".into());
            }
            Ok(())
        })
        .test("gemm_rejects_bad_buffers_before_launch", |ctx| {
            let stream = ctx.default_stream();
            let gemm = Gemm::new(ctx).map_err(|e| e.to_string())?;
            let plan = gemm
                .plan(&GemmDesc::new(64, 64, 64))
                .map_err(|e| e.to_string())?;
            let small = stream
                .alloc_zeros::<bf16>(64 * 64 - 1)
                .map_err(|e| e.to_string())?;
            let full = stream
                .alloc_zeros::<bf16>(64 * 64 + 8)
                .map_err(|e| e.to_string())?;
            let mut d = stream
                .alloc_zeros::<bf16>(64 * 64)
                .map_err(|e| e.to_string())?;
            match gemm.run(&plan, &stream, &small, &full, &mut d, None) {
                Err(GemmError::BufferTooSmall {
                    operand: Operand::A,
                    needed: 4096,
                    got: 4095,
                }) => {}
                other => {
                    return Err(format!(
                        "undersized A: expected BufferTooSmall, got {other:?}"
                    ))
                }
            }
            let offset = full.slice(1..);
            match gemm.run(&plan, &stream, &offset, &full, &mut d, None) {
                Err(GemmError::Kernel(KernelError::Misaligned {
                    operand: "a",
                    required: 16,
                    ..
                })) => {}
                other => {
                    return Err(format!(
                        "misaligned A: expected Kernel(Misaligned), got {other:?}"
                    ))
                }
            }
            match gemm.plan_with(&GemmDesc::new(64, 64, 64), Some("sm90a_no_such_variant")) {
                Err(GemmError::NoVariant { .. }) => Ok(()),
                other => Err(format!(
                    "unknown override: expected NoVariant, got {other:?}"
                )),
            }
        })
        .test(
            "buffer_of_another_context_is_refused_before_launch",
            |ctx| {
                // A second context on the same device stands in for another GPU: its memory is
                // not the launch context's, which the launch layer must notice (issue 15, item 6).
                let other =
                    CudaContext::new_non_primary(ctx.ordinal(), 0).map_err(|e| e.to_string())?;
                let e = |x: cudarc::driver::DriverError| x.to_string();
                let theirs = other.default_stream();
                let foreign_a = theirs.alloc_zeros::<bf16>(64 * 64).map_err(e)?;
                ctx.bind_to_thread().map_err(e)?;
                let stream = ctx.default_stream();
                let b = stream.alloc_zeros::<bf16>(64 * 64).map_err(e)?;
                let mut d = stream.alloc_zeros::<bf16>(64 * 64).map_err(e)?;
                let gemm = Gemm::new(ctx).map_err(|e| e.to_string())?;
                let plan = gemm
                    .plan(&GemmDesc::new(64, 64, 64))
                    .map_err(|e| e.to_string())?;
                match gemm.run(&plan, &stream, &foreign_a, &b, &mut d, None) {
                    Err(GemmError::Kernel(KernelError::WrongDevice { operand: "a", .. })) => Ok(()),
                    other => Err(format!("foreign A: expected WrongDevice, got {other:?}")),
                }
            },
        );
    // The arch-mismatch test needs a variant of the other arch in this build.
    let both_built = VariantArch::ALL.into_iter().all(|arch| {
        moefuse_kernels::compiled()
            .iter()
            .any(|v| v.spec.arch == arch && !v.spec.op.is_grouped())
    });
    if both_built || moefuse_testkit::gpu().is_err() {
        suite
            .test(
                "kernel_of_another_arch_is_refused_before_launch",
                kernel_of_another_arch_is_refused_before_launch,
            )
            .run()
    } else {
        println!(
            "SKIPPED kernel_of_another_arch_is_refused_before_launch: this build has kernels \
             for one arch only (MOEFUSE_CUDA_ARCHS=90a,100a builds both)"
        );
        suite.run()
    }
}

/// A kernel compiled for the other arch is refused before launch. Needs both arches in the
/// build (the default); a single-arch build names the test as skipped.
fn kernel_of_another_arch_is_refused_before_launch(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let (major, minor) = ctx.compute_capability().map_err(|e| e.to_string())?;
    let own = moefuse_kernels::arch_of(major, minor).map_err(|e| e.to_string())?;
    let foreign = VariantArch::ALL
        .into_iter()
        .find(|a| *a != own)
        .expect("moefuse has two arches")
        .name();
    let Some(v) = moefuse_kernels::compiled()
        .iter()
        .find(|v| v.spec.arch.name() == foreign && !v.spec.op.is_grouped())
    else {
        return Err(format!(
            "no {foreign} variant compiled: build with MOEFUSE_CUDA_ARCHS=90a,100a"
        ));
    };
    let kernels = Kernels::new(ctx).map_err(|e| e.to_string())?;
    let stream = ctx.default_stream();
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let a = stream.alloc_zeros::<bf16>(64 * 64).map_err(e)?;
    let mut d = stream.alloc_zeros::<bf16>(64 * 64).map_err(e)?;
    let op = moefuse_kernels::Gemm {
        variant: v,
        shape: GemmShape::new(64, 64, 64),
        a: &a,
        b: &a,
        c: None,
        d: &mut d,
        workspace: None,
    };
    match kernels.launch(&stream, op) {
        Err(KernelError::VariantArch { variant_arch, .. }) if variant_arch == foreign => Ok(()),
        other => Err(format!("{}: expected VariantArch, got {other:?}", v.name())),
    }
}
