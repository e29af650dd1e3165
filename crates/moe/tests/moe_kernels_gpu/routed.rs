//! The two kernels of the lean Training backward, called directly and compared with the
//! CPU reference: the routed activation backward (`d_h_pre` of `w · dh_u`,
//! `d_topk_weights[s] = ⟨dh_u, h⟩`, `h_scaled = w · h`, `h` recomputed from `h_pre`) and the
//! unweighted row gather (`dst[row_of[t·k + j]] = src[t]`). Outputs are poisoned; what a call
//! must not touch keeps its bits; bad device indices raise their error bit and are skipped.

use super::{activations, err, shuffle, POISON_F32};
use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use moefuse::reference::activation;
use moefuse::{Activation, GateUpLayout};
use moefuse_kernels::ffi::{
    MOEFUSE_MOE_ERROR_ROW, MOEFUSE_MOE_ERROR_SOURCE, MOEFUSE_MOE_ERROR_STALE,
};
use moefuse_kernels::{self as mk, Kernels};
use moefuse_testkit::{check_close, to_f32, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

/// The tokens stamp a case hands the kernel.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stamp {
    /// No check.
    Unchecked,
    /// `slots / top_k`: the rows are this call's.
    Matching,
    /// Another token count: the kernel writes nothing and raises the stale bit.
    Stale,
}

/// One routed-backward case: `cap` rows in the buffers, `count` of them live (read on the
/// device), `slots` routing slots (`top_k` per token), optionally one live row whose slot
/// is out of range, and the tokens stamp.
struct RoutedCase {
    i: usize,
    cap: usize,
    count: i32,
    slots: usize,
    top_k: usize,
    bad_row: Option<usize>,
    stamp: Stamp,
}

const fn case(i: usize, cap: usize, count: i32, slots: usize, top_k: usize) -> RoutedCase {
    RoutedCase {
        i,
        cap,
        count,
        slots,
        top_k,
        bad_row: None,
        stamp: Stamp::Unchecked,
    }
}

const ROUTED_CASES: &[RoutedCase] = &[
    case(64, 37, 37, 40, 1),
    RoutedCase {
        stamp: Stamp::Matching,
        ..case(40, 19, 11, 30, 3)
    },
    case(200, 9, 9, 9, 1),
    RoutedCase {
        stamp: Stamp::Matching,
        ..case(8, 5, 0, 6, 2)
    },
    case(264, 70, 1000, 75, 5),
    RoutedCase {
        bad_row: Some(4),
        stamp: Stamp::Matching,
        ..case(64, 12, 12, 20, 4)
    },
    RoutedCase {
        stamp: Stamp::Stale,
        ..case(64, 16, 16, 24, 2)
    },
];

fn check_routed(
    stream: &Arc<CudaStream>,
    kernels: &Kernels,
    act: Activation,
    layout: GateUpLayout,
    case: &RoutedCase,
    seed: u64,
) -> Result<(f64, f64, f64), String> {
    let (i, cap, slots) = (case.i, case.cap, case.slots);
    let w = act.gate_up_width(i);
    let what = format!(
        "routed {act:?} {layout:?} I={i} cap={cap} count={} slots={slots} top_k={} bad={:?} \
         stamp={:?} seed={seed}",
        case.count, case.top_k, case.bad_row, case.stamp
    );
    let e = err(&what);
    let mut rng = Rng::new(seed);
    let scale = match act {
        Activation::SwiGluOai { limit, .. } | Activation::BoundedSwiGlu { limit } => 1.5 * limit,
        _ => 4.0,
    };
    let h_pre: Vec<bf16> = (0..cap * w)
        .map(|_| bf16::from_f32(scale * rng.uniform()))
        .collect();
    let dh_u: Vec<bf16> = (0..cap * i)
        .map(|_| bf16::from_f32(rng.uniform()))
        .collect();
    let weights: Vec<f32> = (0..slots)
        .map(|_| 0.05 + 0.95 * (0.5 + 0.5 * rng.uniform()))
        .collect();
    let mut all_slots: Vec<usize> = (0..slots).collect();
    shuffle(&mut rng, &mut all_slots);
    let mut source_of: Vec<i32> = all_slots[..cap].iter().map(|&s| s as i32).collect();
    if let Some(r) = case.bad_row {
        source_of[r] = (slots + 3) as i32;
    }
    let live = match case.stamp {
        Stamp::Stale => 0,
        _ => case.count.clamp(0, cap as i32) as usize,
    };

    // Reference over the live rows with an in-range slot.
    let (x32, du32) = (to_f32(&h_pre), to_f32(&dh_u));
    let mut want_dhp = vec![POISON_BF16.to_f32(); cap * w];
    let mut want_hs = vec![POISON_BF16.to_f32(); cap * i];
    let mut want_dw = vec![POISON_F32; slots];
    let mut h = vec![0f32; i];
    let mut dh = vec![0f64; i];
    let mut dx = vec![0f64; w];
    for r in 0..live {
        let s = source_of[r];
        if s < 0 || s as usize >= slots {
            continue;
        }
        let wt = weights[s as usize];
        let x = &x32[r * w..(r + 1) * w];
        activation::forward_row(act, layout, x, &mut h);
        let mut dot = 0f64;
        for j in 0..i {
            // h as the forward stores it (bf16).
            let hb = bf16::from_f32(h[j]).to_f32();
            dot += f64::from(du32[r * i + j]) * f64::from(hb);
            want_hs[r * i + j] = wt * hb;
            dh[j] = f64::from(wt) * f64::from(du32[r * i + j]);
        }
        activation::backward_row(act, layout, x, &dh, &mut dx);
        for (o, v) in want_dhp[r * w..(r + 1) * w].iter_mut().zip(&dx) {
            *o = *v as f32;
        }
        want_dw[s as usize] = dot as f32;
    }

    let h_pre_d = stream.clone_htod(&h_pre).map_err(&e)?;
    let dh_d = stream.clone_htod(&dh_u).map_err(&e)?;
    let src_d = stream.clone_htod(&source_of).map_err(&e)?;
    let w_d = stream.clone_htod(&weights).map_err(&e)?;
    let count_d = stream.clone_htod(&[case.count]).map_err(&e)?;
    let mut dhp_d = stream.clone_htod(&vec![POISON_BF16; cap * w]).map_err(&e)?;
    let mut hs_d = stream.clone_htod(&vec![POISON_BF16; cap * i]).map_err(&e)?;
    let mut dw_d = stream.clone_htod(&vec![POISON_F32; slots]).map_err(&e)?;
    let mut errors_d = stream.clone_htod(&[0u32]).map_err(&e)?;
    let tokens = (slots / case.top_k) as u32;
    let stamp_d = stream
        .clone_htod(&[if case.stamp == Stamp::Stale {
            tokens + 1
        } else {
            tokens
        }])
        .map_err(&e)?;
    let (kind, kl) = moefuse::gpu::ActivationDesc::new(act, layout, i).kernel_kind();
    kernels
        .launch(
            stream,
            mk::ActivationBackwardRouted {
                kind,
                layout: kl,
                intermediate: i,
                max_rows: cap,
                total_rows: Some(&count_d),
                h_pre: &h_pre_d,
                dh_u: &dh_d,
                source_of: &src_d,
                top_k: case.top_k,
                weights: &w_d,
                d_h_pre: &mut dhp_d,
                d_weights: &mut dw_d,
                h_scaled: &mut hs_d,
                errors: Some(&mut errors_d),
                expect_tokens: (case.stamp != Stamp::Unchecked)
                    .then_some(&stamp_d as &dyn cudarc::driver::DevicePtr<u32>),
            },
        )
        .map_err(|x| format!("{what}: {x}"))?;
    let dhp = to_f32(&stream.clone_dtoh(&dhp_d).map_err(&e)?);
    let hs = to_f32(&stream.clone_dtoh(&hs_d).map_err(&e)?);
    let dw = stream.clone_dtoh(&dw_d).map_err(&e)?;
    let errors = stream.clone_dtoh(&errors_d).map_err(&e)?[0];

    let want_bit = match case.stamp {
        Stamp::Stale => MOEFUSE_MOE_ERROR_STALE,
        _ if case.bad_row.is_some_and(|r| r < live) => MOEFUSE_MOE_ERROR_SOURCE,
        _ => 0,
    };
    if errors != want_bit {
        return Err(format!(
            "{what}: error word {errors:#x}, expected {want_bit:#x}"
        ));
    }
    // Everything the reference left poisoned must still hold its poison bits.
    let untouched = |got: &[f32], want: &[f32], poison: f32, name: &str| -> Result<(), String> {
        for (j, (g, w)) in got.iter().zip(want).enumerate() {
            if w.to_bits() == poison.to_bits() && g.to_bits() != poison.to_bits() {
                return Err(format!(
                    "{what}: {name}[{j}] must not be written, holds {g}"
                ));
            }
        }
        Ok(())
    };
    let poison = POISON_BF16.to_f32();
    untouched(&dhp, &want_dhp, poison, "d_h_pre")?;
    untouched(&hs, &want_hs, poison, "h_scaled")?;
    untouched(&dw, &want_dw, POISON_F32, "d_weights")?;
    // Compare the written elements (check_close also fails on any still-poisoned one).
    let pick = |got: &[f32], want: &[f32], poison: f32| -> (Vec<f32>, Vec<f32>) {
        got.iter()
            .zip(want)
            .filter(|(_, w)| w.to_bits() != poison.to_bits())
            .map(|(g, w)| (*g, *w))
            .unzip()
    };
    let (g, w_) = pick(&dhp, &want_dhp, poison);
    let e_dhp = check_close(&g, &w_, BF16_REL_ERR, &format!("{what}: d_h_pre"))?;
    let (g, w_) = pick(&hs, &want_hs, poison);
    let e_hs = check_close(&g, &w_, BF16_REL_ERR, &format!("{what}: h_scaled"))?;
    let (g, w_) = pick(&dw, &want_dw, POISON_F32);
    let e_dw = check_close(&g, &w_, BF16_REL_ERR, &format!("{what}: d_weights"))?;
    Ok((e_dhp, e_hs, e_dw))
}

/// Every activation, both layouts, every case.
pub fn routed_activation_backward(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.default_stream();
    let kernels = Kernels::new(ctx).map_err(err("Kernels::new"))?;
    let mut seeds = Rng::new(0x5EED_0A11);
    for act in activations() {
        for layout in [GateUpLayout::Split, GateUpLayout::Interleaved] {
            for case in ROUTED_CASES {
                let (a, b, c) =
                    check_routed(&stream, &kernels, act, layout, case, seeds.next_u64())?;
                println!(
                    "routed {act:?} {layout:?} I={} cap={} count={} bad={:?} stamp={:?}: rel \
                     err d_h_pre {a:.2e} h_scaled {b:.2e} d_weights {c:.2e}",
                    case.i, case.cap, case.count, case.bad_row, case.stamp
                );
            }
        }
    }
    Ok(())
}

/// `dst[row_of[t·k + j]] = src[t]` bit for bit; dropped slots (-1) and rows nobody names
/// keep their poison; an out-of-range entry raises MOEFUSE_MOE_ERROR_ROW and is skipped.
pub fn gather_rows(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.default_stream();
    let kernels = Kernels::new(ctx).map_err(err("Kernels::new"))?;
    // (tokens, top_k, hidden, spare rows, dropped slots, a bad entry)
    let cases: &[(usize, usize, usize, usize, usize, bool)] = &[
        (1, 1, 8, 0, 0, false),
        (37, 4, 72, 5, 3, false),
        (200, 8, 264, 0, 0, false),
        (64, 2, 2048, 17, 10, true),
    ];
    let mut rng = Rng::new(0x5EED_0A12);
    for &(t, k, hd, spare, dropped, bad) in cases {
        let what =
            format!("gather t={t} k={k} hidden={hd} spare={spare} dropped={dropped} bad={bad}");
        let e = err(&what);
        let rows = t * k + spare;
        let src: Vec<bf16> = (0..t * hd).map(|_| bf16::from_f32(rng.uniform())).collect();
        let mut perm: Vec<usize> = (0..rows).collect();
        shuffle(&mut rng, &mut perm);
        let mut row_of: Vec<i32> = perm[..t * k].iter().map(|&r| r as i32).collect();
        for _ in 0..dropped {
            let s = rng.below(t * k);
            row_of[s] = -1;
        }
        if bad {
            row_of[rng.below(t * k)] = (rows + 7) as i32;
        }
        let mut want = vec![POISON_BF16; rows * hd];
        for (s, &r) in row_of.iter().enumerate() {
            if r >= 0 && (r as usize) < rows {
                let tok = s / k;
                want[r as usize * hd..(r as usize + 1) * hd]
                    .copy_from_slice(&src[tok * hd..(tok + 1) * hd]);
            }
        }
        let src_d = stream.clone_htod(&src).map_err(&e)?;
        let row_d = stream.clone_htod(&row_of).map_err(&e)?;
        let mut dst_d = stream
            .clone_htod(&vec![POISON_BF16; rows * hd])
            .map_err(&e)?;
        let mut errors_d = stream.clone_htod(&[0u32]).map_err(&e)?;
        kernels
            .launch(
                &stream,
                mk::GatherRows {
                    tokens: t,
                    top_k: k,
                    hidden: hd,
                    rows,
                    row_of: &row_d,
                    src: &src_d,
                    dst: &mut dst_d,
                    errors: Some(&mut errors_d),
                    expect_tokens: None,
                },
            )
            .map_err(|x| format!("{what}: {x}"))?;
        let got = stream.clone_dtoh(&dst_d).map_err(&e)?;
        let errors = stream.clone_dtoh(&errors_d).map_err(&e)?[0];
        let want_bit = if bad { MOEFUSE_MOE_ERROR_ROW } else { 0 };
        if errors != want_bit {
            return Err(format!(
                "{what}: error word {errors:#x}, expected {want_bit:#x}"
            ));
        }
        if let Some(j) = got
            .iter()
            .zip(&want)
            .position(|(g, w)| g.to_bits() != w.to_bits())
        {
            return Err(format!(
                "{what}: element {j} (row {}) is {}, expected {}",
                j / hd,
                got[j],
                want[j]
            ));
        }
        println!("{what}: bit-exact, error word {errors:#x}");
    }
    Ok(())
}
