//! Activation values at hand-computed points and derivatives against finite differences.

#![forbid(unsafe_code)]

mod common;

use common::{close, Rng};
use moefuse::reference::activation::{backward_row, forward_row, grad, sigmoid, value};
use moefuse::{Activation, GateUpLayout};

const ALL: [Activation; 5] = [
    Activation::SwiGlu,
    Activation::GeGlu,
    Activation::SwiGluOai {
        alpha: 1.702,
        limit: 7.0,
    },
    Activation::BoundedSwiGlu { limit: 1.0 },
    Activation::Relu2,
];

const ALPHA: f64 = 1.702_000_021_934_509_3;

#[test]
fn values_at_hand_computed_points() {
    let cases: &[(Activation, f64, f64, f64)] = &[
        (Activation::SwiGlu, 1.0, 2.0, 1.4621171572600098), // 2·σ(1)
        (Activation::SwiGlu, 0.0, 7.0, 0.0),
        (Activation::GeGlu, 1.0, 1.0, 0.8411919906082768),
        (Activation::GeGlu, -2.0, 3.0, -0.13620691773667482),
        // alpha is the f32 1.702 = 1.70200002193450927734375.
        (
            Activation::swiglu_oai(),
            1.0,
            0.5,
            1.5 / (1.0 + (-ALPHA).exp()),
        ), // σ(α)·1.5
        (
            Activation::swiglu_oai(),
            10.0,
            10.0,
            56.0 / (1.0 + (-7.0 * ALPHA).exp()),
        ), // 7·σ(7α)·8, clamped
        (
            Activation::swiglu_oai(),
            1.0,
            -10.0,
            -6.0 / (1.0 + (-ALPHA).exp()),
        ), // u' = −7
        (
            Activation::BoundedSwiGlu { limit: 1.0 },
            2.0,
            -3.0,
            -0.7310585786300049,
        ), // silu(1)·(−1)
        (
            Activation::BoundedSwiGlu { limit: 1.0 },
            -2.0,
            0.5,
            -2.0 * sigmoid(-2.0) * 0.5,
        ),
        (Activation::Relu2, -2.0, 0.0, 0.0),
        (Activation::Relu2, 1.5, 99.0, 2.25),
    ];
    assert_eq!(ALPHA, f64::from(1.702f32));
    assert!(close(
        value(
            Activation::SwiGluOai {
                alpha: 1.0,
                limit: 7.0
            },
            1.0,
            0.5
        ),
        1.4621171572600098 * 0.75,
        1e-14,
        0.0
    ));
    for &(act, g, u, want) in cases {
        let got = value(act, g, u);
        assert!(
            close(got, want, 1e-14, 1e-15),
            "{act:?} at ({g}, {u}): {got} != {want}"
        );
    }
}

/// Points with both inputs at least 1e-3 away from the kinks (0 for Relu2, ±limit).
fn away_from_kinks(act: Activation, g: f64, u: f64) -> bool {
    let far = |x: f64, k: f64| (x - k).abs() > 1e-3;
    match act {
        Activation::SwiGluOai { limit, .. } | Activation::BoundedSwiGlu { limit } => {
            let l = f64::from(limit);
            far(g, l) && far(u, l) && far(u, -l)
        }
        Activation::Relu2 => far(g, 0.0),
        _ => true,
    }
}

#[test]
fn derivatives_match_central_differences() {
    let mut rng = Rng::new(1);
    let h = 1e-6;
    for act in ALL {
        let mut checked = 0;
        let mut clamped = 0;
        for _ in 0..2000 {
            let g = rng.unit() * 20.0 - 10.0;
            let u = rng.unit() * 20.0 - 10.0;
            if !away_from_kinks(act, g, u) {
                continue;
            }
            let (dg, du) = grad(act, g, u);
            let fg = (value(act, g + h, u) - value(act, g - h, u)) / (2.0 * h);
            let fu = (value(act, g, u + h) - value(act, g, u - h)) / (2.0 * h);
            assert!(
                close(dg, fg, 1e-6, 1e-7),
                "{act:?} d/dg at ({g}, {u}): {dg} vs {fg}"
            );
            assert!(
                close(du, fu, 1e-6, 1e-7),
                "{act:?} d/du at ({g}, {u}): {du} vs {fu}"
            );
            if let Activation::SwiGluOai { limit, .. } | Activation::BoundedSwiGlu { limit } = act {
                let l = f64::from(limit);
                if g > l {
                    assert_eq!(
                        dg, 0.0,
                        "{act:?}: gate beyond the limit must have zero gradient"
                    );
                    clamped += 1;
                }
                if u.abs() > l {
                    assert_eq!(
                        du, 0.0,
                        "{act:?}: up beyond the limit must have zero gradient"
                    );
                    clamped += 1;
                }
            }
            checked += 1;
        }
        assert!(checked > 1900, "{act:?}: only {checked} points checked");
        if matches!(
            act,
            Activation::SwiGluOai { .. } | Activation::BoundedSwiGlu { .. }
        ) {
            assert!(
                clamped > 100,
                "{act:?}: clamps hardly exercised ({clamped})"
            );
        }
    }
}

#[test]
fn gradient_passes_exactly_at_the_limit_and_not_beyond() {
    let act = Activation::BoundedSwiGlu { limit: 2.0 };
    let (dg, du) = grad(act, 2.0, -2.0);
    assert!(
        dg != 0.0 && du != 0.0,
        "at exactly ±limit the gradient passes"
    );
    let (dg, du) = grad(act, 2.0 + 1e-9, -2.0 - 1e-9);
    assert_eq!((dg, du), (0.0, 0.0));
    assert_eq!(grad(Activation::Relu2, 0.0, 0.0), (0.0, 0.0));
    assert_eq!(grad(Activation::Relu2, -1.0, 0.0), (0.0, 0.0));
}

#[test]
fn rows_follow_the_gate_up_layout() {
    let mut rng = Rng::new(2);
    let i_len = 64;
    for act in ALL {
        let w = act.gate_up_width(i_len);
        let pre = rng.vec(w, 3.0);
        let dh: Vec<f64> = (0..i_len).map(|_| rng.unit() - 0.5).collect();
        for layout in [GateUpLayout::Split, GateUpLayout::Interleaved] {
            let mut h = vec![0f32; i_len];
            forward_row(act, layout, &pre, &mut h);
            let mut dpre = vec![f64::NAN; w];
            backward_row(act, layout, &pre, &dh, &mut dpre);
            for j in 0..i_len {
                let (g, u, gc, uc) = if act.is_gated() {
                    let (gc, uc) = layout.columns(j, i_len);
                    (f64::from(pre[gc]), f64::from(pre[uc]), gc, Some(uc))
                } else {
                    (f64::from(pre[j]), 0.0, j, None)
                };
                assert_eq!(
                    h[j],
                    value(act, g, u) as f32,
                    "{act:?} {layout:?} column {j}"
                );
                let (dg, du) = grad(act, g, u);
                assert_eq!(dpre[gc], dh[j] * dg);
                if let Some(uc) = uc {
                    assert_eq!(dpre[uc], dh[j] * du);
                }
            }
            assert!(dpre.iter().all(|v| v.is_finite()), "every column written");
        }
    }
    // Split and Interleaved agree once the columns are permuted.
    let act = Activation::GeGlu;
    let split = rng.vec(2 * i_len, 2.0);
    let mut inter = vec![0f32; 2 * i_len];
    for j in 0..i_len {
        inter[2 * j] = split[j];
        inter[2 * j + 1] = split[i_len + j];
    }
    let (mut a, mut b) = (vec![0f32; i_len], vec![0f32; i_len]);
    forward_row(act, GateUpLayout::Split, &split, &mut a);
    forward_row(act, GateUpLayout::Interleaved, &inter, &mut b);
    assert_eq!(a, b);
}
