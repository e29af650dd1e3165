//! GPU tests of the router (forward and backward) and activation (forward and backward)
//! kernels against this crate's CPU reference: every router kind and every activation in
//! both gate/up layouts, odd sizes, poisoned outputs with spare tails (elements a call must
//! not touch keep their bits), row counts read on the device (clamped to the capacity) and
//! misaligned views (the scalar path). Without a GPU every test prints SKIPPED and is ignored.

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use half::bf16;
use moefuse::gpu::{self, ActivationDesc, Rows};
use moefuse::reference::{self, activation};
use moefuse::{Activation, GateUpLayout, MoeConfig, MoeError, RouterKind};
use moefuse_testkit::{check_close, to_f32, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

/// Element-wise relative bound for the fp32 router outputs (fp64 inside, like the reference).
const ROUTER_REL_ERR: f64 = 1e-5;
/// Spare elements past what a call needs; they must keep their poison.
const TAIL: usize = 13;
/// The poison of int32 ids.
const POISON_ID: i32 = -7;

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// `|got − want| <= bound`; false when either is NaN (so poison never passes).
fn close(got: f64, want: f64, bound: f64) -> bool {
    use std::cmp::Ordering::{Equal, Less};
    matches!((got - want).abs().partial_cmp(&bound), Some(Less | Equal))
}

fn shuffle(rng: &mut Rng, v: &mut [usize]) {
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i + 1));
    }
}

/// Logits without near-ties: each token's row is a random permutation of E values spaced
/// `2·scale/E` apart, each moved by under a tenth of the spacing.
fn distinct_logits(rng: &mut Rng, tokens: usize, e: usize, scale: f32) -> Vec<f32> {
    let step = 2.0 * scale / e as f32;
    let mut out = Vec::with_capacity(tokens * e);
    for _ in 0..tokens {
        let mut perm: Vec<usize> = (0..e).collect();
        shuffle(rng, &mut perm);
        out.extend(
            perm.iter()
                .map(|&p| -scale + step * (p as f32 + 0.5 + 0.1 * rng.uniform())),
        );
    }
    out
}

/// Logits on a coarse grid: many exact ties, which both sides break to the lower id
/// (softmax only: its selection compares the f32 logits exactly).
fn tied_logits(rng: &mut Rng, tokens: usize, e: usize) -> Vec<f32> {
    (0..tokens * e)
        .map(|_| rng.below(5) as f32 * 0.5 - 1.0)
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct RouterCase {
    name: &'static str,
    tokens: usize,
    cfg: MoeConfig,
    bias: bool,
    ties: bool,
}

fn softmax(tokens: usize, e: usize, k: usize, renormalize: bool) -> (usize, MoeConfig) {
    let cfg = MoeConfig::new(64, 64, e, k).with_router(RouterKind::SoftmaxTopK { renormalize });
    (tokens, cfg)
}

fn grouped(
    tokens: usize,
    e: usize,
    k: usize,
    n_group: usize,
    topk_group: usize,
    rsf: f32,
    renormalize: bool,
) -> (usize, MoeConfig) {
    let cfg = MoeConfig::new(64, 64, e, k).with_router(RouterKind::SigmoidGrouped {
        n_group,
        topk_group,
        routed_scaling_factor: rsf,
        renormalize,
    });
    (tokens, cfg)
}

fn router_cases() -> Vec<RouterCase> {
    let case = |name, (tokens, cfg), bias, ties| RouterCase {
        name,
        tokens,
        cfg,
        bias,
        ties,
    };
    vec![
        case("softmax_single", softmax(1, 1, 1, true), false, false),
        case("softmax_k_equals_e", softmax(5, 3, 3, false), false, false),
        case("softmax_small", softmax(37, 8, 2, true), false, false),
        case(
            "softmax_unnormalised",
            softmax(129, 64, 6, false),
            false,
            false,
        ),
        case(
            "softmax_odd_experts",
            softmax(33, 257, 16, true),
            false,
            false,
        ),
        case(
            "softmax_512_experts",
            softmax(77, 512, 16, false),
            false,
            false,
        ),
        case(
            "softmax_many_tokens",
            softmax(3001, 128, 8, true),
            false,
            false,
        ),
        case("softmax_exact_ties", softmax(211, 24, 5, true), false, true),
        case(
            "sigmoid_deepseek_v3",
            grouped(200, 256, 8, 8, 4, 2.5, true),
            true,
            false,
        ),
        case(
            "sigmoid_no_renorm",
            grouped(61, 64, 6, 8, 3, 1.0, false),
            true,
            false,
        ),
        case(
            "sigmoid_no_bias",
            grouped(13, 6, 2, 3, 2, 1.5, true),
            false,
            false,
        ),
        case(
            "sigmoid_pairs_512",
            grouped(45, 512, 16, 256, 8, 2.0, true),
            true,
            false,
        ),
        case(
            "sigmoid_wide_groups",
            grouped(99, 160, 10, 5, 2, 2.0, true),
            true,
            false,
        ),
        case(
            "sigmoid_one_group",
            grouped(50, 512, 4, 1, 1, 0.5, false),
            true,
            false,
        ),
        case(
            "sigmoid_all_groups",
            grouped(17, 12, 12, 4, 4, 1.0, true),
            false,
            false,
        ),
    ]
}

/// Routes one case on the GPU and compares ids exactly and weights to 1e-5, then runs the
/// backward on the reference's routing and compares d_logits.
fn check_router(stream: &Arc<CudaStream>, case: &RouterCase, seed: u64) -> Result<(), String> {
    let (t, e, k) = (case.tokens, case.cfg.experts, case.cfg.top_k);
    let what = format!(
        "{} (T={t} E={e} k={k} {:?} seed={seed})",
        case.name, case.cfg.router
    );
    let d = |x| format!("{what}: {x}");
    let mut rng = Rng::new(seed);
    let logits = if case.ties {
        tied_logits(&mut rng, t, e)
    } else {
        distinct_logits(&mut rng, t, e, 4.0)
    };
    let bias: Option<Vec<f32>> = case
        .bias
        .then(|| (0..e).map(|_| 0.05 * rng.uniform()).collect());
    let want = reference::route(&case.cfg, &logits, bias.as_deref()).map_err(err(&what))?;

    let logits_d = stream.clone_htod(&logits).map_err(err(&what))?;
    let bias_d = match &bias {
        Some(b) => Some(stream.clone_htod(b).map_err(err(&what))?),
        None => None,
    };
    let mut ids_d = stream
        .clone_htod(&vec![POISON_ID; t * k + TAIL])
        .map_err(err(&what))?;
    let mut w_d = stream
        .clone_htod(&vec![f32::NAN; t * k + TAIL])
        .map_err(err(&what))?;
    gpu::route(
        &case.cfg,
        stream,
        t,
        &logits_d,
        bias_d.as_ref().map(|b| b as &dyn DevicePtr<f32>),
        &mut ids_d,
        &mut w_d,
    )
    .map_err(err(&what))?;
    let ids = stream.clone_dtoh(&ids_d).map_err(err(&what))?;
    let w = stream.clone_dtoh(&w_d).map_err(err(&what))?;
    if ids[t * k..].iter().any(|&v| v != POISON_ID) || w[t * k..].iter().any(|v| !v.is_nan()) {
        return Err(d("the kernel wrote past tokens x top_k".into()));
    }
    for i in 0..t * k {
        if ids[i] != want.topk_ids[i] {
            return Err(d(format!(
                "topk_ids[token {}, slot {}] = {}, reference {} (token's ids {:?} vs {:?})",
                i / k,
                i % k,
                ids[i],
                want.topk_ids[i],
                &ids[i / k * k..(i / k + 1) * k],
                &want.topk_ids[i / k * k..(i / k + 1) * k]
            )));
        }
        let (g, r) = (f64::from(w[i]), f64::from(want.topk_weights[i]));
        if !close(g, r, ROUTER_REL_ERR * r.abs()) {
            return Err(d(format!(
                "topk_weights[token {}, slot {}] = {g:e}, reference {r:e}",
                i / k,
                i % k
            )));
        }
    }

    // Backward on the reference's routing.
    let dw: Vec<f32> = (0..t * k).map(|_| rng.uniform()).collect();
    let want_dl = reference::route_backward(&case.cfg, &logits, &want, &dw).map_err(err(&what))?;
    let ids_ref = stream.clone_htod(&want.topk_ids).map_err(err(&what))?;
    let dw_d = stream.clone_htod(&dw).map_err(err(&what))?;
    let mut dl_d = stream
        .clone_htod(&vec![f32::NAN; t * e + TAIL])
        .map_err(err(&what))?;
    gpu::route_backward(&case.cfg, stream, t, &logits_d, &ids_ref, &dw_d, &mut dl_d)
        .map_err(err(&what))?;
    let dl = stream.clone_dtoh(&dl_d).map_err(err(&what))?;
    if dl[t * e..].iter().any(|v| !v.is_nan()) {
        return Err(d("the backward wrote past tokens x experts".into()));
    }
    let scale = want_dl.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    for i in 0..t * e {
        let (g, r) = (f64::from(dl[i]), f64::from(want_dl[i]));
        if !close(g, r, ROUTER_REL_ERR * r.abs() + 1e-9 * scale) {
            return Err(d(format!(
                "d_logits[token {}, expert {}] = {g:e}, reference {r:e}",
                i / e,
                i % e
            )));
        }
    }
    Ok(())
}

fn router_all(ctx: &Arc<CudaContext>, filter: impl Fn(&RouterCase) -> bool) -> Result<(), String> {
    let stream = ctx.default_stream();
    let mut seeds = Rng::new(0x5EED_0001);
    for case in router_cases().iter().filter(|c| filter(c)) {
        check_router(&stream, case, seeds.next_u64())?;
        println!("{}: ok", case.name);
    }
    Ok(())
}

/// Every activation the tests run: defaults, and clamps tight enough to be active often.
fn activations() -> Vec<Activation> {
    vec![
        Activation::SwiGlu,
        Activation::GeGlu,
        Activation::swiglu_oai(),
        Activation::SwiGluOai {
            alpha: 1.0,
            limit: 0.5,
        },
        Activation::BoundedSwiGlu { limit: 0.75 },
        Activation::Relu2,
    ]
}

/// (I, capacity, device row count or None for all rows, leading offset of every view in
/// elements: 1 makes them 2-byte aligned only and forces the scalar path).
const SHAPES: &[(usize, usize, Option<i32>, usize)] = &[
    (64, 37, None, 0),
    (40, 19, Some(11), 0),
    (7, 23, Some(23), 0),
    (64, 9, Some(1000), 1),
    (1, 5, Some(-3), 0),
    (128, 300, Some(257), 0),
    (200, 3, Some(0), 0),
];

/// Runs forward and backward of `desc` over `cap` rows (`count` of them live) and compares
/// both with the reference; every element outside the live rows must keep its poison.
fn check_activation(
    stream: &Arc<CudaStream>,
    desc: &ActivationDesc,
    cap: usize,
    count: Option<i32>,
    offset: usize,
    seed: u64,
) -> Result<(f64, f64), String> {
    let (i, w) = (desc.intermediate, desc.width());
    let what = format!("{desc:?} cap={cap} count={count:?} offset={offset} seed={seed}");
    let mut rng = Rng::new(seed);
    let scale = match desc.activation {
        Activation::SwiGluOai { limit, .. } | Activation::BoundedSwiGlu { limit } => 1.5 * limit,
        _ => 4.0,
    };
    let h_pre: Vec<bf16> = (0..cap * w)
        .map(|_| bf16::from_f32(scale * rng.uniform()))
        .collect();
    let dh: Vec<bf16> = (0..cap * i)
        .map(|_| bf16::from_f32(rng.uniform()))
        .collect();
    let rows = count.map_or(cap, |c| c.clamp(0, cap as i32) as usize);

    // Reference over the live rows.
    let (x32, dh64): (Vec<f32>, Vec<f64>) = (
        to_f32(&h_pre),
        dh.iter().map(|v| f64::from(v.to_f32())).collect(),
    );
    let mut want_h = vec![0f32; rows * i];
    let mut want_dx = vec![0f64; rows * w];
    for r in 0..rows {
        let x = &x32[r * w..(r + 1) * w];
        activation::forward_row(
            desc.activation,
            desc.layout,
            x,
            &mut want_h[r * i..(r + 1) * i],
        );
        activation::backward_row(
            desc.activation,
            desc.layout,
            x,
            &dh64[r * i..(r + 1) * i],
            &mut want_dx[r * w..(r + 1) * w],
        );
    }
    let want_dx: Vec<f32> = want_dx.into_iter().map(|v| v as f32).collect();

    // Device buffers: `offset` poisoned elements, the data, TAIL poisoned elements.
    let padded = |v: &[bf16]| {
        let mut out = vec![POISON_BF16; offset];
        out.extend_from_slice(v);
        out.extend(std::iter::repeat_n(POISON_BF16, TAIL));
        out
    };
    let e = err(&what);
    let x_d = stream.clone_htod(&padded(&h_pre)).map_err(&e)?;
    let dh_d = stream.clone_htod(&padded(&dh)).map_err(&e)?;
    let mut h_d = stream
        .clone_htod(&vec![POISON_BF16; offset + cap * i + TAIL])
        .map_err(&e)?;
    let mut dx_d = stream
        .clone_htod(&vec![POISON_BF16; offset + cap * w + TAIL])
        .map_err(&e)?;
    // The count sits at the end of a prefix-sum array, as offsets[E-1] would.
    let counts = stream
        .clone_htod(&[3i32, 5, count.unwrap_or(0)])
        .map_err(&e)?;
    let count_view = counts.slice(2..);
    let rows_arg = || match count {
        Some(_) => Rows::from_device(&count_view, cap),
        None => Rows::all(cap),
    };
    {
        let x_view = x_d.slice(offset..);
        let mut h_view = h_d.slice_mut(offset..);
        gpu::activation_forward(desc, stream, rows_arg(), &x_view, &mut h_view)
            .map_err(err(&format!("{what}: forward")))?;
    }
    {
        let x_view = x_d.slice(offset..);
        let dh_view = dh_d.slice(offset..);
        let mut dx_view = dx_d.slice_mut(offset..);
        gpu::activation_backward(desc, stream, rows_arg(), &x_view, &dh_view, &mut dx_view)
            .map_err(err(&format!("{what}: backward")))?;
    }
    let h = stream.clone_dtoh(&h_d).map_err(&e)?;
    let dx = stream.clone_dtoh(&dx_d).map_err(&e)?;

    let live = |buf: &[bf16], row: usize, which: &str| -> Result<Vec<f32>, String> {
        let (lo, hi) = (offset, offset + rows * row);
        if let Some(j) = buf
            .iter()
            .enumerate()
            .position(|(j, v)| (j < lo || j >= hi) && v.to_bits() != POISON_BF16.to_bits())
        {
            return Err(format!(
                "{what}: {which} element {j} outside the {rows} live rows was overwritten"
            ));
        }
        Ok(to_f32(&buf[lo..hi]))
    };
    let fwd = check_close(
        &live(&h, i, "h")?,
        &want_h,
        BF16_REL_ERR,
        &format!("{what}: forward"),
    )?;
    let bwd = check_close(
        &live(&dx, w, "d_h_pre")?,
        &want_dx,
        BF16_REL_ERR,
        &format!("{what}: backward"),
    )?;
    Ok((fwd, bwd))
}

fn activation_all(ctx: &Arc<CudaContext>, layout: GateUpLayout) -> Result<(), String> {
    let stream = ctx.default_stream();
    let mut seeds = Rng::new(0x5EED_0002 + layout as u64);
    for act in activations() {
        for &(i, cap, count, offset) in SHAPES {
            let desc = ActivationDesc::new(act, layout, i);
            let (fwd, bwd) =
                check_activation(&stream, &desc, cap, count, offset, seeds.next_u64())?;
            println!(
                "{act:?} {layout:?} I={i} cap={cap} count={count:?} offset={offset}: \
                 rel err fwd {fwd:.2e} bwd {bwd:.2e}"
            );
        }
    }
    Ok(())
}

/// Bad input is rejected with a typed error before anything is launched.
fn rejects_bad_input(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.default_stream();
    let e = err("setup");
    let cfg = MoeConfig::new(64, 64, 8, 2);
    let logits = stream.alloc_zeros::<f32>(4 * 8).map_err(&e)?;
    let bias = stream.alloc_zeros::<f32>(8).map_err(&e)?;
    let mut ids = stream.alloc_zeros::<i32>(4 * 2).map_err(&e)?;
    let mut w = stream.alloc_zeros::<f32>(4 * 2).map_err(&e)?;
    let expect = |got: Result<(), MoeError>, want: MoeError| {
        if got.as_ref().err() == Some(&want) {
            Ok(())
        } else {
            Err(format!("expected Err({want:?}), got {got:?}"))
        }
    };
    expect(
        gpu::route(&cfg, &stream, 5, &logits, None, &mut ids, &mut w),
        MoeError::BufferTooSmall {
            what: "logits [tokens, experts]",
            needed: 40,
            got: 32,
        },
    )?;
    expect(
        gpu::route(&cfg, &stream, 4, &logits, Some(&bias), &mut ids, &mut w),
        MoeError::UnexpectedRouterBias,
    )?;
    expect(
        gpu::route(
            &cfg.with_router(RouterKind::External),
            &stream,
            4,
            &logits,
            None,
            &mut ids,
            &mut w,
        ),
        MoeError::ExternalRouter,
    )?;
    // Zero tokens: nothing to do, nothing launched.
    gpu::route(&cfg, &stream, 0, &logits, None, &mut ids, &mut w)
        .map_err(|x| format!("zero tokens must be Ok: {x}"))?;
    let mut dl = stream.alloc_zeros::<f32>(4 * 8 - 1).map_err(&e)?;
    expect(
        gpu::route_backward(&cfg, &stream, 4, &logits, &ids, &w, &mut dl),
        MoeError::BufferTooSmall {
            what: "d_logits [tokens, experts]",
            needed: 32,
            got: 31,
        },
    )?;

    let desc = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, 64);
    let x = stream.alloc_zeros::<bf16>(10 * 128).map_err(&e)?;
    let mut h = stream.alloc_zeros::<bf16>(10 * 64 - 1).map_err(&e)?;
    expect(
        gpu::activation_forward(&desc, &stream, Rows::all(10), &x, &mut h),
        MoeError::BufferTooSmall {
            what: "h [rows, I]",
            needed: 640,
            got: 639,
        },
    )?;
    let bad = ActivationDesc::new(
        Activation::BoundedSwiGlu { limit: 0.0 },
        GateUpLayout::Split,
        64,
    );
    match gpu::activation_forward(&bad, &stream, Rows::all(1), &x, &mut h) {
        Err(MoeError::InvalidParameter { .. }) => {}
        other => return Err(format!("limit 0: expected InvalidParameter, got {other:?}")),
    }
    let empty = stream.alloc_zeros::<i32>(1).map_err(&e)?;
    let none = empty.slice(1..);
    match gpu::activation_forward(&desc, &stream, Rows::from_device(&none, 10), &x, &mut h) {
        Err(MoeError::BufferTooSmall {
            what: "row count", ..
        }) => {}
        other => {
            return Err(format!(
                "empty count: expected BufferTooSmall, got {other:?}"
            ))
        }
    }
    // Zero capacity: nothing to do, nothing launched.
    gpu::activation_forward(&desc, &stream, Rows::all(0), &x, &mut h)
        .map_err(|x| format!("zero rows must be Ok: {x}"))
}

fn main() {
    GpuSuite::new()
        .test("router_softmax_top_k_matches_reference", |ctx| {
            router_all(ctx, |c| {
                matches!(c.cfg.router, RouterKind::SoftmaxTopK { .. })
            })
        })
        .test("router_sigmoid_grouped_matches_reference", |ctx| {
            router_all(ctx, |c| {
                matches!(c.cfg.router, RouterKind::SigmoidGrouped { .. })
            })
        })
        .test("activation_split_layout_matches_reference", |ctx| {
            activation_all(ctx, GateUpLayout::Split)
        })
        .test("activation_interleaved_layout_matches_reference", |ctx| {
            activation_all(ctx, GateUpLayout::Interleaved)
        })
        .test(
            "moe_kernels_reject_bad_input_before_launch",
            rejects_bad_input,
        )
        .run();
}
