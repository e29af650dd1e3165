//! Router selection (ties, groups, bias), weights, and d_logits against finite differences.

#![forbid(unsafe_code)]

mod common;

use common::{close, Rng};
use moefuse::reference::{route, route_backward, Routing};
use moefuse::{MoeConfig, MoeError, RouterKind};

fn softmax_cfg(e: usize, k: usize, renormalize: bool) -> MoeConfig {
    MoeConfig::new(64, 64, e, k).with_router(RouterKind::SoftmaxTopK { renormalize })
}

fn grouped_cfg(
    e: usize,
    k: usize,
    n_group: usize,
    topk_group: usize,
    rsf: f32,
    renormalize: bool,
) -> MoeConfig {
    MoeConfig::new(64, 64, e, k).with_router(RouterKind::SigmoidGrouped {
        n_group,
        topk_group,
        routed_scaling_factor: rsf,
        renormalize,
    })
}

fn logit(p: f64) -> f32 {
    (p / (1.0 - p)).ln() as f32
}

fn softmax(l: &[f32]) -> Vec<f64> {
    let ex: Vec<f64> = l.iter().map(|&v| f64::from(v).exp()).collect();
    let z: f64 = ex.iter().sum();
    ex.iter().map(|v| v / z).collect()
}

#[test]
fn softmax_top_k_ties_go_to_the_lower_id() {
    let logits = [1.0f32, 3.0, 3.0, 2.0, 3.0];
    let r = route(&softmax_cfg(5, 2, true), &logits, None).unwrap();
    assert_eq!(r.topk_ids, vec![1, 2]);
    assert_eq!(r.topk_weights, vec![0.5, 0.5]);
    let r = route(&softmax_cfg(5, 4, false), &logits, None).unwrap();
    assert_eq!(r.topk_ids, vec![1, 2, 4, 3]);
    let p = softmax(&logits);
    for (&id, &w) in r.topk_ids.iter().zip(&r.topk_weights) {
        assert_eq!(w, p[id as usize] as f32, "unnormalised weight is p");
    }
    // k = E: every expert, in descending order.
    let r = route(&softmax_cfg(5, 5, true), &logits, None).unwrap();
    assert_eq!(r.topk_ids, vec![1, 2, 4, 3, 0]);
}

#[test]
fn softmax_top_k_matches_a_sort_and_renormalises() {
    let mut rng = Rng::new(3);
    let (t, e, k) = (50, 12, 4);
    let logits = rng.vec(t * e, 4.0);
    let r = route(&softmax_cfg(e, k, true), &logits, None).unwrap();
    let plain = route(&softmax_cfg(e, k, false), &logits, None).unwrap();
    assert_eq!(r.topk_ids, plain.topk_ids);
    for tok in 0..t {
        let l = &logits[tok * e..][..e];
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
        let ids: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
        assert_eq!(&r.topk_ids[tok * k..][..k], &ids[..], "token {tok}");
        let sum: f32 = r.topk_weights[tok * k..][..k].iter().sum();
        assert!(
            (sum - 1.0).abs() < 1e-6,
            "token {tok}: renormalised weights sum to {sum}"
        );
        let p = softmax(l);
        let z: f64 = order[..k].iter().map(|&i| p[i]).sum();
        for (s, &i) in order[..k].iter().enumerate() {
            assert!(close(
                f64::from(plain.topk_weights[tok * k + s]),
                p[i],
                1e-6,
                0.0
            ));
            assert!(close(
                f64::from(r.topk_weights[tok * k + s]),
                p[i] / z,
                1e-6,
                0.0
            ));
        }
    }
}

#[test]
fn grouped_selection_differs_from_plain_top_k() {
    // Groups of 2: {0,1} scores 0.9+0.1 = 1.0, {2,3} 0.6+0.6 = 1.2, {4,5} 0.55+0.55 = 1.1,
    // {6,7} 0.4. Keeping 2 groups drops expert 0 (the best single expert).
    let s = [0.9, 0.1, 0.6, 0.6, 0.55, 0.55, 0.2, 0.2];
    let logits: Vec<f32> = s.iter().map(|&p| logit(p)).collect();
    let cfg = grouped_cfg(8, 2, 4, 2, 2.5, true);
    let r = route(&cfg, &logits, None).unwrap();
    assert_eq!(r.topk_ids, vec![2, 3]);
    assert!(
        r.topk_weights.iter().all(|&w| (w - 1.25).abs() < 1e-6),
        "{:?}",
        r.topk_weights
    );
    // With all groups kept it is plain top-k.
    let r = route(&grouped_cfg(8, 2, 4, 4, 1.0, false), &logits, None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 2]);
    assert!((r.topk_weights[0] - 0.9).abs() < 1e-6 && (r.topk_weights[1] - 0.6).abs() < 1e-6);
    // The bias changes the selection but not the weights: +0.5 on experts 6, 7 makes
    // group {6,7} the best (1.4) and experts 6, 7 the top 2.
    let mut bias = vec![0f32; 8];
    bias[6] = 0.5;
    bias[7] = 0.5;
    let r = route(&cfg, &logits, Some(&bias)).unwrap();
    assert_eq!(r.topk_ids, vec![6, 7]);
    assert!(r.topk_weights.iter().all(|&w| (w - 1.25).abs() < 1e-6));
    let r = route(&grouped_cfg(8, 2, 4, 2, 1.0, false), &logits, Some(&bias)).unwrap();
    assert!(
        r.topk_weights.iter().all(|&w| (w - 0.2).abs() < 1e-6),
        "weights use s, not s + bias"
    );
    // Group ties go to the lower group id: all groups score 1.0, keep 1 → group 0.
    let flat: Vec<f32> = [0.5; 8].iter().map(|&p| logit(p)).collect();
    let r = route(&grouped_cfg(8, 2, 4, 1, 1.0, true), &flat, None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 1]);
    // Group score is the top 2, not the sum: group {0,1,2,3} = 0.9+0.8 beats {4..7} = 0.7·4 total.
    let s = [0.9, 0.8, 0.01, 0.01, 0.7, 0.7, 0.7, 0.7];
    let logits: Vec<f32> = s.iter().map(|&p| logit(p)).collect();
    let r = route(&grouped_cfg(8, 3, 2, 1, 1.0, false), &logits, None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 1, 2]);
}

/// Finite differences of `L = Σ c·weights` w.r.t. the logits, skipping perturbations that
/// change the selection.
fn check_d_logits(cfg: &MoeConfig, bias: Option<&[f32]>, seed: u64) {
    let mut rng = Rng::new(seed);
    let (t, e, k) = (6, cfg.experts, cfg.top_k);
    let logits = rng.vec(t * e, 3.0);
    let c = rng.vec(t * k, 1.0);
    let base = route(cfg, &logits, bias).unwrap();
    let dl = route_backward(cfg, &logits, &base, &c).unwrap();
    let loss = |r: &Routing| common::weighted_sum(&c, &r.topk_weights);
    let eps = 5e-3f32;
    let (mut checked, mut skipped) = (0, 0);
    for i in 0..t * e {
        let (mut lp, mut lm) = (logits.clone(), logits.clone());
        lp[i] += eps;
        lm[i] -= eps;
        let (rp, rm) = (
            route(cfg, &lp, bias).unwrap(),
            route(cfg, &lm, bias).unwrap(),
        );
        if rp.topk_ids != base.topk_ids || rm.topk_ids != base.topk_ids {
            skipped += 1;
            continue;
        }
        let fd = (loss(&rp) - loss(&rm)) / f64::from(lp[i] - lm[i]);
        assert!(
            close(f64::from(dl[i]), fd, 1e-2, 2e-4),
            "{:?}: d_logits[{i}] = {} vs finite difference {fd}",
            cfg.router,
            dl[i]
        );
        checked += 1;
    }
    assert!(
        checked >= t * e * 3 / 4,
        "{:?}: only {checked} checked, {skipped} skipped",
        cfg.router
    );
    // Unchosen experts get zero gradient under renormalised or sigmoid routing.
    let renorm_or_sigmoid = !matches!(cfg.router, RouterKind::SoftmaxTopK { renormalize: false });
    if renorm_or_sigmoid {
        for tok in 0..t {
            for ex in 0..e {
                if !base.topk_ids[tok * k..][..k].contains(&(ex as i32)) {
                    assert!(
                        dl[tok * e + ex].abs() < 1e-7,
                        "unchosen expert {ex} of token {tok}"
                    );
                }
            }
        }
    }
}

#[test]
fn d_logits_match_finite_differences() {
    check_d_logits(&softmax_cfg(8, 3, true), None, 10);
    check_d_logits(&softmax_cfg(8, 3, false), None, 11);
    check_d_logits(&softmax_cfg(8, 1, true), None, 12);
    check_d_logits(&softmax_cfg(8, 8, false), None, 13);
    let bias: Vec<f32> = (0..8).map(|i| 0.05 * i as f32).collect();
    check_d_logits(&grouped_cfg(8, 3, 4, 2, 2.5, true), Some(&bias), 14);
    check_d_logits(&grouped_cfg(8, 3, 4, 2, 2.5, false), Some(&bias), 15);
    check_d_logits(&grouped_cfg(8, 2, 2, 1, 1.0, true), None, 16);
}

#[test]
fn routing_inputs_are_checked() {
    let cfg = softmax_cfg(4, 2, true);
    assert_eq!(
        route(&cfg, &[0.0; 7], None),
        Err(MoeError::NotAMultiple {
            what: "logits [tokens, experts]",
            len: 7,
            multiple: 4
        })
    );
    assert_eq!(
        route(&cfg, &[], None),
        Err(MoeError::TokensOutOfRange {
            tokens: 0,
            max: 65536
        })
    );
    assert_eq!(
        route(&cfg, &[0.0; 4], Some(&[0.0; 4])),
        Err(MoeError::UnexpectedRouterBias)
    );
    assert_eq!(
        route(&cfg.with_router(RouterKind::External), &[0.0; 4], None),
        Err(MoeError::ExternalRouter)
    );
    let g = grouped_cfg(4, 2, 2, 1, 1.0, true);
    assert_eq!(
        route(&g, &[0.0; 4], Some(&[0.0; 3])),
        Err(MoeError::ShapeMismatch {
            what: "router_bias [experts]",
            expected: 4,
            found: 3
        })
    );
    let r = route(&cfg, &[0.0; 4], None).unwrap();
    assert!(matches!(
        route_backward(&cfg, &[0.0; 4], &r, &[1.0]),
        Err(MoeError::ShapeMismatch {
            expected: 2,
            found: 1,
            ..
        })
    ));
    let dup = Routing {
        top_k: 2,
        topk_ids: vec![1, 1],
        topk_weights: vec![0.5, 0.5],
    };
    assert!(matches!(
        route_backward(&cfg, &[0.0; 4], &dup, &[1.0, 1.0]),
        Err(MoeError::DuplicateExpert { .. })
    ));
}

/// NaN ranks above every number (torch.topk), ties (NaN with NaN) to the lower id, and
/// its token's softmax weights are NaN; `+inf` ranks below NaN, above every number.
#[test]
fn nan_and_infinite_logits_are_routed_like_torch_topk() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    let cfg = softmax_cfg(6, 4, true);
    let r = route(&cfg, &[1.0, nan, 3.0, nan, inf, -inf], None).unwrap();
    assert_eq!(r.topk_ids, vec![1, 3, 4, 2]);
    assert!(r.topk_weights.iter().all(|w| w.is_nan()));
    // Only +inf: it ranks first; exp(inf - inf) is NaN, so the weights are NaN too.
    let r = route(&cfg, &[1.0, 2.0, inf, 0.0, inf, 5.0], None).unwrap();
    assert_eq!(r.topk_ids, vec![2, 4, 5, 1]);
    assert!(r.topk_weights.iter().all(|w| w.is_nan()));
    // -inf: ranks last, ties to the lower id, weight exactly 0; the others stay finite.
    let cfg2 = softmax_cfg(4, 3, false);
    let r = route(&cfg2, &[-inf, 0.0, -inf, 0.0], None).unwrap();
    assert_eq!(r.topk_ids, vec![1, 3, 0]);
    assert_eq!(r.topk_weights, vec![0.5, 0.5, 0.0]);
    // More NaNs than slots: the lowest ids among them, each expert once.
    let r = route(&softmax_cfg(5, 2, false), &[nan, 9.0, nan, nan, 9.0], None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 2]);
    // Every logit NaN, and every logit -inf: still k distinct experts, lowest ids first.
    let r = route(&softmax_cfg(4, 3, true), &[nan; 4], None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 1, 2]);
    let r = route(&softmax_cfg(4, 3, true), &[-inf; 4], None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 1, 2]);
    assert!(r.topk_weights.iter().all(|w| w.is_nan()));
}

/// The grouped sigmoid router orders groups and experts by the same total order: a NaN
/// score makes its group's score NaN, which ranks first.
#[test]
fn nan_logits_in_the_grouped_router_pick_their_group_first() {
    let (nan, inf) = (f32::NAN, f32::INFINITY);
    // 8 experts in 4 groups of 2, keep 2 groups, top-2.
    let g = grouped_cfg(8, 2, 4, 2, 1.0, false);
    let logits = [0.0, 0.1, 5.0, 4.0, 0.2, nan, -inf, 1.0];
    let r = route(&g, &logits, None).unwrap();
    // Group 2 (NaN) and group 1 (sigmoid(5) + sigmoid(4)) are kept; NaN first.
    assert_eq!(r.topk_ids, vec![5, 2]);
    assert!(r.topk_weights[0].is_nan());
    let want = 1.0 / (1.0 + (-5f64).exp());
    assert!((f64::from(r.topk_weights[1]) - want).abs() < 1e-7);
    // +inf saturates the sigmoid to 1 (finite weight); -inf to 0.
    let r = route(&g, &[inf, 0.0, -inf, -inf, 0.0, 0.0, 0.0, 0.0], None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 1]);
    assert_eq!(r.topk_weights, vec![1.0, 0.5]);
    // Renormalised weights of a token with a NaN are NaN, the ids distinct.
    let gr = grouped_cfg(8, 4, 4, 2, 2.5, true);
    let r = route(&gr, &[nan, nan, 1.0, 2.0, 3.0, 4.0, nan, 0.0], None).unwrap();
    assert_eq!(r.topk_ids, vec![0, 1, 6, 7]);
    assert!(r.topk_weights.iter().all(|w| w.is_nan()));
}

/// The backward takes the same non-finite logits the forward routes, and its NaN
/// propagates by IEEE rules: a softmax token with a NaN has NaN gradients everywhere.
#[test]
fn route_backward_accepts_non_finite_logits() {
    let cfg = softmax_cfg(4, 2, true);
    let logits = [0.0, f32::NAN, 1.0, 2.0];
    let r = route(&cfg, &logits, None).unwrap();
    let d = route_backward(&cfg, &logits, &r, &[1.0, -1.0]).unwrap();
    assert!(d.iter().all(|v| v.is_nan()));
    let logits = [f32::NEG_INFINITY, 0.0, 1.0, 2.0];
    let r = route(&cfg, &logits, None).unwrap();
    let d = route_backward(&cfg, &logits, &r, &[1.0, -1.0]).unwrap();
    assert!(d.iter().all(|v| v.is_finite()), "{d:?}");
    assert_eq!(d[0], 0.0);
}
