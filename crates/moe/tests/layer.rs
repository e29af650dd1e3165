//! The whole layer: forward against a naive per-token computation, every gradient against
//! f64 central finite differences of `L = Σ r·y`, accumulation, and input checks.

#![forbid(unsafe_code)]

mod common;

use common::{close, weighted_sum, Rng};
use moefuse::model::MoeWeights;
use moefuse::reference::{
    activation::value, backward, backward_into, forward, route, ForwardOutput, Gradients,
    RoutingInput,
};
use moefuse::{Activation, GateUpLayout, MoeConfig, MoeError, RouterKind};

const ACTIVATIONS: [Activation; 5] = [
    Activation::SwiGlu,
    Activation::GeGlu,
    // Limits small enough that the clamps are active for a good share of the values.
    Activation::SwiGluOai {
        alpha: 1.702,
        limit: 0.8,
    },
    Activation::BoundedSwiGlu { limit: 0.6 },
    Activation::Relu2,
];
const LAYOUTS: [GateUpLayout; 2] = [GateUpLayout::Split, GateUpLayout::Interleaved];

/// One problem: config, weights, input, loss weights `r` and external routing.
struct Problem {
    cfg: MoeConfig,
    w: MoeWeights,
    x: Vec<f32>,
    r: Vec<f32>,
    ext_ids: Vec<i32>,
    ext_ws: Vec<f32>,
}

impl Problem {
    fn new(cfg: MoeConfig, tokens: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let (d, i, e, k, w) = (
            cfg.hidden,
            cfg.intermediate,
            cfg.experts,
            cfg.top_k,
            cfg.gate_up_width(),
        );
        let grouped = matches!(cfg.router, RouterKind::SigmoidGrouped { .. });
        let weights = MoeWeights {
            router: cfg.router.computes_routing().then(|| rng.vec(e * d, 0.3)),
            router_bias: grouped.then(|| rng.vec(e, 0.05)),
            gate_up: rng.vec(e * w * d, 0.25),
            down: rng.vec(e * d * i, 0.25),
        };
        let ext_ids = (0..tokens)
            .flat_map(|_| rng.distinct(k, e))
            .map(|v| v as i32)
            .collect();
        let ext_ws = (0..tokens * k).map(|_| 0.1 + rng.unit() as f32).collect();
        Problem {
            cfg,
            w: weights,
            x: rng.vec(tokens * d, 1.0),
            r: rng.vec(tokens * d, 1.0),
            ext_ids,
            ext_ws,
        }
    }

    fn input(&self) -> RoutingInput<'_> {
        if self.cfg.router.computes_routing() {
            RoutingInput::Ours
        } else {
            RoutingInput::External {
                topk_ids: &self.ext_ids,
                topk_weights: &self.ext_ws,
            }
        }
    }

    fn forward(&self) -> ForwardOutput {
        forward(&self.cfg, &self.w, &self.x, self.input()).unwrap()
    }
}

/// What a perturbed forward pass produced: the loss and what must not change for the
/// finite difference to be valid (routing, and which side of every kink each h_pre is on).
struct Eval {
    loss: f64,
    ids: Vec<i32>,
    regions: Vec<u8>,
}

fn eval(p: &Problem, out: &ForwardOutput) -> Eval {
    // Kinks: ±limit for the clamped activations (conservatively for gates and ups alike),
    // 0 for Relu2; SwiGlu and GeGlu are smooth.
    let regions = match p.cfg.activation {
        Activation::SwiGluOai { limit, .. } | Activation::BoundedSwiGlu { limit } => out
            .h_pre
            .iter()
            .map(|&v| (v > limit) as u8 | ((v < -limit) as u8) << 1)
            .collect(),
        Activation::Relu2 => out.h_pre.iter().map(|&v| (v > 0.0) as u8).collect(),
        _ => Vec::new(),
    };
    Eval {
        loss: weighted_sum(&p.r, &out.y),
        ids: out.routing.topk_ids.clone(),
        regions,
    }
}

const EPS: f32 = 2e-3;

/// Central differences of the loss over `indices` of one tensor; `run(i, delta)` perturbs
/// element `i` by `delta` and returns the evaluation and the perturbation actually applied.
fn fd_check(
    what: &str,
    base: &Eval,
    analytic: &[f32],
    indices: &[usize],
    mut run: impl FnMut(usize, f32) -> (Eval, f64),
) -> usize {
    let mut checked = 0;
    for &i in indices {
        let (ep, dp) = run(i, EPS);
        let (em, dm) = run(i, -EPS);
        let same = |e: &Eval| e.ids == base.ids && e.regions == base.regions;
        if !same(&ep) || !same(&em) {
            continue;
        }
        let fd = (ep.loss - em.loss) / (dp - dm);
        let an = f64::from(analytic[i]);
        assert!(
            close(an, fd, 1e-2, 3e-4),
            "{what}[{i}]: analytic {an} vs finite difference {fd}"
        );
        checked += 1;
    }
    assert!(
        checked * 4 >= indices.len() * 3,
        "{what}: only {checked} of {} coordinates checkable",
        indices.len()
    );
    checked
}

/// Sample indices of an `[E, rows_per_expert]` weight-gradient tensor, from experts with rows.
fn expert_samples(rng: &mut Rng, out: &ForwardOutput, per_expert: usize, n: usize) -> Vec<usize> {
    let used: Vec<usize> = (0..out.permutation.counts.len())
        .filter(|&e| out.permutation.counts[e] > 0)
        .collect();
    (0..n)
        .map(|_| used[rng.below(used.len())] * per_expert + rng.below(per_expert))
        .collect()
}

/// Checks every gradient of `p` against finite differences; returns the number checked.
fn check_gradients(p: &Problem, samples: usize, seed: u64) -> usize {
    let case = format!("{:?}", p.cfg);
    let mut rng = Rng::new(seed);
    let (d, i_len, e_count, k) = (p.cfg.hidden, p.cfg.intermediate, p.cfg.experts, p.cfg.top_k);
    let w_len = p.cfg.gate_up_width();
    let tokens = p.x.len() / d;
    let out = p.forward();
    let g = backward(&p.cfg, &p.w, &p.x, &out, &p.r).unwrap();
    let base = eval(p, &out);
    let mut checked = 0;

    // Experts without rows get exactly zero weight gradient.
    for e in (0..e_count).filter(|&e| out.permutation.counts[e] == 0) {
        assert!(
            g.d_gate_up[e * w_len * d..][..w_len * d]
                .iter()
                .all(|&v| v == 0.0),
            "{case}: empty expert {e}"
        );
        assert!(
            g.d_down[e * d * i_len..][..d * i_len]
                .iter()
                .all(|&v| v == 0.0),
            "{case}: empty expert {e}"
        );
    }

    let idx: Vec<usize> = (0..samples).map(|_| rng.below(tokens * d)).collect();
    checked += fd_check(&format!("{case} dx"), &base, &g.dx, &idx, |i, delta| {
        let mut q = Problem {
            x: p.x.clone(),
            ..clone_problem(p)
        };
        q.x[i] += delta;
        let dd = f64::from(q.x[i]) - f64::from(p.x[i]);
        (eval(&q, &q.forward()), dd)
    });
    let idx = expert_samples(&mut rng, &out, w_len * d, samples);
    checked += fd_check(
        &format!("{case} d_gate_up"),
        &base,
        &g.d_gate_up,
        &idx,
        |i, delta| {
            let mut q = clone_problem(p);
            q.w.gate_up[i] += delta;
            let dd = f64::from(q.w.gate_up[i]) - f64::from(p.w.gate_up[i]);
            (eval(&q, &q.forward()), dd)
        },
    );
    let idx = expert_samples(&mut rng, &out, d * i_len, samples);
    checked += fd_check(
        &format!("{case} d_down"),
        &base,
        &g.d_down,
        &idx,
        |i, delta| {
            let mut q = clone_problem(p);
            q.w.down[i] += delta;
            let dd = f64::from(q.w.down[i]) - f64::from(p.w.down[i]);
            (eval(&q, &q.forward()), dd)
        },
    );

    // d_topk_weights = ⟨dy, y_e⟩: perturb the weights of the routing actually used.
    let all: Vec<usize> = (0..tokens * k).collect();
    let used = out.routing.clone();
    checked += fd_check(
        &format!("{case} d_topk_weights"),
        &base,
        &g.d_topk_weights,
        &all,
        |i, delta| {
            let mut ws = used.topk_weights.clone();
            ws[i] += delta;
            let dd = f64::from(ws[i]) - f64::from(used.topk_weights[i]);
            let input = RoutingInput::External {
                topk_ids: &used.topk_ids,
                topk_weights: &ws,
            };
            (
                eval(
                    p,
                    &forward(&p.cfg.with_router(RouterKind::External), &p.w, &p.x, input).unwrap(),
                ),
                dd,
            )
        },
    );

    match (&out.logits, p.cfg.router.computes_routing()) {
        (Some(logits), true) => {
            // d_logits: the experts see x unchanged, the routing comes from perturbed logits.
            let d_logits = g.d_logits.as_ref().expect("d_logits when the layer routes");
            let idx: Vec<usize> = (0..samples).map(|_| rng.below(tokens * e_count)).collect();
            checked += fd_check(
                &format!("{case} d_logits"),
                &base,
                d_logits,
                &idx,
                |i, delta| {
                    let mut l = logits.clone();
                    l[i] += delta;
                    let dd = f64::from(l[i]) - f64::from(logits[i]);
                    let r = route(&p.cfg, &l, p.w.router_bias.as_deref()).unwrap();
                    let input = RoutingInput::External {
                        topk_ids: &r.topk_ids,
                        topk_weights: &r.topk_weights,
                    };
                    (eval(p, &forward(&p.cfg, &p.w, &p.x, input).unwrap()), dd)
                },
            );
            let d_router = g.d_router.as_ref().expect("d_router when the layer routes");
            let idx: Vec<usize> = (0..samples).map(|_| rng.below(e_count * d)).collect();
            checked += fd_check(
                &format!("{case} d_router"),
                &base,
                d_router,
                &idx,
                |i, delta| {
                    let mut q = clone_problem(p);
                    let router = q.w.router.as_mut().unwrap();
                    router[i] += delta;
                    let dd = f64::from(router[i]) - f64::from(p.w.router.as_ref().unwrap()[i]);
                    (eval(&q, &q.forward()), dd)
                },
            );
        }
        _ => assert!(
            g.d_logits.is_none() && g.d_router.is_none(),
            "{case}: no router gradient"
        ),
    }
    checked
}

fn clone_problem(p: &Problem) -> Problem {
    Problem {
        cfg: p.cfg,
        w: p.w.clone(),
        x: p.x.clone(),
        r: p.r.clone(),
        ext_ids: p.ext_ids.clone(),
        ext_ws: p.ext_ws.clone(),
    }
}

/// Every activation × layout with one router, on T=5, D=64, I=64, E=6, k=2.
fn sweep(router: RouterKind, seed: u64) {
    for (a, act) in ACTIVATIONS.into_iter().enumerate() {
        for (l, layout) in LAYOUTS.into_iter().enumerate() {
            let cfg = MoeConfig::new(64, 64, 6, 2)
                .with_activation(act)
                .with_gate_up_layout(layout)
                .with_router(router);
            let s = seed + 10 * a as u64 + l as u64;
            let checked = check_gradients(&Problem::new(cfg, 5, s), 8, s);
            assert!(checked >= 30, "{cfg:?}: {checked} coordinates checked");
        }
    }
}

#[test]
fn gradients_external_router() {
    sweep(RouterKind::External, 100);
}

#[test]
fn gradients_softmax_renormalised() {
    sweep(RouterKind::SoftmaxTopK { renormalize: true }, 200);
}

#[test]
fn gradients_softmax_plain() {
    sweep(RouterKind::SoftmaxTopK { renormalize: false }, 300);
}

#[test]
fn gradients_sigmoid_grouped_renormalised() {
    sweep(
        RouterKind::SigmoidGrouped {
            n_group: 3,
            topk_group: 2,
            routed_scaling_factor: 2.5,
            renormalize: true,
        },
        400,
    );
}

#[test]
fn gradients_sigmoid_grouped_plain() {
    sweep(
        RouterKind::SigmoidGrouped {
            n_group: 2,
            topk_group: 1,
            routed_scaling_factor: 1.5,
            renormalize: false,
        },
        500,
    );
}

#[test]
fn gradients_top_1_all_experts_and_single_token() {
    let soft = RouterKind::SoftmaxTopK { renormalize: true };
    let cases = [
        (MoeConfig::new(64, 64, 6, 1).with_router(soft), 5),
        (
            MoeConfig::new(64, 64, 6, 1).with_router(RouterKind::External),
            5,
        ),
        (
            MoeConfig::new(64, 64, 4, 4)
                .with_router(RouterKind::SoftmaxTopK { renormalize: false }),
            5,
        ),
        (
            MoeConfig::new(64, 64, 4, 4).with_router(RouterKind::SigmoidGrouped {
                n_group: 2,
                topk_group: 2,
                routed_scaling_factor: 1.0,
                renormalize: true,
            }),
            4,
        ),
        (
            MoeConfig::new(64, 64, 6, 2)
                .with_router(soft)
                .with_activation(Activation::GeGlu),
            1,
        ),
        (MoeConfig::new(64, 128, 1, 1).with_router(soft), 3),
    ];
    for (n, (cfg, tokens)) in cases.into_iter().enumerate() {
        let checked = check_gradients(&Problem::new(cfg, tokens, 600 + n as u64), 8, n as u64);
        assert!(checked >= 20, "{cfg:?}: {checked} checked");
    }
}

/// `y` and the saved tensors against a naive per-token f64 computation.
fn check_forward(p: &Problem) {
    let (d, i_len, k) = (p.cfg.hidden, p.cfg.intermediate, p.cfg.top_k);
    let w_len = p.cfg.gate_up_width();
    let out = p.forward();
    let tokens = p.x.len() / d;
    for t in 0..tokens {
        let xt = &p.x[t * d..][..d];
        let mut y = vec![0f64; d];
        for s in 0..k {
            let e = out.routing.topk_ids[t * k + s] as usize;
            let wt = f64::from(out.routing.topk_weights[t * k + s]);
            let pre: Vec<f64> = (0..w_len)
                .map(|c| {
                    (0..d)
                        .map(|j| f64::from(xt[j]) * f64::from(p.w.gate_up[(e * w_len + c) * d + j]))
                        .sum()
                })
                .collect();
            let h: Vec<f64> = (0..i_len)
                .map(|j| match p.cfg.activation {
                    Activation::Relu2 => value(p.cfg.activation, pre[j], 0.0),
                    act => {
                        let (gc, uc) = p.cfg.gate_up_layout.columns(j, i_len);
                        value(act, pre[gc], pre[uc])
                    }
                })
                .collect();
            let row = out.permutation.row_of[t * k + s] as usize;
            for (c, &v) in pre.iter().enumerate() {
                assert!(
                    close(f64::from(out.h_pre[row * w_len + c]), v, 1e-5, 1e-6),
                    "h_pre row {row}"
                );
            }
            for (dd, acc) in y.iter_mut().enumerate() {
                let ye: f64 = (0..i_len)
                    .map(|j| h[j] * f64::from(p.w.down[(e * d + dd) * i_len + j]))
                    .sum();
                assert!(
                    close(f64::from(out.y_e[row * d + dd]), ye, 1e-4, 1e-5),
                    "y_e row {row}"
                );
                *acc += wt * ye;
            }
        }
        for (dd, &v) in y.iter().enumerate() {
            assert!(
                close(f64::from(out.y[t * d + dd]), v, 1e-4, 1e-5),
                "{:?}: y[{t}, {dd}]",
                p.cfg
            );
        }
    }
}

#[test]
fn forward_matches_naive_computation() {
    for (a, act) in ACTIVATIONS.into_iter().enumerate() {
        for layout in LAYOUTS {
            let cfg = MoeConfig::new(64, 128, 8, 3)
                .with_activation(act)
                .with_gate_up_layout(layout);
            check_forward(&Problem::new(cfg, 7, 700 + a as u64));
        }
    }
}

#[test]
fn larger_problem_forward_and_backward() {
    let cfg = MoeConfig::new(128, 128, 16, 4)
        .with_activation(Activation::swiglu_oai())
        .with_gate_up_layout(GateUpLayout::Interleaved)
        .with_router(RouterKind::SigmoidGrouped {
            n_group: 4,
            topk_group: 2,
            routed_scaling_factor: 2.5,
            renormalize: true,
        });
    let p = Problem::new(cfg, 64, 800);
    check_forward(&p);
    let out = p.forward();
    let g = backward(&p.cfg, &p.w, &p.x, &out, &p.r).unwrap();
    assert!(g
        .dx
        .iter()
        .chain(&g.d_gate_up)
        .chain(&g.d_down)
        .all(|v| v.is_finite()));
    // Combine is exactly the f32 slot-order sum.
    for t in [0, 17, 63] {
        for dd in [0, 77, 127] {
            let mut acc = 0f32;
            for s in 0..4 {
                let row = out.permutation.row_of[t * 4 + s] as usize;
                acc += out.routing.topk_weights[t * 4 + s] * out.y_e[row * 128 + dd];
            }
            assert_eq!(out.y[t * 128 + dd], acc);
        }
    }
}

#[test]
fn accumulate_adds_weight_gradients() {
    let soft =
        MoeConfig::new(64, 64, 8, 1).with_router(RouterKind::SoftmaxTopK { renormalize: true });
    let p = Problem::new(soft, 3, 900);
    let out = p.forward();
    let fresh = backward(&p.cfg, &p.w, &p.x, &out, &p.r).unwrap();
    let empty: Vec<usize> = (0..8).filter(|&e| out.permutation.counts[e] == 0).collect();
    assert!(!empty.is_empty(), "3 tokens on 8 experts leave some empty");

    let mut rng = Rng::new(901);
    let mut g = Gradients::zeros(&p.cfg, 3);
    g.d_gate_up = rng.vec(g.d_gate_up.len(), 1.0);
    g.d_down = rng.vec(g.d_down.len(), 1.0);
    g.d_router = Some(rng.vec(8 * 64, 1.0));
    g.dx = rng.vec(g.dx.len(), 1.0);
    let before = g.clone();
    backward_into(&p.cfg, &p.w, &p.x, &out, &p.r, &mut g, true).unwrap();
    let sum = |a: &[f32], b: &[f32]| -> Vec<f32> { a.iter().zip(b).map(|(x, y)| x + y).collect() };
    assert_eq!(g.d_gate_up, sum(&before.d_gate_up, &fresh.d_gate_up));
    assert_eq!(g.d_down, sum(&before.d_down, &fresh.d_down));
    assert_eq!(
        g.d_router.as_ref().unwrap(),
        &sum(
            before.d_router.as_ref().unwrap(),
            fresh.d_router.as_ref().unwrap()
        )
    );
    assert_eq!(g.dx, fresh.dx, "dx is overwritten");
    assert_eq!(g.d_topk_weights, fresh.d_topk_weights);
    assert_eq!(g.d_logits, fresh.d_logits);
    let w_len = p.cfg.gate_up_width();
    for &e in &empty {
        let r = e * w_len * 64..(e + 1) * w_len * 64;
        assert_eq!(
            g.d_gate_up[r.clone()],
            before.d_gate_up[r],
            "empty expert {e} unchanged"
        );
    }
    // Without accumulate the values are replaced.
    backward_into(&p.cfg, &p.w, &p.x, &out, &p.r, &mut g, false).unwrap();
    assert_eq!(g, fresh);

    // External routing: d_router left as it is when accumulating, cleared otherwise.
    let ext = Problem::new(
        MoeConfig::new(64, 64, 8, 2).with_router(RouterKind::External),
        3,
        902,
    );
    let out = ext.forward();
    let mut g = Gradients::zeros(&ext.cfg, 3);
    g.d_router = Some(vec![1.0; 8 * 64]);
    backward_into(&ext.cfg, &ext.w, &ext.x, &out, &ext.r, &mut g, true).unwrap();
    assert_eq!(g.d_router, Some(vec![1.0; 8 * 64]));
    backward_into(&ext.cfg, &ext.w, &ext.x, &out, &ext.r, &mut g, true).unwrap();
    let once = backward(&ext.cfg, &ext.w, &ext.x, &out, &ext.r).unwrap();
    assert_eq!(
        g.d_down,
        sum(&once.d_down, &once.d_down),
        "two accumulations"
    );
    backward_into(&ext.cfg, &ext.w, &ext.x, &out, &ext.r, &mut g, false).unwrap();
    assert_eq!(g.d_router, None);
}

#[test]
fn inputs_are_checked_before_computing() {
    let cfg = MoeConfig::new(64, 64, 4, 2);
    let p = Problem::new(cfg, 2, 1000);
    let ext = |ids: &'static [i32], ws: &'static [f32]| RoutingInput::External {
        topk_ids: ids,
        topk_weights: ws,
    };
    assert_eq!(
        forward(&cfg, &p.w, &p.x[..100], RoutingInput::Ours),
        Err(MoeError::NotAMultiple {
            what: "x [tokens, hidden]",
            len: 100,
            multiple: 64
        })
    );
    assert_eq!(
        forward(&cfg, &p.w, &[], RoutingInput::Ours),
        Err(MoeError::TokensOutOfRange {
            tokens: 0,
            max: 65536
        })
    );
    let mut no_router = p.w.clone();
    no_router.router = None;
    assert_eq!(
        forward(&cfg, &no_router, &p.x, RoutingInput::Ours),
        Err(MoeError::MissingRouter)
    );
    let ext_cfg = cfg.with_router(RouterKind::External);
    assert_eq!(
        forward(&ext_cfg, &p.w, &p.x, RoutingInput::Ours),
        Err(MoeError::ExternalRouter)
    );
    assert_eq!(
        forward(&cfg, &p.w, &p.x, ext(&[0, 1, 2], &[1.0; 3])),
        Err(MoeError::ShapeMismatch {
            what: "topk_ids [tokens, top_k]",
            expected: 4,
            found: 3
        })
    );
    assert_eq!(
        forward(&cfg, &p.w, &p.x, ext(&[0, 1, 2, 2], &[1.0; 4])),
        Err(MoeError::DuplicateExpert {
            token: 1,
            first_slot: 0,
            slot: 1,
            id: 2
        })
    );
    assert_eq!(
        forward(&cfg, &p.w, &p.x, ext(&[0, 1, 2, 4], &[1.0; 4])),
        Err(MoeError::ExpertIdOutOfRange {
            token: 1,
            slot: 1,
            id: 4,
            experts: 4
        })
    );
    let mut bad = p.w.clone();
    bad.gate_up.pop();
    assert!(matches!(
        forward(&cfg, &bad, &p.x, RoutingInput::Ours),
        Err(MoeError::ShapeMismatch { .. })
    ));
    assert!(matches!(
        forward(
            &MoeConfig::new(64, 64, 4, 5),
            &p.w,
            &p.x,
            RoutingInput::Ours
        ),
        Err(MoeError::TopKOutOfRange { .. })
    ));
    let out = p.forward();
    assert!(matches!(
        backward(&cfg, &p.w, &p.x, &out, &p.r[..64]),
        Err(MoeError::ShapeMismatch {
            expected: 128,
            found: 64,
            ..
        })
    ));
    let mut tampered = out.clone();
    tampered.permutation.row_of.swap(0, 1);
    assert!(matches!(
        backward(&cfg, &p.w, &p.x, &tampered, &p.r),
        Err(MoeError::InconsistentSaved { .. })
    ));
    let mut g = Gradients::zeros(&cfg, 2);
    g.d_down.pop();
    assert!(matches!(
        backward_into(&cfg, &p.w, &p.x, &out, &p.r, &mut g, true),
        Err(MoeError::ShapeMismatch { .. })
    ));
}
