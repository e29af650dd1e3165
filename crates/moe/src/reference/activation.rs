//! The activations of [`Activation`] in f64: scalar value and partial derivatives, and the
//! row functions that read a gate_up row through its [`GateUpLayout`].

use crate::{Activation, GateUpLayout};

/// `√(2/π)`, the constant of the tanh GELU.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh GELU.
const GELU_CUBIC: f64 = 0.044715;

/// The logistic function `σ(x) = 1/(1+e^(−x))`, computed without overflow.
///
/// ```
/// use moefuse::reference::activation::sigmoid;
/// assert_eq!(sigmoid(0.0), 0.5);
/// assert!(sigmoid(-1000.0) >= 0.0 && sigmoid(1000.0) == 1.0);
/// ```
pub fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// `silu(x) = x·σ(x)` and its derivative `σ(x)·(1 + x·(1 − σ(x)))`.
fn silu_and_grad(x: f64) -> (f64, f64) {
    let s = sigmoid(x);
    (x * s, s * (1.0 + x * (1.0 - s)))
}

/// `gelu_tanh(x) = 0.5x(1 + tanh(√(2/π)(x + 0.044715x³)))` and its derivative.
fn gelu_tanh_and_grad(x: f64) -> (f64, f64) {
    let t = (SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)).tanh();
    let dinner = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x);
    (
        0.5 * x * (1.0 + t),
        0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner,
    )
}

/// `min(x, limit)` (NaN stays NaN) and whether the clamp is active (`x > limit`).
fn clamp_max(x: f64, limit: f64) -> (f64, bool) {
    if x > limit {
        (limit, true)
    } else {
        (x, false)
    }
}

/// `clamp(x, −limit, limit)` (NaN stays NaN) and whether the clamp is active.
fn clamp_sym(x: f64, limit: f64) -> (f64, bool) {
    if x > limit {
        (limit, true)
    } else if x < -limit {
        (-limit, true)
    } else {
        (x, false)
    }
}

/// The value `h` and the partials `(∂h/∂g, ∂h/∂u)` at one point.
fn eval(act: Activation, g: f64, u: f64) -> (f64, f64, f64) {
    match act {
        Activation::SwiGlu => {
            let (s, ds) = silu_and_grad(g);
            (s * u, ds * u, s)
        }
        Activation::GeGlu => {
            let (s, ds) = gelu_tanh_and_grad(g);
            (s * u, ds * u, s)
        }
        Activation::SwiGluOai { alpha, limit } => {
            let (alpha, limit) = (f64::from(alpha), f64::from(limit));
            let (gc, g_clamped) = clamp_max(g, limit);
            let (uc, u_clamped) = clamp_sym(u, limit);
            let s = sigmoid(alpha * gc);
            let glu = gc * s;
            let dglu = s + gc * alpha * s * (1.0 - s);
            let dg = if g_clamped { 0.0 } else { dglu * (uc + 1.0) };
            let du = if u_clamped { 0.0 } else { glu };
            (glu * (uc + 1.0), dg, du)
        }
        Activation::BoundedSwiGlu { limit } => {
            let limit = f64::from(limit);
            let (gc, g_clamped) = clamp_max(g, limit);
            let (uc, u_clamped) = clamp_sym(u, limit);
            let (s, ds) = silu_and_grad(gc);
            let dg = if g_clamped { 0.0 } else { ds * uc };
            let du = if u_clamped { 0.0 } else { s };
            (s * uc, dg, du)
        }
        Activation::Relu2 => {
            let r = if g > 0.0 { g } else { 0.0 };
            (r * r, 2.0 * r, 0.0)
        }
    }
}

/// The activation's value at one point. For [`Activation::Relu2`] the single input is `g`
/// and `u` is ignored.
///
/// ```
/// use moefuse::{reference::activation::value, Activation};
/// assert_eq!(value(Activation::Relu2, 3.0, 0.0), 9.0);
/// assert_eq!(value(Activation::SwiGlu, 0.0, 5.0), 0.0);
/// // BoundedSwiGlu clamps the up value to the limit.
/// assert_eq!(value(Activation::BoundedSwiGlu { limit: 1.0 }, 1.0, 9.0), value(Activation::SwiGlu, 1.0, 1.0));
/// ```
pub fn value(act: Activation, g: f64, u: f64) -> f64 {
    eval(act, g, u).0
}

/// The partial derivatives `(∂h/∂g, ∂h/∂u)` at one point, zero with respect to an input
/// whose clamp is active (strictly beyond the limit). For [`Activation::Relu2`] the single
/// input is `g` and `∂h/∂u = 0`.
///
/// ```
/// use moefuse::{reference::activation::grad, Activation};
/// assert_eq!(grad(Activation::Relu2, 3.0, 0.0), (6.0, 0.0));
/// let oai = Activation::swiglu_oai();
/// assert_eq!(grad(oai, 8.0, 8.0), (0.0, 0.0)); // both clamps active
/// ```
pub fn grad(act: Activation, g: f64, u: f64) -> (f64, f64) {
    let (_, dg, du) = eval(act, g, u);
    (dg, du)
}

/// Applies the activation to one gate_up row `h_pre` (width `W`) into `h` (width `I`),
/// reading gate/up pairs through `layout` (ignored for `Relu2`).
///
/// ```
/// use moefuse::{reference::activation::forward_row, Activation, GateUpLayout};
/// let h_pre = [1.0f32, 2.0, 3.0, 4.0]; // Interleaved: (g, u) = (1, 2), (3, 4)
/// let mut h = [0f32; 2];
/// forward_row(Activation::SwiGlu, GateUpLayout::Interleaved, &h_pre, &mut h);
/// assert!((h[1] - 3.0 * 4.0 / (1.0 + (-3.0f32).exp())).abs() < 1e-5);
/// ```
pub fn forward_row(act: Activation, layout: GateUpLayout, h_pre: &[f32], h: &mut [f32]) {
    let i_len = h.len();
    assert_eq!(
        h_pre.len(),
        act.gate_up_width(i_len),
        "forward_row: row widths disagree"
    );
    for (j, out) in h.iter_mut().enumerate() {
        let (g, u) = read_pair(act, layout, h_pre, j, i_len);
        *out = value(act, g, u) as f32;
    }
}

/// The row backward: from `dh = ∂L/∂h` (width `I`) to `dh_pre = ∂L/∂h_pre` (width `W`),
/// at the forward input `h_pre`. In f64, as the layer's backward keeps its intermediates.
///
/// ```
/// use moefuse::{reference::activation::backward_row, Activation, GateUpLayout};
/// let mut dh_pre = [0f64; 2];
/// backward_row(Activation::Relu2, GateUpLayout::Split, &[-1.0, 2.0], &[1.0, 1.0], &mut dh_pre);
/// assert_eq!(dh_pre, [0.0, 4.0]);
/// ```
pub fn backward_row(
    act: Activation,
    layout: GateUpLayout,
    h_pre: &[f32],
    dh: &[f64],
    dh_pre: &mut [f64],
) {
    let i_len = dh.len();
    let w = act.gate_up_width(i_len);
    assert!(
        h_pre.len() == w && dh_pre.len() == w,
        "backward_row: row widths disagree"
    );
    for (j, &d) in dh.iter().enumerate() {
        let (g, u) = read_pair(act, layout, h_pre, j, i_len);
        let (dg, du) = grad(act, g, u);
        if act.is_gated() {
            let (gc, uc) = layout.columns(j, i_len);
            dh_pre[gc] = d * dg;
            dh_pre[uc] = d * du;
        } else {
            dh_pre[j] = d * dg;
        }
    }
}

/// The inputs `(g, u)` of output column `j` (for `Relu2`: `(x_j, 0)`).
fn read_pair(
    act: Activation,
    layout: GateUpLayout,
    h_pre: &[f32],
    j: usize,
    i_len: usize,
) -> (f64, f64) {
    if act.is_gated() {
        let (gc, uc) = layout.columns(j, i_len);
        (f64::from(h_pre[gc]), f64::from(h_pre[uc]))
    } else {
        (f64::from(h_pre[j]), 0.0)
    }
}
