//! The expert-parallel layer's algorithm on the CPU, against the whole layer's reference:
//! moefuse-comm's host model of the exchange (send plans, receive layouts, combine) with
//! the reference's expert MLP per received row, forward and backward, exactly as
//! `EpMoeLayer` arranges them on the GPU:
//! * forward: y = combine(w, y_e) over the receive layouts;
//! * backward: dy goes out by the same routing with weights 1 (the same layouts), the
//!   expert side gives each row's dx part (for w · dy) and s = ⟨dy, y_e⟩; dx = combine(1,
//!   dx parts); each slot's s comes back through a combine of rows that carry s in the
//!   column of their slot and zeros elsewhere, which leaves every slot's value unmixed;
//!   weight gradients stay with the experts' owner.
//!
//! Ragged token counts, a rank that sends nothing, 1, 2 and 4 ranks.

use moefuse::model::MoeWeights;
use moefuse::reference::{backward, forward, RoutingInput};
use moefuse::{MoeConfig, RouterKind};
use moefuse_comm::{combine, Placement, ReceiveLayout, SendPlan};
use moefuse_testkit::Rng;

struct World {
    cfg: MoeConfig,
    weights: MoeWeights,
    tokens: Vec<usize>,
    x: Vec<Vec<f32>>,
    ids: Vec<Vec<i32>>,
    w: Vec<Vec<f32>>,
    dy: Vec<Vec<f32>>,
}

fn world(ranks: usize, seed: u64) -> World {
    let cfg = MoeConfig::new(64, 64, 8, 2).with_router(RouterKind::External);
    let mut rng = Rng::new(seed);
    let mut weights = MoeWeights::zeros(&cfg, false);
    weights
        .gate_up
        .iter_mut()
        .for_each(|v| *v = 0.3 * rng.uniform());
    weights
        .down
        .iter_mut()
        .for_each(|v| *v = 0.3 * rng.uniform());
    let tokens: Vec<usize> = [7, 0, 5, 9].iter().copied().take(ranks).collect();
    let (d, e, k) = (cfg.hidden, cfg.experts, cfg.top_k);
    let mut per = |n: usize, f: &mut dyn FnMut(&mut Rng) -> Vec<f32>| -> Vec<Vec<f32>> {
        (0..ranks)
            .map(|r| (0..tokens[r] * n).flat_map(|_| f(&mut rng)).collect())
            .collect()
    };
    let x = per(d, &mut |g| vec![g.uniform()]);
    let dy = per(d, &mut |g| vec![g.uniform()]);
    let w = per(1, &mut |g| {
        let a = 0.2 + g.uniform().abs();
        vec![a / (a + 0.5), 0.5 / (a + 0.5)]
    });
    let ids = (0..ranks)
        .map(|r| (0..tokens[r]).flat_map(|_| rng.distinct(e, k)).collect())
        .collect();
    // `per` drew k weights per token as one pair: trim to [T, k].
    let w = w
        .into_iter()
        .zip(&tokens)
        .map(|(v, &t)| v[..t * k].to_vec())
        .collect();
    World {
        cfg,
        weights,
        tokens,
        x,
        ids,
        w,
        dy,
    }
}

fn cat(v: &[Vec<f32>]) -> Vec<f32> {
    v.iter().flatten().copied().collect()
}

fn view(v: &[Vec<f32>]) -> Vec<&[f32]> {
    v.iter().map(|x| x.as_slice()).collect()
}

fn close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (j, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * scale, "{what}[{j}]: {g} vs {w}");
    }
}

fn run(ranks: usize, seed: u64) {
    let wd = world(ranks, seed);
    let (cfg, d, k) = (&wd.cfg, wd.cfg.hidden, wd.cfg.top_k);
    let place = Placement::new(cfg.experts, ranks).unwrap();
    let plans: Vec<SendPlan> = (0..ranks)
        .map(|r| {
            let ids: Vec<i64> = wd.ids[r].iter().map(|&e| e as i64).collect();
            SendPlan::build(&place, r, &ids, k).unwrap()
        })
        .collect();
    let layouts: Vec<ReceiveLayout> = (0..ranks)
        .map(|r| ReceiveLayout::build(&place, r, &plans).unwrap())
        .collect();

    // The whole layer's reference.
    let (x_all, ids_all, w_all) = (cat(&wd.x), wd.ids.concat(), cat(&wd.w));
    let ext = RoutingInput::External {
        topk_ids: &ids_all,
        topk_weights: &w_all,
    };
    let want = forward(cfg, &wd.weights, &x_all, ext).unwrap();
    let grads = backward(cfg, &wd.weights, &x_all, &want, &cat(&wd.dy)).unwrap();

    // Each destination's rows: the expert's output for the received token (weight 1), the
    // row's backward for w · dy, and s = ⟨dy, y_e⟩.
    let s_cols = k.div_ceil(8) * 8;
    let mut y_rows = Vec::new();
    let (mut dx_rows, mut s_rows) = (Vec::new(), Vec::new());
    let mut d_gate_up = vec![0f32; wd.weights.gate_up.len()];
    let mut d_down = vec![0f32; wd.weights.down.len()];
    for (dst, layout) in layouts.iter().enumerate() {
        let (mut y_d, mut dx_d, mut s_d) = (Vec::new(), Vec::new(), Vec::new());
        for (r, row) in layout.rows.iter().enumerate() {
            let local = layout
                .offsets
                .iter()
                .position(|&end| r < end as usize)
                .unwrap();
            let expert = dst * place.per_rank() + local;
            assert_eq!(expert as i32, wd.ids[row.src][row.token * k + row.slot]);
            let xr = &wd.x[row.src][row.token * d..(row.token + 1) * d];
            let one = RoutingInput::External {
                topk_ids: &[expert as i32, ((expert + 1) % cfg.experts) as i32],
                topk_weights: &[1.0, 0.0],
            };
            let out = forward(cfg, &wd.weights, xr, one).unwrap();
            y_d.extend_from_slice(&out.y);
            let w = wd.w[row.src][row.token * k + row.slot];
            let dy: Vec<f32> = wd.dy[row.src][row.token * d..(row.token + 1) * d]
                .iter()
                .map(|v| w * v)
                .collect();
            let g = backward(cfg, &wd.weights, xr, &out, &dy).unwrap();
            dx_d.extend_from_slice(&g.dx);
            // Only this row's expert gets a gradient (the other slot has weight 0).
            d_gate_up
                .iter_mut()
                .zip(&g.d_gate_up)
                .for_each(|(a, b)| *a += b);
            d_down.iter_mut().zip(&g.d_down).for_each(|(a, b)| *a += b);
            let s: f32 = wd.dy[row.src][row.token * d..(row.token + 1) * d]
                .iter()
                .zip(&out.y)
                .map(|(a, b)| a * b)
                .sum();
            let mut cols = vec![0f32; s_cols];
            cols[row.slot] = s;
            s_d.extend(cols);
        }
        y_rows.push(y_d);
        dx_rows.push(dx_d);
        s_rows.push(s_d);
    }
    let (y_rows, dx_rows, s_rows) = (view(&y_rows), view(&dx_rows), view(&s_rows));
    let mut first = 0;
    for (r, plan) in plans.iter().enumerate() {
        let t = wd.tokens[r];
        let ones = vec![1f32; t * k];
        let y = combine(plan, &wd.w[r], &layouts, &y_rows, d);
        close("y", &y, &want.y[first * d..(first + t) * d]);
        let dx = combine(plan, &ones, &layouts, &dx_rows, d);
        close("dx", &dx, &grads.dx[first * d..(first + t) * d]);
        let s = combine(plan, &ones, &layouts, &s_rows, s_cols);
        let d_topk: Vec<f32> = (0..t)
            .flat_map(|i| s[i * s_cols..i * s_cols + k].to_vec())
            .collect();
        close(
            "d_topk_weights",
            &d_topk,
            &grads.d_topk_weights[first * k..(first + t) * k],
        );
        first += t;
    }
    close("d_gate_up", &d_gate_up, &grads.d_gate_up);
    close("d_down", &d_down, &grads.d_down);
}

#[test]
fn ep_algorithm_matches_the_whole_layer_at_1_2_4_ranks() {
    for (ranks, seed) in [(1, 11), (2, 12), (4, 13), (4, 14)] {
        run(ranks, seed);
    }
}
