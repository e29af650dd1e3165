//! GPU tests of the router (forward and backward) and activation (forward and backward)
//! kernels against this crate's CPU reference: every router kind and every activation in
//! both gate/up layouts, odd sizes, poisoned outputs with spare tails (elements a call must
//! not touch keep their bits), row counts read on the device (clamped to the capacity) and
//! misaligned views (the scalar path). Without a GPU every test prints SKIPPED and is ignored.

#![forbid(unsafe_code)]

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use half::bf16;
use moefuse::gpu::{self, ActivationDesc, DeviceErrors, PermuteBuffers, Rows};
use moefuse::reference::{self, activation};
use moefuse::{Activation, GateUpLayout, MoeConfig, MoeError, RouterKind};
use moefuse_testkit::{check_close, to_f32, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

#[path = "moe_kernels_gpu/down_dgrad.rs"]
mod down_dgrad;
#[path = "moe_kernels_gpu/routed.rs"]
mod routed;

/// Element-wise relative bound for the fp32 router outputs (fp64 inside, like the reference).
const ROUTER_REL_ERR: f64 = 1e-5;
/// Spare elements past what a call needs; they must keep their poison.
const TAIL: usize = 13;
/// The poison of int32 ids.
const POISON_ID: i32 = -7;
/// The poison of fp32 router outputs: not NaN, since NaN is a legitimate output for
/// non-finite logits.
const POISON_F32: f32 = -12345.5;

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// `|got − want| <= bound`; false when either is NaN (so poison never passes).
fn close(got: f64, want: f64, bound: f64) -> bool {
    use std::cmp::Ordering::{Equal, Less};
    matches!((got - want).abs().partial_cmp(&bound), Some(Less | Equal))
}

/// [`close`], or both NaN, or equal (infinities): what the reference's IEEE arithmetic
/// gives for non-finite logits, the GPU must give too.
fn same(got: f64, want: f64, bound: f64) -> bool {
    (got.is_nan() && want.is_nan()) || got == want || close(got, want, bound)
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
    let mut rng = Rng::new(seed);
    let logits = if case.ties {
        tied_logits(&mut rng, t, e)
    } else {
        distinct_logits(&mut rng, t, e, 4.0)
    };
    let bias: Option<Vec<f32>> = case
        .bias
        .then(|| (0..e).map(|_| 0.05 * rng.uniform()).collect());
    compare_router(
        stream,
        &case.cfg,
        t,
        &logits,
        bias.as_deref(),
        &what,
        &mut rng,
    )
}

/// Routes `logits` on the GPU and compares with the reference: ids exactly (and distinct
/// within each token), weights to 1e-5 (NaN where the reference's is NaN); then the
/// backward on the reference's routing, d_logits likewise. Outputs start poisoned with
/// spare tails that must keep their poison.
fn compare_router(
    stream: &Arc<CudaStream>,
    cfg: &MoeConfig,
    t: usize,
    logits: &[f32],
    bias: Option<&[f32]>,
    what: &str,
    rng: &mut Rng,
) -> Result<(), String> {
    let (e, k) = (cfg.experts, cfg.top_k);
    let d = |x| format!("{what}: {x}");
    let want = reference::route(cfg, logits, bias).map_err(err(what))?;

    let logits_d = stream.clone_htod(logits).map_err(err(what))?;
    let bias_d = match bias {
        Some(b) => Some(stream.clone_htod(b).map_err(err(what))?),
        None => None,
    };
    let mut ids_d = stream
        .clone_htod(&vec![POISON_ID; t * k + TAIL])
        .map_err(err(what))?;
    let mut w_d = stream
        .clone_htod(&vec![POISON_F32; t * k + TAIL])
        .map_err(err(what))?;
    gpu::route(
        cfg,
        stream,
        t,
        &logits_d,
        bias_d.as_ref().map(|b| b as &dyn DevicePtr<f32>),
        &mut ids_d,
        &mut w_d,
    )
    .map_err(err(what))?;
    let ids = stream.clone_dtoh(&ids_d).map_err(err(what))?;
    let w = stream.clone_dtoh(&w_d).map_err(err(what))?;
    if ids[t * k..].iter().any(|&v| v != POISON_ID) || w[t * k..].iter().any(|&v| v != POISON_F32) {
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
        if !same(g, r, ROUTER_REL_ERR * r.abs()) {
            return Err(d(format!(
                "topk_weights[token {}, slot {}] = {g:e}, reference {r:e}",
                i / k,
                i % k
            )));
        }
    }

    for (tok, row) in ids[..t * k].chunks(k).enumerate() {
        if (1..k).any(|j| row[..j].contains(&row[j])) {
            return Err(d(format!(
                "token {tok} routes to one expert twice: {row:?}"
            )));
        }
    }

    // Backward on the reference's routing.
    let dw: Vec<f32> = (0..t * k).map(|_| rng.uniform()).collect();
    let want_dl = reference::route_backward(cfg, logits, &want, &dw).map_err(err(what))?;
    let ids_ref = stream.clone_htod(&want.topk_ids).map_err(err(what))?;
    let dw_d = stream.clone_htod(&dw).map_err(err(what))?;
    let mut dl_d = stream
        .clone_htod(&vec![POISON_F32; t * e + TAIL])
        .map_err(err(what))?;
    gpu::route_backward(cfg, stream, t, &logits_d, &ids_ref, &dw_d, &mut dl_d)
        .map_err(err(what))?;
    let dl = stream.clone_dtoh(&dl_d).map_err(err(what))?;
    if dl[t * e..].iter().any(|&v| v != POISON_F32) {
        return Err(d("the backward wrote past tokens x experts".into()));
    }
    let scale = want_dl
        .iter()
        .filter(|v| v.is_finite())
        .fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    for i in 0..t * e {
        let (g, r) = (f64::from(dl[i]), f64::from(want_dl[i]));
        if !same(g, r, ROUTER_REL_ERR * r.abs() + 1e-9 * scale) {
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

/// NaN and ±inf logits: NaN ranks above every number (torch.topk), ties to the lower id.
/// The GPU must pick the reference's experts (each once per token) and give NaN exactly
/// where the reference does. Rows: finite, one NaN, more NaNs than slots, ±inf, half
/// -inf, all NaN.
fn router_non_finite(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.default_stream();
    let mut rng = Rng::new(0x5EED_0BAD);
    let cases = [
        ("softmax", softmax(97, 64, 6, true), false),
        ("softmax_odd", softmax(61, 257, 16, false), false),
        ("sigmoid", grouped(61, 64, 6, 8, 3, 2.5, true), true),
        ("sigmoid_v3", grouped(43, 256, 8, 8, 4, 1.0, false), true),
    ];
    for (name, (t, cfg), with_bias) in cases {
        let (e, k) = (cfg.experts, cfg.top_k);
        let mut logits = distinct_logits(&mut rng, t, e, 4.0);
        for (tok, row) in logits.chunks_mut(e).enumerate() {
            match tok % 6 {
                0 => {}
                1 => row[rng.below(e)] = f32::NAN,
                2 => (0..k + 3).for_each(|_| row[rng.below(e)] = f32::NAN),
                3 => {
                    row[rng.below(e)] = f32::INFINITY;
                    row[rng.below(e)] = f32::NEG_INFINITY;
                }
                4 => row.iter_mut().for_each(|v| {
                    if rng.below(2) == 0 {
                        *v = f32::NEG_INFINITY
                    }
                }),
                _ => row.fill(f32::NAN),
            }
        }
        let bias: Option<Vec<f32>> =
            with_bias.then(|| (0..e).map(|_| 0.05 * rng.uniform()).collect());
        let what = format!("non-finite {name} (T={t} E={e} k={k} {:?})", cfg.router);
        compare_router(&stream, &cfg, t, &logits, bias.as_deref(), &what, &mut rng)?;
        println!("{what}: ok");
    }
    Ok(())
}

/// Values exactly representable in bf16.
fn bf_values(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| bf16::from_f32(rng.uniform()).to_f32())
        .collect()
}

/// `row_of` lives on the device: combine and combine_backward must bound every entry by
/// the rows of `y` (and `dy_perm`), skip the bad slots, raise the row bit, and never touch
/// memory past the buffers. `y` and `dy_perm` are views of larger buffers whose spare
/// rows hold poison, so a read or write one row past the end is seen, not just a fault.
fn combine_bounds_row_of(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = ctx.default_stream();
    let e = "combine bounds";
    let (t, k, h) = (6usize, 3usize, 64usize);
    let rows = t * k;
    let guard = 4usize;
    let mut rng = Rng::new(0xB0B);
    // Slot j of token t: 0 valid (a distinct row), 1 the permutation's -1 or valid, 2 bad.
    let mut free: Vec<usize> = (0..rows).collect();
    shuffle(&mut rng, &mut free);
    let bad = [
        rows as i32,
        1 << 20,
        -5,
        i32::MAX,
        i32::MIN,
        rows as i32 + 1,
    ];
    let row_of: Vec<i32> = (0..t * k)
        .map(|i| match i % 3 {
            1 if i % 2 == 0 => -1,
            0 | 1 => free.pop().unwrap() as i32,
            _ => bad[(i / 3) % bad.len()],
        })
        .collect();
    let valid = |r: i32| (0..rows as i32).contains(&r);
    let w = bf_values(&mut rng, t * k);
    let y = bf_values(&mut rng, rows * h);
    let dy = bf_values(&mut rng, t * h);
    let to_bf = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    let mut y_big = to_bf(&y);
    y_big.extend(vec![POISON_BF16; guard * h]);
    let y_d = s.clone_htod(&y_big).map_err(err(e))?;
    let y_view = y_d.slice(..rows * h);
    let row_d = s.clone_htod(&row_of).map_err(err(e))?;
    let w_d = s.clone_htod(&w).map_err(err(e))?;
    let mut out_d = s
        .clone_htod(&vec![POISON_BF16; t * h + TAIL])
        .map_err(err(e))?;
    let mut errors = DeviceErrors::new(&s).map_err(err(e))?;
    gpu::combine(
        &s,
        t,
        k,
        h,
        &row_d,
        Some(&w_d),
        &y_view,
        &mut out_d,
        &mut errors,
    )
    .map_err(err(e))?;
    let out = to_f32(&s.clone_dtoh(&out_d).map_err(err(e))?);
    let mut want = vec![0f32; t * h];
    for tok in 0..t {
        for j in 0..k {
            let r = row_of[tok * k + j];
            if valid(r) {
                for c in 0..h {
                    want[tok * h + c] += w[tok * k + j] * y[r as usize * h + c];
                }
            }
        }
    }
    let want: Vec<f32> = want.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    check_close(
        &out[..t * h],
        &want,
        BF16_REL_ERR,
        "combine with bad row_of entries",
    )?;
    if out[t * h..]
        .iter()
        .any(|v| v.to_bits() != POISON_BF16.to_f32().to_bits())
    {
        return Err("combine wrote past out".into());
    }
    let expect_row_error = |got: Result<(), MoeError>, what: &str| match got {
        Err(MoeError::InvalidDeviceRouting {
            out_of_range: false,
            duplicate: false,
            row_out_of_range: true,
            stale_forward: false,
            source_out_of_range: false,
        }) => Ok(()),
        other => Err(format!("{what}: expected the row error, got {other:?}")),
    };
    expect_row_error(errors.take(), "combine")?;
    errors
        .take()
        .map_err(|x| format!("error word not cleared: {x}"))?;

    // Backward: dy_perm rows of valid slots get w·dy[t], every other row keeps its poison.
    let dy_d = s.clone_htod(&to_bf(&dy)).map_err(err(e))?;
    let mut dyp_d = s
        .clone_htod(&vec![POISON_BF16; (rows + guard) * h])
        .map_err(err(e))?;
    let mut dw_d = s.clone_htod(&vec![POISON_F32; t * k]).map_err(err(e))?;
    {
        let mut dyp_view = dyp_d.slice_mut(..rows * h);
        gpu::combine_backward(
            &s,
            t,
            k,
            h,
            &row_d,
            &w_d,
            &dy_d,
            &y_view,
            &mut dyp_view,
            &mut dw_d,
            &mut errors,
        )
        .map_err(err(e))?;
    }
    let dyp = s.clone_dtoh(&dyp_d).map_err(err(e))?;
    let dw = s.clone_dtoh(&dw_d).map_err(err(e))?;
    let mut touched = vec![false; rows + guard];
    for tok in 0..t {
        for j in 0..k {
            let (i, r) = (tok * k + j, row_of[tok * k + j]);
            if !valid(r) {
                if dw[i] != 0.0 {
                    return Err(format!(
                        "d_weights[{tok}, {j}] (row_of {r}) = {}, want 0",
                        dw[i]
                    ));
                }
                continue;
            }
            let r = r as usize;
            touched[r] = true;
            let dot: f64 = (0..h)
                .map(|c| f64::from(dy[tok * h + c]) * f64::from(y[r * h + c]))
                .sum();
            if !close(f64::from(dw[i]), dot, 1e-4 * (1.0 + dot.abs())) {
                return Err(format!("d_weights[{tok}, {j}] = {}, want {dot}", dw[i]));
            }
            let got: Vec<f32> = dyp[r * h..(r + 1) * h].iter().map(|v| v.to_f32()).collect();
            let want: Vec<f32> = (0..h).map(|c| w[i] * dy[tok * h + c]).collect();
            check_close(&got, &want, BF16_REL_ERR, &format!("dy_perm row {r}"))?;
        }
    }
    for (r, &hit) in touched.iter().enumerate() {
        if !hit
            && dyp[r * h..(r + 1) * h]
                .iter()
                .any(|v| v.to_bits() != POISON_BF16.to_bits())
        {
            return Err(format!(
                "combine_backward wrote dy_perm row {r}, which no valid slot names (rows {rows})"
            ));
        }
    }
    expect_row_error(errors.take(), "combine_backward")
}

/// The permutation against the reference, its device-side id check, and the per-call
/// checks of its buffers.
fn permute_checks(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = ctx.default_stream();
    let e = "permute";
    let (t, ex, k, h) = (300usize, 16usize, 4usize, 64usize);
    let mut rng = Rng::new(0xFACE);
    let ids: Vec<i32> = (0..t).flat_map(|_| rng.distinct(ex, k)).collect();
    let want = reference::permutation(&ids, k, ex).map_err(err(e))?;
    let ids_d = s.clone_htod(&ids).map_err(err(e))?;
    let mut bufs = PermuteBuffers::new(&s, t + 5, ex, k).map_err(err(e))?;
    gpu::permute::<cudarc::driver::CudaSlice<bf16>>(&s, t, ex, k, h, &ids_d, None, &mut bufs, None)
        .map_err(err(e))?;
    let got_off = s.clone_dtoh(bufs.offsets()).map_err(err(e))?;
    let got_row = s.clone_dtoh(bufs.row_of()).map_err(err(e))?;
    let got_src = s.clone_dtoh(bufs.source_of()).map_err(err(e))?;
    if got_off != want.offsets
        || got_row[..t * k] != want.row_of[..]
        || got_src[..t * k] != want.source_of[..]
    {
        return Err("permutation differs from the reference".into());
    }
    bufs.errors_mut().take().map_err(err(e))?;
    // An id outside 0..E on the device: dropped (row -1) and flagged, nothing else touched.
    let mut bad = ids.clone();
    bad[7] = ex as i32;
    bad[8] = -3;
    let bad_d = s.clone_htod(&bad).map_err(err(e))?;
    gpu::permute::<cudarc::driver::CudaSlice<bf16>>(&s, t, ex, k, h, &bad_d, None, &mut bufs, None)
        .map_err(err(e))?;
    let got_row = s.clone_dtoh(bufs.row_of()).map_err(err(e))?;
    if got_row[7] != -1 || got_row[8] != -1 {
        return Err(format!(
            "bad ids kept rows {} and {}",
            got_row[7], got_row[8]
        ));
    }
    match bufs.errors_mut().take() {
        Err(MoeError::InvalidDeviceRouting {
            out_of_range: true, ..
        }) => {}
        other => return Err(format!("ids outside 0..E not flagged: {other:?}")),
    }
    match gpu::permute::<cudarc::driver::CudaSlice<bf16>>(
        &s,
        t + 6,
        ex,
        k,
        h,
        &ids_d,
        None,
        &mut bufs,
        None,
    ) {
        Err(MoeError::TooLarge { what: "tokens", .. }) => {}
        other => return Err(format!("tokens past max_tokens: {other:?}")),
    }
    match gpu::permute::<cudarc::driver::CudaSlice<bf16>>(
        &s,
        t,
        ex,
        k + 1,
        h,
        &ids_d,
        None,
        &mut bufs,
        None,
    ) {
        Err(MoeError::ShapeMismatch { .. }) => {}
        other => return Err(format!("another top_k than the buffers': {other:?}")),
    }
    match PermuteBuffers::new(&s, usize::MAX / 2, ex, k) {
        Err(MoeError::TooLarge { .. }) => Ok(()),
        Err(other) => Err(format!("max_tokens·k overflow: {other:?}")),
        Ok(_) => Err("max_tokens·k overflow accepted".into()),
    }
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
        .test(
            "router_non_finite_logits_match_reference",
            router_non_finite,
        )
        .test("combine_bounds_device_row_of", combine_bounds_row_of)
        .test(
            "permute_matches_reference_and_checks_buffers",
            permute_checks,
        )
        .test(
            "routed_activation_backward_matches_reference",
            routed::routed_activation_backward,
        )
        .test("gather_rows_matches_reference", routed::gather_rows)
        .test(
            "fused_down_dgrad_matches_reference",
            down_dgrad::fused_down_dgrad,
        )
        .run();
}
